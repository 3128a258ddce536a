"""The dashboard's small widgets. Each renders its traitlets; setting a trait to the value it
already has sends nothing, so the live loop can assign every tick. CSS classes (``eksft-*``)
let a browser test find each piece."""

from __future__ import annotations

import html
import time
from collections.abc import Callable
from typing import Any

import ipywidgets as w
from traitlets import Dict, Float, Int, List, Unicode, observe

from .. import cost, reasons
from ..control import FAULTS, WHEN_FIX, parse_when
from ..errors import ControlError
from ..goodput import CATEGORIES
from ..settings import LIVE, MAX_VALUE
from ..states import CheckpointState, FaultScope, JobState, RestartLevel

STATE_COLORS = {JobState.RUNNING: "#2ca02c", JobState.RECOVERING: "#ff7f0e", JobState.SUCCEEDED: "#1f77b4",
                JobState.FAILED: "#d62728", JobState.LOST: "#d62728", JobState.STOPPED: "#7f7f7f",
                JobState.STARTING: "#7f7f7f"}
GOODPUT_COLORS = {"productive": "#2ca02c", "checkpoint_stall": "#d62728",
                  "checkpoint_interference": "#ff9896", "restart_downtime": "#9467bd",
                  "recomputed": "#ff7f0e", "skipped": "#ffbb78", "startup": "#bcbd22", "other": "#c7c7c7"}
LEVEL_NAMES = {level.value: level.label for level in RestartLevel}


class Header(w.VBox):
    """Name, backend and state; a step progress bar; restarts by level, last committed checkpoint, goodput."""

    job = Unicode()
    backend = Unicode()
    origin = Unicode()                       # "resumed from <job> step N", or ""
    state = Unicode("pending")
    # the line beside the job (eksft_nb.reasons): why it failed, what it waits for and since when ("queued:
    # ...", "admitted"), the backend's note on a running job
    detail = Unicode("")
    detail_kind = Unicode("")                # reasons.ERROR, WAITING, NOTE
    step = Int(0)
    total = Int(1, allow_none=True)          # None: a user script's own loop (no known end)
    restarts = Dict()
    last_checkpoint = Int(None, allow_none=True)
    goodput = Float(None, allow_none=True)

    def __init__(self, **kwargs: Any) -> None:
        self._title = w.HTML().add_class("eksft-title")
        self._progress = w.IntProgress(min=0, layout=w.Layout(width="260px")).add_class("eksft-progress")
        self._step = w.HTML().add_class("eksft-step")
        self._facts = w.HTML().add_class("eksft-facts")
        row = w.HBox([self._progress, self._step, self._facts],
                     layout=w.Layout(align_items="center", flex_flow="row wrap", grid_gap="0 16px"))
        super().__init__([self._title, row], **kwargs)
        self.add_class("eksft-header")
        self._render()

    @observe("job", "backend", "origin", "state", "detail", "detail_kind", "step", "total", "restarts",
             "last_checkpoint", "goodput")
    def _render(self, _change: Any = None) -> None:
        color = STATE_COLORS.get(self.state, "#7f7f7f")
        origin = f" · <i>{html.escape(self.origin)}</i>" if self.origin else ""
        if self.detail:
            red = " style='color:#d62728'" if self.detail_kind == reasons.ERROR else ""
            origin += (f" · <span class='eksft-detail' data-kind='{html.escape(self.detail_kind)}'{red}>"
                       f"{html.escape(self.detail)}</span>")
        self._title.value = (f"<b style='font-size:15px'>{html.escape(self.job)}</b> · "
                             f"{html.escape(self.backend)}"
                             " · <span class='eksft-state' "
                             f"style='color:white;background:{color};padding:1px 7px;"
                             f"border-radius:8px'>{html.escape(self.state)}</span>{origin}")
        self._progress.layout.display = "none" if self.total is None else None
        self._progress.max = max(self.total or 1, 1)
        self._progress.value = min(self.step, self._progress.max)
        total = " (optimizer steps)" if self.total is None else f" / {self.total}"
        self._step.value = f"<span style='white-space:nowrap'>step <b>{self.step}</b>{total}</span>"
        restarts = " · ".join(f"{LEVEL_NAMES.get(k, k)} {v}" for k, v in self.restarts.items()) or "none"
        ckpt = "-" if self.last_checkpoint is None else f"step {self.last_checkpoint}"
        goodput = "-" if self.goodput is None else f"{100 * self.goodput:.1f}%"
        self._facts.value = ("<span style='white-space:nowrap'>restarts: <span "
                             f"class='eksft-restarts'>{restarts}"
                             "</span></span> &nbsp;|&nbsp; <span style='white-space:nowrap'>last checkpoint: "
                             f"<span class='eksft-last-ckpt'>{ckpt}</span></span> &nbsp;|&nbsp; "
                             "<span style='white-space:nowrap'>goodput: <span "
                             f"class='eksft-goodput'>{goodput}</span></span>")


