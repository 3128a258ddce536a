"""The Python API: ``launch(spec)`` and ``attach(name)`` return a :class:`Job`."""

from __future__ import annotations

import time
import warnings
from pathlib import Path
from typing import Any, NamedTuple

from .backends import Backend, whereabouts
from .checkpoint_folders import CheckpointInfo, resume_origin
from . import settings
from .control import FaultCommand
from .errors import ControlError, JobError
from .goodput import Goodput, compute
from .monitor import JobMonitor
from .spec import JobSpec
from .validation import check_fault, prepare
from .states import BACKEND_OVERRIDES, CheckpointState, JobState, RestartLevel


class Standing(NamedTuple):
    """Where a job stands: its state, why (the backend's word, or the reason its events recorded), and
    since when it has waited for what ``detail`` names (pods pending, queue admission, the rendezvous, a
    restart); ``since`` is None where it is not waiting or nobody said since when."""

    state: JobState
    detail: str
    since: float | None = None


class Job:
    """A handle on a job, by name. Cheap to create; any number can exist for the same job."""

    def __init__(self, name: str, backend: Backend) -> None:
        self.name, self.backend = name, backend
        self.monitor = JobMonitor()
        self._events = backend.events(name)
        self.note = ""  # what the call that made this handle has to say (a resume's fallback)

    def __repr__(self) -> str:
        return f"Job({self.name!r}, backend={self.backend.name!r}, state={self.state.value!r})"

    def refresh(self) -> JobMonitor:
        """Fold in the events that arrived since the last call."""
        self.monitor.update(self._events.read())
        return self.monitor

    @property
    def spec(self) -> JobSpec:
        return self.backend.spec(self.name)

    @property
    def state(self) -> JobState:
        return self.status()[0]

    def status(self) -> tuple[JobState, str]:
        """The state and why (see :meth:`standing`)."""
        state, detail, _ = self.standing()
        return state, detail

    def standing(self) -> Standing:
        """The state, why, and since when it waits: what the events say, unless the backend knows better
        (the job is gone, stopped, failed outside the ranks, or not started yet). An ended job is reported
        ended once nothing of it runs; until then (a moment) it is still running, ending. A job whose
        events say it recovers, of which the backend says nothing, waits for its restart since the failure
        was detected."""
        mon = self.refresh()
        if mon.finished:
            if self.backend.settled(self.name):
                return Standing(JobState(mon.state), mon.reason)
            return Standing(JobState.RUNNING, f"ending ({mon.state}: {mon.reason})")
        backend = self.backend.state(self.name)
        if backend.orphaned:   # the one place a look at a job starts something: nothing else would
            return Standing(JobState.RUNNING, self.backend.adopt(self.name))
        if backend.state in BACKEND_OVERRIDES:
            return Standing(JobState(backend.state), backend.detail, backend.since)
        if mon.state == JobState.RECOVERING and mon.failures and not backend.detail:
            failure = mon.failures[-1]   # its level and time were checked as the event was read
            level = RestartLevel(failure["level"]).label
            return Standing(JobState.RECOVERING, f"restarting ({level}) after: {failure['cause']}",
                            failure["detected_at"])
        return Standing(JobState(mon.state), backend.detail, backend.since)

    def inject(self, fault: str, rank: int | None = None, step: int | None = None, node: int = 0,
               after: float | None = None, **params: Any) -> FaultCommand:
        """Queue a fault: now, at the start of ``step``, or ``after`` seconds. It has fired once
        :meth:`fired` finds it (the ranks report it when they fire it)."""
        return self.inject_command(FaultCommand(fault, rank=rank, step=step, after=after, node=node,
                                                params=params))

    def inject_command(self, command: FaultCommand) -> FaultCommand:
        """:meth:`inject` of a command already built, checked once by the command layer."""
        return self.backend.inject(self.name, check_fault(command, self.spec, self.backend))

    def fired(self, command: FaultCommand, timeout: float = 0.0) -> dict[str, Any] | None:
        """The ``fault`` event of ``command`` once a rank fired it, waiting up to ``timeout`` seconds; else
        None."""
        deadline = time.time() + timeout
        while True:
            found = next((f for f in self.refresh().faults if f["id"] == command.id), None)
            if found is not None or time.time() >= deadline:
                return found
            time.sleep(0.2)

    def checkpoints(self) -> list[CheckpointInfo]:
        return self.backend.checkpoints(self.name)

    def resume(self, step: int | None = None, name: str | None = None, **changes: Any) -> Job:
        """Start a new job from one of this job's committed checkpoints.

        With ``step``, that checkpoint or none: one the loader would refuse fails here with the reason.
        Without, the newest that the loader accepts; each newer one refused is said in the new handle's
        ``note`` and, once the new job has loaded it, in its resume event (summary, dashboard): the new
        job's spec names this job's checkpoint folder, so that its ranks fall back the same way.
        The new job gets its own name and checkpoint folder; this job's checkpoints stay as they are.
        ``changes`` are dotted spec fields to change, e.g. ``**{"steps": 200}``.
        """
        committed = [c for c in self.checkpoints() if c.state == CheckpointState.COMMITTED]
        if not committed:
            raise JobError(f"job {self.name!r} has no committed checkpoint",
                           "wait for its first save, or launch anew")
        if step is not None:
            committed = [c for c in committed if c.step == step]
            if not committed:
                steps = ", ".join(str(c.step) for c in self.checkpoints()
                                  if c.state == CheckpointState.COMMITTED)
                raise JobError(f"job {self.name!r} has no committed checkpoint at step {step}",
                               f"pick one of: {steps}")
        skipped: list[dict[str, Any]] = []
        for info in reversed(committed):
            reason = _refusal(info)
            if reason is None:
                break
            skipped.append({"step": info.step, "reason": reason})
        else:
            if step is not None:
                raise JobError(f"checkpoint at step {step} cannot be used: {reason}", "pick another step")
            why = "; ".join(f"step {s['step']}: {s['reason']}" for s in skipped)
            raise JobError(f"no checkpoint of job {self.name!r} can be used ({why})"[:600], "launch anew")
        resume = str(info.path) if step is not None else str(Path(info.path).parent)
        try:
            live, unread = self._live_settings(), ""
        except ControlError as e:   # a record that does not read: the spec's settings, said
            live, unread = {}, f" (the live settings record was refused, {e}: the spec's settings hold)"
        spec = self.spec.replace(**{"name": name or _next_name(self.backend, self.name, f"-from-{info.step}"),
                                    "resume": resume, "checkpoint.dir": None, **settings.spec_changes(live),
                                    **self._measured(), **changes})
        spec, _ = prepare(spec)
        whereabouts.launch(self.backend, spec)
        new = Job(spec.name, self.backend)
        new.note = f"resuming {resume_origin(str(info.path), {'step': info.step, 'skipped': skipped})}"
        if live:
            new.note += " with the live settings in force: " + " ".join(f"{k}={v}" for k, v in live.items())
        new.note += unread
        return new

    def _measured(self) -> dict[str, float]:
        """The step time this job measured, where its spec gives none: the resumed job's step section is sized
        from it (see :mod:`.timeouts`). Its saves are not taken: the state size at the storage throughput
        says what a save takes, and a measured one may carry an injected storage fault."""
        from .preflight.check import measured

        step, _ = measured(self.refresh())
        return {"ft.step_time": step} if step and self.spec.ft.step_time is None else {}

    def _live_settings(self) -> dict[str, int]:
        """The live settings changed while the job ran (``set``), which a job resumed from it keeps."""
        record = self.backend.settings(self.name)
        return record["values"] if record is not None and record["step"] is not None else {}

    def stop(self, timeout: float = 60.0) -> None:
        self.backend.stop(self.name, timeout)

    def logs(self, lines: int = 200, debug: bool = False) -> str:
        return self.backend.logs(self.name, lines, debug)

    def goodput(self) -> Goodput:
        return compute(self.refresh())

    def wait(self, timeout: float = 600.0, poll: float = 0.5) -> JobState:
        """Block until the job ends; return its final state."""
        deadline = time.time() + timeout
        while time.time() < deadline:
            state = self.state
            if state.ended:
                return state
            time.sleep(poll)
        raise TimeoutError(f"job {self.name} still {self.state} after {timeout:.0f}s")

    def summary(self) -> dict[str, Any]:
        mon = self.refresh()
        gp = compute(mon)
        state, detail = self.status()
        return {
            "name": self.name, "backend": self.backend.name, "state": state,
            # an end the events never recorded (a Slurm batch shell that could not start eksft): the backend's
            "reason": mon.reason or (detail if state.ended else ""),
            "steps_done": mon.max_step, "total_steps": mon.total_steps,
            "restarts": mon.restarts_by_level(),
            "restart_events": [{k: r[k] for k in ("level", "cause", "blame_rank", "downtime_s", "detection_s",
                                                  "rolled_back_steps", "resumed_step")}
                               | {"phases": r.get("phases"), "restored_from": r.get("restored_from"),
                                  "recovered": r.get("recovered", True)} for r in mon.restarts],
            "checkpoints_committed": sum(c.state == CheckpointState.COMMITTED
                                         for c in mon.checkpoints.values()),
            "checkpoints_rejected": [{"step": c.step, "reason": c.error} for c in mon.checkpoints.values()
                                     if c.state == CheckpointState.REJECTED],
            "goodput": gp.to_dict(), "digest": mon.digest,
            "resumed_from": resume_origin(self.spec.resume, mon.resumes[0] if mon.resumes else None),
            "events_lost": [{k: e.get(k) for k in ("rank", "count", "error", "kinds")}
                            for e in mon.events_lost],
            "warnings": [w["message"] for w in mon.warnings],
        }


