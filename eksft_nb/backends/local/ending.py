"""How a local job's end is recorded, whoever ends it (its supervisor, its keeper, ``stop``), and what is
cleared away once nothing of it runs.

The end is recorded first where a full disk cannot stop it: ``end.json``, written in place over space
reserved when the job was made (:meth:`~eksft_nb.jobdir.JobDir.write_end`), which every reader of
``supervisor.json`` sees over it. Only then come the ``job_end`` event, the supervisor's last words and
``supervisor.json``, into the room the reserve gave back; each may fail without the end being lost, so
a supervisor that ended the job on purpose never exits as a crash that its keeper would answer with a
successor.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
from collections.abc import Callable
from typing import Any

from ...checkpoint_folders import COMMIT, list_checkpoints
from ...errors import EksftError
from ...events import EventWriter
from ...jobdir import TMP_SUFFIX, JobDir, atomic_write
from ...states import CheckpointState, JobState

# what atomic_write leaves when it is cut short (.NAME.PID.tmp), and a progress beacon's temporary file
_TEMPORARY = re.compile(r"\..+\.\d+" + re.escape(TMP_SUFFIX) + r"|rank-\d+" + re.escape(TMP_SUFFIX))


def record(jd: JobDir, state: JobState, reason: str, *, final_step: int, events: EventWriter | None = None,
           say: Callable[[str], Any] | None = None, state_record: dict[str, Any] | None = None,
           **event_fields: Any) -> bool:
    """Record the job's end: ``end.json``, then the ``job_end`` event (``event_fields``: its optional
    fields), ``say`` (the supervisor's narration) and ``supervisor.json`` (``state_record``, else the one
    on disk, with the end). Whether the end is recorded anywhere a reader looks."""
    recorded = jd.write_end(state, reason)
    with contextlib.suppress(OSError):
        writer = events or EventWriter(jd.events_path, jd.name, rank=None)
        writer.emit("job_end", state=state, reason=reason, final_step=final_step, **event_fields)
    if say is not None:
        with contextlib.suppress(OSError):
            say(f"job {state}: {reason}")
    base = state_record if state_record is not None else jd.supervisor()
    try:
        atomic_write(jd.supervisor_path, json.dumps({**base, "state": state, "reason": reason}, indent=1))
    except OSError:
        return recorded
    return True


def tidy(jd: JobDir) -> None:
    """Once nothing of the job runs: remove its warm ranks' sockets, the temporary files of writes cut
    short (a full disk, a killed process), and, in its own checkpoint folder, the step folders of saves
    that were never committed (no restart of this job will finish them; a ``checkpoint.dir`` elsewhere
    may be another job's too: only its failed saves' folders go, as they fail). Committed and rejected
    checkpoints stay."""
    shutil.rmtree(jd.warm, ignore_errors=True)
    for folder, _, files in os.walk(jd.path):
        for name in files:
            if _TEMPORARY.fullmatch(name):
                with contextlib.suppress(OSError):
                    os.unlink(os.path.join(folder, name))
    try:
        root = jd.ckpt_dir(jd.spec())
    except (OSError, ValueError, EksftError):   # a spec that no longer reads: its folder's default
        root = jd.path / "ckpt"
    if root.resolve().parent != jd.path.resolve():
        return
    for info in list_checkpoints(root):
        if info.state == CheckpointState.INCOMPLETE and not info.path.is_symlink() \
                and not (info.path / COMMIT).exists():
            shutil.rmtree(info.path, ignore_errors=True)
