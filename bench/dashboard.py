"""Part 5, dashboard: per live update, the time it takes and the bytes it sends to the front end, and
the memory the monitor and the dashboard hold, for job histories of 1k, 10k and 100k steps.

The job is a real job folder whose events are written with the real schema (steps, a save every
100 steps, a fault and its restart every 10k steps); no process runs. Updates go through the
dashboard's public path (:meth:`Dashboard.update`, as its live thread calls it, at its own interval);
what reaches the front end is captured at the widgets' comm: every comm message's JSON payload plus
its binary buffers (the Jupyter message envelope, a few hundred bytes per message, is not counted).
"""

from __future__ import annotations

import gc
import json
import time
import tracemalloc
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from eksft_nb.events import EventTail, make
from eksft_nb.jobdir import JobDir
from eksft_nb.monitor import JobMonitor
from eksft_nb.spec import JobSpec

from .common import FULL, QUICK, SMOKE, fmt, load_avg, med, stat, table

HISTORIES = (1_000, 10_000, 100_000)
STEP_S = 0.1               # a job of 10 steps/s ...
INTERVAL_S = 0.5           # ... seen by the dashboard's default refresh: 5 new steps per update
TARGET_MS, TARGET_KB = 20.0, 50.0
# the dashboard refreshes the figure and header every 0.5 s ("fast"), and also goodput, the checkpoint
# table and the log every 2 s ("slow"); each pass measures one of them on every update
PATHS = ("fast", "slow")


# size -> (histories, updates per history): 120 updates of 5 steps fold the history (every 500 steps) once at
# least; --smoke's 10k steps hold a fault and its restart
RUNS = {FULL: (HISTORIES, 120), QUICK: (HISTORIES, 12), SMOKE: ((1_000, 10_000), 3)}


def run(size: str) -> dict[str, Any]:
    histories, updates = RUNS[size]
    warm_up(FakeJob("dash-warm-up", 100))  # one-time costs (imports, plotly's validators) are not per-history
    sizes = {}
    for n in histories:
        sizes[str(n)] = measure(f"dash-{n}", n, updates)
    worst = sizes[str(histories[-1])]
    met = {path: med(worst[path]["update_ms"]) < TARGET_MS and med(worst[path]["update_kb"]) < TARGET_KB
           for path in PATHS}
    met["every_update"] = all(worst[p]["update_ms"]["max"] < TARGET_MS
                              and worst[p]["update_kb"]["max"] < TARGET_KB
                              for p in PATHS)
    return {"updates_per_history": updates, "steps_per_update": round(INTERVAL_S / STEP_S),
            "target_at": worst["steps"],
            "interval_s": INTERVAL_S, "histories": sizes,
            "targets": {"update_ms_max": TARGET_MS, "update_kb_max": TARGET_KB}, "targets_met": met}


class FakeJob:
    """A job folder with a synthetic event history, written with the real schema."""

    def __init__(self, name: str, steps: int) -> None:
        self.jd = JobDir.for_name(name)
        self.jd.create(JobSpec().replace(name=name, steps=10 * steps).validate())
        self.name, self.t, self.step = name, time.time() - steps * STEP_S, 0  # the history ends now
        self._write([make("job_start", name, None, t=self.t, spec_digest="x", world_size=2, steps=10 * steps,
                          backend="local", host="bench", pid=1)])
        self.advance(steps)

    def advance(self, n: int) -> None:
        """Append ``n`` steps (with their saves and restarts) in one write."""
        out = []
        for _ in range(n):
            self.step += 1
            self.t += STEP_S
            s, t = self.step, self.t
            out.append(make("step", self.name, 0, t=t, step=s, loss=5.0 / (1 + s / 1000), tokens=1024,
                            step_time=STEP_S))
            if s % 100 == 0:
                out += [make("checkpoint", self.name, 0, t=t, phase="begin", step=s, mode="async"),
                        make("checkpoint", self.name, 0, t=t + 0.02, phase="staged", step=s, blocked_s=0.02,
                             bytes=10**7),
                        make("checkpoint", self.name, 0, t=t + 0.5, phase="committed", step=s, blocked_s=0.02,
                             background_s=0.48, bytes=10**7, path=f"ckpt/step_{s:08d}")]
            if s % 10_000 == 5_000:
                out += [make("fault", self.name, 1, t=t, fault="sigkill", id=f"f{s}", target_rank=1,
                             at_step=s),
                        make("failure", self.name, None, t=t + 0.5, level="injob",
                             cause="injected sigkill on rank 1",
                             blame_rank=1, fault_time=t, detected_at=t + 0.5),
                        make("restart", self.name, None, t=t + 9, level="injob",
                             cause="injected sigkill on rank 1",
                             blame_rank=1, fault_time=t, detection_s=0.5, downtime_s=9.0,
                             rolled_back_steps=50,
                             resumed_step=s - 50)]
        self._write(out)

    def _write(self, events: list[Any]) -> None:
        with open(self.jd.events_path, "a") as f:
            f.write("".join(e.to_json() + "\n" for e in events))


class Sent:
    """What the widgets' comms published: bytes of JSON payload and binary buffers, the plotly.js
    bundle (sent once, with the figure's first state) counted apart."""

    def __init__(self) -> None:
        self.bytes = self.bundle = 0

    def take(self) -> int:
        out, self.bytes = self.bytes, 0
        return out


