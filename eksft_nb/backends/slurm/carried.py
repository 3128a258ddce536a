"""The spec a Slurm batch script carries, on its watcher's stdin (a heredoc): the script needs nothing that
``run`` made, so a dry run's script can be submitted by hand (after ``mkdir -p`` of its log folder, which
Slurm opens before the script starts). Such a job makes its own folder from it; a script submitted into
the folder of another job is refused."""

from __future__ import annotations

import json
import os
import time
from typing import IO, Any

from ...errors import EksftError
from ...jobdir import JobDir, atomic_write
from ...procs import JOB_UID_ENV

RECORD = "slurm.json"   # in the job folder: its Slurm job id (the backend's record of a submission)


def take_carried(jd: JobDir, stream: IO[str] | None, limit: int, spec_type: Any) -> str | None:
    """Make the job folder from the carried spec where ``run`` did not; why not, or None when all is well
    (also for a script that carries no spec)."""
    if stream is None or stream.isatty():
        return None
    text = stream.read(limit + 1)
    if not text.strip():
        return None
    if len(text) > limit:
        return f"the spec this script carries is over {limit} characters: render the script again"
    try:
        carried = spec_type.from_json(text).validate()
    except EksftError as e:
        return f"the spec this script carries is refused: {e}"
    if jd.spec_path.is_file():
        try:
            present = jd.spec()
        except (OSError, ValueError, EksftError) as e:
            return f"the job folder {jd.path} holds a spec that cannot be read ({e})"
        if present.digest() != carried.digest():
            return (f"the job folder {jd.path} is another job's (spec {present.digest()}, this script's "
                    f"{carried.digest()}): remove it (`rm {carried.name} --backend slurm`) or render the "
                    "script with another --name")
        return None
    try:
        for sub in (jd.logs, jd.pending, jd.fired, jd.progress, jd.ckpt_dir(carried)):
            sub.mkdir(parents=True, exist_ok=True, mode=0o700)
        atomic_write(jd.spec_path, carried.to_json())
        job_id = os.environ.get("SLURM_JOB_ID", "")
        if not (jd.path / RECORD).exists() and job_id.isdigit():
            record = {"job_id": job_id, "submitted": time.time(), "by_hand": True,
                      "job_uid": os.environ.get(JOB_UID_ENV)}
            atomic_write(jd.path / RECORD, json.dumps(record))
    except OSError as e:
        return f"cannot make the job folder {jd.path} ({e.strerror or e}): check that it is writable"
    return None
