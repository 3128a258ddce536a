"""What an engine is to the rest of the package: the one contract every engine (``--engine``) implements
whole, so that call sites ask the job's engine (:func:`eksft_nb.engines.registry.engine_of`) instead of
comparing its name.

An engine says what it takes of a spec (:meth:`Engine.check`), the fault kinds it fires
(:meth:`Engine.fires`), what runs on each of ``--nnodes`` and whether a lost one heals alone, which rank
a test's fault targets, and how its events fold (:meth:`Engine.group_losses`). What it runs on each
backend (a local job's supervisor and dry-run plan, an EKS job's objects, a Slurm batch script) is the
backend's to say: each backend keeps a table of its parts per engine (:func:`per_engine`, checked whole
at import), so a backend may import engines, and an engine never imports a backend.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Mapping, Sequence
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, TypeVar

from ..errors import SpecError
from ..states import EngineName

if TYPE_CHECKING:
    from ..spec import JobSpec
    from .torchft.losses import LostGroups

T = TypeVar("T")


class Engine(abc.ABC):
    """One engine: its class attributes say what it is (each engine sets every one), its methods what it
    makes of a given spec (the defaults hold where an engine limits nothing)."""

    name: EngineName
    label: str                 # as a table or a comparison writes it: NVRx, torchft
    node_process: str          # what runs on each node, as a message or a pod's state names it
    # a lost node is restarted alone (by the engine's own runner) and heals from a peer while the others
    # train on: its recoveries are per node, told by its events, and the job restarts only when all are
    # lost; else a lost node restarts the job
    heals_alone: bool
    faults: tuple[str, ...]    # the fault kinds its built-in trainer fires

    @abc.abstractmethod
    def check(self, spec: JobSpec, launching: bool = False) -> None:
        """Raise :class:`SpecError` for what ``spec`` asks that this engine does not take (the command layer
        asks once, after ``spec.validate()``); ``launching``: also what this machine cannot run for it."""

    def check_settings(self, spec: JobSpec) -> None:
        """Raise :class:`ControlError` where a running job of this engine cannot take live settings (the
        command layer asks before anything is queued); by default it takes them."""
        return None

    def fires(self, spec: JobSpec) -> tuple[str, ...]:
        """The fault kinds ``spec``'s job fires (a user's script may fire fewer)."""
        return self.faults

    def check_faults(self, spec: JobSpec, faults: Sequence[Any]) -> None:
        """Refuse a fault (scheduled at launch, or injected into a running job) this engine cannot fire."""
        takes = self.fires(spec)
        where = " in a --script" if spec.script else ""
        for f in faults:
            if f.fault not in takes:
                raise SpecError(f"--engine {self.name} cannot fire {f.fault}{where} so far",
                                f"use one of {', '.join(takes)}, or --engine {EngineName.NVRX}")

    def target_rank(self, spec: JobSpec) -> int:
        """The rank a resilience test's rank fault targets: the last one."""
        return spec.world_size - 1

    def trial_ranks(self, spec: JobSpec) -> Sequence[int]:
        """The ranks a repeated test's trials may target (drawn with its seed): any."""
        return range(spec.world_size)

    def expected_level(self, kind: str, spec: JobSpec) -> str | None:
        """The level that should heal ``kind`` in ``spec``'s job (``none``: absorbed without a restart), the
        ground truth a test's trial is scored against; None where the engine does not say."""
        return None

    def group_losses(self, emit: Callable[..., Any]) -> LostGroups | None:
        """What folds its lost nodes and their heals into ``failure``/``restart`` events where a backend
        watches the job from outside (EKS: pod states), ``emit`` publishing them; None: the job's incidents
        alone (a lost node restarts the job)."""
        return None

    @abc.abstractmethod
    def describe(self, spec: JobSpec) -> str:
        """What ``spec``'s job runs, in one line: only what applies to it."""


def per_engine(parts: Mapping[EngineName, T]) -> Mapping[EngineName, T]:
    """A backend's table of what it does for each engine (renders, runs, deletes), read-only and checked
    whole: a new engine fails at import in every backend that has not said what it does with it."""
    missing = [e.value for e in EngineName if e not in parts]
    if missing:
        raise TypeError(f"no entry for engine(s) {', '.join(missing)}")
    return MappingProxyType(dict(parts))
