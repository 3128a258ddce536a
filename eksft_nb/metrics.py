"""Prometheus metrics for jobs, read from their events at scrape time (``prometheus_client``).

``python -m eksft_nb metrics --port 9400`` serves every local job (or the ones named) on
``/metrics``, for a Prometheus/Grafana stack next to DCGM's GPU metrics.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from .goodput import CATEGORIES, compute
from .gpuhealth import dcgm_metrics
from .job import Job


class JobsCollector(Collector):
    """Collects the current state of some jobs; ``jobs()`` is called at every scrape."""

    def __init__(self, jobs: Callable[[], Iterable[Job]]) -> None:
        self.jobs = jobs
        self._handles: dict[str, Job] = {}

    def collect(self) -> Iterator[Metric]:
        step = GaugeMetricFamily("eksft_step", "Last completed training step", labels=["job"])
        loss = GaugeMetricFamily("eksft_loss", "Loss of the last step", labels=["job"])
        tps = GaugeMetricFamily("eksft_tokens_per_second", "Throughput over the last 20 steps", labels=["job"])
        restarts = CounterMetricFamily("eksft_restarts", "Recoveries by level", labels=["job", "level"])
        downtime = CounterMetricFamily("eksft_restart_downtime_seconds", "Time from faults to recovery", labels=["job"])
        stall = CounterMetricFamily("eksft_checkpoint_stall_seconds", "Training blocked by checkpoints", labels=["job"])
        committed = GaugeMetricFamily("eksft_last_checkpoint_step", "Newest committed checkpoint", labels=["job"])
        goodput = GaugeMetricFamily("eksft_goodput_ratio", "Productive share of wall time", labels=["job"])
        wall = GaugeMetricFamily("eksft_time_seconds", "Wall time by category", labels=["job", "category"])
        running = GaugeMetricFamily("eksft_running", "1 while the job runs", labels=["job"])
        gpus = []   # GPU health, under the DCGM exporter's names
        for listed in self.jobs():
            job = self._handles.setdefault(listed.name, listed)  # keep the incremental reader
            mon = job.refresh()
            name = job.name
            gpus.append((name, mon.gpu))
            running.add_metric([name], 0.0 if mon.finished else 1.0)
            if len(mon.steps):
                step.add_metric([name], mon.last_step)
                if mon.steps.loss[-1] is not None:
                    loss.add_metric([name], mon.steps.loss[-1])
                rate = mon.steps.throughput()
                if rate is not None and rate[1] == "tok/s":
                    tps.add_metric([name], rate[0])
            for level, n in mon.restarts_by_level().items():
                restarts.add_metric([name, level], n)
            downtime.add_metric([name], sum(r["downtime_s"] for r in mon.restarts))
            stall.add_metric([name], mon.checkpoint_stall_s)
            if mon.last_committed is not None:
                committed.add_metric([name], mon.last_committed.step)
            gp = compute(mon)
            goodput.add_metric([name], gp.goodput)
            for category in CATEGORIES:
                wall.add_metric([name, category], gp.seconds()[category])
        yield from (step, loss, tps, restarts, downtime, stall, committed, goodput, wall, running)
        yield from dcgm_metrics(gpus)


def serve(names: list[str] | None, port: int, addr: str = "127.0.0.1") -> None:
    """Serve metrics of the named local jobs (all of them when ``names`` is empty) until interrupted."""
    import time

    from prometheus_client import start_http_server
    from prometheus_client.registry import CollectorRegistry

    from .backends import get_backend

    backend = get_backend("local")

    def jobs() -> list[Job]:
        wanted = names or [j.name for j in backend.jobs()]
        return [Job(n, backend) for n in wanted]

    registry = CollectorRegistry()
    registry.register(JobsCollector(jobs))
    start_http_server(port, addr=addr, registry=registry)
    print(f"serving metrics of {', '.join(names) if names else 'all jobs'} on http://{addr}:{port}/metrics")
    while True:
        time.sleep(3600)
