"""The dashboard's one plotly ``FigureWidget``: five rows on a shared timeline (seconds since the
job started) — throughput, loss, checkpoint saves (blocked vs background), faults and restarts (GPU
faults among them), and a GPU health strip per node.

Each plotted quantity is a :class:`~eksft_nb.dashboard.series.Series` drawn by one trace per part
(its history chunks and its tail); :meth:`TrainingFigure.push` sends only the parts that changed, in
one message.
"""

from __future__ import annotations

import html

from copy import deepcopy
from typing import Any

import numpy as np
import plotly.graph_objects as go
from plotly.serializers import custom_serializers
from plotly.subplots import make_subplots
from traitlets import Dict

from ..gpuhealth.fold import fault_label
from ..incidents import phases_text
from ..monitor import JobMonitor
from ..states import CheckpointState, RestartLevel
from ..plotly_bundle import LOADER
from .series import Series

WIDTH = 840
LANES = ("setting", "fault", "in-process", "in-job", "job")
LEVEL_LANE = {level.value: level.label for level in RestartLevel}
COLORS = {"tokens/s": "#1f77b4", "loss": "#ff7f0e", "blocked": "#d62728", "background": "#2ca02c",
          "faults": "#7f7f7f", "restarts": "#9467bd", "gpu faults": "#d62728", "settings": "#17becf"}
GPU_STATUS = {"ok": "#2ca02c", "throttled": "#ff7f0e", "fault": "#d62728", "none": "#bbbbbb"}
ROW_TITLES = ("throughput (tokens/s)", "loss",   # a user script reports no tokens: steps/s, and no loss
              "checkpoint saves: training blocked (red) vs writing in the background (green), seconds",
              "live settings, faults and restarts (line: downtime until the first step after recovery)",
              "GPU health per node: ok (green), throttled (orange), XID/ECC fault (red), no GPU (grey)")


def _as_lists(value: Any, manager: Any) -> Any:
    """plotly's serializer, with numbers as JSON lists rather than binary buffers (NaN, a gap: null)."""
    if isinstance(value, dict):
        return {k: _as_lists(v, manager) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_as_lists(v, manager) for v in value]
    if isinstance(value, np.ndarray):
        return [None if v != v else v for v in value.tolist()]
    return custom_serializers["to_json"](value, manager)


# nbclient saves the last value of each trait but every binary buffer ever sent with it: an update message's
# buffers outlive the message (reset to None at once), and a notebook reopened with them restored no widget.
_MESSAGE = {"to_json": _as_lists, "from_json": custom_serializers["from_json"]}


class FigureWidget(go.FigureWidget):
    """plotly's FigureWidget with a loader for its JavaScript, so its saved state is its data (see
    plotly_bundle); its update messages carry no binary buffers, and :meth:`settle` makes its saved state the
    figure as it is."""

    _esm = LOADER
    _py2js_addTraces = Dict(allow_none=True).tag(sync=True, **_MESSAGE)
    _py2js_restyle = Dict(allow_none=True).tag(sync=True, **_MESSAGE)
    _py2js_relayout = Dict(allow_none=True).tag(sync=True, **_MESSAGE)
    _py2js_update = Dict(allow_none=True).tag(sync=True, **_MESSAGE)
    _py2js_animate = Dict(allow_none=True).tag(sync=True, **_MESSAGE)

    def settle(self) -> None:
        """Sync the whole figure as its data and layout: what a notebook saved now (by nbclient too, which
        keeps the data first shown and only the last update message) redraws when reopened."""
        self._widget_layout = deepcopy(self._layout_obj._props)
        self._widget_data = deepcopy(self._data)


def _f32(values: list[Any]) -> np.ndarray:
    return np.asarray(values, dtype=np.float32)


def _i32(values: list[Any]) -> np.ndarray:
    return np.asarray(values, dtype=np.int32)


