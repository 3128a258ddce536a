"""Goodput: where a job's wall time went, from its events.

- productive: the last execution of every step (the work that survives in the final model), at
  most the job's clean step time for a step that overlapped a background (async) save
- checkpoint interference: what such steps took beyond the clean step time (the writer competing
  for the machine), so async saves cannot pass a slowdown off as productive time
- recomputed: earlier executions of steps that a restart rolled back (lost work)
- skipped: the share of kept steps whose batches the model never saw (:func:`missing_batches`: a torchft
  step committed without some replica groups' batches), out of productive: lost, as recomputed steps are
- checkpoint stall: time the training loop was blocked by saves
- restart downtime: from each fault to the first step after recovery
- startup: from job start to the first step
- other: the rest (step boundaries, telemetry, waiting)

The breakdown is a share of time; :func:`ettr` is the figure to compare runs by: useful steps per
wall second against a fault-free run of the same job (the effective-training-time ratio).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

import numpy as np

from .monitor import JobMonitor
from .states import JobState

CATEGORIES = ("productive", "checkpoint_stall", "checkpoint_interference", "restart_downtime", "recomputed",
              "skipped", "startup", "other")


@dataclass
class Goodput:
    wall_s: float
    productive_s: float
    checkpoint_stall_s: float
    checkpoint_interference_s: float
    restart_downtime_s: float
    recomputed_s: float
    skipped_s: float
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
        rows = [f"  {c.replace('_', ' '):<24}{s:9.1f} s {pct[c]:6.1f} %" for c, s in self.seconds().items()]
        return "\n".join([f"  {'wall time':<24}{self.wall_s:9.1f} s", *rows])


def compute(mon: JobMonitor, now: float | None = None) -> Goodput:
    if mon.t_start is None:
        return Goodput(0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0)
    end, wall = _window(mon, now)
    s = mon.steps
    last_execution = {step: i for i, step in enumerate(s.step)}
    # a step ended at its event's time and began after the job did: a longer step time is forged
    took = np.minimum(np.asarray(s.step_time, dtype=np.float64),
                      np.maximum(0.0, np.asarray(s.t, dtype=np.float64) - mon.t_start))
    if len(last_execution) == len(s):  # no step ran twice
        idx = np.arange(len(s))
        recomputed = 0.0
    else:
        idx = np.sort(np.fromiter(last_execution.values(), np.int64, len(last_execution)))
        recomputed = float(took.sum() - took[idx].sum())
    kept = float(took.sum()) - recomputed
    interference = _interference(mon, idx, took, end)
    productive = kept - interference
    # a missing batch is one rank's share of a step: that share of a typical kept step
    typical = float(np.median(took[idx])) if len(idx) else 0.0
    skipped = min(productive, skipped_steps(mon) * typical)
    productive -= skipped
    downtime = sum(r["downtime_s"] for r in mon.restarts)
    if mon.state == JobState.RECOVERING and mon.failures and not mon.finished:
        downtime += max(0.0, end - mon.failures[-1]["fault_time"])
    # start-up ends at the first step, or at the first fault if one came before any step
    ends = [s.t[0] - s.step_time[0]] if len(s) else [end]
    ends += [f["fault_time"] for f in mon.failures[:1]]
    startup = min(wall, max(0.0, min(ends) - mon.t_start))
    stall = mon.checkpoint_stall_s
    other = max(0.0, wall - kept - recomputed - downtime - startup - stall)
    return Goodput(wall, productive, stall, interference, downtime, recomputed, skipped, startup, other)


def _window(mon: JobMonitor, now: float | None) -> tuple[float, float]:
    """(end, wall seconds) of a started job: up to its end, else up to ``now``."""
    end = mon.t_end or now or time.time()
    return end, max(0.0, end - mon.t_start) if mon.t_start is not None else 0.0


def _interference(mon: JobMonitor, kept: np.ndarray, took: np.ndarray, end: float) -> float:
    """Time the kept steps (indices into ``mon.steps``, in order; ``took``: every step's time) that
    overlapped a background save took beyond the median of the kept steps that overlapped none."""
    writes = _background_writes(mon, end)
    if not writes or not len(kept):
        return 0.0
    t = np.asarray(mon.steps.t, dtype=np.float64)
    if len(kept) < len(t):
        t, took = t[kept], took[kept]
    starts, ends = np.asarray(writes).T
    first = np.searchsorted(np.maximum.accumulate(ends), t - took, side="right")  # first write ending after
    hit = first < len(writes)
    hit[hit] = starts[first[hit]] < t[hit]   # ... and starting before the step ends: they overlap
    if hit.all() or not hit.any():
        return 0.0
    return float(np.clip(took[hit] - np.median(took[~hit]), 0.0, None).sum())


def _background_writes(mon: JobMonitor, end: float) -> list[tuple[float, float]]:
    """(staged, done) of every async save, in order. A write a fault abandoned has no end: it ends
    at the next save or fault, whichever came first."""
    saves = sorted((c.t_staged, c.t_done, c.t_begin or c.t_staged) for c in mon.checkpoints.values()
                   if c.mode == "async" and c.t_staged is not None)
    faults = [f["fault_time"] for f in mon.failures]
    writes = []
    for k, (staged, done, _) in enumerate(saves):
        if done is None:
            later = [t for t in faults if t > staged] + [b for _, _, b in saves[k + 1:k + 2]]
            done = min([end, *later])
        writes.append((staged, max(staged, done)))
    return writes


def useful_steps(mon: JobMonitor) -> int:
    """Distinct steps that count toward the result so far: each step up to the newest one run once,
    however often a rollback made it run again (steps above it were rolled back)."""
    return len({step for step in mon.steps.step if step <= mon.last_step})


def missing_batches(mon: JobMonitor) -> int:
    """The batches the kept steps lacked, the one count of skipped batches: each step's last execution
    against the job's ``world_size`` ranks' batches (its ``batches``). Under torchft a step the quorum
    committed without a replica group (lost, restarting, or healing from a peer) lacks that group's
    batches, and a group that never came back counts too; a step a group threw away after its gradients
    were all-reduced lacks none (the committed step had them). A step that says no ``batches`` lacks none."""
    if not mon.world_size:
        return 0
    last = {step: n for step, n in zip(mon.steps.step, mon.steps.batches) if step <= mon.last_step}
    return sum(max(0, mon.world_size - n) for n in last.values() if n is not None)


def skipped_steps(mon: JobMonitor) -> float:
    """The steps' worth of batches the kept steps lacked (each batch one rank's share of a step)."""
    return missing_batches(mon) / mon.world_size if mon.world_size else 0.0


def steps_per_s(mon: JobMonitor, now: float | None = None) -> float:
    """Useful steps per wall second, start-up and every loss included (skipped batches too)."""
    wall = _window(mon, now)[1]
    return max(0.0, useful_steps(mon) - skipped_steps(mon)) / wall if wall > 0 else 0.0


def ettr(mon: JobMonitor, reference_steps_per_s: float, now: float | None = None) -> float | None:
    """Effective-training-time ratio (as the Llama 3 report uses it): this job's useful steps per
    wall second against a fault-free run of the same job (``reference_steps_per_s``, from
    :func:`steps_per_s` on that run). None without a reference."""
    if reference_steps_per_s <= 0:
        return None
    return steps_per_s(mon, now) / reference_steps_per_s
