"""Firing fault commands on a rank: which are due here, and the one handler per fault kind.

:func:`fire_due` is the one loop over the inbox (the step protocol's ``step_begin``, and a user
script's optimizer-step hook and fault thread call it); :func:`fire` looks the handler up in
:data:`~eksft_nb.fault_registry.REGISTRY`. A handler reports the ``fault`` event itself when it
must do so before it acts (a killed rank reports nothing after); else :func:`fire` reports it after.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib
import os
import signal
import time
from collections.abc import Callable
from typing import Any

from ..control import FaultCommand
from ..fault_registry import REGISTRY
from ..states import CheckpointState, FaultKind, FaultScope

# a session is a .session.Session, which imports this module: typed Any here to keep the arrow one-way
Session = Any

# raises the injected exception in a user script's main thread (a real-time signal no library claims;
# macOS has none)
FAULT_SIGNAL = signal.SIGRTMIN + 3 if hasattr(signal, "SIGRTMIN") else signal.SIGUSR2


class Firing:
    """One command being fired: on which session, at which step, from which thread."""

    def __init__(self, session: Session, command: FaultCommand, step: int | None,
                 main_thread: int | None = None) -> None:
        self.session, self.command, self.step, self.main_thread = session, command, step, main_thread
        self.reported = False

    @property
    def at(self) -> int:
        """The first step the fault affects."""
        return self.step if self.step is not None else self.session.step_done + 1

    def report(self, **extra: Any) -> None:
        """Emit the ``fault`` event (once)."""
        if self.reported:
            return
        self.reported = True
        cmd = self.command
        node = {"node": cmd.node} if cmd.scope == FaultScope.NODE else {}
        self.session.emit("fault", fault=cmd.fault, id=cmd.id, target_rank=cmd.rank, at_step=self.step,
                          params=cmd.params, **node, **extra)


def handler(kind: FaultKind) -> Callable[[Firing], None]:
    """The function that fires ``kind``, imported by the name the registry gives."""
    module, _, name = REGISTRY[kind].handler.partition(":")
    return getattr(importlib.import_module(module), name)


def fire(session: Session, command: FaultCommand, step: int | None, main_thread: int | None = None) -> None:
    """Fire a claimed command. ``main_thread``: fired from another thread, for a user script: an
    exception is then raised in that thread by :data:`FAULT_SIGNAL`, and a hang stops the
    whole process (SIGSTOP) instead of sleeping in the step."""
    firing = Firing(session, command, step, main_thread)
    handler(FaultKind(command.fault))(firing)
    firing.report()


def mine(session: Session, command: FaultCommand) -> bool:
    """Whether this rank is the one that fires ``command``."""
    if command.scope == FaultScope.RANK:
        return command.rank == session.rank
    if command.scope == FaultScope.NODE:
        return command.node == session.info.node and session.info.local_rank == 0
    return session.rank == 0


def due(session: Session, command: FaultCommand, step: int | None) -> bool:
    """Whether this rank fires ``command`` now: at the start of ``step`` (None: between steps, where
    only commands without a step are due), or once its ``after`` delay has passed."""
    if not mine(session, command):
        return False
    if command.after is not None:
        return time.time() >= (command.queued_at or 0.0) + command.after
    return command.step is None or (step is not None and command.step <= step)


def fire_due(session: Session, step: int | None, *, at: int | None = None, steps_only: bool = False,
             main_thread: int | None = None, lock: Any = None) -> None:
    """Claim and fire, one at a time, every command due on this rank at the start of ``step`` (None:
    between steps). ``at``: the step reported as where it fired (default ``step``); ``steps_only``:
    only commands for a step (a fault thread fires the others); ``lock``: held while the inbox is
    read and a command claimed, never while it fires (a hang never returns)."""
    if session.inbox is None:
        return
    guard = lock if lock is not None else contextlib.nullcontext()
    with guard:
        candidates = [c for c in session.commands() if not steps_only or c.step is not None]
    for command in candidates:
        with guard:
            claimed = due(session, command, step) and session.inbox.take(command)
        if claimed:
            fire(session, command, at if at is not None else step, main_thread)


# ---- the handlers, one per fault kind (named in the registry) -------------------------------------

def exception(f: Firing) -> None:
    f.report()
    s = f.session
    where = f" at step {f.step}" if f.step is not None else ""
    s.pending_exception = f"injected exception on rank {s.rank}{where}"
    if f.main_thread is None:
        s.raise_pending()
    signal.pthread_kill(f.main_thread, FAULT_SIGNAL)


def hang(f: Firing) -> None:
    f.report()
    if f.main_thread is not None:
        os.kill(os.getpid(), signal.SIGSTOP)  # ft_launcher's monitor sends SIGCONT and kills it
    while True:  # an in-process restart interrupts this with an asynchronous exception
        time.sleep(0.05)


def sigkill(f: Firing) -> None:
    f.report()
    os.kill(os.getpid(), signal.SIGKILL)


def sigterm(f: Firing) -> None:
    f.report()
    drain = f.session.drain
    if drain is not None and drain.is_handler():  # the fault is a rank dying of it, not a drain
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGTERM)
    if signal.getsignal(signal.SIGTERM) == signal.SIG_DFL:  # else the script handles it: carry on
        time.sleep(60)


def segfault(f: Firing) -> None:
    f.report()
    ctypes.string_at(0)


def slow_rank(f: Firing) -> None:
    s, params = f.session, f.command.params
    s._slow_until, s._slow_delay = f.at + int(params["duration"]), float(params["delay"])


def save_failure(f: Firing) -> None:
    for callback in f.session.on_save_failure:
        callback()


def disk_full(f: Firing) -> None:
    f.report()
    s = f.session
    s._full_until = f.at + int(f.command.params.get("duration", 10))
    s.events.divert("/dev/full")


def slow_storage(f: Firing) -> None:
    params = f.command.params
    f.session._slow_storage = (f.at + int(params.get("duration", 10)), float(params.get("delay", 2.0)))


def kill_launcher(f: Firing) -> None:
    """The whole node: ft_launcher's process group, this rank included."""
    f.report()
    # a warm rank's parent is its zygote: its shim's parent, the launcher, is named in the environment
    os.killpg(os.getpgid(int(os.environ.get("EKSFT_LAUNCHER_PID") or os.getppid())), signal.SIGKILL)


