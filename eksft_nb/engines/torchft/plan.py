"""What a local torchft job starts: the Lighthouse and, per replica group, the trainer's environment
(used by the supervisor to start them and by ``--dry-run`` to show them)."""

from __future__ import annotations

import sys

from ... import loopback
from ...spec import JobSpec
from . import lighthouse
from .trainer import LAST_STEP_ENV, RESTART_ENV

TRAINER_MODULE = "eksft_nb.engines.torchft.trainer"
SCRIPT_MODULE = "eksft_nb.engines.torchft.script"  # a user's script (--script, or a notebook cell's code)


def group_env(
    spec: JobSpec,
    group: int,
    *,
    job_dir: str,
    lighthouse_port: int,
    store_port: int,
    restart: int = 0,
    last_step: int = 0,
) -> dict[str, str]:
    """The environment of replica group ``group``'s rank (one per group so far: it hosts the group's
    store)."""
    return {
        **loopback.env(),
        "EKSFT_JOB": spec.name,
        "EKSFT_JOB_DIR": job_dir,
        "EKSFT_JOB_ATTEMPT": "0",
        "RANK": str(group),
        "LOCAL_RANK": "0",
        "GROUP_RANK": str(group),
        "WORLD_SIZE": str(spec.world_size),
        "REPLICA_GROUP_ID": str(group),
        "NUM_REPLICA_GROUPS": str(spec.nnodes),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(store_port),
        "OMP_NUM_THREADS": str(spec.threads_per_rank),
        "TORCHFT_LIGHTHOUSE": f"http://127.0.0.1:{lighthouse_port}",
        RESTART_ENV: str(restart),
        LAST_STEP_ENV: str(last_step),
    }


def group_argv(spec: JobSpec) -> list[str]:
    """A replica group's command: the built-in trainer, or the user's script under the torchft probe."""
    if spec.script:
        return [sys.executable, "-m", SCRIPT_MODULE, spec.script, *spec.script_args]
    return [sys.executable, "-m", TRAINER_MODULE]


def render(spec: JobSpec, job_dir: str) -> str:
    """``--dry-run``: the Lighthouse's command line and each group's environment and command."""
    lines = [
        f"# job folder: {job_dir}",
        "# torchft: the Lighthouse, then one process per replica group (ports are picked free at launch)",
        " ".join(lighthouse.argv(29510)),
    ]
    for group in range(spec.nnodes):
        env = group_env(spec, group, job_dir=job_dir, lighthouse_port=29510, store_port=29520 + group)
        argv = " ".join(group_argv(spec))
        lines += [f"# replica group {group}", *(f"{k}={v}" for k, v in env.items()), argv]
    return "\n".join(lines)
