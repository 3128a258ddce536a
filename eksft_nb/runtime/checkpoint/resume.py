"""Which checkpoint a restore tries, and whether this rank's share of one checks out."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ...checkpoint_folders import STEP_DIR, CheckpointInfo, list_checkpoints, share, verify
from ...errors import JobError
from ...procs import JOB_UID_ENV
from ...states import CheckpointState
from .safe_load import read_metadata


class NoStartPoint(JobError):
    """The checkpoint a job was told to start from (step:N, a folder) cannot be loaded, gone or refused,
    and the job has none of its own: no restart can change that, so the job ends with this reason
    instead of restarting into the same failure."""


def job_uid() -> str:
    """Who commits: the job's id (the same across its restarts at every level, new for every job).
    A restart resumes only from its own job's checkpoints or from where the job started, never from
    a newer checkpoint another job left in the folder. Empty when unknown (then every checkpoint
    of the folder counts as the job's own, as before)."""
    return os.environ.get(JOB_UID_ENV, "")


def verify_share(info: CheckpointInfo, rank: int, world_size: int, tick: Callable[[], Any]) -> str | None:
    """Verify this rank's share of a checkpoint's files: sizes and checksums, and, for the rank
    that has ``.metadata``, that the loader would accept it."""
    mine = share(info, rank, world_size)
    reason = verify(info, mine, progress=tick)
    if reason is None and ".metadata" in mine:
        try:
            read_metadata(info.path, info.files, tick)
        except JobError as e:
            reason = e.problem
    return reason


def resume_candidates(root: Path, resume: str, restarting: bool, job_uid: str) -> list[CheckpointInfo]:
    """The committed checkpoints to try, best first (each is verified before it is used).

    A fresh start takes what ``resume`` names: latest, none, step:N, a checkpoint (``step_N`` folder)
    or another job's checkpoint folder (its checkpoints, newest first). A restart (at any level) takes
    this run's own newest checkpoint, else the one it started from: never a newer one that another
    run left in the folder."""
    committed = [i for i in reversed(list_checkpoints(root)) if i.state == CheckpointState.COMMITTED]
    if resume.startswith("step:"):
        want = int(resume.split(":")[1])
        start = [i for i in committed if i.step == want]
    elif resume not in ("latest", "none"):
        external = Path(resume).expanduser()
        if STEP_DIR.match(external.name):  # that checkpoint and no other
            start = [i for i in reversed(list_checkpoints(external.parent))
                     if i.path == external and i.state == CheckpointState.COMMITTED]
        else:  # another job's checkpoint folder: its newest that loads, else the next older
            start = [i for i in reversed(list_checkpoints(external)) if i.state == CheckpointState.COMMITTED]
    elif resume == "none":
        start = []
    else:
        start = committed
    if not restarting:
        return start
    ours = [i for i in committed if i.job_uid == job_uid] if job_uid else committed
    return ours + [i for i in start if i.path not in {o.path for o in ours}]
