"""The folded GPU health under dcgm-exporter's metric names, so Grafana can join our series with
dcgm-exporter's by ``UUID``."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

from .fold import GpuFold


def dcgm_metrics(jobs: Iterable[tuple[str, GpuFold]]) -> Iterator[Any]:
    """The newest readings under dcgm-exporter's metric names and labels (``gpu``, ``UUID``,
    ``Hostname``), plus ``job``. All gauges, as a ``_total`` suffix would break the names."""
    from prometheus_client.core import GaugeMetricFamily

    labels = ["gpu", "UUID", "Hostname", "job"]
    families = {
        "xid": GaugeMetricFamily("DCGM_FI_DEV_XID_ERRORS", "Value of the last XID error encountered",
                                 labels=labels),
        "ecc_dbe": GaugeMetricFamily("DCGM_FI_DEV_ECC_DBE_VOL_TOTAL",
                                     "Total number of double-bit volatile ECC errors", labels=labels),
        "ecc_sbe": GaugeMetricFamily("DCGM_FI_DEV_ECC_SBE_VOL_TOTAL",
                                     "Total number of single-bit volatile ECC errors", labels=labels),
        "temp_c": GaugeMetricFamily("DCGM_FI_DEV_GPU_TEMP", "GPU temperature (in C)", labels=labels),
        "power_w": GaugeMetricFamily("DCGM_FI_DEV_POWER_USAGE", "Power draw (in W)", labels=labels),
        "throttle": GaugeMetricFamily("DCGM_FI_DEV_CLOCK_THROTTLE_REASONS", "Current clock throttle reasons",
                                      labels=labels),
    }
    for job, fold in jobs:
        for state in fold.nodes.values():
            for gpu, e in sorted(state["gpus"].items()):
                for key, family in families.items():
                    if e[key] is not None:
                        family.add_metric([str(gpu), e["uuid"], state["host"], job], float(e[key]))
    yield from families.values()

