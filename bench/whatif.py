"""Part 7, what-if proof: run a job at setting A under a seeded fault schedule, predict settings B from A's
events with :func:`eksft_nb.commands.whatif`, run each B under the same schedule (the same faults at the
same steps), and compare predicted with measured ETTR.

ETTR here is the what-if's: the productive share of wall time (:attr:`eksft_nb.goodput.Goodput.goodput`,
productive seconds / wall seconds, start-up and the final save included). It is not
:func:`eksft_nb.goodput.ettr` (useful steps per wall second against a fault-free run), which needs a
reference run and moves with the machine's speed between runs.

A second run at A, last, measures how far two runs of the same setting land apart on this machine: the
noise floor any prediction meets.

The pair runs side by side (``--whatif-order side-by-side``, the default: on a machine whose load swings,
both meet the same load) or one after the other (``sequential``: on a quiet machine). Side by side on two
cores, one job's downtime gives the other the CPU, so a setting with longer recoveries runs its steps
slower than its A did: a bias the model (which takes A's step time) cannot know of.
"""

from __future__ import annotations

import random
import time
from typing import Any

from eksft_nb import commands
from eksft_nb.errors import EksftError
from eksft_nb.goodput import compute, useful_steps
from eksft_nb.job import attach, launch
from eksft_nb.resilience.whatif import TERMS
from eksft_nb.spec import JobSpec
from eksft_nb.states import JobState

from . import common
from .common import fmt, load_avg, table

EVERY = 10
SEED = 19
# (steps, faults) of each run; a fault lands after the first save of the longest interval is committed
FULL, QUICK = (240, 4), (60, 2)
TARGET_POINTS = 2.0


