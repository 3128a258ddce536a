"""The sbatch script of a job: one ``ft_launcher`` per node (``srun --ntasks-per-node=1``), the
rendezvous at the allocation's first node, the job folder on the shared disk.

The launch line is :func:`eksft_nb.launcher.launcher_argv`'s, as locally and on EKS; the NCCL/EFA
environment is :func:`eksft_nb.nccl.nccl_env`'s, as in the EKS pods.
"""

from __future__ import annotations

import shlex
import uuid
from pathlib import Path

from ...jobdir import JobDir
from ...launcher import Ports, launcher_argv, rank_env
from ...nccl import nccl_env
from ...runtime.quiet import quiet_env
from ...spec import JobSpec
from ...procs import JOB_UID_ENV

RDZV_HOST = "${RDZV_HOST}"     # the batch shell fills it in: the allocation's first node
WATCHER = "eksft_nb.backends.slurm.allocation"
# starts a node's zygote, then becomes its ft_launcher (any cluster)
WARM_ENTRY = "eksft_nb.backends.eks.inpod"
# in the job folder: ``SlurmBackend.stop`` cancelled it (not someone outside eksft)
STOP_MARK = "stop-requested"
REQUEUE_EXIT = 75   # the watcher's exit status that asks the batch script for a job-level restart (a requeue)


def job_dir(spec: JobSpec) -> JobDir:
    return JobDir.for_name(spec.name, Path(str(spec.slurm.shared_dir)))


def directives(spec: JobSpec) -> list[str]:
    s, jd = spec.slurm, job_dir(spec)
    lines = [f"--job-name={spec.name}", f"--nodes={spec.nnodes}", "--ntasks-per-node=1",
             f"--output={jd.logs}/slurm-%j.out", "--open-mode=append",
             "--requeue" if spec.ft.max_job_restarts else "--no-requeue"]
    for flag in ("partition", "account", "qos", "time", "gres", "constraint"):
        if getattr(s, flag):
            lines.append(f"--{flag}={getattr(s, flag)}")
    if s.exclusive:
        lines.append("--exclusive")
    return [f"#SBATCH {line}" for line in lines]


def new_job_uid() -> str:
    """A launch's part of its id (``EKSFT_JOB_UID``); the Slurm job id completes it in the batch shell."""
    return uuid.uuid4().hex[:16]


def uid_line(job_uid: str) -> str:
    """The job's id, one for every node and requeue of one submission (a requeue keeps ``$SLURM_JOB_ID``),
    another for every launch and every sbatch of a printed script: its commits name it, so a relaunch under
    the same name and spec never takes an earlier launch's checkpoints (or processes) for its own."""
    return f'export {JOB_UID_ENV}="{job_uid}-$SLURM_JOB_ID"'


def environment(spec: JobSpec) -> dict[str, str]:
    """Every launcher's and rank's environment, but the attempt and the job's id (the batch shell sets
    them)."""
    values = rank_env(spec, ports=Ports.from_base(spec.slurm.port), job_attempt=0,
                      job_dir=str(job_dir(spec).path))
    del values["EKSFT_JOB_ATTEMPT"]
    values = quiet_env(values)
    # --efa means a p4d/p5-class node (its help says so): EFA with RDMA read
    values.update(nccl_env(spec.slurm.gpus_per_node, spec.slurm.efa, spec.ft.inprocess,
                           rdma_read=spec.slurm.efa))
    return values


def node_line(spec: JobSpec) -> list[str]:
    """One node's command: ft_launcher, its node rank from srun's ``$SLURM_NODEID``."""
    argv = launcher_argv(spec, node_rank="NODE", rdzv_host=RDZV_HOST, ports=Ports.from_base(spec.slurm.port),
                         rdzv_id=f"{spec.name}-$SLURM_JOB_ID-$EKSFT_JOB_ATTEMPT")
    argv = [a for a in argv if not a.startswith("--node-rank=")]
    warm = "python -m " + WARM_ENTRY + " launch " if spec.ft.warm_ranks else ""
    head = f'exec {warm}"$0" --node-rank="$SLURM_NODEID" "$@"'
    return ["bash", "-c", head, *argv]


def render(spec: JobSpec, job_uid: str | None = None) -> str:
    """The sbatch script; ``job_uid`` is the launch's (a new one when not given)."""
    jd = job_dir(spec)
    srun = ["srun", "--ntasks-per-node=1", "--kill-on-bad-exit=1",
            f"--output={jd.logs}/launcher-$EKSFT_JOB_ATTEMPT-%t.log"]
    node = node_line(spec)
    # one line for srun, one for the per-node shell that adds the node rank, one per launcher flag
    groups = [srun, node[:3], *([a] for a in node[3:])]
    lines = ["#!/bin/bash", *directives(spec),
             f"# eksft-nb job {spec.name} (spec {spec.digest()}): its folder {jd.path} is on the shared disk",
             "set -u",
             "# the environment of every launcher and rank",
             *(f"export {k}={shlex.quote(v)}" for k, v in environment(spec).items()),
             'export EKSFT_JOB_ATTEMPT="${SLURM_RESTART_COUNT:-0}"',
             uid_line(job_uid or new_job_uid()),
             "# the rendezvous is at the allocation's first node (this script runs there), ports "
             f"{spec.slurm.port}-{spec.slurm.port + 2}",
             'RDZV_HOST=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1)',
             f"python -m eksft_nb doctor --on-node --spec {shlex.quote(str(jd.spec_path))} || exit 1",
             "# the watcher records the job's start, restarts and end in its folder; it requeues the job",
             "# (a job-level restart) when a node's launcher is lost",
             f"python -m {WATCHER} {shlex.quote(str(jd.path))} -- \\",
             "    " + " \\\n    ".join(" ".join(_shell_word(a) for a in group) for group in groups),
             "rc=$?",
             f'if [ "$rc" = {REQUEUE_EXIT} ]; then scontrol requeue "$SLURM_JOB_ID"; fi',
             'exit "$rc"']
    return "\n".join(lines) + "\n"


def _shell_word(arg: str) -> str:
    """``arg`` quoted for the batch shell; the variables it must expand (the first node, the attempt,
    the Slurm job id) inside double quotes, anything else literal."""
    if any(v in arg for v in (RDZV_HOST, "$EKSFT_JOB_ATTEMPT", "$SLURM_JOB_ID")):
        rest = arg.replace(RDZV_HOST, "").replace("$EKSFT_JOB_ATTEMPT", "").replace("$SLURM_JOB_ID", "")
        if not any(c in rest for c in '"\\`$'):
            return f'"{arg}"'
    return shlex.quote(arg)
