"""Fault commands: what can be injected into a running job, validated before anything is written.

A command is a JSON file in ``control/pending/``. The ranks poll the folder (one ``stat`` per step)
and fire a fault at the start of the chosen step, or of the next step for "now", so faults land
exactly where asked: rank faults on the target rank, ``kill-launcher`` on local rank 0 of the target
node, ``corrupt-checkpoint`` on rank 0. A user script's ranks also poll from a thread, so "now" and
``after`` (seconds after the command was queued) fire whatever the script is doing, and steps are its
optimizer steps. Whoever fires a command creates ``control/fired/<id>`` exclusively, so a fault
fires exactly once even when a restart rolls the job back past its step.
"""

from __future__ import annotations

import json
import os
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from .errors import ControlError
from .jobdir import atomic_write
from .spec import _closest

# fault -> (who fires it, what it does)
FAULTS: dict[str, tuple[str, str]] = {
    "exception": ("rank", "raise an exception in the training loop"),
    "hang": ("rank", "stop making progress (sleep forever inside the step; a user script's rank fired by "
                     "time is stopped with SIGSTOP)"),
    "sigkill": ("rank", "the rank process is killed (SIGKILL), like the OOM killer"),
    "sigterm": ("rank", "the rank process receives SIGTERM"),
    "segfault": ("rank", "the rank process crashes with a segmentation fault"),
    "slow-rank": ("rank", "the rank sleeps `delay` seconds per step for `duration` steps (a straggler)"),
    "save-failure": ("rank", "the rank's next checkpoint write fails; training continues, the save is retried"),
    "kill-launcher": ("node", "the node's ft_launcher and all its ranks die at once (a node is lost)"),
    "corrupt-checkpoint": ("job", "flip bytes in the latest committed checkpoint (resume must skip it)"),
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
    def scope(self) -> str:
        return FAULTS[self.fault][0]

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> FaultCommand:
        data = json.loads(text)
        if not isinstance(data, dict):
            raise ControlError("a fault command must be a JSON object", "write {\"fault\": \"exception\", ...}")
        unknown = set(data) - {"fault", "rank", "step", "after", "node", "params", "id", "queued_at"}
        if unknown:
            raise ControlError(f"unknown field(s) in fault command: {', '.join(sorted(unknown))}",
                               "use only fault, rank, step, after, node and params")
        return cls(**data)

    def validate(self, world_size: int, nnodes: int, current_step: int | None = None) -> FaultCommand:
        """Check the command against the job it targets; raise :class:`ControlError` if it cannot apply."""
        if self.fault not in FAULTS:
            raise ControlError(f"unknown fault {self.fault!r}",
                               f"did you mean {_closest(self.fault, FAULTS)}? Faults: {', '.join(FAULTS)}")
        if self.scope == "rank":
            if self.rank is None:
                self.rank = 0
            if isinstance(self.rank, bool) or not isinstance(self.rank, int) or not 0 <= self.rank < world_size:
                raise ControlError(f"rank {self.rank!r} is out of range for a job of {world_size} ranks",
                                   f"use --rank between 0 and {world_size - 1}")
        elif self.rank is not None:
            raise ControlError(f"{self.fault} does not target a rank", "leave out --rank" +
                               (" and use --node" if self.scope == "node" else ""))
        if isinstance(self.node, bool) or not isinstance(self.node, int) or not 0 <= self.node < nnodes:
            raise ControlError(f"node {self.node!r} is out of range for a job of {nnodes} node(s)",
                               f"use --node between 0 and {nnodes - 1}")
        if self.step is not None:
            if isinstance(self.step, bool) or not isinstance(self.step, int) or self.step < 1:
                raise ControlError(f"step must be a positive integer, got {self.step!r}",
                                   "use --step N with N >= 1, or omit it to inject now")
            if current_step is not None and self.step <= current_step:
                raise ControlError(f"step {self.step} has already passed (the job is at step {current_step})",
                                   f"use --step {current_step + 1} or later, or omit --step to inject now")
        if self.after is not None:
            if isinstance(self.after, bool) or not isinstance(self.after, (int, float)) or not 0 <= self.after < 1e7:
                raise ControlError(f"after must be a number of seconds >= 0, got {self.after!r}",
                                   "use --after 30 (seconds from now), or omit it to inject now")
            if self.step is not None:
                raise ControlError("a fault fires at a step or after a time, not both", "drop --step or --after")
        if not isinstance(self.params, dict):
            raise ControlError("params must be a mapping", "use e.g. params={'delay': 0.5}")
        if self.fault == "slow-rank":
            delay, duration = self.params.setdefault("delay", 0.5), self.params.setdefault("duration", 20)
            if not isinstance(delay, (int, float)) or delay <= 0 or not isinstance(duration, int) or duration < 1:
                raise ControlError("slow-rank needs delay > 0 seconds and duration >= 1 steps",
                                   "use e.g. params delay=0.5 duration=20")
        return self


def parse_fault(text: str) -> FaultCommand:
    """Parse the compact form ``kind[:rank][@step|@SECONDSs]`` used by ``--fault`` (e.g. ``sigkill:1@30``,
    or ``hang:0@45s`` for 45 seconds after launch)."""
    body, _, when = text.partition("@")
    kind, _, target = body.partition(":")
    try:
        rank_or_node = int(target) if target else None
        after = float(when[:-1]) if when.endswith("s") else None
        at = int(when) if when and after is None else None
    except ValueError:
        raise ControlError(f"cannot parse fault {text!r}",
                           "write kind[:rank][@step] (or @SECONDSs: seconds after launch), e.g. exception:0@15, "
                           "hang:0@45s or kill-launcher@60") from None
    if kind in FAULTS and FAULTS[kind][0] != "rank":
        return FaultCommand(kind, step=at, after=after, node=rank_or_node or 0)
    return FaultCommand(kind, rank=rank_or_node, step=at, after=after)


def submit(pending: Path, command: FaultCommand) -> Path:
    if command.queued_at is None:
        command.queued_at = time.time()
    path = pending / f"{command.id}.json"
    atomic_write(path, command.to_json())
    return path


def claim(fired: Path, command: FaultCommand) -> bool:
    """True exactly once per command across all processes of the job."""
    try:
        os.close(os.open(fired / command.id, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
        return True
    except FileExistsError:
        return False


class CommandInbox:
    """A rank's view of the pending commands, re-read only when the folder changes."""

    def __init__(self, pending: Path, fired: Path) -> None:
        self.pending, self.fired = pending, fired
        self._mtime = -1
        self._commands: dict[str, FaultCommand] = {}

    def poll(self) -> list[FaultCommand]:
        """Commands that have not fired yet (cheap when nothing changed: one stat)."""
        try:
            mtime = os.stat(self.pending).st_mtime_ns
        except FileNotFoundError:
            return []
        if mtime != self._mtime:
            self._mtime = mtime
            for p in self.pending.glob("*.json"):
                if p.stem not in self._commands:
                    try:
                        cmd = FaultCommand.from_json(p.read_text())
                    except (ValueError, TypeError, ControlError):
                        continue
                    if cmd.fault in FAULTS:
                        self._commands[p.stem] = cmd
            for cid in [c for c in self._commands if (self.fired / c).exists()]:
                del self._commands[cid]
        return list(self._commands.values())

    def take(self, command: FaultCommand) -> bool:
        self._commands.pop(command.id, None)
        return claim(self.fired, command)
