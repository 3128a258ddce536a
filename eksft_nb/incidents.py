"""Incidents: what a job's ranks and launchers report, turned into ``failure`` and ``restart`` events.

Shared by the local supervisor (which reads ft_launcher's log and the job's events file) and the EKS
backend (which reads pod states and pod logs). A failure opens an incident when it is detected, with
its level (in-process, in-job, job), cause and blamed rank; the first step after recovery closes it
with the detection time, the downtime and the steps rolled back. Optionally, it gives up when
restarts stop making progress.

Blame, in order: the target of an injected fault; a rank that raised on its own; a rank that was
interrupted while *not* waiting for its peers (a hang); the rank whose process died; a hint from the
caller (the local supervisor's progress beacons). A GPU fault (an XID or a double-bit ECC error
reported by :mod:`.gpuhealth`) shortly before or during an incident without an injected fault is
named as its cause, and its time as the fault's.

Every restart that happened is counted: one whose new incarnation fails again before its first step
ends as a ``restart`` with ``recovered: false``, and the new failure opens the next incident with its
own cause (the script's error, not the fault that began the chain). A job that fails names the ranks'
last error in its reason (:meth:`Incidents.named`, see :mod:`.rank_errors`).
"""

from __future__ import annotations

import signal
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any

from .events import RESTART_PHASES, Event
from .fault_registry import LINGERING
from .monitor import JobMonitor
from .rank_errors import KEEP, RankError, fix_for
from .states import RestartLevel

ANY_NODE = "*"   # a relaunch of the whole job (every node's launcher is new)

NODE_FAULT_WINDOW_S = 60.0


@dataclass
class Incident:
    level: RestartLevel
    cause: str
    blame_rank: int | None
    fault_time: float
    detected_at: float
    last_step: int
    resumed_step: int | None = None
    restored_from: str | None = None           # the resume event's source: memory or storage
    gpu_fault: dict[str, Any] | None = None   # the GPU fault named as its cause
    # the recovering ranks' latest entry, process groups formed, and restore done (their rank_start events)
    entered: float | None = None
    grouped: float | None = None
    restored: float | None = None
    # node (a launcher) -> when it restarted its worker group for this incident (ANY_NODE: a relaunch)
    restarted: dict[Hashable, float] = field(default_factory=dict)

    def retried_before(self, node: Hashable, at: float) -> bool:
        """Whether a failure at ``at`` on ``node`` is of an incarnation this incident's restart started."""
        began = self.restarted.get(node, self.restarted.get(ANY_NODE))
        return began is not None and at > began

    def phases(self, end: float) -> dict[str, float]:
        """The downtime up to ``end`` (the first step's start) split at the marks known (see
        :data:`~eksft_nb.events.RESTART_PHASES`); an unknown or out-of-order mark makes its phase 0."""
        last = max(end, self.fault_time)
        bounds = [self.fault_time]
        for mark in (self.detected_at, self.entered, self.grouped, self.restored, end):
            bounds.append(min(max(bounds[-1] if mark is None else mark, bounds[-1]), last))
        return {name: round(bounds[k + 1] - bounds[k], 4) for k, name in enumerate(RESTART_PHASES)}


def phases_text(phases: dict[str, float] | None) -> str:
    """A restart's phases in one line ("" for a restart recorded without them)."""
    return ", ".join(f"{name.replace('_', ' ')} {phases[name]:.2f}s" for name in RESTART_PHASES
                     if name in phases) if phases else ""


