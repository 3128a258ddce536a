"""The launch line: one ft_launcher command per node, derived from the job spec.

The local supervisor runs it as a process; the EKS backend puts the same argv in the pod spec. So
what runs on a laptop is what runs on the cluster.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from .loopback import loopback_address
from .nvrx import NVRx
from .preflight.sections import read_ft_config
from .spec import JobSpec
from .timeouts import derive, resolved

TRAINER_MODULE = "eksft_nb.runtime.trainer_main"
SCRIPT_MODULE = "eksft_nb.runtime.script"
ZYGOTE_MODULE = "eksft_nb.runtime.zygote"
WARM_SHIM = str(Path(__file__).parent / "runtime" / "warm_shim.py")


@dataclass(frozen=True)
class Ports:
    """TCP ports one launch uses on the rank-0 host."""

    rdzv: int      # c10d rendezvous (ft_launcher)
    store: int     # the trainer's process-group store (in-process restart)
    wrapper: int   # inprocess.Wrapper's store

    @classmethod
    def from_base(cls, base: int) -> Ports:
        return cls(base, base + 1, base + 2)


def launcher_argv(spec: JobSpec, *, node_rank: int | str, rdzv_host: str, ports: Ports, rdzv_id: str,
                  log_dir: str | None = None, nvrx: NVRx | None = None, cycle_dir: str | None = None,
                  store_elsewhere: bool = False, warm_python: str | None = None,
                  rdzv_conf: dict[str, str] | None = None, gpu: bool | None = None) -> list[str]:
    """``ft_launcher ...`` for one node (argv[0] is the bare command name).

    ``node_rank`` may be a Kubernetes reference such as ``"$(EKSFT_NODE_RANK)"``, which the kubelet
    fills in per pod, so every pod of a workload shares one launch line.

    Without ``nvrx`` the line uses only flags every supported NVRx (0.4.1 on) takes: a pod's image
    may carry another release than the machine that renders it. With it, that release's own flags
    are added (see :meth:`NVRx.launcher_flags`; ``cycle_dir`` receives its per-cycle records).
    ``store_elsewhere``: no launcher hosts the rendezvous store (the local supervisor, or the
    ``nvrx-control`` it starts, does, so that any node, the first included, can be lost while a hot
    spare takes its place).
    ``rdzv_conf``: more of the rendezvous' settings (``--rdzv-conf``), e.g. its ``join_timeout``.
    ``warm_python``: each worker is :mod:`.runtime.warm_shim` run by that interpreter, which turns it
    into a rank forked from the node's zygote (:mod:`.runtime.zygote`) when there is one.
    ``gpu``: the timeouts for GPU (or CPU) nodes whatever the spec says (a Slurm job without ``--gres``
    renders both lines and picks one where it runs); None: as the spec's backend derives them.
    A loopback ``rdzv_host`` means every node is this machine: it is then each node's address too, so
    the ranks' ``MASTER_ADDR`` is loopback and the stores rank 0 hosts listen there alone (see
    :mod:`.loopback`), not on the address the host name resolves to.
    """
    ft = resolved(spec, gpu).ft   # the timeouts as the backend derives them where the spec leaves them unset
    term = term_timeout(spec, gpu)
    argv = [
        "ft_launcher",
        nnodes_flag(spec, nvrx), f"--nproc-per-node={spec.nproc_per_node}", f"--node-rank={node_rank}",
        "--rdzv-backend=c10d", f"--rdzv-endpoint={rdzv_host}:{ports.rdzv}", f"--rdzv-id={rdzv_id}",
        # how often the launcher polls its workers: a dead rank is noticed within it (NVRx 0.6's default)
        f"--max-restarts={ft.max_injob_restarts}", "--monitor-interval=0.3",
        f"--term-timeout={term:g}", "--workers-stop-timeout=5",
        f"--ft-initial-rank-heartbeat-timeout={ft.initial_heartbeat_timeout:g}",
        f"--ft-rank-heartbeat-timeout={ft.heartbeat_timeout:g}",
        "--ft-workload-check-interval=1", "--ft-enable-nic-monitor=false",
    ]
    argv += section_flags(spec, gpu)
    conf = {**({"is_host": "false"} if store_elsewhere else {}), **(rdzv_conf or {})}
    if conf:
        argv.append("--rdzv-conf=" + ",".join(f"{k}={v}" for k, v in conf.items()))
    if loopback_address(rdzv_host):
        argv.append(f"--local-addr={rdzv_host}")
    if log_dir:
        argv.append(f"--log-dir={log_dir}")
    if nvrx is not None:
        argv += nvrx.launcher_flags(cycle_dir)
    if warm_python:
        argv += warm_worker(warm_python)
    if spec.script:  # the launcher substitutes ${local_rank} in its workers' args (string.Template): $ -> $$
        argv += ["-m", SCRIPT_MODULE, *(a.replace("$", "$$") for a in (spec.script, *spec.script_args))]
    else:
        argv += ["-m", TRAINER_MODULE]
    return argv


def nnodes_flag(spec: JobSpec, nvrx: NVRx | None = None) -> str:
    """``--nnodes``: the job's nodes, or ``N:N+S`` where hot spares are NVRx's own standby nodes (0.6+: the
    first N to join train, the others wait for a lost node's place). Without ``nvrx`` (a cluster's launch
    line: the NVRx there is checked where it runs, see :meth:`NVRx.cannot_run`) spares are standby
    nodes; NVRx 0.4's are in its legacy rendezvous's redundancy list, with ``--nnodes=N``."""
    if spec.spare_nodes and (nvrx is None or nvrx.spares == "standby"):
        return f"--nnodes={spec.nnodes}:{spec.nnodes + spec.spare_nodes}"
    return f"--nnodes={spec.nnodes}"


def control_argv(spec: JobSpec, *, rdzv_host: str, ports: Ports, rdzv_id: str, cycle_dir: str | None = None,
                 cycle_job: str = "") -> list[str]:
    """``nvrx-control ...`` (NVRx 0.6+): the rendezvous's store host outside the launchers, for a job with
    hot spares, so that any node can be lost while a spare takes its place. It closes every rendezvous
    round (choosing the active nodes) and writes the cycle records into ``cycle_dir`` as
    ``cycle_info.<cycle_job>.0.<cycle>``; the launchers then run with ``store_elsewhere``."""
    argv = ["nvrx-control", f"--nnodes={spec.nnodes}:{spec.nnodes + spec.spare_nodes}", "--rdzv-backend=c10d",
            f"--rdzv-endpoint={rdzv_host}:{ports.rdzv}", f"--rdzv-id={rdzv_id}",
            "--ft-enable-log-server=false"]
    if loopback_address(rdzv_host):
        argv.append(f"--local-addr={rdzv_host}")
    if cycle_dir:
        argv += [f"--ft-cycle-info-dir={cycle_dir}", f"--ft-cycle-info-job-id={cycle_job or rdzv_id}"]
    return argv


def term_timeout(spec: JobSpec, gpu: bool | None = None) -> float:
    """ft_launcher's ``--term-timeout``. SIGTERM to the launcher (a drain, a preemption) reaches the ranks,
    which save before they exit: on GPUs it waits the grace period for that before SIGKILL (a restart's
    stop has its own timeout); so does an EKS pod's on CPUs, where SIGTERM only ever means a drain.
    ``gpu`` as in :func:`launcher_argv`."""
    t = derive(spec, gpu)
    return t.grace.seconds if t.gpu or spec.backend == "eks" else 5.0


def section_flags(spec: JobSpec, gpu: bool | None = None) -> list[str]:
    """ft_launcher's section flags (one name in NVRx 0.4.1 to 0.7): the built-in trainer's sections and a
    script's own (see :mod:`.timeouts`), over those of the ``--ft-cfg-path`` file where it reads here (a
    section list on the command line replaces the file's whole list); none unbounded. ``gpu`` as in
    :func:`launcher_argv`."""
    t = derive(spec, gpu)
    flags = [f"--ft-cfg-path={spec.ft.cfg_path}"] if spec.ft.cfg_path else []
    sections: dict[str, float | None] = dict(t.sections())
    if sections and spec.ft.cfg_path:
        sections = {**read_ft_config(spec.ft.cfg_path).sections, **sections}
    if sections:
        flags.append("--ft-rank-section-timeouts=" + ",".join(
            f"{k}:{'none' if v is None else format(v, 'g')}" for k, v in sections.items()))
    if t.out_of_section is not None:
        flags.append(f"--ft-rank-out-of-section-timeout={t.out_of_section.seconds:g}")
    return flags


def warm_worker(python: str) -> list[str]:
    """The flags that make ft_launcher's worker the warm shim run by ``python`` (this installation's
    shim: an EKS pod computes them in the container, see ``eks.pod_entry.launch``)."""
    # the launcher substitutes $ in workers' args
    return ["--no-python", python, "-S", WARM_SHIM.replace("$", "$$")]


def worker_index(argv: list[str]) -> int | None:
    """Where the worker command (``-m`` and one of our entry modules) starts in a launch line."""
    return next((i for i in range(1, len(argv) - 1)
                 if argv[i] == "-m" and argv[i + 1] in (TRAINER_MODULE, SCRIPT_MODULE)), None)


def rank_env(spec: JobSpec, *, ports: Ports, job_attempt: int, job_dir: str | None = None,
             spec_path: str | None = None, events_stdout: bool = False,
             nvrx: NVRx | None = None) -> dict[str, str]:
    """Environment for the launcher and (inherited) its ranks. The in-process tier is on when the
    spec asks for it and ``nvrx`` (when known) still has ``inprocess.Wrapper``."""
    env = {
        "EKSFT_JOB": spec.name,
        "EKSFT_JOB_ATTEMPT": str(job_attempt),
        "EKSFT_STORE_PORT": str(ports.store),
        "OMP_NUM_THREADS": str(spec.threads_per_rank),
    }
    if spec.ft.inprocess and (nvrx is None or nvrx.inprocess != "missing"):
        env["EKSFT_WRAPPER_PORT"] = str(ports.wrapper)
    if job_dir:
        env["EKSFT_JOB_DIR"] = job_dir
    if spec_path:
        env["EKSFT_SPEC"] = spec_path
    if events_stdout:
        env["EKSFT_EVENTS_STDOUT"] = "1"
    return env
