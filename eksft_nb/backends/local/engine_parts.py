"""What a local job is for each engine (the engine contract leaves it to the backend): its dry-run plan,
and the supervisor of its own an engine runs in place of the NVRx one (:mod:`.supervisor`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ... import loopback, nvrx
from ...engines.base import per_engine
from ...engines.registry import engine_of
from ...engines.torchft.plan import render as torchft_plan
from ...launcher import Ports, control_argv, launcher_argv, rank_env
from ...spec import JobSpec
from ...states import EngineName


@dataclass(frozen=True)
class LocalEngine:
    plan: Callable[[JobSpec, str], str]   # --dry-run: what the job starts, given its job folder
    # the module of the engine's own supervisor, which the supervisor's entry point execs in its place
    # (``python -m MODULE --run JOB_DIR [--adopt]``); None: the NVRx one (:class:`.supervisor.Supervisor`)
    supervisor: str | None


def launcher_plan(spec: JobSpec, job_dir: str) -> str:
    """An NVRx job's: each ft_launcher's environment and command line, as this machine's NVRx runs them (with
    hot spares on NVRx 0.6+, its nvrx-control first: the rendezvous's store host)."""
    ports, found = Ports(29500, 29501, 29502), nvrx.installed()
    spares = spec.spare_nodes and found is not None and found.spares
    lines = [f"# job folder: {job_dir}", "# environment of each launcher (ports are picked free at launch):"]
    for k, v in {**rank_env(spec, ports=ports, job_attempt=0, job_dir=job_dir, nvrx=found),
                 **loopback.env()}.items():
        lines.append(f"{k}={v}")
    if spares == "standby":
        control = control_argv(spec, rdzv_host="127.0.0.1", ports=ports, rdzv_id=spec.name)
        lines.append(" \\\n    ".join(control))
    for node in range(spec.nnodes + spec.spare_nodes):   # the spares' lines are the same
        argv = launcher_argv(spec, node_rank=node, rdzv_host="127.0.0.1", ports=ports, rdzv_id=spec.name,
                             nvrx=found, store_elsewhere=bool(spares))
        lines.append(" \\\n    ".join(argv))
    return "\n".join(lines)


PARTS = per_engine({
    EngineName.NVRX: LocalEngine(launcher_plan, None),
    # the Lighthouse, and a process per replica group's rank
    EngineName.TORCHFT: LocalEngine(torchft_plan, "eksft_nb.backends.local.torchft"),
})


def of(spec: JobSpec) -> LocalEngine:
    """``spec``'s engine's parts on the local backend."""
    return PARTS[engine_of(spec).name]
