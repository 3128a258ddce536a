"""Finding and ending a local job's processes.

Every process a job starts inherits ``EKSFT_JOB_UID`` (and ``EKSFT_NODE_TAG``) in its environment,
so the ones that leave their process group (NVRx's double-forked in-process monitor, checkpoint
writers) are still found and ended by a stop.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Sequence

import psutil

JOB_MARK = "EKSFT_JOB_UID"
NODE_MARK = "EKSFT_NODE_TAG"


def marked(job_uid: str, node_tag: str | None = None) -> list[psutil.Process]:
    found = []
    me = os.getpid()
    for p in psutil.process_iter():
        if p.pid == me:
            continue
        try:
            env = p.environ()
        except (psutil.Error, OSError):
            continue
        if env.get(JOB_MARK) == job_uid and (node_tag is None or env.get(NODE_MARK) == node_tag):
            found.append(p)
    return found


def kill_marked(job_uid: str, node_tag: str | None = None, timeout: float = 5.0, keep: Sequence[int] = ()) -> int:
    """SIGKILL every process carrying the job's mark but those in ``keep``; wait until they are gone.
    Returns how many."""
    victims = [p for p in marked(job_uid, node_tag) if p.pid not in keep]
    for p in victims:
        try:
            p.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(victims, timeout=timeout)
    return len(victims)


def kill_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def alive(pid: int) -> bool:
    """True for a running process (zombies count as dead)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
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


def wait_gone(pids: list[int], timeout: float) -> list[int]:
    """Wait until none of ``pids`` runs; return those still alive at the deadline."""
    deadline = time.time() + timeout
    left = [p for p in pids if alive(p)]
    while left and time.time() < deadline:
        time.sleep(0.1)
        left = [p for p in left if alive(p)]
    return left


def terminate(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        pass
