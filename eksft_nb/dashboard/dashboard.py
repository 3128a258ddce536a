"""The live dashboard of one job: header, one plotly figure, goodput, controls, checkpoints, log.

A background thread in the kernel folds new events in and refreshes the widgets at most once per
``interval`` seconds; it stops once the job has ended. Everything it shows comes from the job's
event stream and folder, so a dashboard made after a kernel restart shows the whole history.
"""

from __future__ import annotations

import html
import threading
import time
from pathlib import Path
from typing import Any

import ipywidgets as w

from .. import ckpt_floor, commands, cost, reasons, settings
from ..checkpoint_folders import CheckpointInfo, resume_origin
from ..errors import EksftError
from ..goodput import compute
from ..job import Job, Standing, attach
from ..states import FAILED_ENDS, CheckpointState
from .figure import TrainingFigure
from .parts import CheckpointTable, FaultControls, GoodputBar, Header, LogTail, SettingsControls
from .series import Throttle
from .snapshot import snapshot_svg
from .whatif_tab import WhatIfTab


class Dashboard(w.VBox):
    """Watch and steer one job. ``Dashboard(job)`` shows its history at once and then follows it live.

    ``interval``: seconds between refreshes (the throttle); ``slow_interval``: seconds between the
    costlier refreshes (goodput, checkpoint listing, log); ``tail``/``budget``: points per series
    kept in full / at most before older history is thinned; ``live=False``: no thread (call
    :meth:`update` yourself); ``price``: what the goodput bar prices GPU time at (``--price``'s words;
    default: an EKS job's instance type, else GPU-hours only).
    """

    def __init__(self, job: Job, *, interval: float = 0.5, slow_interval: float = 2.0, tail: int = 500,
                 budget: int = 3000, log_lines: int = 40, live: bool = True,
                 price: str | None = None) -> None:
        self.job = Job(job.name, job.backend)   # a handle of our own: its monitor is fed by our thread only
        self.slow_interval = slow_interval
        self._options = {"interval": interval, "slow_interval": slow_interval, "tail": tail, "budget": budget,
                         "log_lines": log_lines}
        self._lock = threading.RLock()
        self._halt = threading.Event()
        self._next_slow = 0.0
        self.throttle = Throttle(interval)
        self.updates = 0
        self.warnings_said = 0   # the job's warning events shown so far
        spec = self._spec = self.job.spec

        self.header = Header(job=job.name, backend=job.backend.name,
                             total=None if spec.script else spec.steps,
                             origin=_origin(spec.resume, None))
        self._resume = spec.resume
        self.figure = TrainingFigure(tail=tail, budget=budget)
        pricing = cost.pricing(spec, price)
        self.goodput = GoodputBar(gpus=spec.world_size, usd_per_gpu_hour=pricing.usd_per_gpu_hour,
                                  price=pricing.said)
        self.controls = FaultControls(world_size=spec.world_size, nnodes=spec.nnodes)
        self.settings = SettingsControls(values=settings.of_spec(spec))
        self.settings.layout.display = "none" if spec.script else None   # a script's own loop saves
        self.stop_button = w.Button(description="Stop job", button_style="danger",
                                    icon="stop").add_class("eksft-stop")
        self.message = w.HTML().add_class("eksft-message")
        self.checkpoints = CheckpointTable(self.resume)
        self.log_tail = LogTail(lines=log_lines)
        self.resumed = w.VBox().add_class("eksft-resumed")
        self.whatif = WhatIfTab(self.job)
        if not spec.script:   # the same Apply, beside the recommendation it applies
            self.whatif.actions.children = (self.settings.whatif,)

        self.controls.inject.on_click(self._inject_clicked)
        self.settings.set.on_click(lambda _b: self.set_settings(self.settings.changes()))
        self.settings.whatif.on_click(lambda _b: self.apply_whatif())
        self.stop_button.on_click(lambda _b: self.stop())
        self.log_tail.observe(lambda _c: self._refresh_log() if self.log_tail.is_open else None,
                              "selected_index")

        self._fold()                            # the whole history so far, before the figure exists
        figure = self.figure.build()
        figure.add_class("eksft-figure")
        self.tabs = w.Tab([figure, self.whatif], titles=["training", "what-if"]).add_class("eksft-tabs")
        self.tabs.observe(lambda _c: self._refresh_whatif(), "selected_index")
        super().__init__([self.header, self.tabs, self.goodput,
                          w.HBox([self.controls, self.stop_button], layout=w.Layout(flex_flow="row wrap")),
                          self.settings,
                          self.message, self.checkpoints, self.log_tail, self.resumed])
        self.add_class("eksft-dashboard")
        self.add_class(f"eksft-job-{job.name}")
        self.ended = False
        self._snapshot_id = f"eksft-snapshot-{self.model_id}"
        self._shell: Any = None   # the IPython shell whose cells settle this dashboard, once displayed there
        self.update()
        self._thread: threading.Thread | None = None
        if live and not self.ended:
            self._thread = threading.Thread(target=self._run, name=f"eksft-dashboard-{job.name}", daemon=True)
            self._thread.start()

    # ---- live updates --------------------------------------------------------------------------
    def _run(self) -> None:
        while not self._halt.wait(self.throttle.delay()):
            self.throttle.mark()
            try:
                if self.update():
                    return
            except Exception as e:  # the loop must survive a torn read or a vanished folder
                self._say(f"dashboard update failed: {type(e).__name__}: {e}", error=True)
                self._halt.wait(self.slow_interval)

    def _fold(self) -> Standing:
        mon = self.job.refresh()
        status = self.job.standing()
        self.figure.ingest(mon)
        return status

    def update(self) -> bool:
        """Fold in the new events and refresh what changed; True once the job has ended."""
        with self._lock:
            self.updates += 1
            standing = self._fold()
            state, detail = standing.state, standing.detail
            mon = self.job.monitor
            ended = state.ended
            self.figure.push()
            h = self.header
            row = commands.job_row(self.job, standing, self._spec)   # the CLI's and the panel's row
            h.state, h.step, h.total = row["state"], row["step"], row["total_steps"]
            h.detail, h.detail_kind = reasons.line(row), reasons.kind(row)
            h.restarts, h.last_checkpoint, h.goodput = row["restarts"], row["last_checkpoint"], row["goodput"]
            if len(mon.warnings) > self.warnings_said:   # the newest warning, in one line
                self.warnings_said = len(mon.warnings)
                self._say(f"warning: {mon.warnings[-1]['message']}")
            if mon.settings:   # the newest change every rank took
                self.settings.values = mon.settings[max(mon.settings)]["values"]
            if mon.resumes:  # where it did start, with each checkpoint refused before that one
                h.origin = _origin(self._resume, mon.resumes[0])
            now = time.monotonic()
            if ended or now >= self._next_slow:
                self._next_slow = now + self.slow_interval
                self.goodput.seconds = compute(mon).seconds()
                self._refresh_checkpoints()
                if self.log_tail.is_open or ended:
                    self._refresh_log()
                self._refresh_whatif()
            if ended:
                self.ended = True
                self.controls.inject.disabled = self.stop_button.disabled = True
                self.settings.set.disabled = self.settings.whatif.disabled = True
                if state in FAILED_ENDS:
                    self._say(f"{self.job.name} {state}: {detail or mon.reason}", error=True)
                elif mon.drain is not None:
                    self._say(f"{self.job.name} {state}: {mon.reason}")
            return ended

    def _refresh_checkpoints(self) -> None:
        records = self.job.monitor.checkpoints
        try:
            infos = self.job.checkpoints()
        except EksftError as e:  # e.g. an EKS job whose pods are gone: what its events said was committed
            done = sorted((r for r in records.values() if r.state == CheckpointState.COMMITTED),
                          key=lambda r: r.step)
            infos = [CheckpointInfo(r.step, Path(r.path or ""), r.state, r.bytes or 0, r.t_done,
                                    reason=e.problem)
                     for r in done]
        rows = []
        for info in infos:
            rec = records.get(info.step)
            timed = rec is not None and rec.state == CheckpointState.COMMITTED
            rows.append({"step": info.step, "state": info.state, "mib": info.bytes / 2**20, "time": info.time,
                         "blocked": rec.blocked_s if timed else None,
                         "background": rec.background_s if timed else None,
                         "note": info.reason})
        self.checkpoints.rows = rows
        floor = ckpt_floor.floor(self.job.monitor, self._spec.world_size)
        self.checkpoints.floor = "; ".join(x.strip() for x in ckpt_floor.floor_text(floor)) if floor else ""

    def _refresh_whatif(self) -> None:
        if self.tabs.selected_index == 1:
            self.whatif.refresh()

    def _refresh_log(self) -> None:
        self.log_tail.text = self.job.logs(lines=self.log_tail.lines)

    def close(self) -> None:
        """Stop following the job (the job itself keeps running) and close the widgets."""
        self._halt.set()
        self._stop_settling()
        _close_tree(self)

    # ---- saved notebooks -----------------------------------------------------------------------
    def _ipython_display_(self) -> None:
        """The live widget, and after it a static copy of its figure (see snapshot) that each cell's end
        redraws: a notebook saved or converted then shows the figure where no widget can run."""
        from IPython import get_ipython
        from IPython.display import display

        display(self._repr_mimebundle_(), raw=True)
        display(self.snapshot(), raw=True, display_id=self._snapshot_id)
        shell = get_ipython()
        if shell is not None and self._shell is None:
            self._shell = shell
            shell.events.register("post_run_cell", self._settle)

    def snapshot(self) -> dict[str, str]:
        """The figure as a static SVG (and its caption as text), captioned with the job and its step."""
        h = self.header
        caption = (f"{self.job.name}: {h.state}, step {h.step if h.step is not None else '-'} (a "
                   "static copy of"
                   " the dashboard's figure; to see it live, run the cell or trust the notebook)")
        return {"image/svg+xml": snapshot_svg(self.figure, caption), "text/plain": caption}

    def _settle(self, _result: Any = None) -> None:
        """At a cell's end (its messages still reach the kernel's client, nbclient's included): fold in
        what happened, make the figure's saved state the figure as it is, and redraw the static copy.
        Once the job has ended and that is done, cells stop doing it."""
        from IPython.display import update_display

        try:
            with self._lock:
                ended = self.update()
                self.figure.widget.settle()
                update_display(self.snapshot(), raw=True, display_id=self._snapshot_id)
        except Exception as e:  # a torn read must not fail the user's cell
            self._say(f"dashboard update failed: {type(e).__name__}: {e}", error=True)
            return
        if ended:
            self._stop_settling()

    def _stop_settling(self) -> None:
        if self._shell is not None:
            self._shell.events.unregister("post_run_cell", self._settle)
            self._shell = None

    # ---- controls ------------------------------------------------------------------------------
    def _inject_clicked(self, _button: Any) -> None:
        try:
            kwargs = self.controls.command()
        except EksftError as e:
            self._say(str(e), error=True)
            return
        self.inject(**kwargs)

    def inject(self, fault: str, *, rank: int | None = None, step: int | None = None,
               after: float | None = None,
               node: int = 0, **params: Any) -> None:
        """Inject a fault into the job (what the Inject button does); the outcome shows in the message line,
        the command layer's line (the CLI's and the panel's)."""
        try:
            said = commands.inject(self.job.name, fault, rank=rank, step=step, after=after, node=node,
                                   params=params,
                                   backend=self.job.backend.name)["message"]
        except EksftError as e:
            self._say(str(e), error=True)
            return
        self._say(said)

    def set_settings(self, values: dict[str, int]) -> None:
        """Change live settings (what Set does); the figure marks the step every rank takes them at."""
        if not values:
            self._say("nothing to set: change a value first")
            return
        backend = self.job.backend.name
        self._in_background(lambda: commands.set_settings(self.job.name, values, backend=backend))

    def apply_whatif(self) -> None:
        """Set the checkpoint interval the what-if recommends from the job's own failures (Apply what-if)."""
        self._in_background(lambda: commands.apply_whatif(self.job.name, backend=self.job.backend.name))

    def _in_background(self, change: Any) -> None:
        """Run a settings command off the kernel's thread; its line (or refusal) goes to the message line."""
        def run() -> None:
            try:
                self._say(change()["message"])
            except EksftError as e:
                self._say(str(e), error=True)

        threading.Thread(target=run, daemon=True).start()

    def resume(self, step: int) -> Dashboard | None:
        """Start a new job from the checkpoint at ``step`` and show its dashboard below this one."""
        backend = self.job.backend.name
        try:
            row = commands.resume(self.job.name, step=step, backend=backend)
        except EksftError as e:
            self._say(str(e), error=True)
            return None
        child = Dashboard(attach(row["name"], backend), **self._options)
        old, self.resumed.children = self.resumed.children, (child,)
        for dash in old:
            dash.close()
        self._say(row["message"])
        return child

    def stop(self) -> None:
        """Stop the job (in the background: stopping takes a few seconds)."""
        self.stop_button.disabled = True
        self._say(f"stopping {self.job.name}…")

        def run() -> None:
            try:
                said = commands.stop(self.job.name, self.job.backend.name)["message"]
            except EksftError as e:
                self._say(str(e), error=True)
                self.stop_button.disabled = False
                return
            self._say(said)

        threading.Thread(target=run, daemon=True).start()

    def _say(self, text: str, error: bool = False) -> None:
        with self._lock:
            color = "#d62728" if error else "#333"
            self.message.value = f"<span style='color:{color};font-size:13px'>{html.escape(text)}</span>"


def _close_tree(widget: w.Widget) -> None:
    """Close a widget and everything inside it (closing a box alone leaves its children open)."""
    for child in getattr(widget, "children", ()):
        if isinstance(child, Dashboard):
            child.close()  # also stops its thread
        else:
            _close_tree(child)
    w.Widget.close(widget)


def _origin(resume: str, first: dict[str, Any] | None) -> str:
    """'resumed from JOB step N' for a job started from another job's checkpoints (with each refused
    before it), else ''."""
    origin = resume_origin(resume, first)
    return f"resumed {origin}" if origin else ""
