"""Part 6, scale by simulation: a synthetic 1,024-rank EKS job (32 pods x 32 ranks, one step per
second, faults and restarts) replayed through the notebook's whole read path, on one core.

What the pods print is what eksft's ranks print (the runtime's events behind ``LOG_PREFIX``: every
rank's ``rank_start``, rank 0's ``step``/``checkpoint``/``resume``, each node's ``gpu_health`` every
10 s) plus one plain log line per rank per step (a training script's own per-rank logging) and
ft_launcher's line when a worker dies. Faults, at a quarter, half and three quarters of the run: a
rank SIGKILLed (in-job restart), a pod deleted with its node (job restart, a new pod), an XID 79
(in-job restart); each restart rolls back to the last checkpoint (every 100 steps).

Each simulated second is fed through the same code an EKS job's notebook runs: each pod's second of
log as one HTTP chunk split into lines by the Kubernetes client's own ``iter_resp_lines`` and queued
as the log followers queue them ("log follow"), the stream's :class:`Tracker` draining that queue
(log-line and pod-state parsing, with its own monitor and the :class:`Incidents` tracker), the job's
:class:`JobMonitor`, the Prometheus :class:`JobsCollector` (a scrape every 15 simulated seconds) and the
dashboard's :class:`TrainingFigure` (ingest and push, every simulated second). Each component's own CPU time
is timed apart (nested calls are charged to the callee); the input is generated per second, outside the
timings.
"""

from __future__ import annotations

import gc
import statistics
import time
import tracemalloc
from collections import defaultdict
from collections.abc import Callable, Iterator
from queue import Empty, SimpleQueue
from typing import Any

from kubernetes.watch.watch import iter_resp_lines

from eksft_nb.backends.eks import names
from eksft_nb.backends.eks.stream import Tracker
from eksft_nb.events import LOG_PREFIX, make
from eksft_nb.metrics import JobsCollector
from eksft_nb.monitor import JobMonitor
from eksft_nb.spec import JobSpec

from . import common
from .common import fmt, load_avg, table
from .dashboard import recording_comms

FULL = {"nodes": 32, "ranks_per_node": 32, "seconds": 3600, "fault_every": 300}   # an hour, 11 faults
QUICK = {"nodes": 32, "ranks_per_node": 32, "seconds": 80, "fault_every": 20}
SMOKE = {"nodes": 2, "ranks_per_node": 4, "seconds": 80, "fault_every": 20}   # the tests': the same faults
TARGET_X = 10.0            # each component at 10x real time or better
GPUS_PER_NODE = 8
GPU_EVERY_S, SCRAPE_EVERY_S, CKPT_EVERY = 10, 15, 100
RESTART_S = {"injob": 8, "job": 15}   # fault -> the ranks' next start
COMPONENTS = ("log follow", "stream parser", "incidents", "monitor", "metrics", "dashboard")
NAME = "scale"


class Clock:
    """Exclusive CPU time per component: a call inside another's is charged to the inner one."""

    def __init__(self) -> None:
        self.spent: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self._stack: list[list[Any]] = []

    def enter(self, name: str) -> None:
        now = time.process_time()
        if self._stack:
            self.spent[self._stack[-1][0]] += now - self._stack[-1][1]
        self._stack.append([name, now])
        self.calls[name] += 1

    def leave(self) -> None:
        now = time.process_time()
        name, since = self._stack.pop()
        self.spent[name] += now - since
        if self._stack:
            self._stack[-1][1] = now

    def wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            self.enter(name)
            try:
                return fn(*args, **kwargs)
            finally:
                self.leave()
        return timed


