"""Goodput: where a job's wall time went, from its events.

- productive: the last execution of every step (the work that survives in the final model)
- recomputed: earlier executions of steps that a restart rolled back (lost work)
- checkpoint stall: time the training loop was blocked by saves
- restart downtime: from each fault to the first step after recovery
- startup: from job start to the first step
- other: the rest (step boundaries, telemetry, waiting)
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

from .monitor import JobMonitor
from .states import JobState

CATEGORIES = ("productive", "checkpoint_stall", "restart_downtime", "recomputed", "startup", "other")


@dataclass
class Goodput:
    wall_s: float
    productive_s: float
    checkpoint_stall_s: float
    restart_downtime_s: float
    recomputed_s: float
    startup_s: float
    other_s: float

    @property
    def goodput(self) -> float:
        """Fraction of wall time that was productive training."""
        return self.productive_s / self.wall_s if self.wall_s > 0 else 0.0

    def seconds(self) -> dict[str, float]:
        return {c: getattr(self, f"{c}_s") for c in CATEGORIES}

    def percentages(self) -> dict[str, float]:
        return {c: (100.0 * s / self.wall_s if self.wall_s > 0 else 0.0) for c, s in self.seconds().items()}

    def to_dict(self) -> dict[str, float]:
        return {**asdict(self), "goodput": self.goodput}

    def table(self) -> str:
        pct = self.percentages()
        rows = [f"  {c.replace('_', ' '):<18}{s:9.1f} s {pct[c]:6.1f} %" for c, s in self.seconds().items()]
        return "\n".join([f"  {'wall time':<18}{self.wall_s:9.1f} s", *rows])


def compute(mon: JobMonitor, now: float | None = None) -> Goodput:
    if mon.t_start is None:
        return Goodput(0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0)
    end = mon.t_end or now or time.time()
    wall = max(0.0, end - mon.t_start)
    s = mon.steps
    last_execution = {step: i for i, step in enumerate(s.step)}
    productive = sum(s.step_time[i] for i in last_execution.values())
    recomputed = sum(s.step_time) - productive
    downtime = sum(r["downtime_s"] for r in mon.restarts)
    if mon.state == JobState.RECOVERING and mon.failures and not mon.finished:
        downtime += max(0.0, end - mon.failures[-1]["fault_time"])
    # start-up ends at the first step, or at the first fault if one came before any step
    ends = [s.t[0] - s.step_time[0]] if len(s) else [end]
    ends += [f["fault_time"] for f in mon.failures[:1]]
    startup = min(wall, max(0.0, min(ends) - mon.t_start))
    stall = mon.checkpoint_stall_s
    other = max(0.0, wall - productive - recomputed - downtime - startup - stall)
    return Goodput(wall, productive, stall, downtime, recomputed, startup, other)