def launch(spec: JobSpec | None = None, faults: list[FaultCommand | str] | None = None, **fields: Any) -> Job:
    """Launch a job from a spec (or from spec fields, dotted for nested ones) and return its handle."""
    spec = (spec or JobSpec()).replace(**fields) if fields else (spec or JobSpec())
    spec, commands = prepare(spec, faults or [])
    backend = whereabouts.of_spec(spec)
    whereabouts.launch(backend, spec, commands)
    return Job(spec.name, backend)


def attach(name: str, backend: str | None = None) -> Job:
    """A handle on an existing job (from any process, after a kernel restart too), on its backend as it
    was launched (an EKS job's namespace and context); ``backend``: where to look (default: every backend
    that can hold it; two jobs of the name are refused, each named)."""
    b = whereabouts.find(name, backend)
    b.spec(name)  # raises a clear error for an unknown name
    return Job(name, b)


def _refusal(info: CheckpointInfo) -> str | None:
    """Why the loader would refuse ``info`` (see :func:`~eksft_nb.runtime.checkpoint.safe_load.refusal`);
    None where its files are not reachable from here (an EKS volume): the ranks check it, and fall back,
    there."""
    if not Path(info.path).exists():
        return None
    with warnings.catch_warnings():  # torch's import warns about pynvml: noise to whoever reads the answer
        warnings.filterwarnings("ignore", message="The pynvml package is deprecated", category=FutureWarning)
        from .runtime.checkpoint.safe_load import refusal

    return refusal(info)


def _next_name(backend: Backend, name: str, suffix: str) -> str:
    """``name + suffix`` (shortened to stay a 63-character DNS label), made unique with -2, -3..."""
    taken = {j.name for j in backend.jobs()}
    n = 1
    while True:
        tail = suffix if n == 1 else f"{suffix}-{n}"
        candidate = name[: 63 - len(tail)].rstrip("-") + tail
        if candidate not in taken:
            return candidate
        n += 1
