"""The sbatch script of a job: one ``ft_launcher`` per node (``srun --ntasks-per-node=1``), the
rendezvous at the allocation's first node, the job folder on the shared disk.

The launch line is :func:`eksft_nb.launcher.launcher_argv`'s, as locally and on EKS; the NCCL/EFA
environment is :func:`eksft_nb.nccl.nccl_env`'s, as in the EKS pods. Every value is written through
:mod:`eksft_nb.shellquote`.

What Slurm does to a job on day one, and what the script asks of it:

- The time limit: ``--signal=B:USR1@GRACE`` wakes the watcher (the batch shell itself: B: signals it
  alone) the grace period before it; the watcher drains the ranks (SIGTERM to the steps), and requeues
  the job once the drain's save is committed. SIGTERM to the batch shell means the allocation ends
  (scancel, a requeue); SIGTERM to the steps (``scancel --signal=TERM``, a preemption's GraceTime) is a
  drain the ranks see first.
- GPUs: without ``--gres gpu:N`` the batch shell counts the node's (:mod:`.gpus`) and takes the GPU or
  the CPU launch line and environment.
- Resources: whole nodes (``--exclusive``, all of their memory), and the step gets the node's CPUs
  (``srun`` in Slurm 22.05 does not inherit ``--cpus-per-task``: without it, eight ranks share one CPU).
"""

from __future__ import annotations

import uuid
from pathlib import Path

from ...jobdir import JobDir
from ...launcher import Ports, launcher_argv, rank_env
from ...nccl import nccl_env
from ...procs import JOB_UID_ENV
from ...runtime.quiet import quiet_env
from ...shellquote import control_char, directive, expanding, export, filename, word
from ...spec import JobSpec
from ...timeouts import NODE_GPUS_ENV, derive
from ..eks.instances import lookup

RDZV_HOST = "${RDZV_HOST}"     # the batch shell fills it in: the allocation's first node
WATCHER = "eksft_nb.backends.slurm.allocation"
GPUS = "eksft_nb.backends.slurm.gpus"
# starts a node's zygote, then becomes its ft_launcher (any cluster)
WARM_ENTRY = "eksft_nb.backends.eks.inpod"
# in the job folder: ``SlurmBackend.stop`` cancelled it (not someone outside eksft)
STOP_MARK = "stop-requested"
REQUEUE_EXIT = 75   # the watcher's exit status when it requeued the job (a job-level restart, or a drain)
NO_EKSFT_EXIT = 3   # the batch shell's, when its python cannot import eksft_nb
DRAIN_SIGNAL = "USR1"   # Slurm's warning before the time limit (--signal), to the watcher alone
SPEC_END = "EKSFT_SPEC"   # the end of the spec the script carries (the watcher reads it on stdin)
NODE_NOTE = "eksft-node:"   # a line a node's shell writes to its launcher log before the launcher starts
NO_EKSFT = "the nodes' python has no eksft_nb: put the shared environment first on PATH"
_EXPANDED = ("RDZV_HOST", "SLURM_JOB_ID", "EKSFT_JOB_ATTEMPT")   # what a launch line's rendezvous names


def job_dir(spec: JobSpec) -> JobDir:
    return JobDir.for_name(spec.name, Path(str(spec.slurm.shared_dir)))


def directives(spec: JobSpec) -> list[str]:
    """The ``#SBATCH`` lines every engine's script has."""
    s, jd = spec.slurm, job_dir(spec)
    lines = [directive("--job-name", spec.name), directive("--nodes", str(spec.nnodes + spec.spare_nodes)),
             directive("--ntasks-per-node", "1"),
             directive("--output", filename(str(jd.logs)) + "/slurm-%j.out"),
             directive("--open-mode", "append"),
             # a drain requeues whatever max_job_restarts says (the watcher counts only failures against it)
             directive("--requeue")]
    for flag in ("partition", "account", "qos", "time", "gres", "constraint"):
        if getattr(s, flag):
            lines.append(directive(f"--{flag}", getattr(s, flag)))
    if s.exclusive:
        lines.append(directive("--exclusive"))
    if spec.spare_nodes:   # a failed node leaves the allocation (and the step) running: a spare replaces it
        lines.append(directive("--no-kill"))
    cpus = s.cpus_per_task or (None if s.exclusive else spec.nproc_per_node * spec.threads_per_rank + 1)
    if cpus:
        lines.append(directive("--cpus-per-task", str(cpus)))
    if s.mem or s.exclusive:
        lines.append(directive("--mem", s.mem or "0"))   # 0: all of each node's memory
    return lines


