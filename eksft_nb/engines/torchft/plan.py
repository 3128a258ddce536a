"""What a local torchft job starts: the Lighthouse and, per replica group, the trainer's environment
(used by the supervisor to start them and by ``--dry-run`` to show them)."""

from __future__ import annotations

import sys
from typing import Callable

from ... import loopback
from ...spec import JobSpec
from . import hosts, lighthouse
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
    local_rank: int = 0,
) -> dict[str, str]:
    """The environment of replica group ``group``'s rank ``local_rank`` in a local job (its rank 0 hosts
    the group's store at ``store_port``; its rank in the job is ``group * nproc_per_node + local_rank``)."""
    return {
        **loopback.env(),
        **job_env(spec, job_dir=job_dir, lighthouse=f"http://127.0.0.1:{lighthouse_port}",
                  host=hosts.LOCAL, store_port=store_port),
        "RANK": str(group * spec.nproc_per_node + local_rank),
        "LOCAL_RANK": str(local_rank),
        "GROUP_RANK": str(group),
        "REPLICA_GROUP_ID": str(group),
        RESTART_ENV: str(restart),
        LAST_STEP_ENV: str(last_step),
    }


def job_env(spec: JobSpec, *, job_dir: str, lighthouse: str, host: str, store_port: int) -> dict[str, str]:
    """What every replica group's rank gets, on any backend: ``lighthouse`` the Lighthouse's URL, ``host``
    the address the group's servers bind (:func:`.hosts.rendered`: each backend renders its own)."""
    return {
        "EKSFT_JOB": spec.name,
        "EKSFT_JOB_DIR": job_dir,
        "EKSFT_JOB_ATTEMPT": "0",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": str(spec.world_size),
        "NUM_REPLICA_GROUPS": str(spec.nnodes),
        hosts.HOST_ENV: host,
        "MASTER_ADDR": host,
        "MASTER_PORT": str(store_port),
        "OMP_NUM_THREADS": str(spec.threads_per_rank),
        "TORCHFT_LIGHTHOUSE": lighthouse,
    }


def store_port(spec: JobSpec, free: Callable[[], int]) -> int:
    """The port a local replica group's store is given: 0 for a group of one rank, whose store nobody else
    of the group joins (it binds a port the kernel picks as it binds: none found free beforehand, which
    another process can take meanwhile); one ``free()`` finds for a group of N ranks, whose other ranks
    must know it before their rank 0 binds it."""
    return 0 if spec.nproc_per_node == 1 else free()


def group_argv(spec: JobSpec) -> list[str]:
    """A replica group's command: the built-in trainer, or the user's script under the torchft probe."""
    if spec.script:
        return [sys.executable, "-m", SCRIPT_MODULE, spec.script, *spec.script_args]
    return [sys.executable, "-m", TRAINER_MODULE]


def render(spec: JobSpec, job_dir: str) -> str:
    """``--dry-run``: the Lighthouse's command line and each group's environment and command."""
    lines = [
        f"# job folder: {job_dir}",
        "# torchft: the Lighthouse (on a network of its own, behind a gateway that answers only the job's "
        "processes), then each replica group's processes, one per rank (ports are picked free at launch; 0: "
        "the group's rank 0 binds any)",
        " ".join(lighthouse.argv(29510)),
    ]
    argv = " ".join(group_argv(spec))
    for group in range(spec.nnodes):
        port = store_port(spec, lambda: 29520 + group)  # noqa: B023 (called here, in this iteration)
        for local in range(spec.nproc_per_node):
            env = group_env(spec, group, job_dir=job_dir, lighthouse_port=29510, store_port=port,
                            local_rank=local)
            lines += [f"# replica group {group}, rank {local}", *(f"{k}={v}" for k, v in env.items()), argv]
    return "\n".join(lines)
