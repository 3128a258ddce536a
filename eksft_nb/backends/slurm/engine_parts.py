"""What a Slurm job is for each engine (the engine contract leaves it to the backend): its batch script,
and what a failed step of what it runs means."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ...engines.base import per_engine
from ...engines.registry import engine_of
from ...spec import JobSpec
from ...states import EngineName
from . import render, torchft


@dataclass(frozen=True)
class SlurmEngine:
    render: Callable[..., str]   # the sbatch script: (spec, job_uid=None), a new launch id when not given
    # why a failed srun step ends the job, its exit status given: what it runs restarted lost nodes alone
    # until it gave up; None: the allocation restarts the job
    gave_up: Callable[[JobSpec, int], str] | None


PARTS = per_engine({
    EngineName.NVRX: SlurmEngine(render.render, None),                  # ft_launcher per node
    EngineName.TORCHFT: SlurmEngine(torchft.render, torchft.gave_up),   # the Lighthouse, the groups' runner
})


def of(spec: JobSpec) -> SlurmEngine:
    """``spec``'s engine's parts on Slurm."""
    return PARTS[engine_of(spec).name]
