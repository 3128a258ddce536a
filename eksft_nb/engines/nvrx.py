"""NVRx as an engine (``--engine nvrx``, the default): the ranks of every node restart together (in-process,
in-job through ``ft_launcher``, or the whole job through the supervisor) and resume from a checkpoint. The
rest of the package is built around it; this is what it is to the engine contract (:mod:`.base`)."""

from __future__ import annotations

from ..fault_registry import LINGERING
from ..spec import JobSpec
from ..states import FaultKind, RestartLevel
from .base import Engine, EngineName

# what heals each kind in the built-in trainer: a lost rank process is restarted in-job by ft_launcher, a lost
# launcher restarts the job, a straggler or a failed save is absorbed ("none"); an exception or a hang is
# caught in-process where the Wrapper runs, else restarts the ranks in-job
RANK_LOST = frozenset({FaultKind.SIGKILL, FaultKind.SEGFAULT, FaultKind.CORRUPT_CHECKPOINT})
CAUGHT = frozenset({FaultKind.EXCEPTION, FaultKind.HANG})


class NvrxEngine(Engine):
    name = EngineName.NVRX
    label = "NVRx"
    node_process = "ft_launcher"
    heals_alone = False
    faults = tuple(k.value for k in FaultKind)   # every kind of the fault registry

    def check(self, spec: JobSpec, launching: bool = False) -> None:
        """Nothing: the spec's options are NVRx's (what a backend cannot run, the backend refuses)."""

    def expected_level(self, kind: str, spec: JobSpec) -> str | None:
        """Said for the built-in trainer's kinds whose path is fixed (a script's own loop decides how an
        exception or a hang ends; a launcher lost beside a spare, SIGTERM and a lost supervisor: not said)."""
        if kind in RANK_LOST:
            return RestartLevel.INJOB.value
        if kind == FaultKind.KILL_LAUNCHER and not spec.spare_nodes:
            return RestartLevel.JOB.value
        if kind in LINGERING and not spec.script:
            return "none"
        if kind in CAUGHT and not spec.script:
            return (RestartLevel.INPROCESS if spec.ft.inprocess else RestartLevel.INJOB).value
        return None

    def describe(self, spec: JobSpec) -> str:
        ranks = f"{spec.world_size} ranks ({spec.nnodes}x{spec.nproc_per_node})"
        if spec.script:
            args = " " + " ".join(spec.script_args) if spec.script_args else ""
            return (f"{ranks} running {spec.script}{args} (its own loop: steps are its optimizer steps), "
                    f"up to {spec.ft.max_injob_restarts} in-job and {spec.ft.max_job_restarts} job restarts")
        inprocess = "on" if spec.ft.inprocess else "off"
        return (f"{ranks}, {spec.steps} steps, model {spec.model.preset}, {spec.checkpoint.mode} checkpoints "
                f"every {spec.checkpoint.every} steps, in-process restart {inprocess}")


NVRX = NvrxEngine()
