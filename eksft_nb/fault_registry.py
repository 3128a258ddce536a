"""The one table of fault kinds: what each targets, what it does, the parameters it takes, the backends
that cannot deliver it, and the function that fires it on a rank.

The handler is named (``module:function``), not imported: the front ends read this table without
importing the rank side (torch), and a handler may move module without this table changing shape.
:func:`eksft_nb.runtime.faults.fire` resolves it on the rank that fires the fault.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from .states import FaultKind, FaultScope


def integer(v: Any) -> bool:
    """An int that is not a bool (JSON's true is not a step)."""
    return isinstance(v, int) and not isinstance(v, bool)


def number(v: Any) -> bool:
    """A finite int or float."""
    return (integer(v) or isinstance(v, float)) and math.isfinite(v)


@dataclass(frozen=True)
class Param:
    """One parameter a fault command may carry: its default, its check, and what the check means."""

    default: Any
    check: Callable[[Any], bool]
    what: str


@dataclass(frozen=True)
class FaultDef:
    kind: FaultKind
    scope: FaultScope
    description: str
    handler: str                                   # "module:function", called as function(firing)
    params: Mapping[str, Param] = field(default_factory=dict)
    refused_by: frozenset[str] = frozenset()       # backends that cannot deliver it


_RANKS = "eksft_nb.runtime.faults"
_STEPS = Param(10, lambda v: integer(v) and 1 <= v <= 10**6, "steps, an integer >= 1")
_NO_SUPERVISOR = frozenset({"eks", "slurm"})   # no eksft supervisor runs on the cluster or in the allocation

# faults that last while training goes on (a straggler, a failing or slow disk): the cause of a restart only
# where nothing that ends a rank was injected beside them
LINGERING = frozenset({FaultKind.SLOW_RANK, FaultKind.SAVE_FAILURE, FaultKind.DISK_FULL,
                       FaultKind.SLOW_STORAGE})

REGISTRY: Mapping[FaultKind, FaultDef] = {d.kind: d for d in (
    FaultDef(FaultKind.EXCEPTION, FaultScope.RANK, "raise an exception in the training loop",
             f"{_RANKS}:exception"),
    FaultDef(FaultKind.HANG, FaultScope.RANK, "stop making progress (sleep forever inside the step; a user "
             "script's rank fired by time is stopped with SIGSTOP)", f"{_RANKS}:hang"),
    FaultDef(FaultKind.SIGKILL, FaultScope.RANK, "the rank process is killed (SIGKILL), like the OOM killer",
             f"{_RANKS}:sigkill"),
    FaultDef(FaultKind.SIGTERM, FaultScope.RANK, "the rank process receives SIGTERM", f"{_RANKS}:sigterm"),
    FaultDef(FaultKind.SEGFAULT, FaultScope.RANK, "the rank process crashes with a segmentation fault",
             f"{_RANKS}:segfault"),
    FaultDef(FaultKind.SLOW_RANK, FaultScope.RANK, "the rank sleeps `delay` seconds per step for `duration` "
             "steps (a straggler)", f"{_RANKS}:slow_rank", {
                 "delay": Param(0.5, lambda v: number(v) and 0 < v <= 3600,
                                "seconds per step, > 0 and <= 3600"),
                 "duration": Param(20, lambda v: integer(v) and 1 <= v <= 10**9, "steps, an integer >= 1")}),
    # the storage faults: the session holds them in force, the checkpoint writer asks it (storage_fault)
    FaultDef(FaultKind.SAVE_FAILURE, FaultScope.RANK, "the rank's next checkpoint write fails; training "
             "continues, the save is retried", f"{_RANKS}:save_failure"),
    FaultDef(FaultKind.DISK_FULL, FaultScope.RANK,
             "the rank's disk is full for `duration` steps: its checkpoint "
             "and event writes fail (ENOSPC); saves are retried, lost events are counted",
             f"{_RANKS}:disk_full",
             {"duration": _STEPS}),
    FaultDef(FaultKind.SLOW_STORAGE, FaultScope.RANK,
             "the rank's checkpoint writes start `delay` seconds late "
             "for `duration` steps", f"{_RANKS}:slow_storage", {
                 "duration": _STEPS,
                 "delay": Param(2.0, lambda v: number(v) and 0 < v <= 3600,
                                "seconds per write, > 0 and <= 3600")}),
    FaultDef(FaultKind.KILL_LAUNCHER, FaultScope.NODE, "the node's ft_launcher and all its ranks die at once "
             "(a node is lost)", f"{_RANKS}:kill_launcher"),
    FaultDef(FaultKind.CORRUPT_CHECKPOINT, FaultScope.JOB, "flip bytes in the latest committed checkpoint "
             "(resume must skip it)", f"{_RANKS}:corrupt_checkpoint"),
    FaultDef(FaultKind.KILL_SUPERVISOR, FaultScope.JOB, "the job's supervisor is killed (SIGKILL); a new one "
             "adopts the running job", f"{_RANKS}:kill_supervisor", refused_by=_NO_SUPERVISOR),
)}


def refused(backend: str) -> frozenset[str]:
    """The fault kinds ``backend`` cannot deliver."""
    return frozenset(k.value for k, d in REGISTRY.items() if backend in d.refused_by)


def target_text(rank: int | None, node: int | None) -> str:
    """Whom a fault hits, in words: ``rank 1``, ``node 0`` or ``the job`` (both None)."""
    if rank is not None:
        return f"rank {rank}"
    return f"node {node}" if node is not None else "the job"