class SyntheticJob:
    """What the pod watch and the log followers of a 1,024-rank job deliver, second by second."""

    def __init__(self, spec: JobSpec, seconds: int, t0: float, fault_every: int) -> None:
        self.spec, self.seconds, self.t0 = spec, seconds, t0
        self.nodes, self.per_node = spec.nnodes, spec.nproc_per_node
        self.container = names.container(spec)
        self.gen = [0] * self.nodes                 # pod incarnation per node (a new pod after a node loss)
        self.attempt = self.injob = 0
        self.step, self.committed, self.paused_until = 0, 0, -1.0
        self.faults = {s: ("sigkill", "node", "xid")[i % 3] for i,
                       s in enumerate(range(fault_every, seconds, fault_every))}
        self.rank_steps = self.n_faults = 0

    # ---- the pods ----------------------------------------------------------------------------------
    def pod_name(self, node: int) -> str:
        return f"{NAME}-{node}-{self.gen[node]:05d}"

    def pod(self, node: int, deleting: float | None = None) -> dict[str, Any]:
        meta = {"name": self.pod_name(node), "uid": f"uid-{node}-{self.gen[node]}",
                "annotations": {"batch.kubernetes.io/job-completion-index": str(node)}}
        if deleting is not None:   # when the node went, on the cluster's clock
            meta["deletionTimestamp"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(deleting))
        status = {"phase": "Running", "containerStatuses": [
            {"name": self.container, "image": "img:1", "restartCount": 0, "state": {"running": {}}}]}
        return {"metadata": meta, "spec": {"hostname": f"{NAME}-{node}"}, "status": status}

    def up(self, node: int) -> list[tuple[Any, ...]]:
        p = self.pod(node)
        return [("pod", "ADDED", p, False), ("log_start", (p["metadata"]["uid"], 0), p["metadata"]["name"])]

    def line(self, kind: str, rank: int | None, t: float, **data: Any) -> str:
        return LOG_PREFIX + make(kind, NAME, rank, t=t, **data).to_json()

    def pid(self, local_rank: int) -> int:
        return 1000 + 100 * (self.attempt * 10 + self.injob) + local_rank

    def starts(self, t: float) -> list[tuple[Any, ...]]:
        """Every rank (re)starts; rank 0 resumes from the last committed checkpoint."""
        out = []
        for node in range(self.nodes):
            pod = self.pod_name(node)
            for lr in range(self.per_node):
                rank = node * self.per_node + lr
                out.append(("line", pod,
                            self.line("rank_start", rank, t + 0.001 * lr, pid=self.pid(lr), host=pod,
                                                   job_attempt=self.attempt, injob_restart=self.injob,
                                                   inprocess_iteration=0, world_size=self.spec.world_size,
                                                   start_step=self.committed)))
        if self.committed:
            out.append(("line", self.pod_name(0), self.line("resume", 0, t + 0.5, step=self.committed,
                                                            path=f"/ckpt/step_{self.committed:08d}",
                                                            load_s=0.4,
                                                            skipped=[])))
        self.step = self.committed
        return out

    # ---- one simulated second ----------------------------------------------------------------------
    def second(self, s: int) -> list[tuple[Any, ...]]:
        t = self.t0 + s
        out: list[tuple[Any, ...]] = []
        if s == 0:
            for node in range(self.nodes):
                out += self.up(node)
            out += self.starts(t)
        if s == self.paused_until:
            out += self.starts(t)
        fault = self.faults.get(s)
        if fault:
            out += self.fault(fault, t)
        if s % GPU_EVERY_S == 0:
            out += self.gpu(t)
        if s <= self.paused_until or s == 0:
            return out
        self.step += 1
        k = self.step
        for node in range(self.nodes):
            pod = self.pod_name(node)
            for lr in range(self.per_node):   # a training script's own per-rank log line
                out.append(("line", pod, f"[rank{node * self.per_node + lr}]: step {k} loss {2 + 1 / k:.4f} "
                                         f"lr 3.0e-04 grad_norm 1.02 tokens/s 31744"))
        self.rank_steps += self.spec.world_size
        out.append(("line", self.pod_name(0), self.line("step", 0, t, step=k, loss=2 + 1 / k, tokens=32768,
                                                        step_time=1.0)))
        if k % CKPT_EVERY == 0:
            p0 = self.pod_name(0)
            out += [("line", p0, self.line("checkpoint", 0, t + 0.01, phase="begin", step=k, mode="async")),
                    ("line", p0, self.line("checkpoint", 0, t + 0.05, phase="staged", step=k, blocked_s=0.04,
                                           bytes=2**34)),
                    ("line", p0,
                     self.line("checkpoint", 0, t + 0.9, phase="committed", step=k, blocked_s=0.04,
                                           background_s=0.85, bytes=2**34, path=f"/ckpt/step_{k:08d}"))]
            self.committed = k
        return out

    def gpu(self, t: float) -> list[tuple[Any, ...]]:
        out = []
        for node in range(self.nodes):
            gpus = [{"gpu": g, "uuid": f"GPU-{node:04x}{g:04x}-0000-0000-0000-000000000000", "temp_c": 60 + g,
                     "power_w": 650.0, "throttle": 0, "ecc_sbe": 0, "ecc_dbe": 0, "lost": False}
                    for g in range(GPUS_PER_NODE)]
            out.append(("line", self.pod_name(node),
                        self.line("gpu_health", node * self.per_node, t + 0.002 * node,
                                                               node=node, host=f"ip-10-0-{node}-1", gpus=gpus,
                                                               interval_s=float(GPU_EVERY_S))))
        return out

    def fault(self, kind: str, t: float) -> list[tuple[Any, ...]]:
        """A fault at time ``t``: what the pods print and the watch sees, then the restart's schedule."""
        self.n_faults += 1
        node = (5 + 7 * self.n_faults) % self.nodes
        pod, lr = self.pod_name(node), 3 % self.per_node
        rank = node * self.per_node + lr
        out: list[tuple[Any, ...]] = []
        if kind == "sigkill":
            out.append(("line", pod,
                        self.line("fault", rank, t, fault="sigkill", id=f"f{int(t)}", target_rank=rank,
                                               at_step=self.step)))
        if kind == "xid":
            lr, rank = 0, node * self.per_node
            out.append(("line", pod,
                        self.line("gpu_fault", rank, t, node=node, host=f"ip-10-0-{node}-1", gpu=0,
                                               uuid=f"GPU-{node:04x}0000-0000-0000-0000-000000000000",
                                               fault="xid",
                                               detail="XID 79 (GPU fell off the bus)", xid=79)))
        if kind == "node":
            out.append(("pod", "MODIFIED", self.pod(node, deleting=t), False))
            out.append(("pod", "DELETED", self.pod(node, deleting=t), False))
            out.append(("log_end", (f"uid-{node}-{self.gen[node]}", 0)))
            self.gen[node] += 1
            out += self.up(node)
            self.attempt, self.injob = self.attempt + 1, 0
        else:
            out.append(("line", pod,
                        f"[2026-01-01 00:00:10,000] [ERROR] [ft_launcher8@{pod}] failed (exitcode: -9) "
                                     f"local_rank: {lr} (pid: {self.pid(lr)}) of binary: python"))
            self.injob += 1
        self.paused_until = round(t - self.t0) + RESTART_S["job" if kind == "node" else "injob"]
        return out


