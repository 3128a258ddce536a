"""What-if replay: the ETTR and time breakdown a job would have had under other settings, from its
own events (folded by :class:`~eksft_nb.monitor.JobMonitor` and :func:`~eksft_nb.goodput.compute`).

The model, term by term (``N`` useful steps, ``t`` clean step time, ``k`` the interval):

- productive = N * t; startup: as measured (less the in-process Wrapper's set-up, measured by its
  ``inprocess_wrapper`` events, where the setting turns in-process restart off); other: as measured
  (less the Wrapper's exit, likewise), plus the time between steps each
  further save costs beyond its stall (an async save's commit, agreed by the ranks between steps),
  observed: the gaps between steps, less the stall, less a gap's median at every step, per save
- saves = the saves the job made, plus what ``k`` changes in ceil(N / k) and in the saves a rollback
  repeats (so the job's own settings replay its own count), of three kinds that cost differently: the
  first save after each start of the ranks (the job's start and every recovery: it waits for a fresh
  writer and plans the save anew), the last step's (it waits for its write to commit), and the rest.
  Each kind costs its observed mean stall; the firsts are counted by replaying the restarts under
  ``k`` (the save after each resumed step), so a longer interval saves no stall on them.
  Interference = saves * interference per save (an async save's slowdown of the steps it overlaps);
  sync from async: a save blocks for its staging plus its write
- each observed failure replayed at the step it hit (s): it rolls back to the newest save it can
  load, s - s mod k (in-job and job restarts load committed saves only: an async save becomes
  loadable ``commit lag`` steps after it began, the median observed; at the job's own interval the
  newest save committed when it failed is known from its events), so recomputed = sum(lost) * the
  observed time of a lost step (the steps a failure throws away ran beside the write of the save
  before them, slower than the mean step; t where none was lost); its downtime is the observed one,
  or the mean of the job's observed recoveries at the level the setting moves it to; without in-process
  restart, an in-job recovery costs less the Wrapper's set-up in the ranks it started
- ETTR = productive / wall (the productive share of wall time; not :func:`~eksft_nb.goodput.ettr`,
  useful steps per wall second against a fault-free run)

A setting whose effect needs a recovery or a save this job never showed gets no figure, and the
reason instead; so does one that cannot pay off with the job's NVRx (hot spares where its barrier
rendezvous closes the job when a spare joins, NVRx 0.5: see :attr:`eksft_nb.nvrx.NVRx.spares_refused`). The
recommended interval is Young/Daly's, tau = sqrt(2 C (M + R)) - C (C: the cost of a save, M: the mean time
between failures, R: a recovery's downtime), never shorter than the detection latency.

About 500 lines, one idea: the replay's terms share the events they are learned from.
"""

from __future__ import annotations

import math
import re
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from ..errors import EksftError, shown
from ..goodput import CATEGORIES, compute, useful_steps
from ..incidents import phases_text
from ..monitor import JobMonitor
from ..nvrx import NVRx
from ..spec import JobSpec
from ..states import CheckpointState, RestartLevel

MAX_INTERVALS = 16
# goodput's terms but torchft's skipped batches (an NVRx job, the what-if's, skips none)
TERMS = tuple(c for c in CATEGORIES if c != "skipped")


@dataclass(frozen=True)
class Setting:
    ckpt_every: int
    inprocess: bool
    ckpt_mode: str
    spares: int

    @property
    def label(self) -> str:
        return (f"every {self.ckpt_every}, {self.ckpt_mode}, in-process {'on' if self.inprocess else 'off'}, "
                f"{self.spares} spare(s)")


@dataclass(frozen=True)
class Settings:
    """What ``whatif`` was asked: intervals (None: the defaults) and the other knobs (None: as run)."""

    intervals: tuple[int, ...] | None = None
    inprocess: bool | None = None
    ckpt_mode: str | None = None
    spares: int | None = None


