"""The dashboard's figure as a static SVG, shown beside the live widget.

A notebook converted (``jupyter nbconvert --to html``) or viewed where no widget runs (a static page, a
repository's preview, a machine with no network for the widget manager's script) has no live figure: this
copy (an ``image/svg+xml`` output) shows the same five rows with no JavaScript at all. JupyterLab hides it
where it draws the live dashboard above it (nbext/style/index.css); an untrusted notebook shows its caption.
"""

from __future__ import annotations

import html
import math
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .figure import TrainingFigure

WIDTH, LEFT, RIGHT, CAPTION, TITLE = 840, 60, 20, 24, 18
ROWS = (150, 100, 100, 110, 70)   # plot heights, top to bottom (the live figure's row proportions)
GAP = 30                          # below each row: its x labels or the next row's title
MARKERS = {"faults": "M-5,-4h10l-5,8z", "gpu faults": "M-4,-4l8,8m0,-8l-8,8",
           "restarts": "M0,-5l5,5l-5,5l-5,-5z",
           "gpu": "M-4,-4h8v8h-8z"}


def snapshot_svg(fig: TrainingFigure, caption: str) -> str:
    """The figure's series as one ``<svg class="eksft-snapshot">`` (a ``<path class="eksft-trace">`` per
    drawn series), with ``caption`` above the rows."""
    from .figure import COLORS, LANES, ROW_TITLES

    cols = {name: _points(s) for name, s in fig.series.items()}
    xmax = max([1.0] + [_finite_max(c["x"]) for c in cols.values()])
    top = CAPTION
    height = top + sum(TITLE + h + GAP for h in ROWS)
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" class="eksft-snapshot" width="{WIDTH}" '
           f'height="{height}" '
           f'viewBox="0 0 {WIDTH} {height}" font-family="sans-serif" font-size="10">',
           f'<rect width="{WIDTH}" height="{height}" fill="white"/>',
           f'<text x="{LEFT}" y="14" font-size="12" fill="#555">{html.escape(caption)}</text>']
    titles = list(ROW_TITLES)
    if fig.unit != "tok/s":
        titles[0] = f"throughput ({fig.unit})"
    for row, (h, title) in enumerate(zip(ROWS, titles)):
        top += TITLE
        box = _Box(top, h, xmax)
        out.append(f'<text x="{LEFT}" y="{top - 5}" font-size="12">{html.escape(title)}</text>')
        out.append(f'<rect x="{LEFT}" y="{top}" width="{box.w}" height="{h}" fill="none" stroke="#ccc"/>')
        out += _x_ticks(box, labels=row == len(ROWS) - 1)
        if row < 2:
            name = ("tokens/s", "loss")[row]
            box.scale_y(cols[name]["y"])
            out += _y_ticks(box) + [_line(box, name, cols[name], COLORS[name])]
        elif row == 2:
            c = cols["checkpoints"]
            box.scale_y([0.0] + [b + g for b, g in zip(c["blocked"], c["background"])])
            out += _y_ticks(box) + _bars(box, c, COLORS)
        elif row == 3:
            box.lanes(LANES)
            out += _lane_labels(box, LANES)
            for name in ("faults", "gpu faults", "restarts"):
                out.append(_markers(box, name, cols[name], COLORS[name]))
        else:
            lanes = sorted(set(cols["gpu"]["lane"])) or ["node 0"]
            box.lanes(lanes)
            out += _lane_labels(box, lanes) + [_markers(box, "gpu", cols["gpu"], "#bbb")]
        top += h + GAP
    out.append(f'<text x="{LEFT + (WIDTH - LEFT - RIGHT) / 2}" y="{height - 4}" text-anchor="middle">'
               'seconds since the job started</text></svg>')
    return "".join(out)


class _Box:
    """One row's plot area: data coordinates to pixels."""

    def __init__(self, top: float, h: float, xmax: float) -> None:
        self.top, self.h, self.xmax, self.w = top, h, xmax, WIDTH - LEFT - RIGHT
        self.lo, self.hi = 0.0, 1.0
        self.categories: dict[str, int] = {}

    def scale_y(self, values: Iterable[float]) -> None:
        finite = [v for v in values if v is not None and math.isfinite(v)]
        lo, hi = (min(finite), max(finite)) if finite else (0.0, 1.0)
        pad = (hi - lo) * 0.05 or max(abs(hi) * 0.05, 1e-9)
        self.lo, self.hi = lo - pad, hi + pad

    def lanes(self, names: Sequence[str]) -> None:
        self.categories = {n: i for i, n in enumerate(names)}
        self.lo, self.hi = -0.5, len(names) - 0.5

    def px(self, x: float) -> float:
        return LEFT + self.w * x / self.xmax

    def py(self, y: Any) -> float:
        v = self.categories.get(y, 0) if self.categories else y
        return self.top + self.h * (1 - (v - self.lo) / (self.hi - self.lo))