class Chunk:
    """One HTTP chunk of a followed pod log, as ``iter_resp_lines`` reads it from a response."""

    def __init__(self, data: bytes) -> None:
        self.data = data

    def stream(self, amt: Any = None, decode_content: bool = False) -> Iterator[bytes]:
        yield self.data


def arrivals(items: list[tuple[Any, ...]]) -> list[tuple[str, Any]]:
    """``items`` as they reach the stream: pod-watch items as they are, and each run of log lines as
    one chunk per pod (each pod's lines in order; pods interleave as their followers happen to run)."""
    out: list[tuple[str, Any]] = []
    run: dict[str, list[str]] = {}
    for item in [*items, None]:
        if item is not None and item[0] == "line":
            run.setdefault(item[1], []).append(item[2])
            continue
        out += [("chunk", (pod, Chunk(("\n".join(lines) + "\n").encode()))) for pod, lines in run.items()]
        run = {}
        if item is not None:
            out.append(("item", item))
    return out


class Fed:
    """The metrics collector's view of the job: its name and the monitor the notebook keeps."""

    def __init__(self, name: str, mon: JobMonitor) -> None:
        self.name, self.mon = name, mon

    def refresh(self) -> JobMonitor:
        return self.mon


def run(size: str) -> dict[str, Any]:
    return replay(**{common.FULL: FULL, common.QUICK: QUICK, common.SMOKE: SMOKE}[size])