@dataclass
class Inputs:
    """What the events measured, every figure the model uses."""

    steps: int                 # N: useful steps
    step_s: float              # t: clean step time (productive seconds per useful step)
    saves: int                 # saves observed
    stall_per_save_s: float    # mean stall of a save that is neither a start's first nor the last step's
    interference_per_save_s: float
    write_per_save_s: float | None    # async: staging + background write (what a sync save would block for)
    commit_lag_steps: int      # async: median steps from a save's start until it is committed
    # step, level, downtime_s, detection_s, lost, node_loss, phases, committed
    failures: list[dict[str, Any]]
    wall_s: float
    startup_s: float
    other_s: float
    detection_s: float | None  # mean detection latency of the observed failures
    mtbf_s: float | None       # wall seconds per failure (None: none observed)
    recovery_s: float | None   # mean downtime per failure
    first_save_stall_s: float | None = None   # mean stall of the first save after each start of the ranks
    last_save_stall_s: float | None = None    # the last step's save (None: the job has not saved it yet)
    recompute_step_s: float | None = None     # seconds per lost step, as it ran (None: none was lost)
    other_per_save_s: float = 0.0             # time between steps a save costs beyond its stall
    first_saves: int = 0                      # saves that were the first after a start of the ranks
    # NVRx's in-process Wrapper (inprocess_wrapper events; None: not recorded): its set-up in the job's
    # start-up and its completion at the end, on the critical path (see _wrapper)
    wrapper_startup_s: float | None = None
    wrapper_exit_s: float | None = None
    nvrx: str | None = None    # the NVRx version the job ran with (None: not recorded)


@dataclass
class Row:
    setting: Setting
    ettr: float | None = None
    terms: dict[str, float] = field(default_factory=dict)
    saves: int | None = None
    lost_steps: int | None = None
    why: str = ""          # why there is no figure
    notes: list[str] = field(default_factory=list)
    estimated: list[str] = field(default_factory=list)   # terms not learned from the job's own events

    def to_dict(self) -> dict[str, Any]:
        return {"setting": asdict(self.setting), "label": self.setting.label, "ettr": self.ettr,
                "terms": self.terms, "wall_s": round(sum(self.terms.values()), 3) if self.terms else None,
                "saves": self.saves, "lost_steps": self.lost_steps, "why": self.why, "notes": self.notes,
                "estimated": sorted(set(self.estimated))}


@dataclass
class Report:
    job: str
    as_run: Setting
    measured: dict[str, Any]
    inputs: Inputs
    rows: list[Row]
    recommendation: dict[str, Any]

    def to_dict(self) -> dict[str, Any]:
        return {"job": self.job, "as_run": asdict(self.as_run), "measured": self.measured,
                "inputs": asdict(self.inputs), "rows": [r.to_dict() for r in self.rows],
                "recommendation": self.recommendation}


def parse_settings(ckpt_every: str | Sequence[int] | None, inprocess: bool | None, ckpt_mode: str | None,
                   spares: int | None) -> Settings:
    """Check what ``whatif`` was asked; one line naming the problem otherwise."""
    intervals = None
    if ckpt_every is not None:
        words = ckpt_every.split(",") if isinstance(ckpt_every, str) else list(ckpt_every)
        vals = []
        for w in words:
            text = str(w).strip()
            if not re.fullmatch(r"\d{1,7}", text) or int(text) < 1:
                raise EksftError(f"--ckpt-every {shown(ckpt_every)}: {shown(text)} is not a whole number of "
                                 "steps >= 1",
                                 "write e.g. --ckpt-every 5,10,20,50")
            vals.append(int(text))
        if not vals or len(vals) > MAX_INTERVALS:
            raise EksftError(f"--ckpt-every takes 1 to {MAX_INTERVALS} intervals, got {len(vals)}",
                             "write e.g. --ckpt-every 5,10,20,50")
        intervals = tuple(dict.fromkeys(vals))
    if ckpt_mode is not None and ckpt_mode not in ("async", "sync"):
        raise EksftError(f"unknown checkpoint mode {shown(ckpt_mode)}",
                         "use --ckpt-mode async or --ckpt-mode sync")
    if spares is not None and (isinstance(spares, bool) or not isinstance(spares, int)
                               or not 0 <= spares <= 64):
        raise EksftError(f"--spares {shown(spares)} is not a number of nodes from 0 to 64",
                         "write e.g. --spares 1")
    return Settings(intervals, inprocess, ckpt_mode, spares)