class TrainingFigure:
    """Folds a :class:`JobMonitor` into bounded series and draws them in one ``FigureWidget``.

    Call :meth:`ingest` with the monitor whenever it has new events, then :meth:`push` to send what
    changed; :attr:`widget` exists once :meth:`build` has run (so a long history is sent once).
    """

    def __init__(self, tail: int = 500, budget: int = 3000) -> None:
        kw = {"tail": tail, "budget": budget}
        self.series: dict[str, Series] = {
            "tokens/s": Series(("x", "y", "step"), key=("y",), join=True, **kw),
            "loss": Series(("x", "y", "step"), key=("y",), join=True, **kw),
            "checkpoints": Series(("x", "blocked", "background", "step"), key=("blocked", "background"),
                                  **kw),
            "faults": Series(("x", "lane", "text"), **kw),
            "restarts": Series(("x", "lane", "downtime", "text", "hover", "where"), key=("downtime",), **kw),
            "gpu faults": Series(("x", "lane", "text"), **kw),
            "settings": Series(("x", "lane", "text"), **kw),  # live changes, where the ranks took them
            # a point per node per sample: a many-node job's strip would re-send a large tail every 10 s
            "gpu": Series(("x", "lane", "color", "label", "hover"), tail=max(2, tail // 5),
                          budget=max(8, budget // 5)),
        }
        self.t0: float | None = None
        self.unit = "tok/s"                 # "steps/s" once a step without tokens arrives (a user script's)
        self._unit_shown = "tok/s"
        self.widget: FigureWidget | None = None
        self.traces: dict[tuple[str, str], list[Any]] = {}
        self._seen_steps = self._seen_restarts = self._seen_faults = 0
        self._seen_gpu = self._seen_gpu_faults = 0
        self._seen_saves: set[tuple[int, float]] = set()
        self._seen_settings: set[int] = set()
        self._per_lane: dict[str, int] = {}

    # ---- data --------------------------------------------------------------------------------
    def ingest(self, mon: JobMonitor) -> None:
        """Append what the monitor learned since the last call."""
        if self.t0 is None:
            self.t0 = mon.t_start or (mon.steps.t[0] if len(mon.steps) else None)
            if self.t0 is None:
                return
        t0, s = self.t0, mon.steps
        for i in range(self._seen_steps, len(s)):
            x = s.t[i] - t0
            if i and s.step[i] != s.step[i - 1] + 1:  # a restart rolled back or resumed: break the lines
                for name in ("tokens/s", "loss"):
                    self.series[name].append((s.t[i - 1] - t0 + x) / 2, float("nan"), s.step[i])
            if s.tokens[i] is None:
                self.unit = "steps/s"
            work = 1 if s.tokens[i] is None else s.tokens[i]
            self.series["tokens/s"].append(x, work / max(s.step_time[i], 1e-9), s.step[i])
            self.series["loss"].append(x, s.loss[i], s.step[i])
        self._seen_steps = len(s)
        saves = [c for c in mon.checkpoints.values()
                 if c.state == CheckpointState.COMMITTED and (c.step, c.t_done) not in self._seen_saves]
        for c in sorted(saves, key=lambda c: c.t_begin or c.t_done or 0.0):
            self._seen_saves.add((c.step, c.t_done))
            self.series["checkpoints"].append((c.t_begin or c.t_done or t0) - t0, c.blocked_s or 0.0,
                                              c.background_s or 0.0, c.step)
        for f in mon.faults[self._seen_faults:]:
            target = f"rank {f['rank']}" if f["rank"] is not None else f"node {f.get('node', 0)}"
            self.series["faults"].append(f["t"] - t0, "fault", f"{f['fault']} {target}")
        self._seen_faults = len(mon.faults)
        for f in mon.gpu.faults[self._seen_gpu_faults:]:
            # throttling shows in the health strip; XIDs and ECC errors beside restarts
            if f["fault"] != "throttle":
                self.series["gpu faults"].append(f["t"] - t0, "fault", fault_label(f))
        self._seen_gpu_faults = len(mon.gpu.faults)
        for seq in sorted(set(mon.settings) - self._seen_settings):
            self._seen_settings.add(seq)
            change = mon.settings[seq]
            self.series["settings"].append(change["t"] - t0, "setting", setting_label(change))
        for g in mon.gpu.since(self._seen_gpu):
            label = g["text"] if g["status"] == "none" else ""   # "no GPU" is said once, on the strip
            self.series["gpu"].append(g["t"] - t0, f"node {g['node']}", GPU_STATUS[g["status"]], label,
                                      g["text"])
        self._seen_gpu = mon.gpu.n_samples
        for r in mon.restarts[self._seen_restarts:]:
            lane = LEVEL_LANE.get(r["level"], r["level"])
            self._per_lane[lane] = self._per_lane.get(lane, 0) + 1
            # neighbours in a lane alternate
            where = "top right" if self._per_lane[lane] % 2 else "bottom right"
            self.series["restarts"].append(r["fault_time"] - t0, lane, r["downtime_s"], restart_label(r),
                                           restart_hover(r), where)
        self._seen_restarts = len(mon.restarts)

    # ---- drawing -----------------------------------------------------------------------------
    def _draw(self) -> tuple[go.Figure, list[tuple[str, str]]]:
        """A figure of everything ingested so far, and the (series, part) each of its traces draws."""
        fig = make_subplots(rows=5, cols=1, shared_xaxes=True, vertical_spacing=0.05,
                            row_heights=[0.27, 0.2, 0.2, 0.2, 0.13], subplot_titles=ROW_TITLES)
        order: list[tuple[str, str]] = []
        for name, series in self.series.items():
            for part in series.parts:
                for style, props in zip(self._styles(name, part), self._props(name, series.data(part))):
                    row = style.pop("row")
                    fig.add_trace(style.pop("cls")(**style).update(props), row=row, col=1)
                    order.append((name, part))
        # a fixed width: plotly sizes a widget before it is on the page, so it cannot fit its container
        fig.update_layout(width=WIDTH, height=800, margin=dict(l=60, r=20, t=40, b=40),
                          template="plotly_white",
                          barmode="stack", bargap=0.0, uirevision="eksft", hovermode="closest",
                          showlegend=False)
        fig.update_annotations(font_size=12)
        fig.update_yaxes(row=4, col=1, type="category", categoryorder="array", categoryarray=list(LANES),
                         range=[-0.5, len(LANES) - 0.5], fixedrange=True)
        fig.update_yaxes(row=3, col=1, rangemode="tozero")
        fig.update_yaxes(row=5, col=1, type="category", categoryorder="category ascending", fixedrange=True)
        fig.update_xaxes(row=5, col=1, title_text="seconds since the job started")
        return fig, order

    def figure(self) -> go.Figure:
        """Everything ingested so far as a plain figure, no widget (what the JupyterLab panel draws)."""
        fig, order = self._draw()
        self._set_unit(fig.layout, [t for key, t in zip(order, fig.data) if key[0] == "tokens/s"])
        return fig

    def build(self) -> FigureWidget:
        """Create the widget with everything ingested so far."""
        fig, order = self._draw()
        for series in self.series.values():
            series.take_dirty()
        self.widget = FigureWidget(fig)
        for (key, trace) in zip(order, self.widget.data):
            self.traces.setdefault(key, []).append(trace)
        self._show_unit()
        return self.widget

    def _show_unit(self) -> None:
        """Title and hover of the throughput row in the unit the steps report."""
        if self.unit == self._unit_shown:
            return
        self._unit_shown = self.unit
        self._set_unit(self.widget.layout, [t for part in self.series["tokens/s"].parts
                                            for t in self.traces[("tokens/s", part)]])

    def _set_unit(self, layout: Any, traces: list[Any]) -> None:
        if self.unit == "tok/s":   # what the styles say already
            return
        layout.annotations[0].text = f"throughput ({self.unit})"
        for trace in traces:
            trace.hovertemplate = f"step %{{customdata}}<br>%{{y:,.2f}} {self.unit}<extra></extra>"

    def push(self) -> bool:
        """Send the changed parts (one update message); False if nothing changed."""
        if self.widget is None:
            return False
        changes = [(name, part) for name,
                   series in self.series.items() for part in sorted(series.take_dirty())]
        if not changes:
            return False
        with self.widget.batch_update():
            self._show_unit()
            for name, part in changes:
                for trace, props in zip(self.traces[(name, part)],
                                        self._props(name, self.series[name].data(part))):
                    trace.update(props)
        return True

    @staticmethod
    def _styles(name: str, part: str) -> list[dict[str, Any]]:
        """Static trace attributes (type, row, colours, hover) of one part of a series."""
        color = COLORS.get(name)
        if name in ("tokens/s", "loss"):
            value = "%{y:,.0f} tok/s" if name == "tokens/s" else "loss %{y:.4f}"
            return [dict(cls=go.Scatter, row=1 if name == "tokens/s" else 2, name=name, meta=part,
                         mode="lines",
                         line=dict(color=color, width=1.5),
                         hovertemplate=f"step %{{customdata}}<br>{value}<extra></extra>")]
        if name == "checkpoints":
            return [dict(cls=go.Bar, row=3, name=lane, meta=part,
                         marker=dict(color=COLORS[lane], line=dict(width=0)),
                         hovertemplate=f"save of step %{{customdata}}: {what} %{{y:.3f}} s<extra></extra>")
                    for lane,
                    what in (("blocked", "training blocked"), ("background", "written in background"))]
        if name == "gpu":
            return [dict(cls=go.Scatter, row=5, name=name, meta=part, mode="markers+text",
                         textposition="middle right",
                         marker=dict(symbol="square", size=9),
                         textfont=dict(size=10, color=GPU_STATUS["none"]),
                         hovertemplate="%{hovertext}<extra></extra>")]
        marker = {"faults": "triangle-down", "restarts": "diamond", "gpu faults": "x",
                  "settings": "star"}[name]
        style = dict(cls=go.Scatter, row=4, name=name, meta=part, mode="markers+text",
                     marker=dict(symbol=marker, size=10, color=color), textfont=dict(size=10, color=color))
        if name == "faults":
            return [dict(style, textposition="top right", hovertemplate="injected %{text}<extra></extra>")]
        if name == "gpu faults":
            return [dict(style, textposition="top right", hovertemplate="GPU fault: %{text}<extra></extra>")]
        if name == "settings":
            return [dict(style, textposition="top right",
                         hovertemplate="live setting: %{text}<extra></extra>")]
        return [dict(style, hovertemplate="%{hovertext}<extra></extra>",
                     error_x=dict(type="data", symmetric=False, width=0, thickness=3, color=color))]

    @staticmethod
    def _props(name: str, cols: dict[str, list[Any]]) -> list[dict[str, Any]]:
        """The data attributes of one part of a series (numbers as typed arrays: sent as binary)."""
        x = _f32(cols["x"])
        if name in ("tokens/s", "loss"):
            return [dict(x=x, y=_f32(cols["y"]), customdata=_i32(cols["step"]))]
        if name == "checkpoints":
            step = _i32(cols["step"])
            return [dict(x=x, y=_f32(cols["blocked"]), customdata=step),
                    dict(x=x, y=_f32(cols["background"]), customdata=step)]
        if name in ("faults", "gpu faults", "settings"):
            return [dict(x=x, y=list(cols["lane"]), text=list(cols["text"]))]
        if name == "gpu":
            return [dict(x=x, y=list(cols["lane"]), marker=dict(color=list(cols["color"])),
                         text=list(cols["label"]),
                         hovertext=list(cols["hover"]))]
        down = _f32(cols["downtime"])
        return [dict(x=x, y=list(cols["lane"]), text=list(cols["text"]), hovertext=list(cols["hover"]),
                     textposition=list(cols["where"]),
                     error_x=dict(array=down, arrayminus=np.zeros_like(down)))]


def setting_label(r: dict[str, Any]) -> str:
    """The text next to a live setting's marker: what changed and the step every rank took it at."""
    changed = ", ".join(f"{k} {old}→{new}" for k, (old, new) in r["changes"].items()) or "no change"
    return f"{changed} @ step {r['step']}"


def restart_label(r: dict[str, Any]) -> str:
    """The text next to a restart marker: cause and downtime (its lane is the level)."""
    return f"{r['cause']} · {r['downtime_s']:.1f}s down"


def restart_hover(r: dict[str, Any]) -> str:
    blamed = "-" if r.get("blame_rank") is None else f"rank {r['blame_rank']}"
    return (f"<b>{LEVEL_LANE.get(r['level'], r['level'])} restart</b>: {r['cause']}<br>blamed: {blamed}<br>"
            f"detected after {r['detection_s']:.1f}s, down {r['downtime_s']:.1f}s<br>"
            + (f"phases: {phases_text(r['phases'])}<br>" if r.get("phases") else "")
            + f"resumed from step {r['resumed_step']}, {r['rolled_back_steps']} steps rolled back"
            + (f"<br>NVRx cycle {r['nvrx_cycle']}" if "nvrx_cycle" in r else "")
            + "".join(f"<br>{k.replace('_', ' ')}: {html.escape(str(v))}"
                      for k, v in (r.get("nvrx_nodes") or {}).items()))
