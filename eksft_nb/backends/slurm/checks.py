"""Slurm-specific checks of a job spec: what sbatch or the nodes would refuse, or accept and then run wrong,
fails here first in one line with the fix. What only the node can know (its GPUs without ``--gres``) is
checked there, by the watcher."""

from __future__ import annotations

import re
import shutil
import subprocess

from ...errors import JobError, SpecError
from ...spec import JobSpec
from ..eks.instances import lookup
from .render import grace_s


def check(spec: JobSpec, launching: bool) -> None:
    s = spec.slurm
    gpus, known = s.gpus_per_node, lookup(s.instance_type)
    if known and gpus > known.gpus:
        raise SpecError(f"--gres gpu:{gpus} but a {s.instance_type} has {known.gpus} GPUs",
                        f"use --gres gpu:{known.gpus} or fewer")
    most = gpus or (known.gpus if known else 0)
    if most and spec.nproc_per_node > most:
        where = f"--gres gpu:{gpus}" if gpus else f"a {s.instance_type}"
        more = f", or --gres gpu:{min(spec.nproc_per_node, known.gpus if known else 8)}" if gpus else ""
        raise SpecError(f"{spec.nproc_per_node} ranks per node but {where} gives {most} GPUs per node (one "
                        "GPU per rank)", f"use --nproc-per-node {most}{more}")
    if gpus and spec.device == "cpu":
        raise SpecError("--device cpu with --gres gpu wastes the GPUs", "use --device auto, or drop --gres")
    if s.efa and known and not known.efa:
        raise SpecError(f"--efa but a {s.instance_type} has no EFA", "drop --efa")
    limit = time_limit_s(s.time) if s.time else None
    if limit is not None and limit <= 2 * grace_s(spec):
        raise SpecError(f"--time {s.time} leaves no room to train: the drain before it starts "
                        f"{grace_s(spec)} s ahead (a save in flight and one more)",
                        f"use --time of at least {_minutes(4 * grace_s(spec))} minutes")
    if launching and s.container_image and not pyxis():
        raise JobError("--container-image needs pyxis, which this cluster does not have (srun --help lists "
                       "no --container-image)", "drop --container-image (the nodes' own environment runs the "
                       "job), or install pyxis and enroot on the cluster")


def pyxis() -> bool:
    """Whether srun takes pyxis's container options (its plugin adds them to ``srun --help``)."""
    if shutil.which("srun") is None:
        return False
    try:
        done = subprocess.run(["srun", "--help"], capture_output=True, text=True, timeout=30)
    except subprocess.TimeoutExpired:
        return False
    return "--container-image" in done.stdout + done.stderr


def time_limit_s(text: str) -> int | None:
    """sbatch's time formats (minutes, M:S, H:M:S, D-H, D-H:M, D-H:M:S) in seconds; None for unlimited or
    anything else."""
    m = re.fullmatch(r"(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?", text)
    if m is None:
        return None
    days, a, b, c = (int(g) if g else None for g in m.groups())
    if days is not None:   # D-H[:M[:S]]
        return ((days * 24 + a) * 60 + (b or 0)) * 60 + (c or 0)
    if c is not None:      # H:M:S
        return (a * 60 + b) * 60 + c
    if b is not None:      # M:S
        return a * 60 + b
    return a * 60          # M


def _minutes(seconds: float) -> int:
    return int(-(-seconds // 60))
