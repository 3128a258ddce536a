"""Plotly figures of the resilience lab: a test's card (each case's downtime split into its phases,
passed or failed), a what-if's ETTR against the checkpoint interval, and a comparison of engines side by
side (each one's wall time by term, each fault's recovery by phase)."""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from ..events import RESTART_PHASES
from .ledger import TERMS

WIDTH = 840
PHASE_COLORS = dict(zip(RESTART_PHASES, ("#d62728", "#ff7f0e", "#9467bd", "#1f77b4", "#2ca02c")))
TERM_COLORS = dict(zip(TERMS, ("#2ca02c", "#d62728", "#ff9896", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f",
                               "#c7c7c7")))


def card_figure(card: dict[str, Any], widget: go.FigureWidget | None = None) -> go.Figure:
    """One horizontal bar per case, its downtime stacked by phase, labelled pass or FAIL and the level
    that healed it. Given ``widget`` (a live view), redraws that one in place."""
    rows = card["rows"]
    repeated = (card.get("plan") or {}).get("repeat", 1) > 1   # each trial its own bar
    names = [(f"{r['case']} #{r.get('trial', 1)}" if repeated else r["case"])
             + f" ({'pass' if r['passed'] else 'FAIL'}, {r['level'] or '-'})" for r in rows]
    fig = widget if widget is not None else go.Figure()
    traces = [
        go.Bar(
            name=p.replace("_", " "),
            y=names,
            x=[r["phases"].get(p, 0.0) for r in rows],
            orientation="h",
            marker_color=PHASE_COLORS[p],
            hovertemplate="%{y}: %{x:.2f}s " + p.replace("_", " ") + "<extra></extra>",
        )
        for p in RESTART_PHASES
    ]
    with fig.batch_update() if widget is not None else nullcontext():
        fig.data = []
        fig.add_traces(traces)
        fig.update_layout(
            barmode="stack",
            width=WIDTH,
            height=140 + 36 * max(1, len(rows)),
            title=f"resilience test of {card['job']}: downtime by phase, per case "
            f"({'passed' if card['passed'] else 'running or failed'})",
            xaxis_title="seconds from the fault to the first step after recovery",
            yaxis={"autorange": "reversed"},
            margin={"l": 10, "r": 10, "t": 50, "b": 40},
        )
    return fig


def whatif_figure(report: dict[str, Any]) -> go.Figure:
    """ETTR against the checkpoint interval (settings that cannot be estimated are left out and named
    in the title), the measured ETTR as a line, the recommendation as a marker."""
    rows = sorted(
        (r for r in report["rows"] if r["ettr"] is not None), key=lambda r: r["setting"]["ckpt_every"]
    )
    missing = [r["label"] for r in report["rows"] if r["ettr"] is None]
    fig = go.Figure(
        go.Scatter(
            x=[r["setting"]["ckpt_every"] for r in rows],
            y=[100 * r["ettr"] for r in rows],
            mode="lines+markers",
            name="predicted",
            text=[r["label"] for r in rows],
            hovertemplate="%{text}: %{y:.1f}% ETTR<extra></extra>",
        )
    )
    fig.add_hline(y=100 * report["measured"]["ettr"], line_dash="dot", annotation_text="measured (as run)")
    rec = report["recommendation"]
    hit = [r for r in rows if r["setting"]["ckpt_every"] == rec.get("young_daly")]
    if hit:
        fig.add_trace(
            go.Scatter(
                x=[rec["young_daly"]],
                y=[100 * hit[0]["ettr"]],
                mode="markers",
                name=rec["text"],
                marker={"size": 14, "symbol": "star"},
            )
        )
    title = f"what-if for {report['job']}: ETTR against the checkpoint interval"
    if missing:
        title += f" ({len(missing)} setting(s) cannot be estimated)"
    fig.update_layout(
        width=WIDTH,
        height=380,
        title=title,
        xaxis_title="checkpoint every N steps",
        yaxis_title="ETTR (%)",
        margin={"l": 10, "r": 10, "t": 50, "b": 40},
    )
    return fig


def compare_figure(result: dict[str, Any]) -> go.Figure:
    """A comparison of engines (:func:`eksft_nb.resilience.compare.compare`): on top, each engine's wall
    time split into goodput's terms (percent; productive is its ETTR, samples skipped counted as lost);
    below, each fault's recovery on each engine, stacked by phase (seconds from the fault until the failed
    part trains again)."""
    engines = list(result["engines"].values())
    names = [e["label"] for e in engines]
    rows = [(f"{fault} · {e['label']}", e["faults"][i]) for i, fault in enumerate(result["plan"]["faults"])
            for e in engines if i < len(e["faults"])]
    fig = make_subplots(rows=2, cols=1, vertical_spacing=0.16, row_heights=[0.4, 0.6],
                        subplot_titles=("wall time by term (%): productive = ETTR",
                                        "recovery per fault, by phase (s)"))
    for t in TERMS:
        fig.add_trace(go.Bar(
            name=t.replace("_", " "), y=names, orientation="h", marker_color=TERM_COLORS[t],
            x=[100 * e["terms"][t] / e["wall_s"] if e["wall_s"] else 0.0 for e in engines],
            text=[f"ETTR {100 * e['ettr']:.1f}%" if t == "productive" else "" for e in engines],
            textposition="inside", legendgroup="terms",
            hovertemplate="%{y}: %{x:.1f}% " + t.replace("_", " ") + "<extra></extra>"), row=1, col=1)
    for p in RESTART_PHASES:
        fig.add_trace(go.Bar(
            name=p.replace("_", " "), y=[label for label, _ in rows], orientation="h",
            x=[r["phases"].get(p, 0.0) for _, r in rows], marker_color=PHASE_COLORS[p], legendgroup="phases",
            customdata=[[r["level"] or "no recovery seen", r["stall_s"] or 0.0] for _, r in rows],
            hovertemplate="%{y}: %{x:.2f}s " + p.replace("_", " ")
            + " (healed by: %{customdata[0]}; the job stalled %{customdata[1]:.2f}s)<extra></extra>"),
            row=2, col=1)
    plan = result["plan"]
    fig.update_layout(
        barmode="stack", width=WIDTH, height=300 + 28 * (len(engines) + len(rows)),
        title=f"engines side by side: {plan['steps']} steps, {', '.join(plan['faults'])} "
              f"(seed {plan['seed']})",
        margin={"l": 10, "r": 10, "t": 70, "b": 40}, legend={"tracegroupgap": 20})
    fig.update_yaxes(autorange="reversed")
    return fig