def measure(mon: JobMonitor, spec: JobSpec, now: float | None = None) -> Inputs:
    """The model's inputs from a job's folded events."""
    gp = compute(mon, now)
    n = useful_steps(mon)
    if not n:
        raise EksftError(f"job {mon.name or spec.name!r} has run no step yet",
                         "ask again once it has trained a while")
    step_s = gp.productive_s / n
    saves = [c for c in mon.saves if c.t_staged is not None]   # a step saved again after a rollback: twice
    async_saves = [c for c in saves if c.mode == "async"]
    writes = [(c.blocked_s or 0.0) + c.background_s for c in async_saves if c.background_s is not None]
    lags = [math.ceil((c.t_done - c.t_begin) / step_s) for c in async_saves
            if c.t_done and c.t_begin and c.state == CheckpointState.COMMITTED and step_s > 0]
    committed = sorted((c.t_done, c.step) for c in mon.saves
                       if c.state == CheckpointState.COMMITTED and c.t_done is not None)
    failures = []
    for r in mon.restarts:
        failures.append({"step": r["resumed_step"] + r["rolled_back_steps"], "level": r["level"],
                         "cause": r["cause"],
                         "downtime_s": r["downtime_s"], "detection_s": r["detection_s"],
                         "lost": r["rolled_back_steps"], "node_loss": _node_loss(r, spec),
                         "phases": r.get("phases") or {},
                         # the Wrapper's set-up in the ranks this recovery started (None: none recorded)
                         "wrapper_s": _wrapper(mon, "setup", r["fault_time"], r["t"]),
                         # the newest save on storage when it failed: what its own interval restores
                         "committed": max((st for t,
                                           st in committed if t <= r["fault_time"] and st <= r["resumed_step"]
                                           + r["rolled_back_steps"]), default=0)})
    wall = gp.wall_s
    first, last, rest = _save_kinds(mon, spec, saves)
    st = mon.steps   # training began at the first step, or at the first fault if one came before it
    began = min(([st.t[0] - st.step_time[0]] if len(st) else [])
                + [r["fault_time"] for r in mon.restarts[:1]], default=math.inf)
    lost = sum(r["rolled_back_steps"] for r in mon.restarts)
    return Inputs(
        steps=n, step_s=step_s, saves=len(saves),
        stall_per_save_s=((gp.checkpoint_stall_s - sum(first) - sum(last)) / len(rest) if rest
                          else gp.checkpoint_stall_s / len(saves) if saves else 0.0),
        interference_per_save_s=gp.checkpoint_interference_s / len(async_saves) if async_saves else 0.0,
        write_per_save_s=statistics.fmean(writes) if writes else None,
        commit_lag_steps=statistics.median_low(lags) if lags else 0,
        failures=failures, wall_s=wall, startup_s=gp.startup_s, other_s=gp.other_s,
        detection_s=statistics.fmean(f["detection_s"] for f in failures) if failures else None,
        mtbf_s=wall / len(failures) if failures else None,
        recovery_s=statistics.fmean(f["downtime_s"] for f in failures) if failures else None,
        first_save_stall_s=statistics.fmean(first) if first else None,
        last_save_stall_s=last[0] if last else None,
        recompute_step_s=gp.recomputed_s / lost if lost and gp.recomputed_s > 0 else None,
        other_per_save_s=_between_steps_per_save(mon, gp.checkpoint_stall_s - sum(last),
                                                 len(saves) - len(last)),
        first_saves=len(first), wrapper_startup_s=_wrapper(mon, "setup", mon.t_start or 0.0, began),
        wrapper_exit_s=_wrapper(mon, "exit", began, math.inf), nvrx=mon.nvrx)


def _wrapper(mon: JobMonitor, phase: str, t0: float, t1: float) -> float | None:
    """The seconds NVRx's Wrapper spent in ``phase`` between ``t0`` and ``t1`` on the critical path. Set-up:
    the least over the ranks (the rank that came last to the Wrapper's barrier waited for none). Exit: the
    most (the ranks return together, from the trainer's last barrier; the job ends with the last to leave)."""
    seen = [w["seconds"] for w in mon.wrapper if w["phase"] == phase and t0 <= w["t"] <= t1]
    return (min if phase == "setup" else max)(seen) if seen else None