def replay(nodes: int, ranks_per_node: int, seconds: int, fault_every: int) -> dict[str, Any]:
    """Two passes over the same synthetic job: one timed, one under ``tracemalloc`` (which slows
    everything down) for the memory the components hold."""
    before = load_avg()
    spec = JobSpec(name=NAME, backend="eks", nnodes=nodes, nproc_per_node=ranks_per_node, steps=10**6)
    out = one_pass(spec, seconds, fault_every, traced=False)
    held = one_pass(spec, seconds, fault_every, traced=True)["held_mib"]
    clock, sim, mon = out.pop("clock"), out.pop("sim"), out.pop("mon")
    comps = {}
    for name in COMPONENTS:
        cpu = clock.spent[name]
        comps[name] = {"cpu_s": cpu, "realtime_x": seconds / cpu if cpu else None,
                       "rank_steps_per_s": sim.rank_steps / cpu if cpu else None,
                       "us_per_rank_step": 1e6 * cpu / sim.rank_steps if sim.rank_steps else None}
    total = sum(clock.spent[n] for n in COMPONENTS)
    peak = max(m for _, m in held)
    return {"nodes": nodes, "ranks_per_node": ranks_per_node, "ranks": spec.world_size, "seconds": seconds,
            "rank_steps": sim.rank_steps, **out, "components": comps,
            "pipeline": {"cpu_s": total, "realtime_x": seconds / total if total else None,
                         "us_per_rank_step": 1e6 * total / sim.rank_steps if sim.rank_steps else None,
                         "cores_at_real_time": total / seconds},
            "held_mib": held, "peak_held_mib": peak, "kib_per_rank": 1024 * peak / spec.world_size,
            "restarts": [(r["level"], r["cause"], r["downtime_s"]) for r in mon.restarts],
            "final_step": mon.last_step, "faults": sim.n_faults, "failures": len(mon.failures),
            "gpu_faults": len(mon.gpu.faults), "targets": {"realtime_x_min": TARGET_X},
            "targets_met": {name: (c["realtime_x"] or 0) >= TARGET_X for name, c in comps.items()},
            "load_avg_before": before, "load_avg_after": load_avg()}


