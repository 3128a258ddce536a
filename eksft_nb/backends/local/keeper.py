"""The keeper of a local job: a small daemon that holds the job folder's lock and runs the job's
supervisor (:mod:`.supervisor`) as its child, starting a successor that adopts the job when one dies
before the job ended, and ending the job after :data:`MAX_SUPERVISORS` deaths.

Run as ``python -m eksft_nb.backends.local.keeper JOB_DIR`` (the local backend does this, with the
job's mark ``EKSFT_JOB_UID`` in the environment): it forks into the background and returns at once.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

from ... import procs
from ...events import EventTail, EventWriter
from ...jobdir import JobDir, atomic_write
from ...monitor import JobMonitor
from ...runtime.memcopy import remove_copies
from ...states import RECORDED_ENDS, JobState
from .supervisor import UNRECORDED

MAX_SUPERVISORS = 5    # supervisor deaths the keeper recovers from before it ends the job
SUPERVISOR_MODULE = "eksft_nb.backends.local.supervisor"


def keep(jd: JobDir) -> int:
    """The keeper: run the job's supervisor as a child and, when it dies before the job ended, start
    a successor that adopts the job (see the module's docstring). One keeper per job folder."""
    lock = jd.keeper_lock()
    if lock is None or jd.supervisor().get("state") in RECORDED_ENDS:
        return 0  # another keeper looks after the job, or it has ended
    record = jd.supervisor()
    adopt = "supervisor" in record  # a supervisor ran before this keeper: adopt what it started
    uid = os.environ.setdefault(procs.JOB_UID_ENV, str(record.get("job_uid") or uuid.uuid4().hex[:16]))
    atomic_write(jd.supervisor_path, json.dumps({**record, "job_uid": uid,
                                                 "keeper": procs.identity(os.getpid()),
                                                 "state": record.get("state", JobState.STARTING)}, indent=1))
    inode = os.stat(jd.path).st_ino
    stopping = False
    child: subprocess.Popen | None = None

    def on_signal(signum: int, frame: Any) -> None:
        nonlocal stopping
        stopping = True
        if child is not None and child.poll() is None:
            child.send_signal(signal.SIGTERM)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    for _ in range(MAX_SUPERVISORS):
        with open(jd.logs / "supervisor.err", "ab") as err:
            child = subprocess.Popen([sys.executable, "-m", SUPERVISOR_MODULE, str(jd.path),
                                      *(["--adopt"] if adopt else [])],
                                     stdin=subprocess.DEVNULL, stdout=err, stderr=err)
        code = child.wait()
        try:
            if os.stat(jd.path).st_ino != inode:
                return 0  # the job folder was deleted or replaced
        except FileNotFoundError:
            return 0
        if stopping or code == UNRECORDED or jd.supervisor().get("state") in RECORDED_ENDS:
            return 0
        adopt = True
        how = signal.Signals(-code).name if -code in signal.Signals._value2member_map_ else f"exit {code}"
        with open(jd.logs / "supervisor.log", "a") as log:
            log.write(f"{time.strftime('%H:%M:%S')} the supervisor (pid {child.pid}) died ({how}): "
                      "starting another to adopt the job\n")
    reason = (f"the supervisor died {MAX_SUPERVISORS} times (see logs/supervisor.err); the job's processes "
              "were stopped: resume it from its last checkpoint")
    procs.kill_marked(uid, keep=[os.getpid()])
    remove_copies(uid)
    mon = JobMonitor()
    mon.update(EventTail(jd.events_path).read())
    EventWriter(jd.events_path, jd.name, rank=None).emit("job_end", state=JobState.FAILED, reason=reason,
                                                         final_step=mon.last_step)
    atomic_write(jd.supervisor_path,
                 json.dumps({**jd.supervisor(), "state": JobState.FAILED, "reason": reason}, indent=1))
    return 1


def main() -> None:
    job_dir = JobDir(Path(sys.argv[1]))
    if os.fork() > 0:  # the launching process reaps this parent at once; the child is the daemon
        os._exit(0)
    os.setsid()
    sys.exit(keep(job_dir))


if __name__ == "__main__":
    main()