class GoodputBar(w.HTML):
    """Where the wall time went, as one stacked bar with a legend (see :mod:`eksft_nb.goodput`), and what
    it cost: each term's GPU-hours on the job's ``gpus`` (one per rank) in its tooltip, and a line with what
    the faults and checkpoints cost (dollars where the dashboard has a price, see :mod:`eksft_nb.cost`)."""

    seconds = Dict()
    gpus = Int(1)
    usd_per_gpu_hour = Float(None, allow_none=True)
    price = Unicode("")     # where the price came from, as the line says it

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.add_class("eksft-goodput-bar")
        self._render()

    @observe("seconds", "gpus", "usd_per_gpu_hour", "price")
    def _render(self, _change: Any = None) -> None:
        total = sum(self.seconds.values())
        pricing = cost.Pricing(self.usd_per_gpu_hour, self.price)
        if total <= 0:
            self.value = "<div style='color:#777'>goodput: waiting for the first step</div>"
            return
        bar, legend = [], []
        for cat in CATEGORIES:
            sec = self.seconds.get(cat, 0.0)
            pct = 100 * sec / total
            label = cat.replace("_", " ")
            spent = cost.text(pricing.cost(sec, self.gpus))
            bar.append(f"<div title='{label}: {sec:.1f}s ({pct:.1f}%), {spent}' style='width:{pct:.3f}%;"
                       f"background:{GOODPUT_COLORS[cat]}'></div>")
            legend.append(f"<span class='eksft-gp-{cat}'><span style='color:{GOODPUT_COLORS[cat]}'>■</span> "
                          f"{label} {sec:.1f}s ({pct:.0f}%)</span>")
        a = cost.account(self.seconds, 0, self.gpus, 1, pricing)
        price = html.escape(self.price) if self.price else "GPU-hours only: no price"
        spent = (f"<div class='eksft-gp-cost' style='font-size:12px;margin-top:2px'><b>cost</b> "
                 f"{cost.text(a['wall'])} on {self.gpus} GPU(s): lost {cost.text(a['lost'])} (faults "
                 f"{cost.text(a['faults'])}, checkpoints {cost.text(a['checkpoints'])}) "
                 f"<span style='color:#777'>({price})</span></div>")
        self.value = ("<div style='font-size:12px'><b>wall time</b> " + f"{total:.1f}s:&nbsp; "
                      + " &nbsp;".join(legend)
                      + "</div><div style='display:flex;height:12px;border-radius:3px;overflow:hidden;"
                      "margin-top:3px'>" + "".join(bar) + "</div>" + spent)