def one_pass(spec: JobSpec, seconds: int, fault_every: int, traced: bool) -> dict[str, Any]:
    """Replay the job once; ``traced``: also the memory held (MiB, per simulated minute) by what the
    components keep, the dashboard's widget counted from after it is built."""
    from eksft_nb.dashboard.figure import TrainingFigure

    t0 = time.time() - seconds - 60              # a timeline that has already happened, on the pods' clock
    sim = SyntheticJob(spec, seconds, t0, fault_every)
    clock = Clock()
    tracker = Tracker(spec, created=t0 - 5, server="https://eks.example")
    for method in ("observe", "worker_failed", "node_failed", "hang"):
        setattr(tracker.incidents, method, clock.wrap("incidents", getattr(tracker.incidents, method)))
    tracker.mon.update = clock.wrap("monitor", tracker.mon.update)
    mon = JobMonitor()
    collector = JobsCollector(lambda: [Fed(NAME, mon)])
    queue: SimpleQueue[tuple[Any, ...]] = SimpleQueue()
    held: list[tuple[int, float]] = []
    pushed: list[float] = []     # kB each dashboard push sent to the front end
    lines = events = samples = 0
    with recording_comms() as sent:
        figure = TrainingFigure()
        figure.build()
        sent.take()
        if traced:
            gc.collect()
            tracemalloc.start()
        for s in range(seconds):
            items = sim.second(s)
            lines += sum(1 for it in items if it[0] == "line")
            feed = arrivals(items)
            clock.enter("log follow")   # what the watch and follower threads do (the same GIL, the same core)
            for what, x in feed:
                if what == "item":
                    queue.put(x)
                    continue
                pod, chunk = x
                for text in iter_resp_lines(chunk):
                    queue.put(("line", pod, text))
            clock.leave()
            clock.enter("stream parser")
            while True:
                try:
                    tracker.feed(queue.get_nowait())
                except Empty:
                    break
            tracker.finish(time.time())
            new = tracker.take()
            clock.leave()
            events += len(new)
            clock.enter("monitor")
            mon.update(new)
            clock.leave()
            if s % SCRAPE_EVERY_S == SCRAPE_EVERY_S - 1:
                clock.enter("metrics")
                samples += sum(len(m.samples) for m in collector.collect())
                clock.leave()
            clock.enter("dashboard")
            figure.ingest(mon)
            figure.push()
            clock.leave()
            pushed.append(sent.take() / 1000)
            if traced and (s % 60 == 59 or s == seconds - 1):
                del items, feed, new
                held.append((s + 1, tracemalloc.get_traced_memory()[0] / 2**20))
        if traced:
            tracemalloc.stop()
    return {"lines": lines, "events": events, "metric_samples": samples, "dashboard_kb": sum(pushed),
            "push_kb": {"median": statistics.median(pushed), "max": max(pushed)},
            "clock": clock, "sim": sim, "mon": mon, "held_mib": held}


def report(result: dict[str, Any]) -> str:
    r = result
    rows = [[name, fmt(c["cpu_s"], ".2f"), fmt(c["realtime_x"], ",.0f", "x"),
             fmt(c["rank_steps_per_s"], ",.0f"),
             fmt(c["us_per_rank_step"], ".2f"), "yes" if r["targets_met"][name] else "NO"]
            for name, c in r["components"].items()]
    p = r["pipeline"]
    rows.append(["all", fmt(p["cpu_s"], ".2f"), fmt(p["realtime_x"], ",.0f", "x"),
                 fmt(r["rank_steps"] / p["cpu_s"] if p["cpu_s"] else None, ",.0f"),
                 fmt(p["us_per_rank_step"], ".2f"),
                 ""])
    title = (f"6. scale: a {r['ranks']:,}-rank job ({r['nodes']} pods x {r['ranks_per_node']} ranks), "
             f"{r['seconds']} s at one step per second, replayed on one core (load "
             f"{r['load_avg_before'][0]}->"
             f"{r['load_avg_after'][0]})")
    header = ["component", "CPU s", "real time x", "rank-steps/s", "us per rank-step", f">= {TARGET_X:g}x"]
    by_level: dict[str, list[float]] = defaultdict(list)
    for level, _, down in r["restarts"]:
        by_level[level].append(down)
    levels = ", ".join(f"{len(d)} {lvl} ({max(d):.0f} s down at most)" for lvl,
                       d in by_level.items()) or "none"
    return (table(title, header, rows) +
            f"  {r['lines']:,} log lines, {r['events']:,} events, {r['faults']} faults, restarts: {levels}\n"
            f"  memory held: {r['peak_held_mib']:.1f} MiB at most = {r['kib_per_rank']:.1f} KiB per rank; "
            f"{r['held_mib'][len(r['held_mib']) // 2][1]:.1f} MiB at half time, {r['held_mib'][-1][1]:.1f} "
            "at the end; "
            f"{p['cores_at_real_time'] * 100:.2f} % of a core at real time; dashboard sent "
            f"{r['dashboard_kb']:.0f} kB, "
            f"{r['push_kb']['median']:.1f} kB per push (median), {r['push_kb']['max']:.1f} kB at most\n")

