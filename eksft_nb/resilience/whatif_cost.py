"""The what-if in GPU-hours and dollars: what each setting's faults and checkpoints cost the job as it ran
(its replayed terms on every rank, :mod:`eksft_nb.cost`), and, for a run the user names (``--for 30d
--nodes 16``), the model's projection of each setting, with the saving against the job's own settings said
as a sentence ("every 20 steps instead of 10 saves ~$3,400 over 30d at 16 x p5.48xlarge").

Per setting the model takes: checkpoints' share of steady training time (stall, interference and the time
between steps a save costs, against productive time and the rest of ``other``), and a failure's cost (the
mean replayed downtime, plus the steps a failure at a uniformly random step loses under the setting,
:func:`.whatif.expected_lost`, at the job's recompute step time). With a failure rate for the run, it says
Young/Daly's interval for that rate too: the job's own rate (a test's injected faults) is no cluster's.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from .. import cost as costs
from ..spec import JobSpec
from .whatif import Report, Setting, expected_lost

FAULTS = ("restart_downtime", "recomputed")
CHECKPOINTS = ("checkpoint_stall", "checkpoint_interference")


def priced(report: Report, spec: JobSpec, p: costs.Pricing) -> dict[str, Any]:
    """``report`` as a dict, each row (and the measured run) with its cost, and the projection where asked."""
    out = report.to_dict()
    gpus = spec.world_size
    inp = report.inputs
    out["measured"]["cost"] = _cost(out["measured"]["terms"], gpus, p)
    rows = [(report.as_run, out["measured"]["predicted_as_run"])] + \
        [(r.setting, d) for r, d in zip(report.rows, out["rows"])]
    for setting, d in rows:
        d["cost"] = _cost(d["terms"], gpus, p) if d["ettr"] is not None else None
        d["projection"] = None
        if p.run is not None and d["ettr"] is not None:
            d["projection"] = costs.project(_losses(report, setting, d, spec), p)
    base = out["measured"]["predicted_as_run"].get("projection")
    for d in out["rows"]:
        proj = d.get("projection")
        d["vs_as_run"] = None if proj is None or base is None else \
            p.delta(proj["lost"]["gpu_h"] - base["lost"]["gpu_h"])
    out["cost"] = {"gpus": gpus, "pricing": p.to_dict(), "saving": _saving(out, report.as_run, p),
                   "at_scale": _young_daly(inp, p, spec)}
    return out


def _cost(terms: Mapping[str, float], gpus: int, p: costs.Pricing) -> dict[str, Any]:
    lost = sum(v for k, v in terms.items() if k != "productive")
    return {"lost": p.cost(lost, gpus), "faults": p.cost(sum(terms.get(t, 0.0) for t in FAULTS), gpus),
            "checkpoints": p.cost(sum(terms.get(t, 0.0) for t in CHECKPOINTS), gpus)}


def _losses(report: Report, s: Setting, d: Mapping[str, Any], spec: JobSpec) -> costs.Losses:
    inp, terms = report.inputs, d["terms"]
    between = (d["saves"] or 0) * inp.other_per_save_s
    ckpt = sum(terms.get(t, 0.0) for t in CHECKPOINTS) + between
    steady = terms["productive"] + terms["other"] + sum(terms.get(t, 0.0) for t in CHECKPOINTS)
    n = len(inp.failures)
    lost = expected_lost(inp, report.as_run, s)
    per = None if not n or lost is None else \
        terms["restart_downtime"] / n + lost * (inp.recompute_step_s or inp.step_s)
    detail = (f"its replayed downtime {terms['restart_downtime'] / n:.2f}s + {lost:.1f} steps lost at a "
              f"random step, {inp.recompute_step_s or inp.step_s:.3f}s each") if per is not None else ""
    return costs.Losses(ckpt / steady if steady else 0.0, per, n, inp.wall_s, spec.nnodes, detail)


def _saving(out: Mapping[str, Any], as_run: Setting, p: costs.Pricing) -> str:
    """The sentence: the setting that loses the least at the named scale, against the job's own."""
    rows = [d for d in out["rows"] if d.get("vs_as_run") is not None]
    if p.run is None or not rows:
        return ""
    best = min(rows, key=lambda d: d["vs_as_run"]["gpu_h"])
    proj = best["projection"]
    where = f"{proj['nodes']} x {p.instance}" if p.instance else \
        f"{proj['nodes']} nodes ({proj['gpus']} GPUs)"
    if best["vs_as_run"]["gpu_h"] >= 0:
        return f"the job's own settings ({Setting(**out['as_run']).label}) lose the least of those " \
               f"compared over {p.run.said} at {where} (a model)"
    gain = best["vs_as_run"]
    amount = costs.money(-gain["usd"]) if gain["usd"] is not None else \
        costs.gpu_hours_text(-gain["gpu_h"])
    s = best["setting"]
    change = f"every {s['ckpt_every']} steps instead of {as_run.ckpt_every}" \
        if s["ckpt_every"] != as_run.ckpt_every else best["label"]
    return f"{change} saves ~{amount} over {p.run.said} at {where} (a model; see what it assumes)"