def _between_steps_per_save(mon: JobMonitor, stall_s: float, saves: int) -> float:
    """Seconds between steps each save a step followed (``saves`` of them, their stall ``stall_s``) costs
    beyond its stall: the gaps between consecutive steps (a restart's excluded), less the stall, less the
    median gap at every step, per save."""
    s = mon.steps
    if not saves or len(s) < 3:
        return 0.0
    faults = sorted(r["fault_time"] for r in mon.restarts)
    gaps = []
    for i in range(1, len(s)):
        start, prev = s.t[i] - s.step_time[i], s.t[i - 1]
        if s.step[i] == s.step[i - 1] + 1 and not any(prev <= f <= start for f in faults):
            gaps.append(max(0.0, start - prev))
    if not gaps:
        return 0.0
    return max(0.0, sum(gaps) - stall_s - len(gaps) * statistics.median(gaps)) / saves


def _save_kinds(mon: JobMonitor, spec: JobSpec,
                saves: list[Any]) -> tuple[list[float], list[float], list[Any]]:
    """The stalls of the first save after each start of the ranks and of the last step's save, and the other
    saves: the first waits for a fresh writer and plans anew, the last waits for its write to commit."""
    saves = sorted(saves, key=lambda c: c.t_begin or c.t_staged)
    last = {id(c) for c in saves if c.step == spec.steps}
    starts = [mon.t_start or 0.0] + [r["fault_time"] for r in mon.restarts]
    firsts = {id(c) for p in starts for c in [c for c in saves if (c.t_begin or c.t_staged) > p][:1]
              if id(c) not in last}
    return ([c.blocked_s or 0.0 for c in saves if id(c) in firsts],
            [c.blocked_s or 0.0 for c in saves if id(c) in last],
            [c for c in saves if id(c) not in firsts | last])


def _node_loss(restart: dict[str, Any], spec: JobSpec) -> bool:
    """Whether a node was lost: a job-level restart, or an in-job one where a spare took its place."""
    return restart["level"] == RestartLevel.JOB or (spec.spare_nodes > 0 and restart["blame_rank"] is None
                                                    and "node" in restart["cause"])


