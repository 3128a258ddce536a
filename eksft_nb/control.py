"""Fault commands: what can be injected into a running job, validated before anything is written.

A command is a JSON file in ``control/pending/``. The ranks poll the folder (one ``stat`` per step)
and fire a fault at the start of the chosen step, or of the next step for "now", so faults land
exactly where asked: rank faults on the target rank, ``kill-launcher`` on local rank 0 of the target
node, ``corrupt-checkpoint`` and ``kill-supervisor`` on rank 0. A user script's ranks also poll from a
thread, so "now" and ``after`` (seconds after the command was queued) fire whatever the script is
doing, and steps are its optimizer steps. Whoever fires a command creates ``control/fired/<id>``
exclusively, so a fault fires exactly once even when a restart rolls the job back past its step.
"""

from __future__ import annotations

import json
import os
import re
import stat
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from .errors import ControlError, closest, shown
from .fault_registry import REGISTRY, integer, number, target_text
from .jobdir import atomic_write
from .states import FaultKind, FaultScope

# fault -> (what it targets, what it does), by name, from the one table
FAULTS: dict[str, tuple[FaultScope, str]] = {k.value: (d.scope, d.description) for k, d in REGISTRY.items()}
ID = re.compile(r"[A-Za-z0-9_-]{1,64}")   # a command's id names its files: no path, no dot


# field -> (check, what it must be)
FIELDS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "fault": (lambda v: isinstance(v, str), "a fault name (a string)"),
    "rank": (lambda v: v is None or integer(v), "an integer rank, or null"),
    "step": (lambda v: v is None or integer(v), "an integer step, or null"),
    "node": (integer, "an integer node"),
    "params": (lambda v: isinstance(v, dict) and all(isinstance(k, str) for k in v), "a JSON object"),
    "id": (lambda v: isinstance(v, str) and ID.fullmatch(v) is not None, "1-64 letters, digits, '-' or '_'"),
    "after": (lambda v: v is None or (number(v) and 0 <= v < 1e7),
              "seconds from when it was queued (>= 0), or null"),
    "queued_at": (lambda v: v is None or number(v), "a time in seconds since the epoch, or null"),
}


