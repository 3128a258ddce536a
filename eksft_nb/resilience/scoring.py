"""A test's trials scored per fault kind: n/N passed, the spread (least, median, most) of detection, downtime
and steps lost over its trials, and what each cost in GPU-hours and dollars (:mod:`eksft_nb.cost`).

A trial's cost is what the fault took from the whole job: its downtime on every rank, its recomputed steps
(steps lost times the reference's clean step time) on every rank, and each batch a torchft group skipped
(one rank's share of a step). The reference run's checkpoints cost their stall and interference on every
rank. Scaled to a run the user names, a kind's mean cost per fault is priced on that run's GPUs.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from typing import Any, TypedDict

from .. import cost as costs
from ..goodput import compute
from ..monitor import JobMonitor


class Spread(TypedDict):
    n: int
    min: float
    median: float
    max: float


class KindRow(TypedDict):
    kind: str
    trials: int          # planned
    passed: int
    levels: dict[str, int]        # the levels that healed its trials, and how often
    expected_level: str | None
    detection_s: Spread | None
    downtime_s: Spread | None
    lost: Spread | None
    cost: dict[str, float | None]          # mean per trial
    cost_at_scale: dict[str, float | None] | None   # the mean fault on the run the user names
    ok: bool
    why: list[str]       # each failed trial's reasons, the trial named


def spread(values: Sequence[float | int | None]) -> Spread | None:
    seen = [float(v) for v in values if v is not None]
    if not seen:
        return None
    return {"n": len(seen), "min": round(min(seen), 4), "median": round(statistics.median(seen), 4),
            "max": round(max(seen), 4)}


def price_trial(row: dict[str, Any], step_s: float, gpus: int, pricing: costs.Pricing) -> None:
    """Set ``row``'s GPU-seconds lost and its cost (None where no recovery was measured)."""
    down, lost = row.get("downtime_s"), row.get("lost")
    if down is None and lost is None:
        row["lost_gpu_s"], row["cost"] = None, pricing.cost(None, gpus)
        return
    gpu_s = ((down or 0.0) + (lost or 0) * step_s) * gpus + row.get("skipped_batches", 0) * step_s
    row["lost_gpu_s"] = round(gpu_s, 4)
    row["cost"] = pricing.cost(gpu_s, 1)


def reference_costs(ref: JobMonitor, gpus: int, pricing: costs.Pricing) -> dict[str, Any]:
    """What the reference run's checkpoints cost (stall and interference on every rank), its clean step
    time, and its checkpoints' share of steady training time (the scaled model's)."""
    gp = compute(ref)
    ckpt = gp.checkpoint_stall_s + gp.checkpoint_interference_s
    steady = gp.productive_s + ckpt + gp.other_s
    steps = len(set(ref.steps.step))
    return {"step_s": round(gp.productive_s / steps, 6) if steps else 0.0, "checkpoints_s": round(ckpt, 4),
            "checkpoints": pricing.cost(ckpt, gpus), "ckpt_share": round(ckpt / steady, 6) if steady else 0.0}


def score(rows: Sequence[Mapping[str, Any]], kinds: Sequence[str], repeat: int, expected: Mapping[str, Any],
          problem: str, pricing: costs.Pricing, gpus: int) -> list[KindRow]:
    """One row per kind that applies: its trials' pass count and spreads; a card that could run no trial
    (``problem``) fails every kind with it."""
    out: list[KindRow] = []
    for kind in kinds:
        mine = [r for r in rows if r["case"] == kind]
        levels: dict[str, int] = {}
        for r in mine:
            levels[r["level"] or "not healed"] = levels.get(r["level"] or "not healed", 0) + 1
        why = [f"trial {r.get('trial', 1)} ({r['target']}, step {r['at_step']}): {w}" for r in mine
               for w in r["why"]]
        if problem:
            why = [problem]
        elif len(mine) < repeat:
            why.append(f"{repeat - len(mine)} of its {repeat} trials did not run")
        passed = sum(bool(r["passed"]) for r in mine)
        per = [r["lost_gpu_s"] for r in mine if r.get("lost_gpu_s") is not None]
        mean = statistics.fmean(per) if per else None
        at_scale = None
        if pricing.run is not None and mean is not None:
            nodes = pricing.run.nodes or 0
            at_scale = pricing.cost(mean / gpus, nodes * pricing.gpus_per_node) if nodes else None
        out.append({"kind": kind, "trials": repeat, "passed": passed, "levels": levels,
                    "expected_level": expected.get(kind),
                    "detection_s": spread([r["detection_s"] for r in mine]),
                    "downtime_s": spread([r["downtime_s"] for r in mine]),
                    "lost": spread([r["lost"] for r in mine]),
                    "cost": pricing.cost(mean, 1), "cost_at_scale": at_scale,
                    "ok": not problem and passed == repeat, "why": why})
    return out


def projection(reference: Mapping[str, Any], kinds: Sequence[KindRow], rows: Sequence[Mapping[str, Any]],
               pricing: costs.Pricing, gpus: int, nodes: int) -> dict[str, Any] | None:
    """The scaled model for the card: the reference's checkpoint share, and a failure costing the mean of
    the trials' (a test's trials are injected: the rate comes from --failures-per-day, or none)."""
    if pricing.run is None or not reference:
        return None
    per = [r["lost_gpu_s"] / gpus for r in rows if r.get("lost_gpu_s") is not None]
    losses = costs.Losses(reference.get("ckpt_share", 0.0), statistics.fmean(per) if per else None, 0, 0.0,
                          nodes, f"the mean of the card's {len(per)} trials" if per else "")
    return costs.project(losses, pricing)


def _s(sp: Spread | None, unit: str = "s") -> str:
    if sp is None:
        return "-"
    fmt = (lambda v: f"{v:.2f}{unit}") if unit else (lambda v: f"{v:g}")
    if sp["n"] == 1 or sp["min"] == sp["max"]:
        return fmt(sp["median"])
    return f"{fmt(sp['median'])} [{fmt(sp['min'])}-{fmt(sp['max'])}]"


def kinds_text(card: Mapping[str, Any]) -> list[str]:
    """One line per kind: n/N, the levels, median [least-most] of detection, downtime and steps lost, the
    mean cost per fault (and at the named scale)."""
    if not card.get("kinds"):
        return []
    lines = [f"  {'kind':<20}{'passed':>7}  {'healed at':<18}{'detect':<20}{'downtime':<22}{'lost':<12}"
             "cost per fault"]
    for k in card["kinds"]:
        levels = ", ".join(f"{lv}" if n == k["trials"] else f"{lv} x{n}"
                           for lv, n in k["levels"].items()) or "-"
        price = costs.text(k["cost"])
        if k.get("cost_at_scale"):
            price += f"; {costs.text(k['cost_at_scale'])} at the named scale"
        lines.append(f"  {k['kind']:<20}{k['passed']:>3}/{k['trials']:<3}  {levels:<17} "
                     f"{_s(k['detection_s']):<20}"
                     f"{_s(k['downtime_s']):<22}{_s(k['lost'], ''):<12}{price}"
                     + ("" if k["ok"] else "  FAIL"))
        lines += [f"      {w}" for w in k["why"][:6]]
        if len(k["why"]) > 6:
            lines.append(f"      ... and {len(k['why']) - 6} more (see the trials below)")
    return lines
