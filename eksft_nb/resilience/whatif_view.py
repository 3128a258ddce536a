"""The what-if as a dashboard shows it: the recommendation in one line, the table as cells (each setting's
GPU-hours and dollars lost among them), and the plot of ETTR against the interval. One form for the widget
tab and the lab panel's job view: the panel draws the cells and the figure as they come, knowing none of the
report's fields."""

from __future__ import annotations

import json
from typing import Any

from ..cost import money
from .figures import whatif_figure
from .whatif import TERMS

COLUMNS = ["setting", "ETTR", "wall", *(t.replace("_", " ") for t in TERMS), "saves", "lost steps",
           "lost GPU-h", "lost $", "notes"]


def view(report: dict[str, Any]) -> dict[str, Any]:
    """``report`` (``commands.whatif``'s) as the dashboards show it. ``every``: the recommended interval
    (None: none recommended), for an action that applies it."""
    rec = report["recommendation"]
    m = report["measured"]
    rows = [_cells("measured (as run)", m["ettr"], m["wall_s"], m["terms"], None, None, "", m.get("cost")),
            _cells("predicted (as run)", **_predicted(m["predicted_as_run"]))]
    rows += [_cells(r["label"], **_predicted(r)) for r in report["rows"]]
    return {"job": report["job"], "line": rec["text"], "every": rec.get("every"),
            "formula": rec.get("formula", ""), "columns": COLUMNS, "rows": rows,
            "figure": json.loads(whatif_figure(report).to_json())}


def _predicted(row: dict[str, Any]) -> dict[str, Any]:
    notes = "; ".join([f"cannot estimate: {row['why']}"] if row["ettr"] is None else row["notes"])
    if row.get("estimated"):
        notes = f"estimated: {', '.join(row['estimated'])}; {notes}"
    return {"ettr": row["ettr"], "wall": row["wall_s"], "terms": row["terms"], "saves": row["saves"],
            "lost": row["lost_steps"], "notes": notes, "cost": row.get("cost")}


def _cells(label: str, ettr: float | None, wall: float | None, terms: dict[str, float], saves: int | None,
           lost: int | None, notes: str, cost: dict[str, Any] | None = None) -> list[str]:
    if ettr is None:
        return [label, "-", "-", *("-" for _ in TERMS), "-", "-", "-", "-", notes]
    spent = (cost or {}).get("lost") or {}
    gpu_h = "-" if spent.get("gpu_h") is None else f"{spent['gpu_h']:.4g}"
    usd = "-" if spent.get("usd") is None else money(spent["usd"])
    return [label, f"{100 * ettr:.1f}%", f"{wall or 0.0:.2f}s", *(f"{terms.get(t, 0.0):.2f}s" for t in TERMS),
            "-" if saves is None else str(saves), "-" if lost is None else str(lost), gpu_h, usd, notes]