def predict(inp: Inputs, as_run: Setting, s: Setting) -> Row:
    """The breakdown ``inp``'s job would have had under ``s`` (it ran under ``as_run``)."""
    row = Row(s)
    if s.spares > 0 and inp.nvrx and (refused := NVRx(inp.nvrx).spares_refused):
        row.why = f"hot spares do not pay off with this job's NVRx: {refused}"
        return row
    if s.inprocess and not as_run.inprocess:
        row.why = ("in-process restart was off, so NVRx's Wrapper never ran: what its set-up adds to each "
                   "start of the ranks and what its recoveries cost were never measured (run it once with "
                   "in-process on)")
        return row
    stall, interference = inp.stall_per_save_s, inp.interference_per_save_s
    lag = inp.commit_lag_steps if s.ckpt_mode == "async" else 0
    if s.ckpt_mode != as_run.ckpt_mode:
        if s.ckpt_mode == "sync":
            if inp.write_per_save_s is None:
                row.why = "no async save with its write time was observed, so a sync save's cost is unknown"
                return row
            stall, interference = inp.write_per_save_s, 0.0
            row.notes.append(f"a sync save blocks for the observed staging + write, {stall:.3f}s")
        else:
            row.why = ("no async save was observed: its staging stall, interference and commit lag are "
                       "unknown (run it once with --ckpt-mode async)")
            return row
    unwrapped = as_run.inprocess and not s.inprocess   # without the Wrapper's set-up in each start

    def cost(f: dict[str, Any]) -> float:
        return f["downtime_s"] - ((f.get("wrapper_s") or 0.0) if unwrapped else 0.0)

    downtimes: list[float] = []
    for f in inp.failures:
        level, why = _level_under(f, as_run, s)
        if why:
            row.why = why
            return row
        if level == f["level"]:
            downtimes.append(cost(f))
            continue
        seen = [g for g in inp.failures if g["level"] == level]
        if not seen:
            now_, then = RestartLevel(f["level"]).label, RestartLevel(level).label
            row.why = (f"the {now_} recovery at step {f['step']} would become {then}, and this job shows no "
                       f"{then} recovery to take its downtime from")
            return row
        # learned from the job's own recoveries at that level of the same cause (an exception's rank must
        # end its process first; a killed one is gone at once), else estimated from those of other causes
        alike = [g for g in seen if cause_kind(g.get("cause", "")) == cause_kind(f.get("cause", ""))]
        downtimes.append(statistics.fmean(cost(g) for g in alike or seen))
        what = f"{cause_kind(f.get('cause', ''))}-caused"
        if alike:
            row.notes.append(f"the {f['level']} recovery at step {f['step']} becomes {level} "
                             f"({downtimes[-1]:.2f}s, the mean of the job's {len(alike)} {what} {level} "
                             "ones)")
        else:
            row.estimated.append("restart_downtime")
            row.notes.append(f"estimated: the {f['level']} recovery at step {f['step']} becomes {level}, and "
                             f"the job shows no {what} {level} recovery: charged as its {len(seen)} of other "
                             f"causes ({downtimes[-1]:.2f}s); an exception's rank ends its process first, "
                             "which a kill skips")
    made, made_then = _made(inp, s), _made(inp, as_run)
    if made.ckpt_every != s.ckpt_every:
        row.notes.append(f"a save due every {s.ckpt_every} step(s) waits for the write before it "
                         f"({inp.commit_lag_steps} steps observed): one is made every {made.ckpt_every}")
    lost = [_lost(f, made, made_then, lag, _level_under(f, as_run, s)[0]) for f in inp.failures]
    # the saves the job made, plus what the setting changes by the same count: the job's own settings
    # replay its saves (a step saved again after a rollback included), whatever the count misses
    saves, firsts = _saves(inp, made, lost)
    saves_then, firsts_then = _saves(inp, made_then, [f["lost"] for f in inp.failures])
    saves = max(0, inp.saves + saves - saves_then) if s.ckpt_every > 0 else 0
    firsts = max(0, inp.first_saves + firsts - firsts_then)
    t = inp.step_s
    other = inp.other_s + (saves - inp.saves) * inp.other_per_save_s
    startup = inp.startup_s
    if unwrapped:
        startup -= inp.wrapper_startup_s or 0.0
        other -= inp.wrapper_exit_s or 0.0
        if inp.wrapper_startup_s is None:
            row.notes.append("the in-process Wrapper's set-up was not recorded (events from before it was): "
                             "start-up and in-job restarts are taken as observed, the Wrapper's share "
                             "included")
        else:
            row.notes.append("without the in-process Wrapper: its observed set-up "
                             f"({inp.wrapper_startup_s:.2f}s at the start, and in each in-job restart as "
                             "observed there) and its exit "
                             f"({inp.wrapper_exit_s or 0.0:.2f}s) are not spent")
    if s.ckpt_mode == as_run.ckpt_mode:
        stall_s = _stall(inp, saves, firsts, stall)
    else:
        stall_s = saves * stall
    row.terms = {"productive": inp.steps * t, "checkpoint_stall": stall_s,
                 "checkpoint_interference": saves * interference, "restart_downtime": sum(downtimes),
                 "recomputed": sum(lost) * (inp.recompute_step_s or t), "startup": max(0.0, startup),
                 "other": max(0.0, other)}
    row.terms = {k: round(v, 4) for k, v in row.terms.items()}
    wall = sum(row.terms.values())
    row.ettr = round(row.terms["productive"] / wall, 5) if wall > 0 else None
    row.saves, row.lost_steps = saves, sum(lost)
    return row


