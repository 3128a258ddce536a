"""torchft's fault matrix, timed: ``python -m bench.torchft_faults [--repeats N]``.

One 2-group torchft job (the tiny model, one rank per group) per repeat takes each fault in turn, the
next once the last one healed: a rank's sigkill, a whole group lost (kill-launcher), a hang, an
exception inside backward, then every group lost at one step (the job resumes from its checkpoint).
From the job's events, per fault:

- detection: fault -> the supervisor's ``failure`` (a hang: its no-progress limit);
- stall: how much longer than a typical step the survivors' first step after the fault took (they
  wait until the Lighthouse drops the lost group); for the loss of every group, the job's downtime to
  its first step after the resume;
- heal: fault -> the lost group healed from its peer (its process started again, imported, joined);
- skipped: the batches the healed group did not train.

It is not a part of ``python -m bench`` (that set is shared with the compare part under way).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from eksft_nb import commands
from eksft_nb.events import Event, read_all
from eksft_nb.jobdir import JobDir
from eksft_nb.spec import JobSpec, ModelConfig

from .common import RESULTS, fmt, load_avg, machine, private_home, save, table

FAULTS = ("sigkill", "kill-launcher", "hang", "exception", "every-group")
STEPS = 100_000  # stopped once the last fault recovered
TIMEOUT_S = 300


def run(repeats: int) -> dict[str, Any]:
    rows: list[dict[str, Any]] = []
    for i in range(repeats):
        rows += one_job(f"tft-bench-{i}")
    return {"rows": rows, "load_avg": load_avg()}


def one_job(name: str) -> list[dict[str, Any]]:
    spec = JobSpec(name=name, engine="torchft", nnodes=2, nproc_per_node=1, steps=STEPS,
                   model=ModelConfig("tiny")).replace(**{"checkpoint.every": 20, "ft.max_job_restarts": 10})
    commands.launch(spec, [])
    try:
        wait(name, lambda ev: len([e for e in ev if e.kind == "step"]) >= 40, "the first 40 steps")
        for kind in FAULTS:
            before = time.time()
            if kind == "every-group":
                at = last_step(name) + 50  # room to queue both: one fault ending every group at once
                for group in (0, 1):
                    commands.inject(name, "kill-launcher", node=group, step=at)
                wait(name, lambda ev, t=before: any(e.kind == "restart" and e.t > t for e in ev), kind)
            else:
                target = {"node": 0} if kind == "kill-launcher" else {"rank": 1}
                commands.inject(name, kind, **target)
                wait(name, lambda ev, t=before: any(e.kind == "fault" and e.t > t for e in ev), kind)
                fired = [e for e in read_all(JobDir.for_name(name).events_path)
                         if e.kind == "fault" and e.t > before][0]
                wait(name, lambda ev, t=fired.t: any(e.kind == "heal" and e.t > t for e in ev),
                     f"{kind}'s heal")
            wait(name, lambda ev, t=time.time(): len([e for e in ev if e.kind == "step" and e.t > t]) >= 20,
                 "20 steps after it")
    finally:
        commands.stop(name)
    return measure(read_all(JobDir.for_name(name).events_path))


def wait(name: str, done: Any, what: str) -> None:
    deadline = time.time() + TIMEOUT_S
    while not done(read_all(JobDir.for_name(name).events_path)):
        if time.time() > deadline:
            raise RuntimeError(f"{name}: timed out waiting for {what}")
        time.sleep(0.5)


def last_step(name: str) -> int:
    return max(e["step"] for e in read_all(JobDir.for_name(name).events_path) if e.kind == "step")


def measure(events: list[Event]) -> list[dict[str, Any]]:
    faults = [e for e in events if e.kind == "fault" and e["fault"] != "slow-rank"]
    restarts = [e for e in events if e.kind == "restart"]
    rows = []
    for f in faults:
        if f["fault"] == "exception":  # no restart: the step is thrown away, the group heals it
            thrown = next(e for e in events if e.kind == "step_discarded" and e.t > f.t)
            heal = next(e for e in events if e.kind == "heal" and e.t > thrown.t)
            rows.append({"fault": "exception", "detection_s": None, "stall_s": None,
                         "heal_s": heal.t - f.t, "skipped": heal["skipped_batches"]})
            continue
        r = next((e for e in restarts if e["fault_time"] == f.t), None)
        if r is None:
            continue  # the second kill of the loss of every group dates the same restart
        every = r["blame_rank"] is None
        rows.append({"fault": "every-group" if every else f["fault"], "detection_s": r["detection_s"],
                     "stall_s": r["downtime_s"], "heal_s": None if every else r["group_downtime_s"],
                     "skipped": None if every else r["skipped_batches"],
                     "resumed_step": r["resumed_step"], "restored_from": r.get("restored_from")})
    return rows


def report(result: dict[str, Any]) -> str:
    out = []
    for kind in FAULTS:
        rows = [r for r in result["rows"] if r["fault"] == kind]

        def median(key: str, rows: list[dict[str, Any]] = rows) -> float | None:
            values = [r[key] for r in rows if r.get(key) is not None]
            return statistics.median(values) if values else None

        out.append([kind, str(len(rows)), fmt(median("detection_s"), ".2f", " s"),
                    fmt(median("stall_s"), ".2f", " s"), fmt(median("heal_s"), ".2f", " s"),
                    fmt(median("skipped"), ".0f")])
    return table("torchft fault matrix (medians)", ["fault", "n", "detection", "stall", "heal", "skipped"],
                 out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.torchft_faults", description=__doc__.split("\n")[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    with private_home():
        result = {"machine": machine(), **run(args.repeats)}
    path = save(result, args.out, "torchft-faults")
    print(report(result))
    print(f"results: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
