"""torchft as an engine, to the engine contract (:mod:`eksft_nb.engines.base`): replica groups (one per
``--nnodes``) train on through a per-step quorum, and a lost one is restarted alone and heals from a peer."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from ...spec import JobSpec
from ...states import RestartLevel
from ..base import Engine, EngineName
from . import checks
from .losses import LostGroups


class TorchftEngine(Engine):
    name = EngineName.TORCHFT
    label = "torchft"
    node_process = "the replica group's trainer"
    heals_alone = True
    faults = checks.FAULTS

    def check(self, spec: JobSpec, launching: bool = False) -> None:
        checks.check(spec, launching)

    def check_settings(self, spec: JobSpec) -> None:
        checks.check_settings(spec)

    def fires(self, spec: JobSpec) -> tuple[str, ...]:
        return checks.SCRIPT_FAULTS if spec.script else checks.FAULTS

    def target_rank(self, spec: JobSpec) -> int:
        """The last replica group's first rank: it reports the group's thrown-away step and its heal."""
        return (spec.nnodes - 1) * spec.nproc_per_node

    def trial_ranks(self, spec: JobSpec) -> Sequence[int]:
        """The first rank of each replica group but the first (the one that reports its group's thrown-away
        step and heal; the first group's rank 0 also reports the job's committed steps)."""
        return range(spec.nproc_per_node, spec.world_size, spec.nproc_per_node)

    def expected_level(self, kind: str, spec: JobSpec) -> str | None:
        """A lost group is restarted by the backend (``job``) and heals from a peer; an exception throws the
        step away and heals it without a restart, a straggler is waited for (``none``)."""
        return {"sigkill": RestartLevel.JOB.value, "exception": "none", "slow-rank": "none"}.get(kind)

    def group_losses(self, emit: Callable[..., Any]) -> LostGroups:
        return LostGroups(emit)

    def describe(self, spec: JobSpec) -> str:
        if spec.script:
            args = " " + " ".join(spec.script_args) if spec.script_args else ""
            return (f"torchft: {spec.nnodes} replica groups running {spec.script}{args} (its own loop: steps "
                    f"are those torchft commits), a lost group heals from a peer (up to "
                    f"{spec.ft.max_job_restarts} restarts each)")
        return (f"torchft: {spec.nnodes} replica groups of {spec.nproc_per_node} rank(s), {spec.steps} "
                f"steps, model {spec.model.preset}, a lost group heals from a peer (up to "
                f"{spec.ft.max_job_restarts} restarts each; no checkpoints yet)")


TORCHFT = TorchftEngine()
