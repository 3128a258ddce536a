"""The FSx for Lustre file system ``--create-pvc`` provisions: its throughput is what the timeouts assume.

A PERSISTENT_2 file system delivers its size in TiB times its per-unit throughput, one of
:data:`TIERS` MB/s per TiB (AWS counts 1200 GiB as 1.2 TiB: 300 MB/s at 250). The timeouts of a GPU job
are derived from ``--storage-mbps`` (the time to save and to restore a checkpoint), so the tier is the
least that delivers it at ``--storage-size``, or ``--fsx-throughput`` as given, which must deliver it.
"""

from __future__ import annotations

import math

from ...errors import SpecError, shown
from ...spec import JobSpec
from .sizing import GiB, quantity

TIERS = (125, 250, 500, 1000)   # MB/s per TiB of PERSISTENT_2


def size_tib(spec: JobSpec) -> float:
    return quantity(spec.eks.storage_size, "--storage-size") / GiB / 1000


def delivers(spec: JobSpec, tier: int) -> float:
    """MB/s a file system of the spec's size delivers at ``tier``."""
    return size_tib(spec) * tier


def throughput_per_tib(spec: JobSpec) -> int:
    """The StorageClass's ``perUnitStorageThroughput``: as given, else the least tier that delivers
    ``--storage-mbps`` (the fastest, where none does: :func:`check` refuses that first)."""
    given = spec.eks.fsx_throughput
    if given is not None:
        return given
    wanted = spec.checkpoint.storage_mbps
    return next((t for t in TIERS if delivers(spec, t) >= wanted), TIERS[-1])


def check(spec: JobSpec) -> None:
    """Refuse a file system that cannot deliver what the timeouts are derived from."""
    e, wanted = spec.eks, spec.checkpoint.storage_mbps
    if e.fsx_throughput is not None and e.fsx_throughput not in TIERS:
        raise SpecError(f"--fsx-throughput {shown(e.fsx_throughput)} is not an FSx for Lustre tier",
                        f"use --fsx-throughput {' / '.join(map(str, TIERS))} (MB/s per TiB)")
    tier = throughput_per_tib(spec)
    if delivers(spec, tier) >= wanted:
        return
    if e.fsx_throughput is None or delivers(spec, TIERS[-1]) < wanted:
        need = math.ceil(wanted / TIERS[-1] * 1000 / 2400) * 2400
        top = delivers(spec, TIERS[-1])
        raise SpecError(f"FSx for Lustre of {e.storage_size} delivers at most {top:.0f} "
                        f"MB/s ({TIERS[-1]} MB/s per TiB), less than the {wanted:g} MB/s of --storage-mbps "
                        "that the timeouts assume",
                        f"use --storage-size {need}Gi or more, or lower --storage-mbps")
    better = next(t for t in TIERS if delivers(spec, t) >= wanted)
    raise SpecError(f"FSx for Lustre of {e.storage_size} at {tier} MB/s per TiB delivers "
                    f"{delivers(spec, tier):.0f} MB/s, less than the {wanted:g} MB/s of --storage-mbps that "
                    "the timeouts assume",
                    f"use --fsx-throughput {better}, or --storage-mbps {math.floor(delivers(spec, tier))}")