def grace_s(spec: JobSpec) -> int:
    """How long before the time limit the drain starts: the grace period of the values the job may run
    with (a job without ``--gres`` learns on the node whether they are the GPU or the CPU ones)."""
    if spec.slurm.gpus_per_node:
        return int(derive(spec, gpu=True).grace.seconds)
    return int(max(derive(spec, gpu=g).grace.seconds for g in (True, False)))


def new_job_uid() -> str:
    """A launch's part of its id (``EKSFT_JOB_UID``); the Slurm job id completes it in the batch shell."""
    return uuid.uuid4().hex[:16]


def uid_line(job_uid: str) -> str:
    """The job's id, one for every node and requeue of one submission (a requeue keeps ``$SLURM_JOB_ID``),
    another for every launch and every sbatch of a printed script: its commits name it, so a relaunch under
    the same name and spec never takes an earlier launch's checkpoints (or processes) for its own."""
    return f'export {JOB_UID_ENV}={word(job_uid)}"-$SLURM_JOB_ID"'


def efa_on(spec: JobSpec) -> bool:
    """``--efa``, or by default whether the nodes' instance type has EFA."""
    s = spec.slurm
    known = lookup(s.instance_type)
    return s.efa if s.efa is not None else bool(known and known.efa)


def environment(spec: JobSpec, gpu: bool | None = None) -> dict[str, str]:
    """Every launcher's and rank's environment, but the attempt and the job's id (the batch shell sets
    them). ``gpu``: with the NCCL/EFA environment of GPU nodes (None: where ``--gres`` asks for GPUs)."""
    values = rank_env(spec, ports=Ports.from_base(spec.slurm.port), job_attempt=0,
                      job_dir=str(job_dir(spec).path))
    del values["EKSFT_JOB_ATTEMPT"]
    values = quiet_env(values)
    values.update(gpu_environment(spec) if (spec.slurm.gpus_per_node if gpu is None else gpu) else {})
    return values


def gpu_environment(spec: JobSpec) -> dict[str, str]:
    """NCCL's (and EFA's) environment on the job's GPU nodes: device RDMA only where the instance type's
    EFA reads RDMA (p4d, p5...; g5/g6 abort in libfabric with it); NCCL on EFA only where ``--efa`` asked
    for it, as an EKS pod's ``--efa-per-node`` does (by default, a fall back to sockets is a warning)."""
    known = lookup(spec.slurm.instance_type)
    return nccl_env(max(1, spec.slurm.gpus_per_node), efa_on(spec), spec.ft.inprocess,
                    rdma_read=bool(known and known.rdma_read), require_efa=spec.slurm.efa is True)


def launch_words(spec: JobSpec, gpu: bool | None) -> list[str]:
    """One node's ``ft_launcher`` command (its node rank from srun's ``$SLURM_NODEID``, added by the
    node's shell), as the words of the batch shell's ``LAUNCH`` array."""
    # with hot spares the watcher runs NVRx's nvrx-control as the rendezvous's store host (see allocation):
    # any node's launcher, the first's included, can then be lost while a standby node takes its place
    argv = launcher_argv(spec, node_rank="NODE", rdzv_host=RDZV_HOST, ports=Ports.from_base(spec.slurm.port),
                         rdzv_id=f"{spec.name}-$SLURM_JOB_ID-$EKSFT_JOB_ATTEMPT", gpu=gpu,
                         store_elsewhere=bool(spec.spare_nodes))
    argv = [a for a in argv if not a.startswith("--node-rank=")]
    return [expanding(a, _EXPANDED) if a.startswith(("--rdzv-endpoint=", "--rdzv-id=")) else word(a)
            for a in argv]


def node_shell(spec: JobSpec) -> str:
    """What each node's task runs before its launcher: a rendezvous host that does not resolve there is
    said in the launcher's log at once (the launchers would wait for it the whole join timeout)."""
    warm = f"python -m {WARM_ENTRY} launch " if spec.ft.warm_ranks else ""
    return (f'getent hosts "$RDZV_HOST" >/dev/null || echo "{NODE_NOTE} the rendezvous host $RDZV_HOST does '
            f'not resolve on $SLURMD_NODENAME" >&2; exec {warm}"$0" --node-rank="$SLURM_NODEID" "$@"')