def _points(series: Any) -> dict[str, list[Any]]:
    """A series' whole history and tail, in time order."""
    hist = series.history
    return {c: hist[c] + series.tail[c] for c in series.columns}


def _finite_max(values: list[float]) -> float:
    return max((v for v in values if math.isfinite(v)), default=0.0)


def _nice_ticks(lo: float, hi: float, n: int = 5) -> list[float]:
    span = hi - lo
    if span <= 0:
        return [lo]
    raw = span / n
    step = min((m * 10 ** math.floor(math.log10(raw)) for m in (1, 2, 5, 10)), key=lambda s: abs(s - raw))
    first = math.ceil(lo / step) * step
    return [first + i * step for i in range(int((hi - first) / step) + 1)]


def _fmt(v: float) -> str:
    return f"{v:,.0f}" if abs(v) >= 100 else f"{v:.3g}"


def _x_ticks(box: _Box, labels: bool) -> list[str]:
    out = []
    for t in _nice_ticks(0.0, box.xmax):
        x = round(box.px(t), 1)
        out.append(f'<line x1="{x}" x2="{x}" y1="{box.top}" y2="{box.top + box.h}" stroke="#eee"/>')
        if labels:
            out.append(f'<text x="{x}" y="{box.top + box.h + 12}" text-anchor="middle">{_fmt(t)}</text>')
    return out


def _y_ticks(box: _Box) -> list[str]:
    return [f'<text x="{LEFT - 4}" y="{round(box.py(t), 1) + 3}" text-anchor="end">{_fmt(t)}</text>'
            for t in _nice_ticks(box.lo, box.hi, 3)]


def _lane_labels(box: _Box, lanes: Sequence[str]) -> list[str]:
    return [f'<text x="{LEFT - 4}" y="{round(box.py(n), 1) + 3}" text-anchor="end">{html.escape(n)}</text>'
            for n in lanes]


def _line(box: _Box, name: str, c: dict[str, list[Any]], color: str) -> str:
    """A polyline, broken where y is NaN (a restart's rollback)."""
    d, pen = [], "M"
    for x, y in zip(c["x"], c["y"]):
        if y is None or not math.isfinite(y):
            pen = "M"
            continue
        d.append(f"{pen}{box.px(x):.1f},{box.py(y):.1f}")
        pen = "L"
    return f'<path class="eksft-trace" data-name="{name}" d="{"".join(d)}" fill="none" stroke="{color}"/>'


def _bars(box: _Box, c: dict[str, list[Any]], colors: dict[str, str]) -> list[str]:
    """The saves, blocked (below) and in the background (stacked above), 3 px wide."""
    base = box.py(0.0)
    out = []
    for lane in ("blocked", "background"):
        d = []
        for x, blocked, background in zip(c["x"], c["blocked"], c["background"]):
            lo = 0.0 if lane == "blocked" else blocked
            y0, y1 = box.py(lo), box.py(lo + (blocked if lane == "blocked" else background))
            d.append(f"M{box.px(x) - 1.5:.1f},{min(y0, base):.1f}V{y1:.1f}h3V{y0:.1f}z")
        out.append(f'<path class="eksft-trace" data-name="{lane}" d="{"".join(d)}" fill="{colors[lane]}"/>')
    return out


def _markers(box: _Box, name: str, c: dict[str, list[Any]], color: str) -> str:
    """One marker per point (and a restart's downtime as a bar to its right); labels beside them."""
    shape, d, labels = MARKERS[name], [], []
    colors = c.get("color") or [color] * len(c["x"])
    for i, (x, lane) in enumerate(zip(c["x"], c["lane"])):
        px, py = box.px(x), box.py(lane)
        d.append(f"M{px:.1f},{py:.1f}m{shape[1:]}")
        if name == "restarts":
            d.append(f"M{px:.1f},{py:.1f}H{box.px(x + c['downtime'][i]):.1f}")
        if name == "gpu":
            labels.append(f'<path d="M{px:.1f},{py:.1f}m{shape[1:]}" fill="{colors[i]}"/>')
        text = c.get("text") or c.get("label")
        if text and text[i]:
            labels.append(f'<text x="{px + 7:.1f}" y="{py - 6:.1f}" '
                          f'fill="{color}">{html.escape(str(text[i]))}</text>')
    fill = "none" if name == "gpu" else color
    return (f'<path class="eksft-trace" data-name="{name}" d="{"".join(d)}" fill="{fill}" stroke="{color}" '
            f'stroke-width="{3 if name == "restarts" else 1}"/>' + "".join(labels))
