"""Part 3, goodput: a job that runs for a fixed wall time after its first step, with a fault every
``period`` seconds (kinds in turn), for async vs sync checkpoints and in-process restart on vs off,
plus a fault-free reference of each checkpoint mode in the same run. ETTR (useful steps per wall
second against the reference of the same checkpoint mode), goodput and its breakdown come from
:mod:`eksft_nb.goodput`, over the events up to the end of the window."""

from __future__ import annotations

import math
import time
from typing import Any

from eksft_nb.events import read_all
from eksft_nb.goodput import CATEGORIES, compute, ettr, steps_per_s, useful_steps
from eksft_nb.jobdir import JobDir
from eksft_nb.job import launch
from eksft_nb.monitor import JobMonitor
from eksft_nb.spec import JobSpec

from .common import FULL, QUICK, SMOKE, fmt, load_avg, table

CONFIGS = {
    "async ckpt, in-process on": {"checkpoint.mode": "async", "ft.inprocess": True},
    "sync ckpt, in-process on": {"checkpoint.mode": "sync", "ft.inprocess": True},
    "async ckpt, in-process off": {"checkpoint.mode": "async", "ft.inprocess": False},
    "sync ckpt, in-process off": {"checkpoint.mode": "sync", "ft.inprocess": False},
}
# size -> (window seconds, fault period, the configurations, the fault-free references' checkpoint modes):
# --quick runs each checkpoint mode and each in-process setting once, against the async reference; --smoke
# (the tests) one configuration with one fault, and its reference, on the tiny model
RUNS = {FULL: (600.0, 120.0, tuple(CONFIGS), ("async", "sync")),
        QUICK: (12.0, 6.0, ("async ckpt, in-process on", "sync ckpt, in-process off"), ("async",)),
        SMOKE: (4.0, 2.0, ("sync ckpt, in-process off",), ("async",))}
FAULTS = (("exception", 0), ("sigkill", 1), ("hang", 0), ("kill-launcher", None))
# the demo's job (small model, a save every 10 steps), made to run until stopped
SPEC = {"model.preset": "small", "steps": 1_000_000, "checkpoint.every": 10, "ft.max_injob_restarts": 20,
        "ft.max_job_restarts": 20}


def run(size: str, window_s: tuple[float, float] | None = None) -> dict[str, Any]:
    """``window_s``: (duration, fault period) instead of the size's (a shortened run)."""
    duration, period, chosen, modes = RUNS[size]
    duration, period = window_s or (duration, period)
    model = {"model.preset": "tiny"} if size == SMOKE else {}
    references = {mode: window(f"goodput-ref-{mode}", {**model, "checkpoint.mode": mode}, duration, None)
                  for mode in modes}
    configs = {}
    for i, (label, changes) in enumerate(CONFIGS.items()):
        if label not in chosen:
            continue
        mode = changes["checkpoint.mode"] if changes["checkpoint.mode"] in references else "async"
        configs[label] = {**window(f"goodput-{i}", {**model, **changes}, duration, period,
                                   references[mode]["steps_per_s"]),
                          "reference": mode}
    return {"duration_s": duration, "fault_period_s": period, "faults": [f for f, _ in FAULTS],
            "references": references, "configs": configs}


FIRST_STEP_WITHIN_S = 600.0  # a launch that runs no step by then is a failure of the run


def window(name: str, changes: dict[str, Any], duration: float, period: float | None,
           reference_steps_per_s: float | None = None) -> dict[str, Any]:
    """Run one configuration for ``duration`` seconds from its first step, injecting a fault every
    ``period`` seconds (none when ``period`` is None: a reference run). The start-up before the first
    step is in the window too (goodput counts it as lost), but does not eat into it: on a busy machine
    a short window counted from launch could end before any step ran."""
    before = load_avg()
    job = launch(JobSpec().replace(name=name, **{**SPEC, **changes}).validate())
    deadline = time.time() + FIRST_STEP_WITHIN_S
    while job.refresh().max_step < 1 and not job.state.ended:
        if time.time() > deadline:
            job.stop()
            raise RuntimeError(f"{name} ran no step within {FIRST_STEP_WITHIN_S:.0f} s of its launch")
        time.sleep(0.2)
    t0 = time.time()
    fired = []
    try:
        # at period, 2 period, ... before the end
        for k in range(1, math.ceil(duration / period) if period else 1):
            time.sleep(max(0.0, t0 + k * period - time.time()))
            kind, rank = FAULTS[(k - 1) % len(FAULTS)]
            job.inject(kind, rank=rank)
            fired.append(kind)
        time.sleep(max(0.0, t0 + duration - time.time()))
        t_end = time.time()
    finally:
        job.stop()
    mon = JobMonitor()
    mon.update(e for e in read_all(JobDir.for_name(name).events_path) if e.t <= t_end)
    gp = compute(mon, now=t_end)
    return {"goodput": gp.goodput, "seconds": gp.seconds(), "percent": gp.percentages(), "wall_s": gp.wall_s,
            "useful_steps": useful_steps(mon), "steps_per_s": steps_per_s(mon, now=t_end),
            "ettr": ettr(mon, reference_steps_per_s, now=t_end) if reference_steps_per_s else None,
            "faults_injected": fired, "faults_fired": len(mon.faults), "restarts": mon.restarts_by_level(),
            "final_step": mon.max_step, "steps_executed": len(mon.steps),
            "checkpoints_committed": sum(c.state == "committed" for c in mon.checkpoints.values()),
            "load_avg_before": before, "load_avg_after": load_avg()}


def report(result: dict[str, Any]) -> str:
    rows = []
    runs = {**{f"fault-free {m} (reference)": r for m, r in result["references"].items()},
            **result["configs"]}
    for label, c in runs.items():
        pct = c["percent"]
        r = c["restarts"]
        ref = result["references"].get(c.get("reference", ""))
        # the machine's speed in the window: productive time per useful step (a clean step, on average)
        step, ref_step = _step_s(c), _step_s(ref) if ref else None
        same_speed = 100 * c["ettr"] * step / ref_step if c[
            "ettr"] is not None and step and ref_step else None
        rows.append([label, fmt(None if c["ettr"] is None else 100 * c["ettr"], ".1f", " %"),
                     fmt(same_speed, ".1f", " %"),
                     str(c["useful_steps"]), fmt(None if step is None else 1000 * step, ".0f"),
                     fmt(100 * c["goodput"], ".1f", " %"), *[fmt(pct[k], ".1f") for k in CATEGORIES],
                     f"{r['inprocess']}/{r['injob']}/{r['job']}",
                     f"{c['load_avg_before'][0]}->{c['load_avg_after'][0]}"])
    title = (f"3. goodput: {result['duration_s']:.0f} s per configuration, a fault every "
             f"{result['fault_period_s']:.0f} s "
             f"({', '.join(result['faults'])} in turn); ETTR = useful steps per wall second / the fault-free "
             "run's of the same checkpoint mode; same speed: ETTR x this window's step ms / the reference's "
             "(the shared machine's speed drifts between windows); % of wall time")
    if len(result["references"]) == 1:
        title += f" (one reference: {next(iter(result['references']))})"
    header = ["configuration", "ETTR", "same speed", "useful steps", "step ms", "goodput",
              *[k.replace("_", " ").replace("checkpoint ", "ckpt ") for k in CATEGORIES],
              "restarts ip/ij/job", "load"]
    return table(title, header, rows)


def _step_s(c: dict[str, Any]) -> float | None:
    return c["seconds"]["productive"] / c["useful_steps"] if c["useful_steps"] else None