def schedule(seed: int, steps: int, n: int) -> list[str]:
    """``n`` faults, in-process (exception on rank 0) and in-job (sigkill on rank 1) in turn, one in each
    of ``n`` equal stretches of the run after step ``4 * EVERY``, at a seeded step off every interval's
    save step (so each setting loses a different number of steps to it)."""
    rng = random.Random(seed)
    first = 4 * EVERY
    span = (steps - first - 5) // n
    out = []
    for i in range(n):
        lo = first + i * span
        candidates = [s for s in range(lo + 1, lo + span) if s % (EVERY // 2) != 1]
        kind = ("exception:0", "sigkill:1")[i % 2]
        out.append(f"{kind}@{rng.choice(candidates)}")
    return out


SETTINGS = {  # label: (spec changes, what-if arguments)
    "interval x0.5": ({"checkpoint.every": EVERY // 2}, {"ckpt_every": str(EVERY // 2)}),
    "interval x2": ({"checkpoint.every": 2 * EVERY}, {"ckpt_every": str(2 * EVERY)}),
    "in-process off": ({"ft.inprocess": False}, {"ckpt_every": str(EVERY), "inprocess": False}),
}
# size -> (steps, faults, the settings, the model, the noise floor run): --quick runs one interval change and
# in-process off (each setting's code path once); --smoke (the tests) in-process off alone
RUNS = {common.FULL: (*FULL, tuple(SETTINGS), "small", True),
        common.QUICK: (*QUICK, ("interval x2", "in-process off"), "tiny", False),
        common.SMOKE: (*QUICK, ("in-process off",), "tiny", False)}


ORDERS = ("side-by-side", "sequential")


def run(size: str, order: str = "side-by-side") -> dict[str, Any]:
    steps, n, chosen, model, noise_floor = RUNS[size]
    faults = schedule(SEED, steps, n)
    base = {"model.preset": model, "steps": steps, "checkpoint.every": EVERY,
            "checkpoint.mode": "async", "ft.inprocess": True, "seed": 0}
    runs: dict[str, Any] = {}
    for i, (label, (changes, ask)) in enumerate(SETTINGS.items()):
        if label not in chosen:
            continue
        a, b = pair(f"whatif-a{i}", base, f"whatif-b{i}", {**base, **changes}, faults, order)
        report = commands.whatif(a["name"], **ask)   # from A's events alone
        [row] = report["rows"]
        if row["ettr"] is None:
            raise EksftError(f"the what-if gave no figure for {label}: {row['why']}", "see the job's events")
        runs[label] = {"a": a, "b": b, "error_points": round(100 * (row["ettr"] - b["ettr"]), 2),
                       "predicted": {"ettr": row["ettr"], "terms": row["terms"], "saves": row["saves"],
                                     "lost_steps": row["lost_steps"], "notes": row["notes"],
                                     # the terms A's events could not teach (in-process off: an exception's
                                     # in-job restart, charged as A's in-job restarts of other causes)
                                     "estimated": row["estimated"],
                                     "gpu_h_lost": row["cost"]["lost"]["gpu_h"]}}
    noise = None
    if noise_floor:
        a, again = pair("whatif-a", base, "whatif-a-again", base, faults, order)
        noise = {"a": a, "b": again, "points": round(100 * (again["ettr"] - a["ettr"]), 2)}
    errors = [abs(r["error_points"]) for r in runs.values()]
    return {"steps": steps, "every": EVERY, "seed": SEED, "faults": faults, "ettr": "productive / wall",
            "order": order,
            "settings": runs, "noise": noise,
            "max_error_points": max(errors), "target_points": TARGET_POINTS,
            "target_met": max(errors) <= TARGET_POINTS}


def pair(name_a: str, changes_a: dict[str, Any], name_b: str, changes_b: dict[str, Any],
         faults: list[str], order: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """Run two jobs to their ends under the same ``faults``: at once (``side-by-side``: on a shared
    machine whose load swings by minutes both meet the same load; run one after the other there, they met
    5.7 and 20), or one after the other (``sequential``: each alone, on a quiet machine)."""
    before = load_avg()
    t0 = time.time()
    specs = [JobSpec().replace(name=name, **{"ft.max_injob_restarts": 20, **changes}).validate()
             for name, changes in ((name_a, changes_a), (name_b, changes_b))]
    jobs: list[Any] = []
    try:
        if order == "sequential":
            states = []
            for spec in specs:
                jobs.append(launch(spec, faults))
                states.append(jobs[-1].wait(timeout=1800))
        else:
            jobs = [launch(spec, faults) for spec in specs]
            states = [job.wait(timeout=1800) for job in jobs]
    finally:
        for job in jobs:
            if not job.state.ended:
                job.stop()
    for job, state in zip(jobs, states):
        if state != JobState.SUCCEEDED:
            raise EksftError(f"bench job {job.name} ended {state}, not succeeded",
                             f"see its logs: {job.logs(40)}")
    extra = {"run_s": round(time.time() - t0, 1), "load_avg_before": before, "load_avg_after": load_avg()}
    return measured(name_a, extra), measured(name_b, extra)


def measured(name: str, extra: dict[str, Any]) -> dict[str, Any]:
    """A finished job's ETTR and breakdown, and what the what-if read from it."""
    mon = attach(name).refresh()
    gp = compute(mon)
    report = commands.whatif(name)
    # the terms the what-if predicts (goodput's skipped batches are torchft's: an NVRx job has none)
    terms = {k: round(v, 4) for k, v in gp.seconds().items() if k in TERMS}
    return {"name": name, "ettr": round(gp.goodput, 5), "terms": terms,
            "gpu_h_lost": report["measured"]["cost"]["lost"]["gpu_h"],
            "wall_s": round(gp.wall_s, 3), "useful_steps": useful_steps(mon),
            "step_s": report["inputs"]["step_s"],
            "failures": [{**{k: f[k] for k in ("step", "level", "downtime_s", "lost", "committed")},
                          "cause": r["cause"]} for f, r in zip(report["inputs"]["failures"], mon.restarts)],
            "saves": report["inputs"]["saves"], "commit_lag_steps": report["inputs"]["commit_lag_steps"],
            "as_run_predicted": report["measured"]["predicted_as_run"]["ettr"], **extra}


def report(result: dict[str, Any]) -> str:
    head = ["run", "ETTR", "predicted", "error pts", "wall s", "step ms", "lost", "saves",
            *[t.replace("checkpoint_", "ckpt ").replace("restart_", "") for t in TERMS], "load"]

    def line(label: str, r: dict[str, Any], pred: dict[str, Any] | None = None, err: float | None = None,
             ) -> list[list[str]]:
        terms = r["terms"]
        predicted = "-" if pred is None else fmt(100 * pred["ettr"], ".1f", " %")
        row = [label, fmt(100 * r["ettr"], ".1f", " %"), predicted, fmt(err, "+.2f"), fmt(r["wall_s"], ".1f"),
               fmt(1000 * r["step_s"], ".0f"),
               str(sum(f["lost"] for f in r["failures"])), str(r["saves"]),
               *[fmt(terms.get(t), ".2f") for t in TERMS],
               f"{r['load_avg_before'][0]}->{r['load_avg_after'][0]}"]
        if pred is None:
            return [row]
        p = pred["terms"]
        return [row, ["  predicted from A", "", "", "", fmt(sum(p.values()), ".1f"), "",
                      str(pred["lost_steps"]), str(pred["saves"]), *[fmt(p.get(t), ".2f") for t in TERMS],
                      ""]]

    rows: list[list[str]] = []
    for label, r in result["settings"].items():
        rows += line(f"A: every {result['every']}, in-process on", r["a"])
        rows += line(f"B: {label}", r["b"], r["predicted"], r["error_points"])
    noise = result["noise"]
    if noise:
        rows += line("A", noise["a"]) + line("A again (noise floor)", noise["b"], None, noise["points"])
    together = result.get("order", "side-by-side") == "side-by-side"
    pairing = "beside its A (same load)" if together else "after its A (one at a time)"
    title = (f"7. what-if proof: {result['steps']} steps, 2 ranks, async saves, faults "
             f"{', '.join(result['faults'])} (seed {result['seed']}) in every run; each B runs {pairing} "
             "and is predicted from "
             "A's events alone; ETTR = productive / wall seconds (the what-if's, not goodput.ettr); "
             "error = predicted - measured; seconds per term")
    met = "MET" if result["target_met"] else "NOT MET"
    runs = [(f"B {label}", r["b"]) for label, r in result["settings"].items()] + \
        [(f"A beside {label}", r["a"]) for label, r in result["settings"].items()]
    unscheduled = [f"{who}: {f['level']} at step {f['step'] + 1} ({f['cause']})" for who, r in runs
                   for f in r["failures"] if not f["cause"].startswith("injected")]
    own = [abs(r["a"]["as_run_predicted"] - r["a"]["ettr"]) * 100 for r in result["settings"].values()]
    estimated = [f"{label}: {', '.join(r['predicted'].get('estimated') or [])}" for label, r in
                 result["settings"].items() if r["predicted"].get("estimated")]
    return table(title, head, rows) + (
        f"  largest error {result['max_error_points']:.2f} points "
        f"(target <= {result['target_points']:.0f}) {met}; "
        f"each A replayed at its own settings: within {max(own):.2f} points"
        + (f"; A run twice {'side by side' if together else 'in a row'}: {noise['points']:+.2f} points apart"
           if noise else "") + "\n"
        + (f"  failures no fault was scheduled for (the what-if replays them at the step they hit): "
           f"{'; '.join(unscheduled)}\n" if unscheduled else "")
        + (f"  terms A's events could not teach, estimated (the what-if says so on the row): "
           f"{'; '.join(estimated)}\n" if estimated else ""))
