"""NVRx as an engine (``--engine nvrx``, the default): the ranks of every node restart together (in-process,
in-job through ``ft_launcher``, or the whole job through the supervisor) and resume from a checkpoint. The
rest of the package is built around it; this is what it is to the engine contract (:mod:`.base`)."""

from __future__ import annotations

from ..spec import JobSpec
from ..states import FaultKind
from .base import Engine, EngineName


class NvrxEngine(Engine):
    name = EngineName.NVRX
    label = "NVRx"
    node_process = "ft_launcher"
    heals_alone = False
    faults = tuple(k.value for k in FaultKind)   # every kind of the fault registry

    def check(self, spec: JobSpec, launching: bool = False) -> None:
        """Nothing: the spec's options are NVRx's (what a backend cannot run, the backend refuses)."""

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
