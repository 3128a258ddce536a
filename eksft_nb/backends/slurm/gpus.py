"""The GPUs of the node a Slurm job runs on, counted there.

Slurm knows a job's GPUs only when it asks for them (``--gres gpu:N``), and AWS's FSDP sbatch files do
not. A job without ``--gres`` cannot be told at render whether its nodes have GPUs, so its batch shell
counts them where it runs (``python -m eksft_nb.backends.slurm.gpus`` prints the count), exports the
count (:data:`eksft_nb.timeouts.NODE_GPUS_ENV`) and picks the GPU or the CPU launch line: the watcher
and every rank derive their timeouts from it.

The count, in order: what Slurm granted (``$SLURM_GPUS_ON_NODE``: ``--exclusive`` is granted every GPU of
the node); the driver's (``nvidia-smi -L``,
within ``$CUDA_VISIBLE_DEVICES`` where set); without a driver tool, Slurm's record of the node
(``Gres=gpu:N`` of ``scontrol show node``, from its gres.conf).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass

TIMEOUT_S = 30.0
_GPU_GRES = re.compile(r"(?:^|,)gpu(?::[^:,(]+)?:(\d+)")


@dataclass(frozen=True)
class NodeGpus:
    count: int
    source: str                 # where the count comes from (for the job's log)
    problem: str | None = None  # why the job cannot use the node's GPUs (with the fix)


def count(env: Mapping[str, str] = os.environ) -> NodeGpus:
    """The GPUs this job's processes on this node can use."""
    node = env.get("SLURMD_NODENAME", "this node")
    granted = env.get("SLURM_GPUS_ON_NODE", "")
    if granted.isdigit():
        return NodeGpus(int(granted), f"Slurm's allocation on {node}: SLURM_GPUS_ON_NODE={granted}")
    recorded = slurm_record(env.get("SLURMD_NODENAME"))
    driver = _driver()
    if driver is None:
        if recorded:
            return NodeGpus(recorded, f"Slurm's record of node {node} (Gres=gpu:{recorded}; no nvidia-smi "
                                      "there)")
        return NodeGpus(0, f"no nvidia-smi and no GPU in Slurm's record of node {node}")
    visible = env.get("CUDA_VISIBLE_DEVICES")
    n = driver if visible is None else min(driver, len([d for d in visible.split(",") if d.strip()]))
    source = f"nvidia-smi -L on {node}" + (f" within CUDA_VISIBLE_DEVICES={visible}" if visible is not None
                                          else "")
    if n == 0 and recorded:
        return NodeGpus(0, source, f"Slurm gives node {node} {recorded} GPUs (Gres=gpu:{recorded}) but this "
                                   "job sees none: the cluster lets a job use only the GPUs it asks for "
                                   f"(ConstrainDevices); add --gres gpu:{recorded}")
    return NodeGpus(n, source)


def slurm_record(node: str | None) -> int:
    """The GPUs Slurm's configuration gives ``node`` (0 when it names none, or cannot be asked)."""
    if not node or shutil.which("scontrol") is None:
        return 0
    try:
        done = subprocess.run(["scontrol", "show", "node", node, "-o"], capture_output=True, text=True,
                              timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return 0
    m = re.search(r"(?:^|\s)Gres=(\S+)", done.stdout if done.returncode == 0 else "")
    return sum(int(n) for n in _GPU_GRES.findall(m.group(1))) if m else 0


def _driver() -> int | None:
    """The GPUs the NVIDIA driver lists; None without ``nvidia-smi``, 0 when it lists none or fails."""
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        done = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return 0
    return sum(line.startswith("GPU ") for line in done.stdout.splitlines()) if done.returncode == 0 else 0


if __name__ == "__main__":
    print(count().count)
    sys.exit(0)