@dataclass
class FaultCommand:
    fault: str
    rank: int | None = None       # rank faults: the global rank
    step: int | None = None       # fire at the start of this step; None: as soon as possible
    after: float | None = None    # or this many seconds after it was queued
    node: int = 0                 # node faults: which node
    params: dict[str, Any] = field(default_factory=dict)
    id: str = field(default_factory=lambda: uuid.uuid4().hex[:12])
    queued_at: float | None = None  # wall-clock time :func:`submit` wrote it

    @property
    def when(self) -> str:
        """When it fires, in words: ``now``, ``at step N`` or ``N s after it was queued``."""
        if self.step is not None:
            return f"at step {self.step}"
        return f"{self.after:g}s after it was queued" if self.after is not None else "now"

    @property
    def scope(self) -> FaultScope:
        return FAULTS[self.fault][0]

    @property
    def target(self) -> str:
        """Whom it hits, in words: ``rank 1``, ``node 0`` or ``the job``."""
        return target_text(self.rank, self.node if self.scope == FaultScope.NODE else None)

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str | bytes) -> FaultCommand:
        """Parse a command file; anything but a well-typed command raises :class:`ControlError`."""
        try:
            data = json.loads(text)
        except (ValueError, RecursionError):
            raise ControlError("a fault command is not valid JSON",
                               'write one JSON object, e.g. {"fault": "exception", "rank": 0}') from None
        return cls.from_dict(data)

    @classmethod
    def from_dict(cls, data: Any) -> FaultCommand:
        if not isinstance(data, dict):
            raise ControlError("a fault command must be a JSON object", 'write {"fault": "exception", ...}')
        unknown = set(data) - set(FIELDS)
        if unknown:
            raise ControlError("unknown field(s) in fault command: "
                               f"{', '.join(sorted(map(str, unknown)))[:200]}",
                               "use only fault, rank, step, after, node, params and id")
        if "fault" not in data:
            raise ControlError("a fault command lacks its fault",
                               f"add \"fault\": one of {', '.join(FAULTS)}")
        command = cls(**data)
        command._check_types()
        return command

    def _check_types(self) -> None:
        for name, (ok, what) in FIELDS.items():
            if not ok(getattr(self, name)):
                raise ControlError(f"fault command field {name} is {shown(getattr(self, name))}",
                                   f"it must be {what}")

    def validate(self, world_size: int, nnodes: int, current_step: int | None = None) -> FaultCommand:
        """Check the command against the job it targets; raise :class:`ControlError` if it cannot apply.

        Every writer (CLI, magics, ``Job.inject``, the in-pod ``inject``) and every reader (the ranks)
        calls this, so a command that passes can be fired without further checks."""
        self._check_types()
        if self.fault not in FAULTS:
            raise ControlError(f"unknown fault {shown(self.fault)}",
                               f"did you mean {closest(self.fault, FAULTS)}? Faults: {', '.join(FAULTS)}")
        if self.scope == FaultScope.RANK:
            if self.rank is None:
                self.rank = 0
            if not 0 <= self.rank < world_size:
                raise ControlError(f"rank {shown(self.rank)} is out of range for a job of {world_size} ranks",
                                   f"use --rank between 0 and {world_size - 1}")
        elif self.rank is not None:
            raise ControlError(f"{self.fault} does not target a rank", "leave out --rank" +
                               (" and use --node" if self.scope == FaultScope.NODE else ""))
        if not 0 <= self.node < nnodes:
            raise ControlError(f"node {shown(self.node)} is out of range for a job of {nnodes} node(s)",
                               f"use --node between 0 and {nnodes - 1}")
        if self.step is not None:
            if self.step < 1:
                raise ControlError(f"step must be a positive integer, got {shown(self.step)}",
                                   "use --step N with N >= 1, or omit it to inject now")
            if current_step is not None and self.step <= current_step:
                raise ControlError(f"step {self.step} has already passed (the job is at step {current_step})",
                                   f"use --step {current_step + 1} or later, or omit --step to inject now")
        if self.after is not None and self.step is not None:
            raise ControlError("a fault fires at a step or after a time, not both", "drop --step or --after")
        allowed = REGISTRY[FaultKind(self.fault)].params
        unknown = sorted(set(self.params) - set(allowed))
        if unknown:
            takes = f"it takes only {', '.join(allowed)}" if allowed else "it takes none"
            raise ControlError(f"{self.fault} has no parameter(s) {shown(', '.join(unknown))}",
                               f"leave them out: {takes}")
        for name, param in allowed.items():
            value = self.params.setdefault(name, param.default)
            if not param.check(value):
                raise ControlError(f"{self.fault} parameter {name} is {shown(value)}", f"use {param.what}")
        return self


WHEN_FIX = "write now, the step to fire at (e.g. 120), or seconds from now (e.g. 30s)"


def parse_when(text: str) -> tuple[int | None, float | None]:
    """``(step, after)`` from when a fault fires, in words: ``now`` (or nothing), a step (``120`` or
    ``step 120``) or seconds (``30s``). Raises :class:`ValueError` for anything else."""
    when = text.strip().lower()
    if when in ("", "now"):
        return None, None
    if when.endswith("s") and not when.startswith("step"):
        return None, float(when[:-1])
    return int(when.removeprefix("step").strip()), None


def parse_fault(text: str) -> FaultCommand:
    """Parse the compact form ``kind[:rank][@when]`` used by ``--fault`` (e.g. ``sigkill:1@30``,
    or ``hang:0@45s`` for 45 seconds after launch); ``when`` as :func:`parse_when` reads it."""
    body, at_sign, when = text.partition("@")
    kind, _, target = body.partition(":")
    try:
        rank_or_node = int(target) if target else None
        at, after = parse_when(when) if at_sign and when.strip() not in ("", "now") else (None, None)
    except ValueError:
        raise ControlError(f"cannot parse fault {shown(text)}",
                           "write kind[:rank][@step] (or @SECONDSs: seconds after launch), e.g. "
                           "exception:0@15, "
                           "hang:0@45s or kill-launcher@60") from None
    if kind in FAULTS and FAULTS[kind][0] != FaultScope.RANK:
        return FaultCommand(kind, step=at, after=after, node=rank_or_node or 0)
    return FaultCommand(kind, rank=rank_or_node, step=at, after=after)


