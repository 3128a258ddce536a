"""What the trainer container asks of its node: CPU, memory and the memory-backed ``/dev/shm``.

Without requests a pod is Burstable with nothing reserved, first in line for eviction and the OOM
killer. The trainer requests (on a known instance type) all of the node but a share for the kubelet
and the DaemonSets, or (elsewhere) the ranks' floor plus ``/dev/shm``; its memory limit equals the
request, and it has no CPU limit (CFS throttling would stall NCCL's proxy threads and the data
loaders for nothing). ``--cpu`` and ``--memory`` override; the checks keep them above the floor.
"""

from __future__ import annotations

import math

from ...errors import SpecError, shown
from ...spec import JobSpec
from . import quantities
from .instances import lookup

GiB = 1 << 30
GPU_RANK_FLOOR = 8 * GiB      # host memory a GPU rank needs at least (CUDA context, pinned buffers, state)
CPU_RANK_FLOOR = 1 * GiB      # a CPU rank of the small presets
SCRIPT_SHM_PER_GPU_RANK = 8 * GiB   # a script's /dev/shm per rank where the pod's memory is not known

def quantity(value: str, flag: str) -> float:
    """A Kubernetes quantity ("16Gi", "500m", "2") as a number, or a SpecError naming the flag."""
    if (exact := quantities.parse(value)) is None:
        raise SpecError(f"{flag} {shown(value)} is not a Kubernetes quantity",
                        f"write e.g. {flag} {'4 (or 500m)' if flag == '--cpu' else '16Gi'}")
    return float(exact)


def gib(n_bytes: float) -> str:
    return f"{max(1, math.ceil(n_bytes / GiB))}Gi"


def rank_floor(spec: JobSpec) -> int:
    """Host memory per rank the pod must leave beside ``/dev/shm``."""
    return GPU_RANK_FLOOR if spec.eks.gpus_per_node else CPU_RANK_FLOOR


def default_shm(spec: JobSpec) -> str:
    """/dev/shm per pod. The built-in trainer: the node's share of the checkpointed state (fp32 weights
    and two AdamW moments, 12 bytes per parameter), staged once into shared memory by the async
    checkpoint writer, with 50% headroom, plus 1 GiB for NCCL (256 MiB for CPU pods). A ``--script``
    (whose model size is not known here) on GPUs: a quarter of the pod's memory where that is known
    (``--memory`` or the instance type), else 8 GiB per rank."""
    e = spec.eks
    if spec.script and e.gpus_per_node:
        memory = _given_memory(spec)
        return gib(memory / 4) if memory else gib(SCRIPT_SHM_PER_GPU_RANK * spec.nproc_per_node)
    state_bytes = 12 * spec.model.n_params() / spec.nnodes
    base = GiB if e.gpus_per_node else GiB / 4
    return gib(1.5 * state_bytes + base)


def shm_size(spec: JobSpec) -> str:
    return spec.eks.shm_size or default_shm(spec)


def min_memory(spec: JobSpec) -> float:
    """The least memory a pod may have: its memory-backed /dev/shm (which counts against the pod's
    memory) plus the per-rank floor for every rank."""
    return quantity(shm_size(spec), "--shm-size") + rank_floor(spec) * spec.nproc_per_node


def memory(spec: JobSpec) -> str:
    """The trainer's memory request and limit."""
    return spec.eks.memory or gib(_given_memory(spec) or min_memory(spec))


def cpu(spec: JobSpec) -> str:
    """The trainer's CPU request: the instance's share, else a core per rank thread and one for
    the launcher."""
    known = lookup(spec.eks.instance_type)
    if spec.eks.cpu:
        return spec.eks.cpu
    return str(known.cpu_request if known else spec.nproc_per_node * spec.threads_per_rank + 1)


def _given_memory(spec: JobSpec) -> float | None:
    known = lookup(spec.eks.instance_type)
    if spec.eks.memory:
        return quantity(spec.eks.memory, "--memory")
    return known.memory_request_gib * GiB if known else None