def cause_kind(cause: str) -> str:
    """What ended a rank, from a failure's cause (:meth:`eksft_nb.incidents.Incidents.cause_from_exit`'s
    words): ``exception`` (raised, or exited with an error: the process ends itself), ``hang`` (no
    progress: stopped on a timeout) or ``loss`` (the process or its node gone at once)."""
    words = cause.lower()
    injected = re.match(r"injected ([a-z-]+)", words)
    if injected:
        return {"exception": "exception", "hang": "hang"}.get(injected.group(1), "loss")
    if words.startswith("hang") or "heartbeat" in words:
        return "hang"
    return "exception" if " failed: " in words or "exited with code" in words else "loss"


def expected_lost(inp: Inputs, as_run: Setting, s: Setting) -> float | None:
    """The steps a failure at a uniformly random step loses under ``s``, over the levels of the job's own
    failures (None: it showed none, or one cannot be replayed): the newest save is ``s mod k`` steps back,
    the one before it while an async save is still being written (``lag`` steps, from storage)."""
    k = _made(inp, s).ckpt_every
    levels = [_level_under(f, as_run, s) for f in inp.failures]
    if not levels or any(why for _, why in levels):
        return None
    if k <= 0:
        return inp.steps / 2
    lag = inp.commit_lag_steps if s.ckpt_mode == "async" else 0
    return statistics.fmean((k - 1) / 2 + (min(lag, k) if level != RestartLevel.INPROCESS else 0)
                            for level, _ in levels)


def _made(inp: Inputs, s: Setting) -> Setting:
    """``s`` at the interval its saves are made at: an async save due while the write before it runs
    waits for it, so saves come no more often than one per observed commit lag."""
    if s.ckpt_mode != "async" or s.ckpt_every <= 0 or inp.commit_lag_steps <= s.ckpt_every:
        return s
    return replace(s, ckpt_every=inp.commit_lag_steps)