def submit(pending: Path, command: FaultCommand) -> Path:
    command._check_types()   # the id names the file
    if command.queued_at is None:
        command.queued_at = time.time()
    path = pending / f"{command.id}.json"
    atomic_write(path, command.to_json())
    return path


def claim(fired: Path, command: FaultCommand | str) -> bool:
    """True exactly once per command (or command id) across all processes of the job."""
    cid = command if isinstance(command, str) else command.id
    try:
        os.close(os.open(fired / cid, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
        return True
    except FileExistsError:
        return False


def reject(pending: Path, fired: Path, cid: str, reason: str) -> bool:
    """Set a command file that cannot fire aside, once: it moves to ``control/rejected/`` with the
    reason beside it, so no rank reads it again (after any restart). True for the one caller that
    did it (and should report it)."""
    try:
        if not claim(fired, cid):
            return False
    except OSError:   # a file name that cannot be a marker: leave it, it never parses
        return False
    rejected = pending.with_name("rejected")
    try:
        rejected.mkdir(mode=0o700, exist_ok=True)
        atomic_write(rejected / f"{cid}.reason", reason + "\n")
        os.replace(pending / f"{cid}.json", rejected / f"{cid}.json")
    except OSError:
        pass   # claimed in fired/: it never fires, wherever the file stays
    return True


MAX_COMMAND_BYTES = 64 << 10


def read_command(path: Path) -> bytes:
    """A command file's bytes, if it is a regular file (not a link, FIFO or device: opened without
    following a link and without blocking, checked on the open descriptor) of a command's size."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as e:
        raise ControlError(f"command file {path.name} cannot be opened ({e.strerror or e})",
                           "write commands as regular files (python -m eksft_nb inject)") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise ControlError(f"command file {path.name} is not a regular file",
                               "write commands as regular files (python -m eksft_nb inject)")
        if info.st_size > MAX_COMMAND_BYTES:
            raise ControlError(f"command file {path.name} holds {info.st_size} bytes, more than a command",
                               "write one small JSON object per command")
        with os.fdopen(os.dup(fd), "rb") as f:
            return f.read(MAX_COMMAND_BYTES + 1)
    finally:
        os.close(fd)


class CommandInbox:
    """A rank's view of the pending commands: re-read when the folder's mtime changes, and at least
    every :attr:`RELIST_S` seconds, because on a filesystem with coarse timestamps (Lustre: one
    second) a command renamed in within the tick of the last listing leaves the mtime unchanged."""

    RELIST_S = 1.0

    def __init__(self, pending: Path, fired: Path) -> None:
        self.pending, self.fired = pending, fired
        self._mtime = -1
        self._listed = -float("inf")   # time.monotonic() of the last listing
        self._commands: dict[str, FaultCommand] = {}
        self.rejected: dict[str, str] = {}   # command files that do not parse: id -> why

    def poll(self) -> list[FaultCommand]:
        """Commands that have not fired yet: one stat per call, a listing only when the folder changed
        or :attr:`RELIST_S` has passed."""
        try:
            mtime = os.stat(self.pending).st_mtime_ns
        except FileNotFoundError:
            return []
        now = time.monotonic()
        if mtime != self._mtime or now - self._listed >= self.RELIST_S:
            self._mtime, self._listed = mtime, now
            for p in self.pending.glob("*.json"):
                if p.stem not in self._commands:
                    try:
                        cmd = FaultCommand.from_json(read_command(p))
                        if cmd.id != p.stem:
                            raise ControlError(f"command file {p.name} holds id {cmd.id}",
                                               "name it <id>.json")
                    except (OSError, ControlError) as e:
                        self.rejected[p.stem] = str(e)
                        continue
                    self._commands[p.stem] = cmd
            for cid in [c for c in self._commands if (self.fired / c).exists()]:
                del self._commands[cid]
        return list(self._commands.values())

    def take(self, command: FaultCommand) -> bool:
        self._commands.pop(command.id, None)
        return claim(self.fired, command)
