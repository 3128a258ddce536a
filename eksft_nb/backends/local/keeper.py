"""The keeper of a local job: a small daemon that holds the job folder's lock and runs the job's
supervisor (:mod:`.supervisor`) as its child, starting a successor that adopts the job when one dies
before the job ended or stops beating (:mod:`.beat`: it is killed by identity first), and ending the
job after :data:`MAX_SUPERVISORS` deaths.

Run as ``python -m eksft_nb.backends.local.keeper JOB_DIR`` (the local backend does this, with the
job's mark ``EKSFT_JOB_UID`` in the environment): it forks into the background and returns at once.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import psutil

from ... import procs
from ...events import EventTail
from ...jobdir import JobDir, atomic_write
from ...monitor import JobMonitor
from ...runtime.memcopy import remove_copies
from ...states import RECORDED_ENDS, JobState
from . import ending
from .beat import SILENCE_S, Pulse
from .supervisor import UNRECORDED

MAX_SUPERVISORS = 5    # supervisor deaths the keeper recovers from before it ends the job
SUPERVISOR_MODULE = "eksft_nb.backends.local.supervisor"
KILL_WAIT_S = 10.0     # a killed supervisor stuck in the kernel (a hung filesystem) may take a while to go


def keep(jd: JobDir) -> int:
    """The keeper: run the job's supervisor as a child and, when it dies (or stops beating) before the
    job ended, start a successor that adopts the job (see the module's docstring). One keeper per job."""
    lock = jd.keeper_lock()
    if lock is None or jd.supervisor().get("state") in RECORDED_ENDS:
        return 0  # another keeper looks after the job, or it has ended
    record = jd.supervisor()
    adopt = "supervisor" in record  # a supervisor ran before this keeper: adopt what it started
    uid = os.environ.setdefault(procs.JOB_UID_ENV, str(record.get("job_uid") or uuid.uuid4().hex[:16]))
    try:
        atomic_write(jd.supervisor_path, json.dumps({**record, "job_uid": uid,
                                                     "keeper": procs.identity(os.getpid()),
                                                     "state": record.get("state", JobState.STARTING)},
                                                    indent=1))
    except OSError:
        pass  # a full disk: the supervisor finds it so too, and ends the job in the room reserved for that
    # a predecessor still there (stopped, whose keeper died): it gives way to the one that adopts its job
    _kill(procs.recorded(record.get("supervisor"), uid))
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
        pulse = Pulse()
        err = _error_log(jd)
        try:
            child = subprocess.Popen([sys.executable, "-m", SUPERVISOR_MODULE, str(jd.path),
                                      *(["--adopt"] if adopt else [])],
                                     stdin=subprocess.DEVNULL, stdout=err, stderr=err,
                                     env={**os.environ, **pulse.env()}, pass_fds=(pulse.write,))
        finally:
            if err is not subprocess.DEVNULL:
                err.close()
        pulse.started()
        try:
            ident = procs.identity(child.pid)
        except psutil.Error:
            ident = None   # it has already ended
        code = pulse.wait(child)
        if code is None:   # silent: stopped, or stuck in a write that never returns
            how = f"stopped beating for {SILENCE_S:.0f}s (its state: {_status(child.pid)}) and was killed"
            _kill(procs.recorded(ident), wait=False)
            try:
                code = child.wait(KILL_WAIT_S)
            except subprocess.TimeoutExpired:
                how += " (it has not exited yet)"
        else:
            how = signal.Signals(-code).name if -code in signal.Signals._value2member_map_ else f"exit {code}"
            how = f"died ({how})"
        try:
            if os.stat(jd.path).st_ino != inode:
                return 0  # the job folder was deleted or replaced
        except FileNotFoundError:
            return 0
        if stopping or code == UNRECORDED or jd.supervisor().get("state") in RECORDED_ENDS:
            return 0
        adopt = True
        with contextlib.suppress(OSError):
            with open(jd.logs / "supervisor.log", "a") as log:
                log.write(f"{time.strftime('%H:%M:%S')} the supervisor (pid {child.pid}) {how}; "
                          "starting another to adopt the job\n")
    reason = (f"the supervisor died or stopped beating {MAX_SUPERVISORS} times (see logs/supervisor.err); "
              "the job's processes were stopped: resume it from its last checkpoint")
    procs.kill_marked(uid, keep=[os.getpid()])
    remove_copies(uid)
    mon = JobMonitor()
    mon.update(EventTail(jd.events_path).read())
    ending.record(jd, JobState.FAILED, reason, final_step=mon.last_step)
    ending.tidy(jd)
    return 1


def _kill(p: psutil.Process | None, wait: bool = True) -> None:
    """SIGKILL ``p`` (found by identity: never a process that merely reuses its pid) and wait for it."""
    if p is None:
        return
    with contextlib.suppress(psutil.Error):
        p.kill()
        if wait:
            p.wait(KILL_WAIT_S)


def _status(pid: int) -> str:
    try:
        return psutil.Process(pid).status()
    except psutil.Error:
        return "gone"


def _error_log(jd: JobDir) -> Any:
    """The supervisor's stderr: ``logs/supervisor.err``, else nowhere (a full disk cannot stop a start)."""
    try:
        return open(jd.logs / "supervisor.err", "ab")
    except OSError:
        return subprocess.DEVNULL


def main() -> None:
    job_dir = JobDir(Path(sys.argv[1]))
    if os.fork() > 0:  # the launching process reaps this parent at once; the child is the daemon
        os._exit(0)
    os.setsid()
    sys.exit(keep(job_dir))


if __name__ == "__main__":
    main()