class FaultControls(w.HBox):
    """Fault type, target (rank, or node for node faults), when (``now`` or a step) and Inject."""

    world_size = Int(1)
    nnodes = Int(1)

    def __init__(self, **kwargs: Any) -> None:
        short = {"description_width": "initial"}
        self.fault = w.Dropdown(options=list(FAULTS), value="exception", description="fault", style=short,
                                layout=w.Layout(width="210px")).add_class("eksft-fault")
        self.target = w.Dropdown(description="rank", style=short,
                                 layout=w.Layout(width="100px")).add_class("eksft-rank")
        self.when = w.Text(value="now", description="when", placeholder="now, a step, or 30s", style=short,
                           layout=w.Layout(width="150px")).add_class("eksft-when")
        self.inject = w.Button(description="Inject", button_style="warning",
                               icon="bolt").add_class("eksft-inject")
        super().__init__([self.fault, self.target, self.when, self.inject], **kwargs)
        self.add_class("eksft-controls")
        self.fault.observe(self._retarget, "value")
        self._retarget()

    @observe("world_size", "nnodes")
    def _retarget(self, _change: Any = None) -> None:
        node = FAULTS[self.fault.value][0] == FaultScope.NODE
        self.fault.tooltip = FAULTS[self.fault.value][1]
        self.target.description = "node" if node else "rank"
        self.target.options = [(str(i), i) for i in range(self.nnodes if node else self.world_size)]
        self.target.value = 0

    def command(self) -> dict[str, Any]:
        """Keyword arguments for :meth:`Job.inject` from the current choices."""
        try:
            step, after = parse_when(self.when.value)
        except ValueError:
            raise ControlError(f"cannot read when={self.when.value!r}", WHEN_FIX) from None
        fault = self.fault.value
        if FAULTS[fault][0] == FaultScope.NODE:
            return {"fault": fault, "node": self.target.value, "step": step, "after": after}
        return {"fault": fault, "rank": self.target.value, "step": step, "after": after}


class SettingsControls(w.HBox):
    """The live settings (see :mod:`eksft_nb.settings`): one box per setting, Set, and Apply what-if
    (the recommended checkpoint interval, replayed from the job's own failures)."""

    values = Dict()   # the settings in force: name -> value

    def __init__(self, **kwargs: Any) -> None:
        short = {"description_width": "initial"}
        self.boxes = {name: w.BoundedIntText(min=live.low, max=MAX_VALUE, description=name, tooltip=live.help,
                                             style=short, layout=w.Layout(width="150px"))
                      for name, live in LIVE.items()}
        for name, box in self.boxes.items():
            box.add_class(f"eksft-{name}")
        self.set = w.Button(description="Set", icon="sliders", tooltip="every rank takes it at the same step"
                            ).add_class("eksft-set")
        self.whatif = w.Button(description="Apply what-if", icon="magic", layout=w.Layout(width="140px"),
                               tooltip="set the checkpoint interval the what-if recommends")
        self.whatif.add_class("eksft-apply")
        super().__init__([*self.boxes.values(), self.set, self.whatif], **kwargs)
        self.add_class("eksft-settings")

    @observe("values")
    def _render(self, change: Any) -> None:
        """Show a newly taken value; a box the user is editing keeps the text unless it changed under it."""
        for name, value in self.values.items():
            if name in self.boxes and (change["old"] or {}).get(name) != value:
                self.boxes[name].value = value

    def changes(self) -> dict[str, int]:
        """The boxes that differ from what is in force."""
        return {name: box.value for name, box in self.boxes.items() if box.value != self.values.get(name)}


