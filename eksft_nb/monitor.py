"""JobMonitor: folds a job's event stream into the state that the CLI, the dashboard and the
supervisor read (steps, checkpoints, restarts, faults, outcome). Feed it events in order with
:meth:`update`; it keeps per-step data compactly and never re-reads what it has seen."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from .events import Event
from .gpuhealth.fold import GpuFold
from .states import RECORDED_ENDS, CheckpointState, JobState, RestartLevel


@dataclass
class CheckpointRecord:
    step: int
    mode: str = ""
    t_begin: float | None = None
    t_staged: float | None = None
    t_done: float | None = None
    state: CheckpointState = CheckpointState.IN_FLIGHT   # in flight, committed, failed or rejected
    blocked_s: float | None = None
    background_s: float | None = None
    bytes: int | None = None
    path: str | None = None
    error: str | None = None
    staged_bytes: int | None = None   # one rank's state, as it staged it (async)
    copy_s: float | None = None       # the seconds its copies alone took (the stall's floor, see ckpt_floor)


@dataclass
class StepSeries:
    """Columnar per-step data (one entry per executed step, re-executions included)."""

    step: list[int] = field(default_factory=list)
    t: list[float] = field(default_factory=list)
    loss: list[float | None] = field(default_factory=list)     # None: not reported (a user script's step)
    step_time: list[float] = field(default_factory=list)
    tokens: list[int | None] = field(default_factory=list)     # likewise
    batches: list[int | None] = field(default_factory=list)    # the ranks' batches it trained (None: all)

    def __len__(self) -> int:
        return len(self.step)

    def throughput(self, last: int = 20) -> tuple[float, str] | None:
        """Over the last steps: (tokens per second, "tok/s") when they report tokens, else (steps per
        second, "steps/s"); None before any step."""
        times, tokens = self.step_time[-last:], self.tokens[-last:]
        if not times:
            return None
        dt = sum(times) or 1e-9
        if all(n is not None for n in tokens):
            return sum(tokens) / dt, "tok/s"
        return len(times) / dt, "steps/s"


@dataclass
class JobMonitor:
    name: str = ""
    total_steps: int | None = None
    world_size: int | None = None
    backend: str = ""
    t_start: float | None = None
    t_end: float | None = None
    state: JobState = JobState.STARTING   # never lost: only a backend can tell a job is gone
    reason: str = ""
    steps: StepSeries = field(default_factory=StepSeries)
    checkpoints: dict[int, CheckpointRecord] = field(default_factory=dict)
    restarts: list[dict[str, Any]] = field(default_factory=list)
    failures: list[dict[str, Any]] = field(default_factory=list)
    faults: list[dict[str, Any]] = field(default_factory=list)
    rank_errors: list[dict[str, Any]] = field(default_factory=list)
    resumes: list[dict[str, Any]] = field(default_factory=list)
    events_lost: list[dict[str, Any]] = field(default_factory=list)   # a writer could not write them
    warnings: list[dict[str, Any]] = field(default_factory=list)      # warning events, in order
    settings: dict[int, dict[str, Any]] = field(default_factory=dict)  # live changes by seq (setting events)
    drain: dict[str, Any] | None = None   # the ranks stopped on SIGTERM after saving (the drain event)
    rank_pids: dict[int, int] = field(default_factory=dict)
    nvrx: str | None = None   # the NVRx version the job ran with, as its supervisor found it (job_start)
    # (attempt, cycle) -> record
    nvrx_cycles: dict[tuple[int, int], dict[str, Any]] = field(default_factory=dict)
    # what NVRx's in-process Wrapper added to each rank process (inprocess_wrapper events, in order)
    wrapper: list[dict[str, Any]] = field(default_factory=list)
    saves: list[CheckpointRecord] = field(default_factory=list)   # every save begun, a step's repeats too
    gpu: GpuFold = field(default_factory=GpuFold)   # GPU health per node (gpu_health / gpu_fault events)
    digest: str | None = None
    checkpoint_stall_s: float = 0.0
    last_event_t: float | None = None
    n_events: int = 0

    def update(self, events: Iterable[Event]) -> list[Event]:
        """Fold events in; return them (handy for chaining)."""
        events = list(events)
        for e in events:
            self.n_events += 1
            self.last_event_t = e.t
            handler = getattr(self, f"_on_{e.kind}", None)
            if handler is not None:
                handler(e)
        return events

    # -- derived views --
    @property
    def last_step(self) -> int:
        return self.steps.step[-1] if self.steps.step else 0

    @property
    def max_step(self) -> int:
        return max(self.steps.step) if self.steps.step else 0

    @property
    def last_committed(self) -> CheckpointRecord | None:
        done = [c for c in self.checkpoints.values() if c.state == CheckpointState.COMMITTED]
        return max(done, key=lambda c: c.step) if done else None

    def restarts_by_level(self) -> dict[str, int]:
        out = {level.value: 0 for level in RestartLevel}
        for r in self.restarts:
            out[r["level"]] = out.get(r["level"], 0) + 1
        return out

    @property
    def finished(self) -> bool:
        return self.state in RECORDED_ENDS

    # -- handlers --
    def _on_job_start(self, e: Event) -> None:
        self.name = e.job
        self.t_start = self.t_start or e.t
        self.total_steps, self.world_size, self.backend = e["steps"], e["world_size"], e["backend"]
        self.nvrx = e.get("nvrx") if isinstance(e.get("nvrx"), str) else None
        self.state = JobState.RUNNING

    def _on_rank_start(self, e: Event) -> None:
        self.rank_pids[e.rank] = e["pid"]
        if self.state in (JobState.STARTING, JobState.RECOVERING):
            self.state = JobState.RUNNING
        self.t_start = self.t_start or e.t

    def _on_step(self, e: Event) -> None:
        s = self.steps
        s.step.append(e["step"])
        s.t.append(e.t)
        s.loss.append(e["loss"])
        s.step_time.append(e["step_time"])
        s.tokens.append(e["tokens"])
        s.batches.append(e.get("batches"))
        if self.state == JobState.RECOVERING:
            self.state = JobState.RUNNING

    def _on_checkpoint(self, e: Event) -> None:
        step, phase = e["step"], e["phase"]
        rec = self.checkpoints.get(step)
        if phase == "begin" or rec is None:
            rec = self.checkpoints[step] = CheckpointRecord(step, mode=e.get("mode", ""), t_begin=e.t)
            self.saves.append(rec)
        if phase == "staged":
            rec.t_staged, rec.blocked_s, rec.bytes = e.t, e.get("blocked_s"), e.get("bytes")
            rec.staged_bytes, rec.copy_s = e.get("bytes"), e.get("copy_s")
            self.checkpoint_stall_s += rec.blocked_s or 0.0
        elif phase == "committed":
            # sync saves block for all of it; async ones only for staging plus any wait at the end
            self.checkpoint_stall_s += max(0.0, (e.get("blocked_s") or 0.0) - (rec.blocked_s or 0.0))
            rec.state, rec.t_done, rec.path = CheckpointState.COMMITTED, e.t, e.get("path")
            rec.blocked_s, rec.background_s = e.get("blocked_s"), e.get("background_s")
            rec.bytes = e.get("bytes")
            if rec.t_staged is None:
                rec.t_staged = (rec.t_begin or e.t) + (rec.blocked_s or 0.0)
        elif phase in ("failed", "rejected"):
            rec.state, rec.t_done = CheckpointState(phase), e.t
            rec.error = e.get("error") or e.get("reason")

    def _on_fault(self, e: Event) -> None:
        self.faults.append({"t": e.t, "fault": e["fault"], "rank": e["target_rank"], "step": e["at_step"],
                            "id": e["id"], **{k: v for k, v in e.data.items() if k in ("node", "path")}})

    def _on_rank_error(self, e: Event) -> None:
        self.rank_errors.append({"t": e.t, "rank": e.rank, "error": e["error"], "step": e["step"],
                                 "origin": e["origin"]})

    def _on_failure(self, e: Event) -> None:
        self.failures.append({"t": e.t, **e.data})
        self.state = JobState.RECOVERING

    def _on_restart(self, e: Event) -> None:
        restart = {"t": e.t, **e.data}
        # NVRx 0.6+: the worker-group cycle this restart began, and the nodes NVRx's record names for it
        if restart["level"] in (RestartLevel.INJOB, RestartLevel.JOB):
            began = [k for k, c in self.nvrx_cycles.items() if restart["fault_time"] <= c["start"] <= e.t]
            if began:
                self._name_cycle(restart, max(began, key=lambda k: self.nvrx_cycles[k]["start"]))
        self.restarts.append(restart)

    def _name_cycle(self, restart: dict[str, Any], key: tuple[int, int]) -> None:
        cycle = self.nvrx_cycles[key]
        restart["nvrx_cycle"] = key[1]
        restart["nvrx_nodes"] = {k: cycle[k] for k in ("active_nodes", "standby_nodes", "active_ranks")
                                 if cycle.get(k)}

    def _on_nvrx_cycle(self, e: Event) -> None:
        key = (e["attempt"], e["cycle"])
        self.nvrx_cycles[key] = dict(e.data)
        for restart in self.restarts:   # a record read after the restart it began (a pod's rank relays it)
            if ("nvrx_cycle" not in restart and restart["level"] in (RestartLevel.INJOB, RestartLevel.JOB)
                    and restart["fault_time"] <= e["start"] <= restart["t"]):
                self._name_cycle(restart, key)

    def _on_resume(self, e: Event) -> None:
        self.resumes.append({"t": e.t, **e.data})

    def _on_events_lost(self, e: Event) -> None:
        self.events_lost.append({"rank": e.rank, **e.data})

    def _on_setting(self, e: Event) -> None:
        """One record per change: when and at which step each rank took it (the same, when agreed)."""
        first = {"seq": e["seq"], "t": e.t, "step": e["step"], "changes": e["changes"], "values": e["values"],
                 "ranks": {}}
        record = self.settings.setdefault(e["seq"], first)
        record["ranks"].setdefault(e.rank, e["step"])

    def _on_drain(self, e: Event) -> None:
        self.drain = {"t": e.t, **e.data}

    def _on_warning(self, e: Event) -> None:
        self.warnings.append({"t": e.t, "rank": e.rank, "what": e["what"], "message": e["message"]})

    def _on_inprocess_wrapper(self, e: Event) -> None:
        self.wrapper.append({"t": e.t, "rank": e.rank, "phase": e["phase"], "seconds": e["seconds"]})

    def _on_gpu_health(self, e: Event) -> None:
        self.gpu.on_health(e.t, e.data)

    def _on_gpu_fault(self, e: Event) -> None:
        self.gpu.on_fault(e.t, e.data)

    def _on_rank_end(self, e: Event) -> None:
        self.digest = e.get("digest", self.digest)

    def _on_job_end(self, e: Event) -> None:
        self.state, self.reason, self.t_end = JobState(e["state"]), e["reason"], e.t
        self.digest = e.get("digest", self.digest)