@contextmanager
def recording_comms() -> Iterator[Sent]:
    """Widgets made inside get a comm that records what it would send to the front end."""
    import comm
    from comm.base_comm import BaseComm

    sent = Sent()

    class RecordingComm(BaseComm):
        def publish_msg(self, msg_type: str, data: Any = None, metadata: Any = None, buffers: Any = None,
                        **keys: Any) -> None:
            state = data.get("state") if isinstance(data, dict) else None
            bundle = len(json.dumps(state["_esm"])) if isinstance(state, dict) and "_esm" in state else 0
            sent.bundle += bundle
            sent.bytes += len(json.dumps(data, default=str, separators=(",", ":"))) - bundle
            sent.bytes += sum(memoryview(b).nbytes for b in buffers or ())

    old = comm.create_comm
    comm.create_comm = RecordingComm
    try:
        yield sent
    finally:
        comm.create_comm = old


def measure(name: str, steps: int, updates: int) -> dict[str, Any]:
    from eksft_nb import attach
    from eksft_nb.dashboard import Dashboard

    before = load_avg()
    job = FakeJob(name, steps)
    out: dict[str, Any] = {"steps": steps, "events": job.jd.events_path.read_bytes().count(b"\n")}
    out["monitor_mib"], out["dashboard_mib"] = memory(job)
    with recording_comms() as sent:
        for path, slow_interval in zip(PATHS, (1e9, 0.0)):
            t0 = time.perf_counter()
            dash = Dashboard(attach(name), live=False, slow_interval=slow_interval)
            build_s = time.perf_counter() - t0
            initial = sent.take()
            ms, kb = [], []
            for _ in range(updates):
                job.advance(round(INTERVAL_S / STEP_S))
                t0 = time.perf_counter()
                dash.update()
                ms.append(1000 * (time.perf_counter() - t0))
                kb.append(sent.take() / 1000)
            dash.close()
            out[path] = {"update_ms": stat(ms), "update_kb": stat(kb)}
            if path == "fast":
                out["build_s"], out["initial_kb"], out[
                    "plotly_bundle_kb"] = build_s, initial / 1000, sent.bundle / 1000
    out["load_avg_before"], out["load_avg_after"] = before, load_avg()
    return out


def warm_up(job: FakeJob) -> None:
    """What :func:`memory` builds, built once untraced: the imports and caches it pays once are not counted
    in the first history's memory (and are not slowed by tracemalloc)."""
    from eksft_nb import attach
    from eksft_nb.dashboard import Dashboard

    _fed(job)
    with recording_comms():
        Dashboard(attach(job.name), live=False).close()


def memory(job: FakeJob) -> tuple[float, float]:
    """MiB held by a JobMonitor fed the whole history, and by a whole Dashboard (its own monitor included)."""
    from eksft_nb import attach
    from eksft_nb.dashboard import Dashboard

    held = []
    with recording_comms():
        for build in (lambda: _fed(job), lambda: Dashboard(attach(job.name), live=False)):
            gc.collect()
            tracemalloc.start()
            obj = build()
            gc.collect()
            held.append(tracemalloc.get_traced_memory()[0] / 2**20)
            tracemalloc.stop()
            if hasattr(obj, "close"):
                obj.close()
            del obj
    return held[0], held[1]


def _fed(job: FakeJob) -> JobMonitor:
    mon = JobMonitor()
    mon.update(EventTail(job.jd.events_path).read())
    return mon


def report(result: dict[str, Any]) -> str:
    rows = []
    for n, h in result["histories"].items():
        f, sl = h["fast"], h["slow"]
        rows.append([f"{int(n):,} steps", fmt(med(f["update_ms"]), ".1f"), fmt(f["update_ms"]["max"], ".1f"),
                     fmt(med(sl["update_ms"]), ".1f"), fmt(sl["update_ms"]["max"], ".1f"),
                     fmt(med(f["update_kb"]), ".1f"),
                     fmt(med(sl["update_kb"]), ".1f"),
                     fmt(max(f["update_kb"]["max"], sl["update_kb"]["max"]), ".1f"),
                     fmt(h["initial_kb"], ".0f"), fmt(h["build_s"], ".2f"), fmt(h["monitor_mib"], ".1f"),
                     fmt(h["dashboard_mib"], ".1f")])
    met = result["targets_met"]
    title = (f"5. dashboard: per update ({result['steps_per_update']} new steps; "
             f"{result['updates_per_history']} updates "
             f"per pass): ms, and kB sent to the front end")
    header = ["history", "0.5s ms", "max", "2s ms", "max", "0.5s kB", "2s kB", "max kB", "1st render kB*",
              "1st render s", "monitor MiB", "dashboard MiB"]

    def word(ok: bool) -> str:
        return "MET" if ok else "NOT MET"

    return (table(title, header, rows) +
            f"  target at {result.get('target_at', HISTORIES[-1]):,} steps, < {TARGET_MS:g} ms and "
            f"< {TARGET_KB:g} kB per update: 0.5 s refresh (median) "
            f"{word(met['fast'])}, 2 s refresh (median) {word(met['slow'])}, every update "
            f"{word(met['every_update'])}\n"
            "  0.5 s: figure and header; 2 s: also goodput, checkpoint table, log. * without the "
            "plotly.js bundle "
            f"({next(iter(result['histories'].values()))['plotly_bundle_kb']:.0f} kB, sent once with "
            "the figure)\n")