class CheckpointTable(w.VBox):
    """One row per checkpoint on disk, newest first, with Resume-from-here on the committed ones.

    The row widgets are made once and reused (``max_rows`` of them), so a long job that saves
    thousands of times creates no new widgets."""

    rows = List()            # dicts: step, state, mib, time, blocked, background, note
    floor = Unicode("")      # the saves against their physical floor (see eksft_nb.ckpt_floor), one line

    def __init__(self, on_resume: Callable[[int], None], max_rows: int = 20, **kwargs: Any) -> None:
        self.on_resume = on_resume
        self._slots = [_CheckpointRow(self._clicked) for _ in range(max_rows)]
        self._more = w.HTML()
        head = w.HTML("<div style='font-size:12px;color:#555'><b>checkpoints</b> (newest first; a job "
                      "resumed from one starts at the step after it)</div>")
        self._floor = w.HTML().add_class("eksft-ckpt-floor")
        super().__init__([head, self._floor, *self._slots, self._more], **kwargs)
        self.add_class("eksft-ckpt-table")
        self._render()

    def _clicked(self, step: int) -> None:
        self.on_resume(step)

    @observe("rows", "floor")
    def _render(self, _change: Any = None) -> None:
        self._floor.value = (f"<div style='font-size:12px;color:#555'>{html.escape(self.floor)}</div>"
                             if self.floor else "")
        shown = sorted(self.rows, key=lambda r: -r["step"])[: len(self._slots)]
        for slot, row in zip(self._slots, shown + [None] * (len(self._slots) - len(shown))):
            slot.show(row)
        hidden = len(self.rows) - len(shown)
        self._more.value = (f"<i style='font-size:12px'>and {hidden} older</i>" if hidden else
                            "" if self.rows else "<i style='font-size:12px;color:#777'>none yet</i>")


class _CheckpointRow(w.HBox):
    def __init__(self, on_click: Callable[[int], None]) -> None:
        self.step: int | None = None
        self.button = w.Button(description="Resume from here", icon="play",
                               layout=w.Layout(width="170px", height="26px")).add_class("eksft-resume")
        self.button.on_click(lambda _b: on_click(self.step) if self.step is not None else None)
        self.text = w.HTML()
        super().__init__([self.button, self.text], layout=w.Layout(align_items="center", display="none"))
        self.add_class("eksft-ckpt-row")

    def show(self, r: dict[str, Any] | None) -> None:
        if r is None:
            self.layout.display, self.step = "none", None
            return
        if self.step != r["step"]:
            if self.step is not None:
                self.button.remove_class(f"eksft-resume-{self.step}")
            self.button.add_class(f"eksft-resume-{r['step']}")
        self.step = r["step"]
        self.layout.display = "flex"
        self.button.layout.visibility = "visible" if r["state"] == CheckpointState.COMMITTED else "hidden"
        cell = "padding:0 10px 0 0"
        when = time.strftime("%H:%M:%S", time.localtime(r["time"])) if r.get("time") else "-"
        timing = ("" if r.get("blocked") is None else
                  f"blocked {r['blocked']:.3f}s, background {r.get('background') or 0.0:.3f}s")
        color = {CheckpointState.COMMITTED: "#2ca02c",
                 CheckpointState.REJECTED: "#d62728"}.get(r["state"], "#7f7f7f")
        self.text.value = (f"<span style='font-family:monospace;font-size:12px'><span style='{cell}'>step "
                           f"<b>{r['step']}</b></span><span style='{cell};color:{color}'>{r['state']}</span>"
                           f"<span style='{cell}'>{r['mib']:.2f} MiB</span><span style='{cell}'>{when}</span>"
                           f"<span style='{cell}'>{timing}</span><span style='color:#d62728'>"
                           f"{html.escape(r.get('note') or '')}</span></span>")


class LogTail(w.Accordion):
    """The last lines of the job's log, folded away until opened."""

    text = Unicode()
    lines = Int(40)

    def __init__(self, lines: int = 40) -> None:
        self._pre = w.HTML()
        super().__init__([self._pre], selected_index=None)
        self.add_class("eksft-logs")
        self.lines = lines
        self._render()

    @property
    def is_open(self) -> bool:
        return self.selected_index == 0

    @observe("text", "lines")
    def _render(self, _change: Any = None) -> None:
        kept = [line[:300] for line in self.text.splitlines()[-self.lines:]]
        self.set_title(0, f"log (last {len(kept)} lines)")
        self._pre.value = (
            "<pre style='font-size:11px;line-height:1.25;max-height:320px;overflow:auto;margin:0'>"
                           + html.escape("\n".join(kept)) + "</pre>")
