"""Prometheus metrics for jobs, read from their events at scrape time (``prometheus_client``).

``python -m eksft_nb metrics --port 9400`` serves every local job (or the ones named) on
``/metrics``, for a Prometheus/Grafana stack next to DCGM's GPU metrics; ``--root`` points it at
another jobs folder (on EKS each pod serves its job's folder on the shared volume this way). The
Grafana dashboard ``deploy/grafana/eksft-nb.json`` charts these families. The ``job`` label is the
job's name: scrape with ``honor_labels`` so Prometheus keeps it.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from .control import FAULTS
from .goodput import CATEGORIES, compute
from .gpuhealth.export import dcgm_metrics
from .job import Job

# a restart's cause is a sentence; as a label it is a small set of classes (the injected fault's kind
# when one caused it), so a job's series stay few: first match wins
CAUSE_CLASSES = [(re.compile(rf"\binjected {re.escape(kind)}\b"), kind) for kind in FAULTS] + [
    (re.compile(r"\bhang\b|stopped making progress|heartbeat"), "hang"),
    (re.compile(r"\braised\b|\bfailed: "), "exception"),
    (re.compile(r"\bdied \(SIG|\bwas killed\b"), "killed"),
    (re.compile(r"\bexited with code\b|\bgave up\b"), "exit"),
    (re.compile(r"\bft_launcher on node\b|\bnode\b|\bpod\b"), "node-lost"),
]


def cause_class(cause: str) -> str:
    """The label value for a restart's ``cause`` sentence (``other`` when none of the classes fits)."""
    return next((label for pattern, label in CAUSE_CLASSES if pattern.search(cause)), "other")


class JobsCollector(Collector):
    """Collects the current state of some jobs; ``jobs()`` is called at every scrape."""

    def __init__(self, jobs: Callable[[], Iterable[Job]]) -> None:
        self.jobs = jobs
        self._handles: dict[str, Job] = {}

    def collect(self) -> Iterator[Metric]:
        step = GaugeMetricFamily("eksft_step", "Last completed training step", labels=["job"])
        loss = GaugeMetricFamily("eksft_loss", "Loss of the last step", labels=["job"])
        tps = GaugeMetricFamily("eksft_tokens_per_second", "Throughput over the last 20 steps",
                                labels=["job"])
        sps = GaugeMetricFamily("eksft_steps_per_second", "Steps per second over the last 20 steps",
                                labels=["job"])
        restarts = CounterMetricFamily("eksft_restarts", "Recoveries by level", labels=["job", "level"])
        causes = CounterMetricFamily("eksft_restarts_by_cause", "Recoveries by level and cause class",
                                     labels=["job", "level", "cause"])
        downtime = CounterMetricFamily("eksft_restart_downtime_seconds", "Time from faults to recovery",
                                       labels=["job"])
        stall = CounterMetricFamily("eksft_checkpoint_stall_seconds", "Training blocked by checkpoints",
                                    labels=["job"])
        committed = GaugeMetricFamily("eksft_last_checkpoint_step", "Newest committed checkpoint",
                                      labels=["job"])
        committed_t = GaugeMetricFamily("eksft_last_checkpoint_timestamp_seconds",
                                        "When the newest committed checkpoint was committed (Unix time)",
                                        labels=["job"])
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
                times = mon.steps.step_time[-20:]
                sps.add_metric([name], len(times) / (sum(times) or 1e-9))
            for level, n in mon.restarts_by_level().items():
                restarts.add_metric([name, level], n)
            by_cause: dict[tuple[str, str], int] = {}
            for r in mon.restarts:
                key = (r["level"], cause_class(r["cause"]))
                by_cause[key] = by_cause.get(key, 0) + 1
            for (level, cause), n in sorted(by_cause.items()):
                causes.add_metric([name, level, cause], n)
            downtime.add_metric([name], sum(r["downtime_s"] for r in mon.restarts))
            stall.add_metric([name], mon.checkpoint_stall_s)
            if mon.last_committed is not None:
                committed.add_metric([name], mon.last_committed.step)
                if mon.last_committed.t_done is not None:
                    committed_t.add_metric([name], mon.last_committed.t_done)
            gp = compute(mon)
            goodput.add_metric([name], gp.goodput)
            for category in CATEGORIES:
                wall.add_metric([name, category], gp.seconds()[category])
        yield from (step, loss, tps, sps, restarts, causes, downtime, stall, committed, committed_t, goodput,
                    wall,
                    running)
        yield from dcgm_metrics(gpus)


def serve(names: list[str] | None, port: int, addr: str = "127.0.0.1", root: Path | None = None) -> None:
    """Serve metrics of the named local jobs (all of them when ``names`` is empty) until interrupted;
    ``root``: the jobs folder (default: the local backend's)."""
    import time

    from prometheus_client import start_http_server
    from prometheus_client.registry import CollectorRegistry

    from .backends.local import LocalBackend

    backend = LocalBackend(root)

    def jobs() -> list[Job]:
        wanted = names or [j.name for j in backend.jobs()]
        return [Job(n, backend) for n in wanted]

    registry = CollectorRegistry()
    registry.register(JobsCollector(jobs))
    start_http_server(port, addr=addr, registry=registry)
    print(f"serving metrics of {', '.join(names) if names else 'all jobs'} on http://{addr}:{port}/metrics")
    while True:
        time.sleep(3600)
