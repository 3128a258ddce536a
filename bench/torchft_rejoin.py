"""A killed torchft group's rejoin, phase by phase: ``python -m bench.torchft_rejoin [--runs N]``.

Runs the torchft job of the compare part's plan (:mod:`bench.compare`: the tiny model, 2 replica groups,
its seeded ``sigkill`` then ``exception``) ``N`` times, each beside ``K`` CPU burners at nice 0 (the load of
a busy CI machine), and splits each group restart from the job's events:

- detection: the fault -> the supervisor's ``failure``; relaunch: -> the new process started;
- the new process's set-up (its ``rank_start``'s ``t_setup``): imports (interpreter, torch, torchft),
  session, model, manager (the group's store and torchft Manager up: from here it heartbeats),
  wiring (DDP, the group's process group, the checkpoint package), then its first quorum and the heal
  from a peer (to its ``heal``);
- whether the group's later fault fired, and how many steps the survivor trained alone meanwhile.

Each run's events and logs are kept under ``--keep`` (default: beside the results). It is not a part
of ``python -m bench``.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from eksft_nb.events import Event, read_all
from eksft_nb.jobdir import JobDir
from eksft_nb.job import launch
from eksft_nb.resilience.compare import engine_specs, plan
from eksft_nb.spec import JobSpec

from .common import QUICK, RESULTS, fmt, load_avg, machine, private_home, save, table
from .compare import EVERY, RUNS, SEED

SETUP = ("imports", "session", "model", "manager", "wiring")
PHASES = ("detection", "relaunch", *SETUP, "quorum_heal")
TIMEOUT_S = 900


def one_run(i: int, burners: int, keep: Path) -> dict[str, Any]:
    model, steps, n = RUNS[QUICK]
    fault_plan = plan(SEED, steps, n, EVERY)
    spec = engine_specs(f"rejoin{i}", JobSpec().replace(**{"model.preset": model, "seed": 0, "steps": steps,
                                                            "checkpoint.every": EVERY}))["torchft"]
    hogs = [subprocess.Popen([sys.executable, "-c", "while 1: pass"]) for _ in range(burners)]
    try:
        time.sleep(5 if burners else 0)   # the load average rises
        before = load_avg()
        job = launch(spec.validate(), fault_plan.commands())
        state = job.wait(TIMEOUT_S)
        after = load_avg()
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()
    jd = JobDir.for_name(spec.name)
    shutil.copytree(jd.path, keep / spec.name, ignore=shutil.ignore_patterns("ckpt", "warm"), symlinks=True)
    events = read_all(jd.events_path)
    return {"job": spec.name, "state": str(state), "faults": list(fault_plan.faults), "burners": burners,
            "load_before": before, "load_after": after, "restarts": rejoins(events),
            "fired": [e["fault"] for e in events if e.kind == "fault"]}


def rejoins(events: list[Event]) -> list[dict[str, Any]]:
    """Each group restart's phases (seconds, each from the previous one's end; None: not reached before
    the job ended)."""
    out = []
    end = max(e.t for e in events)
    for f in (e for e in events if e.kind == "failure" and e["blame_rank"] is not None):
        group, t0 = f["blame_rank"], f["fault_time"]
        after = [e for e in events if e.t >= f.t]
        started = next((e for e in after if e.kind == "rank_start" and e.rank == group), None)
        heal = next((e for e in after if e.kind == "heal" and e.rank == group), None)
        setup = (started.get("t_setup") or {}) if started else {}
        # the wiring ends the set-up: a restarted group's rank_start follows it at once
        ends = [f["detected_at"], started["t_enter"] if started else None,
                *(setup.get(p) for p in SETUP[:-1]), started.t if started else None, heal.t if heal else None]
        phases, t = {}, t0
        for name, at in zip(PHASES, ends):
            phases[name] = None if at is None or t is None else round(at - t, 3)
            t = at
        steps = [e["step"] for e in events if e.kind == "step"]
        at_fault = max((e["step"] for e in events if e.kind == "step" and e.t <= t0), default=0)
        out.append({"group": group, "fault_time": t0, "phases": phases,
                    # each set-up mark, seconds after the process started
                    "t_setup": {k: round(v - started["t_enter"], 3) for k, v in setup.items()},
                    "rejoin_s": round(heal.t - t0, 3) if heal else None,
                    "away_at_end_s": None if heal else round(end - t0, 3),
                    "survivor_steps_alone": (heal["step"] if heal else max(steps, default=0)) - at_fault})
    return out


def report(result: dict[str, Any]) -> str:
    rows = []
    for run in result["runs"]:
        for r in run["restarts"]:
            rows.append([run["job"], f"{run['load_before'][0]:.1f}/{run['load_after'][0]:.1f}",
                         *(fmt(r["phases"].get(p), ".2f") for p in PHASES),
                         fmt(r["rejoin_s"], ".2f") if r["rejoin_s"] is not None
                         else f"away {r['away_at_end_s']:.0f}s", ",".join(run["fired"])])
    return table("torchft group rejoin (seconds from the previous phase)",
                 ["job", "load", *PHASES, "rejoin", "fired"], rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.torchft_rejoin", description=__doc__.split("\n")[0])
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--burners", type=int, default=4, help="CPU burners beside each run (nice 0)")
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument("--keep", type=Path, help="where each run's events and logs go (default: beside --out's)")
    args = p.parse_args(argv)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    keep = args.keep or args.out / f"torchft-rejoin-{stamp}"
    keep.mkdir(parents=True, exist_ok=True)
    with private_home():
        result = {"machine": machine(), "runs": [one_run(i, args.burners, keep) for i in range(args.runs)]}
    path = save(result, args.out, "torchft-rejoin", stamp)
    print(report(result))
    print(f"results: {path}; events and logs: {keep}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
