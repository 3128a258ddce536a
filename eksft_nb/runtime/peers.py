"""Telling peers at once that an in-process restart began: shut down this rank's gloo connections.

A peer blocked in a gloo collective cannot be interrupted: NVRx's asynchronous exception waits for the
collective to return, and neither ``ProcessGroupGloo.abort()`` nor ``destroy_process_group()`` closes
the group's sockets while anything (FSDP's DeviceMesh) still holds the group. So the peer waited out
the collective timeout. A blocked gloo receive returns at once, with "Connection closed by peer", when
either end of its connection shuts down; so

- the failing rank shuts down its gloo connections as its exception leaves the training function
  (:func:`shutdown`, called by the built-in trainer), and
- every rank's NVRx monitor thread does the same in its abort step (chained before the Wrapper's
  own abort by :func:`abort_chain`): a rank that hangs, or the ranks of a script's own Wrapper.

NCCL communicators are untouched here: NVRx's ``AbortTorchDistributed`` still aborts them, after.

Gloo's sockets are those torch's process-group constructor opened for a gloo-only group (recorded
by :func:`track`), never one an existing listener accepted meanwhile (a store serving a late
client). A group mixing gloo and NCCL is not recorded: it relies on NCCL's abort and the timeout.
"""

from __future__ import annotations

import functools
import os
import socket
from typing import Any

_GLOO: set[int] = set()   # socket inodes of this process's gloo connections
_tracking = False


def _sockets() -> dict[int, int]:
    """This process's sockets: inode -> file descriptor."""
    found = {}
    for name in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
        except OSError:   # closed meanwhile
            continue
        if target.startswith("socket:["):
            found[int(target[8:-1])] = int(name)
    return found


def _open(fd: int, inode: int) -> socket.socket | None:
    """A duplicate of ``fd`` as a socket object, if ``fd`` is still the socket ``inode`` (not reused)."""
    try:
        dup = os.dup(fd)
    except OSError:
        return None
    if os.fstat(dup).st_ino != inode:
        os.close(dup)
        return None
    try:
        return socket.socket(fileno=dup)
    except OSError:
        os.close(dup)
        return None


def _listening_ports(sockets: dict[int, int]) -> set[int]:
    ports = set()
    for inode, fd in sockets.items():
        s = _open(fd, inode)
        if s is None:
            continue
        with s:
            if s.family in (socket.AF_INET,
                            socket.AF_INET6) and s.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
                ports.add(s.getsockname()[1])
    return ports


def _record(before: dict[int, int], listening: set[int]) -> None:
    for inode, fd in _sockets().items():
        if inode in before:
            continue
        s = _open(fd, inode)
        if s is None:
            continue
        with s:
            if s.family not in (socket.AF_INET, socket.AF_INET6) or s.type != socket.SOCK_STREAM:
                continue
            try:
                s.getpeername()
            except OSError:   # gloo's own listener: nothing waits on it
                continue
            if s.getsockname()[1] not in listening:
                _GLOO.add(inode)


def track() -> None:
    """Record the gloo connections of every process group created from now on (idempotent; Linux)."""
    global _tracking
    if _tracking or not os.path.isdir("/proc/self/fd"):
        return
    import torch.distributed.distributed_c10d as c10d

    create = c10d._new_process_group_helper

    @functools.wraps(create)
    def _new_process_group_helper(*args: Any, **kwargs: Any) -> Any:
        backend = str(kwargs.get("backend", args[3] if len(args) > 3 else "")).lower()
        if "gloo" not in backend or "nccl" in backend:   # NCCL's own sockets are NCCL's to abort
            return create(*args, **kwargs)
        before = _sockets()
        listening = _listening_ports(before)
        try:
            return create(*args, **kwargs)
        finally:
            _record(before, listening)

    c10d._new_process_group_helper = _new_process_group_helper
    _tracking = True


def shutdown() -> int:
    """Shut down every recorded gloo connection: peers blocked on this rank fail at once, as does this
    rank's own blocked collective. Returns how many were shut down."""
    sockets, n = _sockets(), 0
    for inode in list(_GLOO):
        _GLOO.discard(inode)
        s = _open(sockets[inode], inode) if inode in sockets else None
        if s is None:
            continue
        with s:
            try:
                s.shutdown(socket.SHUT_RDWR)
                n += 1
            except OSError:   # not connected any more
                pass
    return n


def abort_chain(abort: Any) -> Any:
    """NVRx's abort step ``abort`` preceded by :class:`ShutdownGloo` (None stays None: no abort wanted)."""
    if abort is None:
        return None
    from nvidia_resiliency_ext.inprocess import Compose
    from nvidia_resiliency_ext.inprocess.abort import Abort

    class ShutdownGloo(Abort):
        """Unblock this rank's main thread and its peers from a gloo collective (see the module)."""

        def __call__(self, state: Any) -> Any:
            shutdown()
            return state

    return Compose(abort, ShutdownGloo())   # Compose runs its parts last to first
