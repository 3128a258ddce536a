"""Part 4, overhead: steps per second of the built-in trainer with its telemetry, NVRx heartbeats and
fault-command polling on, against the same job with ``EKSFT_INSTRUMENT=0`` (all of them off), in
alternating pairs; plus microbenchmarks of one event emit and of the per-step protocol."""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from eksft_nb.events import EventWriter, read_all
from eksft_nb.jobdir import JobDir
from eksft_nb.job import launch
from eksft_nb.spec import JobSpec

from .common import FULL, QUICK, REPO, SMOKE, fmt, load_avg, med, stat, table
from .protocol_probe import per_call_us

TARGET = 0.99
SPEC = {"model.preset": "small", "checkpoint.every": 0}  # the demo's model; no saves but the final one
MICRO_N = 20_000
PROBE = REPO / "bench" / "protocol_probe.py"


# size -> (alternating pairs, steps per job, calls per microbenchmark, spec changes)
RUNS = {FULL: (4, 250, MICRO_N, {}), QUICK: (1, 40, MICRO_N, {}),
        SMOKE: (1, 10, 1_000, {"model.preset": "tiny"})}


def run(size: str) -> dict[str, Any]:
    pairs, steps, n, changes = RUNS[size]
    before = load_avg()
    on: list[float] = []
    off: list[float] = []
    for i in range(pairs):  # on, off, on, off...: drift hits both arms alike
        on.append(steps_per_s(f"ovh-on-{i}", steps, instrument=True, changes=changes))
        off.append(steps_per_s(f"ovh-off-{i}", steps, instrument=False, changes=changes))
    ratios = [a / b for a, b in zip(on, off)]
    micro = {**microbench(n), **in_situ("ovh-in-situ", n)}
    step_s = 1.0 / med(stat(on))
    per_step_us = micro["step_protocol_in_situ_us"]["median"] - micro["step_protocol_off_us"]["median"]
    return {"pairs": pairs, "steps": steps, "steps_per_s_on": stat(on), "steps_per_s_off": stat(off),
            "ratio": stat(ratios), "target": TARGET, "target_met": med(stat(ratios)) >= TARGET,
            "micro": micro, "step_s": step_s, "emit_vs_step": micro["emit_us"]["median"] * 1e-6 / step_s,
            "protocol_vs_step": per_step_us * 1e-6 / step_s,
            "load_avg_before": before, "load_avg_after": load_avg()}


@contextmanager
def environ(**changes: str) -> Iterator[None]:
    old = {k: os.environ.get(k) for k in changes}
    os.environ.update(changes)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def steps_per_s(name: str, steps: int, instrument: bool, changes: dict[str, Any] | None = None) -> float:
    """Training-loop steps per second of one job (from its ``rank_end``: steps run / loop time)."""
    with environ(EKSFT_INSTRUMENT="1" if instrument else "0"):  # inherited by the supervisor and the ranks
        job = launch(JobSpec().replace(name=name, steps=steps, **{**SPEC, **(changes or {})}).validate())
    state = job.wait(timeout=900)
    events = read_all(JobDir.for_name(name).events_path)
    restarts = [e for e in events if e.kind == "restart"]
    end = next((e for e in events if e.kind == "rank_end" and e.rank == 0), None)
    if state != "succeeded" or restarts or end is None:
        raise RuntimeError(f"overhead job {name}: {state}, {len(restarts)} restarts; the measurement "
                           "needs a clean run")
    return end["steps_run"] / end["loop_s"]


def in_situ(name: str, n: int = MICRO_N) -> dict[str, Any]:
    """Per-call cost of an NVRx heartbeat and of the whole step protocol, timed inside a job's ranks
    (``bench/protocol_probe.py`` as the job's script, under ft_launcher), ``n`` calls of each."""
    with tempfile.TemporaryDirectory(prefix="eksft-bench-ovh-") as tmp:
        out = Path(tmp) / "probe.json"
        spec = JobSpec().replace(name=name, steps=n, script=str(PROBE), script_args=[str(out), str(n)])
        state = launch(spec.validate()).wait(timeout=600)
        if state != "succeeded" or not out.exists():
            raise RuntimeError(f"in-situ protocol probe {name}: {state}")
        raw = json.loads(out.read_text())
    return {"heartbeat_us": stat(raw["heartbeat_us"]),
            "step_protocol_in_situ_us": stat(raw["step_protocol_us"])}


def microbench(n: int = MICRO_N) -> dict[str, Any]:
    """Microseconds per event emit, and per step_begin+step_end of a rank session (instrumented or not;
    no NVRx heartbeat here: that needs ft_launcher, the end-to-end pairs include it), ``n`` calls each."""
    from eksft_nb.runtime.session import RankInfo, Session

    with tempfile.TemporaryDirectory(prefix="eksft-bench-ovh-") as tmp:
        writer = EventWriter(Path(tmp) / "events.jsonl", "bench", 0)
        emit = stat(per_call_us(lambda i: writer.emit("step", step=i, loss=2.5, tokens=1024, step_time=0.15),
                                n))
        writer.close()
        jd = JobDir(Path(tmp) / "job")
        jd.create(JobSpec(name="job"))
        protocol = {}
        for arm, flag in (("on", "1"), ("off", "0")):
            with environ(EKSFT_INSTRUMENT=flag):
                s = Session(jd.spec(), jd.path, RankInfo(0, 0, 2, 0, 0, 0))

            def one_step(i: int, s: Session = s) -> None:
                s.step_begin(i)
                s.step_end(i, 2.5, 1024, 0.15)

            protocol[arm] = stat(per_call_us(one_step, n))
            s.close()
    return {"emit_us": emit, "step_protocol_on_us": protocol["on"], "step_protocol_off_us": protocol["off"]}


def report(result: dict[str, Any]) -> str:
    m = result["micro"]
    rows = [["instrumented (telemetry, heartbeats, polling)", fmt(med(result["steps_per_s_on"]), ".2f"),
             fmt(result["steps_per_s_on"]["min"], ".2f"), fmt(result["steps_per_s_on"]["max"], ".2f")],
            ["EKSFT_INSTRUMENT=0", fmt(med(result["steps_per_s_off"]), ".2f"),
             fmt(result["steps_per_s_off"]["min"], ".2f"), fmt(result["steps_per_s_off"]["max"], ".2f")]]
    r = result["ratio"]
    title = (f"4. overhead: steps/s of the built-in trainer ({result['pairs']} alternating pairs of "
             f"{result['steps']}-step "
             f"jobs; load {result['load_avg_before'][0]}->{result['load_avg_after'][0]})")
    return (table(title, ["arm", "median steps/s", "min", "max"], rows) +
            f"  on/off = {100 * r['median']:.1f} % (pairs: "
            f"{', '.join(f'{100 * v:.1f}' for v in r['values'])}); "
            f"target >= {100 * TARGET:.0f} %: {'MET' if result['target_met'] else 'NOT MET'}\n"
            f"  one event emit {m['emit_us']['median']:.1f} us = {100 * result['emit_vs_step']:.3f} % of a "
            f"{1000 * result['step_s']:.0f} ms step; one NVRx heartbeat (a round trip to ft_launcher) "
            f"{m['heartbeat_us']['median']:.0f} us; the whole step protocol in a rank "
            f"{m['step_protocol_in_situ_us']['median']:.0f} us "
            f"on vs {m['step_protocol_off_us']['median']:.1f} us off = "
            f"{100 * result['protocol_vs_step']:.2f} % of a step\n")