class Incidents:
    """Incident bookkeeping for one job.

    ``emit(kind, **fields)`` publishes ``failure``/``restart`` events; ``say(text)`` narrates (the
    supervisor's log). ``patience``: give up (see :attr:`give_up`) after this many incidents in a
    row that happened with the same newest committed checkpoint. ``steps_expected``: False for a
    user script that may report no steps, whose recovery then ends when its ranks start again.
    """

    def __init__(self, mon: JobMonitor, emit: Callable[..., Any], t_start: float, *,
                 say: Callable[[str], Any] = lambda text: None, patience: int | None = None,
                 steps_expected: bool = True) -> None:
        self.mon, self.emit, self.say = mon, emit, say
        self.patience, self.steps_expected = patience, steps_expected
        self.incident: Incident | None = None
        self.recent_faults: list[dict[str, Any]] = []   # rank faults since a step ran after them
        self.recent_errors: list[dict[str, Any]] = []   # rank errors, likewise
        self.recent_gpu: list[dict[str, Any]] = []      # XID and ECC faults, likewise
        self.incarnation: dict[int, tuple[int, int, int]] = {}  # rank -> (job attempt, in-job, in-process)
        self.recovered_to: tuple[int, int, int] | None = None  # the incarnation the last incident ended in
        # the newest restore: when, from where
        self.last_resume: tuple[float, str | None] = (float("-inf"), None)
        self.last_alive = t_start
        self.stuck_at: list[Any] = []   # per incident: newest committed checkpoint (or a script's step count)
        self.give_up: str | None = None
        self.errors: list[RankError] = []   # the ranks' latest errors (events and launcher logs), newest last

    # ---- inputs --------------------------------------------------------------------------------
    def observe(self, e: Event) -> None:
        """A rank's event (call after the monitor has folded it in)."""
        if e.kind == "fault" and e["target_rank"] is not None:
            self.recent_faults.append({"t": e.t, "fault": e["fault"], "rank": e["target_rank"]})
            self.recent_faults.sort(key=lambda f: f["fault"] in LINGERING)   # a sigkill beside a straggler
        elif e.kind == "gpu_fault" and e["fault"] in ("xid", "ecc"):
            self.recent_gpu.append({"t": e.t, **e.data})
            self._gpu_cause()   # it may arrive after the failure it caused was detected
        elif e.kind == "rank_error":
            self.recent_errors.append({"t": e.t, "rank": e.rank, "origin": e["origin"], "error": e["error"],
                                       "waiting": e.get("waiting", False)})
            if e["origin"] in ("fault", "exception"):
                where = e.get("where")
                self._remember(RankError(e.t, e.rank, e["error"], where if isinstance(where, str) else ""))
        elif e.kind == "rank_start" and e.rank is not None:
            self.last_alive = max(self.last_alive, e.t)
            now = (e["job_attempt"], e["injob_restart"], e["inprocess_iteration"])
            before = self.incarnation.get(e.rank)
            self.incarnation[e.rank] = now
            # a start of the incarnation the last incident already recovered to is no new incident:
            # several pods' logs arrive interleaved, so a rank's start can follow another rank's step
            new = self.recovered_to is None or now > self.recovered_to
            if before is not None and now != before and self.incident is None and new:
                same_process = now[:2] == before[:2]
                detected = max((x["t"] for x in self.recent_errors), default=e.t)
                fallback = "the wrapped training function was restarted" if same_process else \
                    "the worker group was restarted"
                self.open(Incident(RestartLevel.INPROCESS if same_process else RestartLevel.INJOB,
                                   self.cause_from_ranks(fallback),
                                   self.blame(), self.fault_time(), detected, self.mon.last_step))
            i = self.incident
            if i is not None and i.restored_from is None and self.last_resume[0] >= i.fault_time:
                i.restored_from = self.last_resume[1]
            if i is not None and e.t >= i.detected_at:   # a rank of the recovering incarnation is ready
                i.entered = max(i.entered or 0.0, e.get("t_enter", e.t))
                i.grouped = max(i.grouped or 0.0, e.get("t_group", i.entered))
                i.restored = max(i.restored or 0.0, e.t)
            if self.incident is not None and e.rank == 0:
                self.incident.resumed_step = e["start_step"]
                if not self.steps_expected and not len(self.mon.steps) and e.t > self.incident.detected_at:
                    self.close(e.t)  # a script that reports no steps has recovered once it runs again
        elif e.kind == "resume":
            # an in-process restart restores before its rank_start opens the incident: kept for it
            self.last_resume = (e.t, e.get("source"))
            if self.incident is not None:
                self.incident.restored_from = e.get("source")
        elif e.kind == "step":
            started = e.t - e["step_time"]
            # a survivor's step in flight when a node was lost can end after the loss was detected: a step
            # is the recovered job's once a recovering rank has started, or if it began after the detection
            i = self.incident
            if i is not None and e.t > i.detected_at and (i.entered is not None or started > i.detected_at):
                self.close(started)
            # forget what a whole step ran after (by time: several pods' logs arrive interleaved)
            self.recent_faults = [f for f in self.recent_faults if f["t"] >= started]
            self.recent_errors = [x for x in self.recent_errors if x["t"] >= started]
            self.recent_gpu = [x for x in self.recent_gpu if x["t"] >= started]

    def launcher_line(self, node: Hashable, seen: Any, rank: int | None = None,
                      hint: int | None = None) -> None:
        """One line of ft_launcher's log that matters (a ``backends.launcher_log.LauncherLine``) from the
        launcher of ``node``: a group restart, a rank's traceback, a timeout, a rank's exit (``rank``:
        whose process it was, where the caller knows). The caller has dropped what it accounts for
        otherwise (a stop it asked for, a failure of ranks that have all started again since)."""
        if seen.kind == "restarting":
            self.group_restarted(node, seen.at)
        elif seen.kind == "error":
            self._remember(RankError(seen.at, None, seen.detail))
        elif seen.kind == "hang":
            self.hang(seen.at, seen.timeout_s, hint, node=node, which=seen.detail)
        else:
            self.worker_failed(rank, seen.exitcode, seen.at, node=node)

    def group_restarted(self, node: Hashable, at: float) -> None:
        """The launcher of ``node`` restarts its worker group (an in-job restart), or the whole job is
        relaunched (``node`` ANY_NODE), for the open incident."""
        i = self.incident
        if i is not None and node not in i.restarted and at >= i.detected_at - 1.0:
            i.restarted[node] = at

    def worker_failed(self, rank: int | None, code: int, at: float, node: Hashable = None) -> None:
        """ft_launcher saw a rank's process exit with ``code`` (negative: a signal)."""
        if not self._new_failure(node, at):
            return
        own = [x for x in self.recent_errors if x["origin"] in ("fault", "exception")]
        if own and not self.recent_faults:  # ft_launcher may notice a peer's consequent failure first
            rank = own[0]["rank"]
        self.open(Incident(RestartLevel.INJOB, self.cause_from_exit(rank, code), self.blame(rank),
                           self.fault_time(), at,
                           self.mon.last_step))

    def hang(self, at: float, timeout_s: float | None = None, hint: int | None = None, node: Hashable = None,
             which: str = "") -> None:
        """ft_launcher's heartbeat or section timeout fired (``which``: "step section", "subsequent
        heartbeat", "out-of-section"); ``hint``: who looked stuck to the caller. The rank fell silent
        ``timeout_s`` before ``at``: a peer's monitor may log the same hang just after the group's restart
        began (NVRx 0.6+ runs one monitor per rank), and that line is still of the incarnation it ended."""
        if not self._new_failure(node, at, since=at - timeout_s if timeout_s else at):
            return
        blame = self.blame(hint)
        over = f" for over {timeout_s:g}s" if timeout_s else ""
        if blame is None:
            cause = f"hang detected by ft_launcher's {which or 'heartbeat'} timeout"
        elif which.endswith(" section"):
            cause = f"hang: rank {blame} stayed in its {which}{over} (ft_launcher's section timeout)"
        elif which == "out-of-section":
            cause = f"hang: rank {blame} ran outside any section{over} (ft_launcher's out-of-section timeout)"
        else:
            waited = f" for {timeout_s:g}s" if timeout_s else ""
            cause = f"hang: no heartbeat from rank {blame}{waited} (ft_launcher timeout)"
        self.open(Incident(RestartLevel.INJOB, cause, blame, self.fault_time(), at, self.mon.last_step))

    def _new_failure(self, node: Hashable, at: float, since: float | None = None) -> bool:
        """Whether a failure seen at ``at`` (of what went wrong at ``since``, default ``at``) opens an
        incident: none is open, or the open one's restart already began on that node, so this is its new
        incarnation failing (that restart ends as one that failed, and counts); a failure of the
        incarnation the open incident is about is part of it."""
        i = self.incident
        if i is None:
            return True
        if not i.retried_before(node, at if since is None else since):
            return False
        self._restart_failed(at, min(i.restarted.values()))
        return True

    def _restart_failed(self, at: float, began: float) -> None:
        """The open incident's restart (begun at ``began``) failed before its first step, at ``at``."""
        i, self.incident = self.incident, None
        end = max(at, i.detected_at)
        self.emit("restart", level=i.level, cause=i.cause, blame_rank=i.blame_rank, fault_time=i.fault_time,
                  detection_s=max(0.0, i.detected_at - i.fault_time), downtime_s=max(0.0, end - i.fault_time),
                  rolled_back_steps=0, resumed_step=i.resumed_step or 0, phases=i.phases(end),
                  recovered=False, **({"restored_from": i.restored_from} if i.restored_from else {}))
        self.say(f"the {i.level} restart after \"{i.cause[:120]}\" failed before its first step")
        # what happened before that restart is its incident's: the next one's cause is the new failure
        self.recent_faults = [f for f in self.recent_faults if f["t"] >= began]
        self.recent_errors = [x for x in self.recent_errors if x["t"] >= began]
        self.recent_gpu = [x for x in self.recent_gpu if x["t"] >= began]
        self.last_alive = max(self.last_alive, began)

    def node_failed(self, cause: str, detected: float, ended_at: float | None = None,
                    level: RestartLevel = RestartLevel.JOB) -> None:
        """A node (a launcher, a pod) is gone: the job-level tier recovers by relaunching it, or (level
        ``injob``) the rendezvous replaces it with a hot spare. An open incident whose restart had begun
        ends as a restart that failed; one whose restart never began (the launcher gave up) is this one's."""
        i = self.incident
        if i is not None and i.restarted:
            self._restart_failed(detected, min(i.restarted.values()))
        node_fault = next((f for f in reversed(self.mon.faults)
                           if f.get("node") is not None and detected - f["t"] < NODE_FAULT_WINDOW_S), None)
        if node_fault:
            cause = f"injected {node_fault['fault']} on node {node_fault['node']}: {cause}"
        fault_time = node_fault["t"] if node_fault else (ended_at or self.last_progress())
        self.open(Incident(level, cause, None, fault_time, detected, self.mon.last_step), force=True)

    def restore(self, e: Event) -> None:
        """Fold in a ``failure`` or ``restart`` event published before (a supervisor that adopts a
        job replays its events): a failure reopens its incident, quietly; a restart closes it."""
        if e.kind == "failure":
            if self.incident is None:
                committed = self.mon.last_committed
                self.stuck_at.append(committed.step if committed else None)
            self.incident = Incident(e["level"], e["cause"], e["blame_rank"], e["fault_time"],
                                     e["detected_at"],
                                     self.mon.last_step)
        elif e.kind == "restart" and self.incident is not None:
            self.incident = None
            self.recovered_to = max(self.incarnation.values(), default=None)
            self.last_alive = max(self.last_alive, e.t)

    # ---- incidents -----------------------------------------------------------------------------
    def open(self, incident: Incident, force: bool = False) -> None:
        if self.incident is not None and not force:
            return
        self.incident = incident
        self._gpu_cause()
        committed = self.mon.last_committed
        if committed is None and not self.steps_expected:
            # a user script's own checkpoints are not seen: it is stuck if no step ran since the last incident
            self.stuck_at.append(("steps", len(self.mon.steps)))
        else:
            self.stuck_at.append(committed.step if committed else None)
        self.emit("failure", level=incident.level, cause=incident.cause, blame_rank=incident.blame_rank,
                  fault_time=incident.fault_time, detected_at=incident.detected_at)
        who = f" (blamed: rank {incident.blame_rank})" if incident.blame_rank is not None else ""
        self.say(f"{incident.level} failure at step {incident.last_step}: {incident.cause}{who}")
        n = self.patience
        if n and len(self.stuck_at) >= n and len(set(self.stuck_at[-n:])) == 1:
            last = self.stuck_at[-1]
            if isinstance(last, tuple):
                self.give_up = (f"no progress: {n} restarts in a row failed before the script took a step "
                                f"(last cause: {incident.cause})")
            else:
                where = f"checkpoint step {last}" if last is not None else "the start"
                self.give_up = (f"no progress: {n} restarts in a row resumed from {where} and failed "
                                "before a newer "
                                f"checkpoint was committed (last cause: {incident.cause})")

    def close(self, first_step_start: float) -> None:
        i, self.incident = self.incident, None
        resumed = i.resumed_step or 0
        downtime = max(0.0, first_step_start - i.fault_time)
        self.emit("restart", level=i.level, cause=i.cause, blame_rank=i.blame_rank, fault_time=i.fault_time,
                  detection_s=max(0.0, i.detected_at - i.fault_time), downtime_s=downtime,
                  rolled_back_steps=max(0, i.last_step - resumed), resumed_step=resumed,
                  phases=i.phases(first_step_start),
                  **({"restored_from": i.restored_from} if i.restored_from else {}))
        self.last_alive = max(self.last_alive, first_step_start)
        self.recovered_to = max(self.incarnation.values(), default=None)
        source = f" (loaded from {i.restored_from})" if i.restored_from else ""
        self.say(f"recovered ({i.level}): resumed from step {resumed}{source}, {downtime:.1f}s "
                 "after the fault")

    def end(self, at: float) -> None:
        """The job ends: a restart still under way (it began, no step yet) counts, as one that failed."""
        i = self.incident
        if i is not None and i.restarted:
            self._restart_failed(at, min(i.restarted.values()))

    # ---- the ranks' errors -----------------------------------------------------------------------
    def _remember(self, error: RankError) -> None:
        self.errors = [*self.errors[-(KEEP - 1):], error]

    def last_error(self) -> RankError | None:
        """The ranks' newest error since the job last took a step (an older one is not why it fails now)."""
        since = self.mon.steps.t[-1] if len(self.mon.steps) else float("-inf")
        recent = [x for x in self.errors if x.t >= since]
        # a rank's own report says more than its traceback's last line, or an exit status
        reported = [x for x in recent if x.rank is not None and not x.text.startswith("exit code")]
        return (reported or recent or [None])[-1]

    def named(self, reason: str) -> str:
        """A failed job's reason, with the ranks' last error (and its fix, where known) when the reason
        does not already say it."""
        error = self.last_error()
        if error is None:
            return reason
        if error.text[:60] not in reason:
            return f"{reason}; the ranks' last error: {error.said()}"
        fix = fix_for(error.text, error.where)
        return f"{reason}; {fix}" if fix and fix not in reason else reason

    # ---- attribution ---------------------------------------------------------------------------
    def _gpu_cause(self) -> None:
        """Name a GPU fault near the open incident as its cause, unless an injected fault explains it."""
        i = self.incident
        near = [g for g in self.recent_gpu if abs(g["t"] - i.detected_at) < NODE_FAULT_WINDOW_S] if i else []
        if not near or i.gpu_fault is not None or self.recent_faults:
            return
        g = i.gpu_fault = near[0]
        i.cause = f"GPU fault on node {g['node']} GPU {g['gpu']}: {g['detail'][:160]}; then {i.cause}"
        if i.fault_time < g["t"] <= i.detected_at:
            i.fault_time = g["t"]

    def last_progress(self) -> float:
        """The last moment the job was known to be fine: its last step, or a later rank start."""
        return max([self.last_alive, *self.mon.steps.t[-1:]])

    def fault_time(self) -> float:
        return self.recent_faults[0]["t"] if self.recent_faults else self.last_progress()

    def cause_from_ranks(self, fallback: str) -> str:
        if faults := self.recent_faults:
            return f"injected {faults[0]['fault']} on rank {faults[0]['rank']}"
        own = [x for x in self.recent_errors if x["origin"] in ("fault", "exception")]
        if own:
            return f"rank {own[0]['rank']} raised {own[0]['error'][:160]}"
        hung = [x for x in self.recent_errors if x["origin"] == "interrupted" and not x["waiting"]]
        if hung:
            return f"rank {hung[0]['rank']} stopped making progress (in-process soft timeout)"
        return fallback

    def cause_from_exit(self, rank: int | None, code: int) -> str:
        """Why a rank's process ended: an injected fault, the error it reported, or its exit status."""
        if faults := self.recent_faults:
            return f"injected {faults[0]['fault']} on rank {faults[0]['rank']}"
        who = f"rank {rank}" if rank is not None else "a rank"
        errors = [x for x in self.recent_errors if x["rank"] == rank]
        if errors:
            return f"{who} failed: {errors[0]['error'][:160]}"
        if code < 0 and -code in signal.Signals._value2member_map_:
            return f"{who} died ({signal.Signals(-code).name})"
        return f"{who} exited with code {code}"

    def blame(self, fallback: int | None = None) -> int | None:
        if faults := self.recent_faults:
            return faults[0]["rank"]
        if fallback is not None:
            return fallback
        for pick in (lambda x: x["origin"] in ("fault", "exception"),
                     lambda x: x["origin"] == "interrupted" and not x["waiting"]):
            found = [x["rank"] for x in self.recent_errors if pick(x)]
            if found:
                return found[0]
        return None