def srun_words(spec: JobSpec) -> list[str]:
    s, jd = spec.slurm, job_dir(spec)
    cpus = str(s.cpus_per_task) if s.cpus_per_task else '"$SLURM_CPUS_ON_NODE"'
    # a lost node's launcher ends the step, unless a hot spare is to take its place
    kill = ["--kill-on-bad-exit=0", "--no-kill"] if spec.spare_nodes else ["--kill-on-bad-exit=1"]
    words = ["srun", "--ntasks-per-node=1", *kill, f"--cpus-per-task={cpus}",
             *(["--mem=0"] if s.mem or s.exclusive else []),
             expanding(f"--output={filename(str(jd.logs))}/launcher-$EKSFT_JOB_ATTEMPT-%t.log",
                       ["EKSFT_JOB_ATTEMPT"])]
    if s.container_image:
        shared = str(s.shared_dir)
        mounts = [m for m in (s.container_mounts or "").split(",") if m]
        if not any(m.split(":")[0] == shared for m in mounts):
            mounts.insert(0, f"{shared}:{shared}")   # the job folder at the same path inside
        names = [*environment(spec, gpu=True), "EKSFT_JOB_ATTEMPT", JOB_UID_ENV, NODE_GPUS_ENV, "RDZV_HOST"]
        names += [n for n in (s.container_env or "").split(",") if n and n not in names]
        words += [word(f"--container-image={s.container_image}"),
                  word(f"--container-mounts={','.join(mounts)}"), word(f"--container-env={','.join(names)}")]
    return words


def render(spec: JobSpec, job_uid: str | None = None) -> str:
    """The sbatch script; ``job_uid`` is the launch's (a new one when not given)."""
    jd = job_dir(spec)
    known_gpus = bool(spec.slurm.gpus_per_node)
    lines = ["#!/bin/bash", *directives(spec), directive("--signal", f"B:{DRAIN_SIGNAL}@{grace_s(spec)}"),
             f"# eksft-nb job {spec.name} (spec {spec.digest()}): its folder {_comment(str(jd.path))} is on "
             "the shared disk",
             "# submitted by hand, it needs the folder of its log first: mkdir -p "
             f"{_comment(word(str(jd.logs)))} && sbatch THIS_FILE",
             "set -u",
             "# the batch shell runs eksft-nb's watcher: the nodes' python must be the shared environment's",
             "if ! python -c 'import eksft_nb'; then",
             f'    echo "eksft: $(command -v python || echo no python on PATH): {NO_EKSFT}" >&2',
             f"    exit {NO_EKSFT_EXIT}",
             "fi",
             "# the environment of every launcher and rank",
             *(export(k, v) for k, v in environment(spec).items()),
             'export EKSFT_JOB_ATTEMPT="${SLURM_RESTART_COUNT:-0}"',
             uid_line(job_uid or new_job_uid()),
             "# the rendezvous is at the allocation's first node (this script runs there), ports "
             f"{spec.slurm.port}-{spec.slurm.port + 2}",
             'export RDZV_HOST=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1)']
    if known_gpus:
        lines += [f"LAUNCH=({' '.join(launch_words(spec, None))})"]
    else:
        gpu_only = {k: v for k, v in environment(spec, gpu=True).items() if k not in environment(spec)}
        lines += ["# no --gres: the GPUs are counted on the node (the driver's, else Slurm's record of it);",
                  "# where it has them the job takes the GPU values (timeouts, NCCL/EFA environment), where "
                  "not the CPU ones",
                  f"export {NODE_GPUS_ENV}=$(python -m {GPUS})",
                  f'if [ "${NODE_GPUS_ENV}" != 0 ]; then',
                  *(f"    {export(k, v)}" for k, v in gpu_only.items()),
                  f"    LAUNCH=({' '.join(launch_words(spec, True))})",
                  "else",
                  f"    LAUNCH=({' '.join(launch_words(spec, False))})",
                  "fi"]
    lines += ["# the watcher runs doctor's gate first (the node's NVRx, torch, GPUs); it records the job's",
              "# start, restarts and end in its folder; it requeues the job (a job-level restart) when a",
              "# node's launcher is lost, and drains it before the time limit",
              f"exec python -m {WATCHER} {word(str(jd.path))} -- {' '.join(srun_words(spec))} \\",
              f"    bash -c {word(node_shell(spec))} \"${{LAUNCH[@]}}\" <<'{SPEC_END}'",
              spec.to_json(),
              SPEC_END]
    return "\n".join(lines) + "\n"


def _comment(text: str) -> str:
    """``text`` in a comment line (the spec refuses control characters: the comment ends with the line)."""
    assert control_char(text) is None, text
    return text