def corrupt_checkpoint(f: Firing) -> None:
    """Flip 64 bytes in the middle of the largest shard of the newest committed checkpoint."""
    from ..checkpoint_folders import list_checkpoints

    committed = [i for i in list_checkpoints(f.session.checkpoint_dir())
                 if i.state == CheckpointState.COMMITTED]
    if not committed:
        f.report(path=None, note="no committed checkpoint yet: nothing corrupted")
        return
    victim = max(committed[-1].path.glob("*.distcp"), key=lambda p: p.stat().st_size)
    middle = victim.stat().st_size // 2
    with open(victim, "r+b") as file:
        file.seek(middle)
        chunk = file.read(64)
        file.seek(middle)
        file.write(bytes(b ^ 0xFF for b in chunk))
    f.report(path=str(victim), checkpoint_step=committed[-1].step)


def kill_supervisor(f: Firing) -> None:
    """SIGKILL the job's local supervisor: the one ``supervisor.json`` names, if that pid is still
    the process it names and carries this job's mark."""
    from .. import procs

    job_dir = f.session.job_dir
    record = job_dir.supervisor() if job_dir else {}
    victim = procs.recorded(record.get("supervisor"), os.environ.get(procs.JOB_UID_ENV) or "")
    if victim is None:
        f.report(note="no supervisor of this job runs here: nothing killed")
        return
    victim.kill()
    f.report(supervisor_pid=victim.pid)
