"""Finding and ending a local job's processes, by identity rather than by number.

A pid (or a process group id) read back from a job's folder may by now belong to an unrelated
process: pids are reused once a process is gone. So a process is named by its pid *and* its start
time (:func:`identity`), and every process a job starts inherits the job's uid (:data:`JOB_UID_ENV`,
its one name on disk and in the code is ``job_uid``) and ``EKSFT_NODE_TAG`` in its environment;
nothing is signalled unless it carries the job's mark or its recorded identity. The mark also finds
the processes that leave their process group (NVRx's double-forked in-process monitor, checkpoint
writers).
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import psutil

JOB_UID_ENV = "EKSFT_JOB_UID"   # the job uid, the mark of its processes: new per launch, kept across restarts
NODE_MARK = "EKSFT_NODE_TAG"


def identity(pid: int) -> dict[str, Any]:
    """What names a live process for good: its pid and its start in clock ticks since boot (see
    :func:`start_ticks`; ``started``, the wall-clock start, is for people and for platforms without
    ticks: psutil derives it from the boot time, which moves whenever the system clock is stepped)."""
    return {"pid": pid, "started": psutil.Process(pid).create_time(), "ticks": start_ticks(pid)}


def start_ticks(pid: int | str = "self") -> int | None:
    """When process ``pid`` started, in the kernel's clock ticks since boot (Linux): with the pid, it
    names the process exactly, where a start time in seconds can match another one's."""
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def recorded(entry: dict[str, Any] | None, job_uid: str | None = None) -> psutil.Process | None:
    """The running process that ``entry`` (an :func:`identity`, read back from disk) names; None when
    it is gone, or when its pid now belongs to another process (another start time, or, given
    ``job_uid``, no such mark)."""
    if not isinstance(entry, dict) or not isinstance(entry.get("pid"), int) or entry["pid"] <= 0:
        return None
    try:
        p = psutil.Process(entry["pid"])
        ticks, now = entry.get("ticks"), start_ticks(p.pid)
        if isinstance(ticks, int) and now is not None:
            same = ticks == now
        else:  # recorded without ticks: by the wall-clock start, as exact as psutil's boot time allows
            same = abs(p.create_time() - float(entry.get("started", -1))) <= 0.01
        if not same or p.status() == psutil.STATUS_ZOMBIE:
            return None
        if job_uid is not None and p.environ().get(JOB_UID_ENV) != job_uid:
            return None
        return p
    except (psutil.Error, OSError, TypeError, ValueError):
        return None


def marked(job_uid: str, node_tag: str | None = None) -> list[psutil.Process]:
    """The live processes that carry the job's mark (and, given, the node tag), but this one."""
    return [p for p, env in _live_environs()
            if env.get(JOB_UID_ENV) == job_uid and (node_tag is None or env.get(NODE_MARK) == node_tag)]


def live_marks() -> set[str]:
    """The marks of every job that has a live process (that this user can see), this one's apart."""
    return {env[JOB_UID_ENV] for _, env in _live_environs() if env.get(JOB_UID_ENV)}


def _live_environs() -> list[tuple[psutil.Process, dict[str, str]]]:
    found = []
    me = os.getpid()
    for p in psutil.process_iter():
        if p.pid == me:
            continue
        try:
            env = p.environ()
            if p.status() == psutil.STATUS_ZOMBIE:
                continue
        except (psutil.Error, OSError):
            continue
        found.append((p, env))
    return found


def signal_marked(job_uid: str, sig: int, node_tag: str | None = None,
                  keep: Sequence[int] = ()) -> list[psutil.Process]:
    """Send ``sig`` to every process carrying the job's mark but those in ``keep``; return them."""
    victims = [p for p in marked(job_uid, node_tag) if p.pid not in keep]
    for p in victims:
        try:
            p.send_signal(sig)  # psutil checks that the pid still names the process it found
        except psutil.Error:
            pass
    return victims


def kill_marked(job_uid: str, node_tag: str | None = None, timeout: float = 5.0,
                keep: Sequence[int] = ()) -> int:
    """SIGKILL every process carrying the job's mark but those in ``keep``, until none is left or
    ``timeout`` passes. One pass is not enough: a marked parent (a launcher starting its ranks) may
    fork while the scan runs, and a child started after the scan reached it is not in the list.
    Returns how many processes it signalled."""
    deadline = time.monotonic() + timeout
    killed: set[int] = set()
    while victims := signal_marked(job_uid, signal.SIGKILL, node_tag, keep):
        killed.update(p.pid for p in victims)
        psutil.wait_procs(victims, timeout=max(0.0, deadline - time.monotonic()))
        if time.monotonic() >= deadline:
            break
    return len(killed)


def alive(pid: int) -> bool:
    """True for a running process (zombies count as dead)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def running(p: psutil.Process) -> bool:
    """Whether the process ``p`` (not merely its pid) still runs."""
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def halted(p: psutil.Process) -> bool:
    """Whether ``p`` is stopped (SIGSTOP, a debugger): it runs, but does nothing until continued."""
    try:
        return p.status() in (psutil.STATUS_STOPPED, psutil.STATUS_TRACING_STOP)
    except psutil.Error:
        return False


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    return any(alive(p.pid) for p in psutil.process_iter() if _pgid(p.pid) == pgid)


def _pgid(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except ProcessLookupError:
        return None


def wait_gone(processes: Sequence[psutil.Process], timeout: float) -> list[psutil.Process]:
    """Wait until none of ``processes`` runs; return those still running at the deadline."""
    deadline = time.time() + timeout
    left = [p for p in processes if running(p)]
    while left and time.time() < deadline:
        time.sleep(0.1)
        left = [p for p in left if running(p)]
    return left