def _young_daly(inp: Any, p: costs.Pricing, spec: JobSpec) -> dict[str, Any] | None:
    """Young/Daly's interval at the run's failure rate (given), from the job's save cost and recovery."""
    if p.run is None or not p.run.failures_per_day or inp.step_s <= 0:
        return None
    cost = inp.stall_per_save_s + inp.interference_per_save_s
    m = 86400.0 / p.run.failures_per_day
    r = inp.recovery_s or 0.0
    tau = math.sqrt(2 * cost * (m + r)) - cost if cost < 2 * m else m
    every = max(1, round(max(tau, inp.detection_s or 0.0) / inp.step_s))
    return {"every": every, "tau_s": round(tau, 3), "mtbf_s": round(m, 1),
            "text": f"at {p.run.failures_per_day:g} failures a day Young/Daly gives every {every} steps "
                    f"(tau {tau:.0f}s from a save's {cost:.3f}s and a recovery's {r:.2f}s)"}


def text(report: Mapping[str, Any]) -> str:
    """``whatif``'s text: the replay's table, then what each setting costs (and at the named scale)."""
    from .whatif import format_report

    lines = [format_report(report)]
    c = report.get("cost")
    if not c:
        return lines[0]
    price = c["pricing"]["price"] or "GPU-hours only (give --price INSTANCE or USD/h for dollars)"
    lines.append(f"cost on {c['gpus']} GPU(s), one per rank ({price}): lost to faults + checkpoints + the "
                 "rest")
    m = report["measured"]
    entries = [("measured (as run)", m), ("predicted (as run)", m["predicted_as_run"]), *(
        (r["label"], r) for r in report["rows"])]
    for label, r in entries:
        cost = r.get("cost")
        if not cost:
            continue
        line = (f"  {label:<44}{costs.text(cost['lost']):>22}: faults {costs.text(cost['faults'])}, "
                f"checkpoints {costs.text(cost['checkpoints'])}")
        proj = r.get("projection")
        if proj:
            line += f"; over {c['pricing']['run']['said']}: lost {costs.text(proj['lost'])}"
            if r.get("vs_as_run") is not None:
                line += f" ({_signed(r['vs_as_run'])} against the job's own settings)"
        lines.append(line + (f"  [estimated: {', '.join(r['estimated'])}]" if r.get("estimated") else ""))
    base = m["predicted_as_run"].get("projection")
    if base:
        lines += costs.projection_text(base)
    if c.get("saving"):
        lines.append(f"at scale: {c['saving']}")
    if c.get("at_scale"):
        lines.append(f"  {c['at_scale']['text']}")
    return "\n".join(lines)


def _signed(cost: Mapping[str, Any]) -> str:
    sign = "+" if cost["gpu_h"] >= 0 else "-"
    usd = None if cost["usd"] is None else abs(cost["usd"])
    amount = costs.text({"gpu_h": abs(cost["gpu_h"]), "usd": usd})
    return f"{sign}{amount}"