def _saves(inp: Inputs, s: Setting, lost: list[int]) -> tuple[int, int]:
    """Saves every ``s.ckpt_every`` steps, and how many are a start's first: one per ``k`` useful steps, and
    again each save a failure rolled back (``lost`` steps each); a start (the job's, each recovery's resumed
    step) has a first save of its own if it reaches its next save before the next failure."""
    k, n = s.ckpt_every, inp.steps
    if k <= 0:
        return 0, 0
    steps = [f["step"] for f in inp.failures]
    resumed = [0] + [st - lost_ for st, lost_ in zip(steps, lost)]
    again = sum(st // k - r // k for st, r in zip(steps, resumed[1:]))
    nexts = [((r // k + 1) * k, until) for r, until in zip(resumed, [*steps, n])]   # a start's next save
    firsts = sum(1 for x, until in nexts if x < n and x <= until)
    return math.ceil(n / k) + again, firsts


def _stall(inp: Inputs, saves: int, firsts: int, per_save: float) -> float:
    """The stall of ``saves`` saves: the last step's and ``firsts`` firsts after a start of the ranks at their
    observed costs, the rest at ``per_save``."""
    if not saves:
        return 0.0
    last = 1 if inp.last_save_stall_s is not None else 0
    firsts = firsts if inp.first_save_stall_s is not None else 0
    rest = max(0, saves - last - firsts)
    return rest * per_save + firsts * (inp.first_save_stall_s or 0.0) + last * (inp.last_save_stall_s or 0.0)


def _level_under(f: dict[str, Any], as_run: Setting, s: Setting) -> tuple[str, str]:
    """The level that would recover failure ``f`` under ``s``, or why that cannot be told."""
    level = f["level"]
    if level == RestartLevel.INPROCESS and not s.inprocess:
        return RestartLevel.INJOB.value, ""
    if s.inprocess and not as_run.inprocess and level == RestartLevel.INJOB and not f["node_loss"]:
        return "", ("in-process restart was off, so none was observed: which failures it would catch, and "
                    "how fast, cannot be told from these events")
    if f["node_loss"] and (s.spares > 0) != (as_run.spares > 0):
        if s.spares > 0:
            return "", ("a node was lost and the job had no spare: a spare's takeover was never observed, so "
                        "its downtime is unknown (hot spares may recover slower than a job restart)")
        return RestartLevel.JOB.value, ""
    return level, ""


def _lost(f: dict[str, Any], setting: Setting, as_run: Setting, lag: int, level: str) -> int:
    """Steps a failure at step ``f['step']`` loses under ``setting``, recovered at ``level``. With the job's
    own saves: what it lost, at the level it was recovered at (observed: a save that committed after the
    fault, before the restore read the folder, was loaded); from storage at another level, back to the
    newest save committed when it failed. Otherwise back to a save every ``k`` steps, loadable ``lag``
    steps after it began (the median commit lag observed) from storage."""
    s, k = f["step"], setting.ckpt_every
    if k <= 0:
        return s
    own = (k, setting.ckpt_mode) == (as_run.ckpt_every, as_run.ckpt_mode)
    if own and level == f["level"]:
        return f["lost"]
    from_storage = level != RestartLevel.INPROCESS
    if from_storage and own and f.get("committed") is not None:
        return max(0, s - f["committed"])
    lag = lag if from_storage else 0
    back = s % k
    if back < lag and s >= k:   # the newest save is still being written: the one before it is loaded
        back += k
    return min(back, s)


def recommend(inp: Inputs, as_run: Setting, base: Row) -> dict[str, Any]:
    """Young/Daly's interval from the measured save cost, failure rate and recovery, never shorter than
    the detection latency; with the ETTR it gains over the job's own interval, replayed. ``every`` (what
    Apply sets) only where that gain is positive: an interval that loses on the replay is said, never
    recommended (``young_daly`` keeps the formula's interval either way)."""
    cost = inp.stall_per_save_s + inp.interference_per_save_s
    if inp.mtbf_s is None:
        return {"every": None, "text": "no failure observed: the events give no failure rate, so no interval "
                "can be recommended (the interval only bounds what a failure would lose)"}
    m, r, t = inp.mtbf_s, inp.recovery_s or 0.0, inp.step_s
    tau = math.sqrt(2 * cost * (m + r)) - cost if cost < 2 * m else m
    floor_s = inp.detection_s or 0.0
    every = max(1, round(max(tau, floor_s) / t)) if t > 0 else 1
    formula = (f"tau = sqrt(2 C (M + R)) - C = sqrt(2 x {cost:.3f} x ({m:.1f} + {r:.2f})) - {cost:.3f} "
               f"= {tau:.2f}s; floor: detection latency {floor_s:.2f}s; / step {t:.4f}s = {every} steps")
    row = predict(inp, as_run, replace(as_run, ckpt_every=every))
    gain = None if row.ettr is None or base.ettr is None else round(100 * (row.ettr - base.ettr), 2)
    now = as_run.ckpt_every
    pays = gain is not None and gain > 0 and every != now
    if pays:
        text = f"every {every} steps: {gain:+.1f} points ETTR (now every {now})"
    elif every == now:
        text = f"keep every {now}: it is Young/Daly's interval for this job's measured costs"
    elif gain is None:
        text = f"keep every {now}: Young/Daly's every {every} steps cannot be estimated ({row.why})"
    else:  # the formula's interval loses on the replay of this job's own failures: never recommended
        text = (f"keep every {now}: Young/Daly's every {every} steps would give {gain:+.1f} points ETTR "
                "on the replay of this job's failures")
    return {"every": every if pays else None, "young_daly": every, "tau_s": round(tau, 4),
            "save_cost_s": round(cost, 4), "mtbf_s": round(m, 3), "recovery_s": round(r, 3),
            "floor_s": round(floor_s, 3), "gain_points": gain, "formula": formula, "text": text,
            "failures": len(inp.failures)}


def replay(mon: JobMonitor, spec: JobSpec, settings: Settings = Settings(),
           now: float | None = None) -> Report:
    """Every row ``settings`` asks for, the measured breakdown, and the recommendation."""
    inp = measure(mon, spec, now)
    as_run = Setting(spec.checkpoint.every, spec.ft.inprocess, spec.checkpoint.mode, spec.spare_nodes)
    base = predict(inp, as_run, as_run)
    rec = recommend(inp, as_run, base)
    asked = {"inprocess": settings.inprocess, "ckpt_mode": settings.ckpt_mode, "spares": settings.spares}
    other = replace(as_run, **{k: v for k, v in asked.items() if v is not None})
    k = as_run.ckpt_every or 10
    intervals = settings.intervals or tuple(dict.fromkeys(
        [x for x in (max(1, k // 2), k, 2 * k, rec.get("young_daly")) if x]))
    rows = [predict(inp, as_run, replace(other, ckpt_every=i)) for i in intervals]
    gp = compute(mon, now)
    # the terms it predicts (an NVRx job skips no batches: torchft's skipped time is not one of them)
    measured = {"ettr": round(gp.goodput, 5),
                "terms": {c: round(v, 4) for c, v in gp.seconds().items() if c in TERMS},
                "wall_s": round(gp.wall_s, 3), "predicted_as_run": base.to_dict()}
    if as_run.inprocess and inp.nvrx and NVRx(inp.nvrx).inprocess == "deprecated":
        # in-process restart on an NVRx that deprecates it: what in-job restart, its way forward, costs
        measured["without_inprocess"] = {"nvrx": inp.nvrx,
                                         **predict(inp, as_run, replace(as_run, inprocess=False)).to_dict()}
    return Report(mon.name or spec.name, as_run, measured, inp, rows, rec)


def format_report(report: dict[str, Any]) -> str:
    """The report as text: the inputs, one line per setting with its terms, the recommendation."""
    i, m = report["inputs"], report["measured"]
    rates = (f", MTBF {i['mtbf_s']:.1f}s, recovery {i['recovery_s']:.2f}s, detection {i['detection_s']:.2f}s"
             if i["failures"] else "")
    terms = " + ".join(t.replace("checkpoint_", "ckpt ").replace("restart_", "") for t in TERMS)
    lines = [f"what-if for {report['job']} (as run: {Setting(**report['as_run']).label})",
             f"measured: N {i['steps']} steps x t {i['step_s']:.4f}s; {i['saves']} saves, stall "
             f"{i['stall_per_save_s']:.3f}s + interference {i['interference_per_save_s']:.3f}s each; "
             f"{len(i['failures'])} failure(s){rates}",
             *(f"  failure at step {f['step']}: {f['level']}, {f['downtime_s']:.2f}s down, {f['lost']} steps "
               "lost" + (f" ({phases_text(f['phases'])})" if f["phases"] else "") for f in i["failures"]),
             f"  {'setting':<44}{'ETTR':>7}{'wall':>9} = {terms}"]
    as_run = m["predicted_as_run"]
    lines.append(_row_line("measured (as run)", m["ettr"], m["wall_s"], m["terms"]))
    lines.append(_row_line("predicted (as run)", as_run["ettr"], as_run["wall_s"], as_run["terms"]))
    for r in report["rows"]:
        if r["ettr"] is None:
            lines.append(f"  {r['label']:<44}{'-':>7}  cannot estimate: {r['why']}")
        else:
            lines.append(_row_line(r["label"], r["ettr"], r["wall_s"], r["terms"])
                         + f"   ({r['saves']} saves, {r['lost_steps']} steps lost)")
        lines += [f"      {n}" for n in r["notes"]]
    if off := m.get("without_inprocess"):
        known = off["ettr"] is not None and as_run["ettr"] is not None
        cost = (f"{100 * off['ettr']:.1f}% ETTR ({100 * (off['ettr'] - as_run['ettr']):+.1f} points)" if known
                else f"cannot estimate: {off['why']}")
        lines.append(f"NVRx {off['nvrx']} deprecates in-process restart; in-job restart instead "
                     f"(--no-inprocess): {cost}")
    rec = report["recommendation"]
    lines.append(f"recommended: {rec['text']}")
    if rec.get("formula"):
        lines.append(f"  {rec['formula']}")
    return "\n".join(lines)


def _row_line(label: str, ettr: float | None, wall: float | None, terms: dict[str, float]) -> str:
    pct = "-" if ettr is None else f"{100 * ettr:.1f}%"
    parts = " + ".join(f"{terms.get(t, 0.0):.2f}" for t in TERMS)
    return f"  {label:<44}{pct:>7}{(wall or 0.0):>8.2f}s = {parts}"
