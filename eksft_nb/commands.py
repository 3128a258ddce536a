"""The one command layer under every front end (``python -m eksft_nb``, the magics, the JupyterLab
server extension): typed operations that return JSON-ready models and print nothing. The table of their
arguments, from which the CLI's and the magics' parsers are built, is :mod:`.arguments`.

Bad input raises the :class:`~eksft_nb.errors.EksftError` the CLI shows (``str(e)`` is the one line),
before anything is written.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypedDict

from . import ckpt_floor, cost, row_cache
from .backends import Backend, JobSummary, get_backend, whereabouts
from .backends.folder import FolderJobs
from .control import FaultCommand
from .errors import ControlError, EksftError, SpecError, closest, shown
from .goodput import compute
from .engines.registry import engine_of
from .job import Job, Standing, attach
from .preflight import check as preflight
from .preflight.check import CheckResult
from .spec import JobSpec, spec_options
if TYPE_CHECKING:
    from .preflight.doctor import DoctorResult
from .spec_fields import parse_option_value
from .states import JobState, RestartLevel
from .validation import check_fault, check_settings, faults_for, prepare

# the one validation, here for every front end
__all__ = ["check_fault", "check_settings", "faults_for", "prepare"]


class JobRow(TypedDict):
    """One job at a glance: what the list, the status line and the side panel show."""

    name: str
    backend: str
    state: str                  # a JobState value
    step: int                   # the last step seen (0 before any)
    total_steps: int | None     # None: a user's script (its own loop decides)
    restarts: dict[str, int]    # by RestartLevel value
    goodput: float | None       # productive share of wall time, 0..1; None before the job started
    last_checkpoint: int | None  # the newest committed step
    script: str | None
    ended: bool
    detail: str                 # the backend's reason (why it failed, what a pod waits for) or ""
    started_at: float | None    # when it started (its first record); None before
    ended_at: float | None      # when it ended (its end record, else its last event); None while it runs
    waiting_since: float | None  # since when it waits for what ``detail`` names (see job.Standing), or None


class Removal(TypedDict):
    """One job of an ``rm`` of many: removed, or refused with the line that says what to do first."""

    name: str
    backend: str
    removed: bool
    message: str


class InjectResult(TypedDict):
    id: str
    job: str
    fault: str
    target: str      # "rank 1" | "node 0"
    when: str        # "now" | "step 30" | "after 2.0s"
    fired: bool
    step: int | None  # where it fired
    message: str     # the line the CLI prints


class SettingsResult(TypedDict):
    job: str
    seq: int | None               # the change's number; None: nothing to change
    values: dict[str, int]        # every live setting once it is taken
    changes: dict[str, list[int]]  # name -> [old, new]
    applied: bool                 # every rank took it (within the wait)
    step: int | None              # the step every rank took it at
    message: str                  # the line the CLI prints


class ResumeResult(JobRow):
    message: str     # the line the CLI prints: where the new job starts, each checkpoint refused before it


class StopResult(JobRow):
    message: str     # the line the CLI prints


class LaunchResult(JobRow):
    warnings: list[str]   # the pre-flight's warnings (``check``): said, and launched


# ---- the operations ---------------------------------------------------------------------------

def job_row(job: Job, status: Standing | tuple[JobState, str] | None = None,
            spec: JobSpec | None = None) -> JobRow:
    """The row of a job whose events this process can read (any local job, an EKS job by name): what the
    list, the status line, the side panel and the dashboard's header show. ``status``: the standing of a
    job whose events the caller has just folded in (the dashboard: its thread alone feeds its monitor);
    ``spec``: the job's, where the caller holds it (on EKS reading it is an API call)."""
    mon = job.refresh() if status is None else job.monitor
    status = job.standing() if status is None else status
    state, detail, since = status[0], status[1], status[2] if len(status) > 2 else None
    spec = spec or job.spec
    committed = mon.last_committed
    ended_at = (mon.t_end or mon.last_event_t) if state.ended else None
    return {"name": job.name, "backend": job.backend.name, "state": state.value, "step": mon.last_step,
            "total_steps": None if spec.script else (mon.total_steps or spec.steps),
            "restarts": mon.restarts_by_level(), "goodput": compute(mon).goodput if mon.t_start else None,
            "last_checkpoint": committed.step if committed else None, "script": spec.script,
            "ended": state.ended, "detail": detail, "started_at": mon.t_start, "ended_at": ended_at,
            "waiting_since": since}


def list_jobs(backend: str = "local") -> list[JobRow]:
    """Every job of ``backend``, oldest first. On EKS a job's events come from its pods' logs, which
    is too slow for a listing: its row holds the workload's state only (``status`` has the rest)."""
    b = get_backend(backend)
    rows: list[JobRow] = []
    for j in b.jobs():
        try:
            rows.append(row_cache.row_of(Job(j.name, b), job_row, JobRow) if isinstance(b, FolderJobs)
                        else summary_row(j, j.detail))
        except EksftError as e:   # one unreadable job folder hides no other job
            rows.append(summary_row(j, str(e)))
    return rows


def summary_row(j: JobSummary, detail: str) -> JobRow:
    """A row from the backend's view alone (no events read)."""
    state = JobState(j.state) if j.state in set(JobState) else JobState.FAILED
    return {"name": j.name, "backend": j.backend, "state": state.value, "step": 0, "total_steps": None,
            "restarts": {level.value: 0 for level in RestartLevel}, "goodput": None, "last_checkpoint": None,
            "script": None, "ended": state.ended, "detail": detail, "started_at": None, "ended_at": None,
            "waiting_since": j.since}


def status(name: str, backend: str | None = None) -> JobRow:
    return job_row(attach(name, backend))


def launch(spec: JobSpec, faults: Sequence[str | FaultCommand] = ()) -> LaunchResult:
    """Validate the spec and the faults (a contradiction of its timeouts that guarantees failure is
    refused), start the job detached, return its first row and the pre-flight's warnings."""
    spec, commands = prepare(spec, faults)
    b = whereabouts.of_spec(spec)
    whereabouts.launch(b, spec, commands)
    return {**job_row(Job(spec.name, b)), "warnings": preflight.check(spec).warnings}


def check(spec: JobSpec, from_job: str | None = None, backend: str | None = None) -> CheckResult:
    """The pre-flight of ``spec``: every timeout acting on it, and each contradiction (see
    :mod:`.preflight.check`). ``from_job``: a job whose events measured a step and a save."""
    spec = spec.validate()
    engine_of(spec).check(spec)
    step = save = None
    if from_job:
        step, save = preflight.measured(attach(from_job, backend).refresh())
    if save and not spec.ft.save_time:
        spec = spec.replace(**{"ft.save_time": save})
    return preflight.check(spec, step_time=step).to_dict()


def doctor(spec: JobSpec | None = None, on_node: bool = False) -> DoctorResult:
    """The versions this environment has, what each supports, and what it would refuse of ``spec``
    (see :mod:`.preflight.doctor`)."""
    from .preflight.doctor import diagnose

    return diagnose(spec.validate() if spec else None, on_node=on_node).to_dict()


def dry_run(spec: JobSpec, queue_objects: bool = False, faults: Sequence[str | FaultCommand] = ()) -> str:
    """What :func:`launch` would start (EKS: the manifests; local: the launchers' commands), the spec and
    ``faults`` checked as a launch checks them. ``queue_objects``: on EKS, also a Kueue LocalQueue,
    ClusterQueue and ResourceFlavors for the job's queue."""
    spec, _ = prepare(spec, faults, launching=False)
    backend = get_backend(spec.backend)
    if queue_objects and spec.backend == "eks":
        return backend.render(spec, queue_objects=True)
    return backend.render(spec)


def inject(name: str, fault: str, *, rank: int | None = None, step: int | None = None,
           after: float | None = None,
           node: int = 0, params: dict[str, Any] | None = None, backend: str | None = None,
           wait: float = 0.0) -> InjectResult:
    """Queue a fault into a running job; wait up to ``wait`` seconds for a rank to fire it."""
    command = FaultCommand(fault, rank=rank, step=step, after=after, node=node, params=dict(params or {}))
    return inject_command(name, command, backend=backend, wait=wait)


def inject_command(name: str, command: FaultCommand, *, backend: str | None = None,
                   wait: float = 0.0) -> InjectResult:
    """:func:`inject` of a command already built (the server reads one from a request body)."""
    job = attach(name, backend)
    cmd = job.inject_command(command)
    fired = job.fired(cmd, timeout=wait)
    if fired is not None:
        at = f" at step {fired['step']}" if fired["step"] is not None else ""
        message = f"fired {cmd.fault} on {cmd.target} of {job.name}{at}"
    else:
        message = (f"queued {cmd.fault} for {cmd.target} of {job.name} ({cmd.when}); it shows as fired "
                   "when the rank fires it")
    when = (f"step {cmd.step}" if cmd.step is not None
            else f"after {cmd.after:g}s" if cmd.after is not None else "now")
    return {"id": cmd.id, "job": job.name, "fault": cmd.fault, "target": cmd.target, "when": when,
            "fired": fired is not None, "step": fired["step"] if fired is not None else None,
            "message": f"{message}; id {cmd.id}"}


def set_settings(name: str, values: Sequence[str] | Mapping[str, Any], backend: str | None = None,
                 wait: float = 0.0) -> SettingsResult:
    """Change live settings of a running job (``["ckpt-every=25"]`` or ``{"ckpt-every": 25}``): every
    rank takes them at the same step; wait up to ``wait`` seconds for that step (see :mod:`.settings`)."""
    from . import settings

    changes = (settings.check_values(values) if isinstance(values, Mapping)
               else settings.parse_assignments(values))
    job = attach(name, backend)
    check_settings(job.spec)
    asked = job.backend.set_settings(job.name, changes)
    diff = {k: [asked["before"][k], v] for k, v in asked["values"].items() if asked["before"][k] != v}
    said = ", ".join(f"{k} {old} -> {new}" for k, (old, new) in diff.items())
    result: SettingsResult = {"job": job.name, "seq": asked["seq"], "values": asked["values"],
                              "changes": diff, "applied": False, "step": None, "message": ""}
    if asked["seq"] is None:
        now = " ".join(f"{k}={v}" for k, v in asked["values"].items())
        return {**result, "message": f"{job.name} already runs with {now}: nothing changed"}
    deadline = time.monotonic() + wait
    while True:
        taken = job.refresh().settings.get(asked["seq"])
        if taken is not None and len(taken["ranks"]) >= job.spec.world_size:
            steps = sorted(set(taken["ranks"].values()))
            at = f"step {steps[0]}" if len(steps) == 1 else f"steps {steps}"
            return {**result, "applied": True, "step": steps[0] if len(steps) == 1 else None,
                    "message": f"{job.name}: {said}, taken by all {len(taken['ranks'])} ranks at {at}"}
        if time.monotonic() >= deadline:
            return {**result, "message": f"{job.name}: queued {said} (change {asked['seq']}); every rank "
                    "takes it at the same step, the next they all reach"}
        time.sleep(0.2)


def settings_in_force(name: str, backend: str | None = None) -> dict[str, Any]:
    """The live settings a job runs with: seq, values, and the step they took effect at (None: the spec's)."""
    job = attach(name, backend)
    record = job.backend.settings(job.name)
    if record is None:
        raise ControlError(f"the {job.backend.name} backend keeps no live settings",
                           "read the job's spec (status, summary)")
    return {"job": job.name, **record}


def apply_whatif(name: str, backend: str | None = None, wait: float = 0.0) -> SettingsResult:
    """Set the checkpoint interval the what-if recommends for ``name``, live."""
    job = attach(name, backend)
    check_settings(job.spec)   # before the what-if's work
    backend = job.backend.name
    rec = whatif(name, backend=backend)["recommendation"]
    if rec["every"] is None:
        raise ControlError(f"the what-if recommends no interval ({rec['text']})",
                           "apply one yourself, e.g. set NAME ckpt-every=20")
    return set_settings(name, {"ckpt-every": rec["every"]}, backend=backend, wait=wait)


def stop(name: str, backend: str | None = None) -> StopResult:
    """End the job; when this returns nothing of it runs."""
    job = attach(name, backend)
    job.stop()
    return {**job_row(job), "message": f"stopped {job.name}; nothing of it keeps running"}


def checkpoints(name: str, backend: str | None = None) -> list[dict[str, Any]]:
    return [i.to_dict() for i in attach(name, backend).checkpoints()]


def resume(name: str, *, step: int | None = None, new_name: str | None = None, steps: int | None = None,
           backend: str | None = None) -> ResumeResult:
    """Start a new job from a committed checkpoint of ``name`` (``step``, or the newest the loader
    accepts, each newer one refused said in ``message``); the new job's row."""
    changes = {"steps": steps} if steps else {}
    new = attach(name, backend).resume(step=step, name=new_name, **changes)
    return {**job_row(new), "message": f"launched {new.name}, {new.note}"}


def summary(name: str, backend: str | None = None, **cost_options: Any) -> dict[str, Any]:
    """Steps, restarts (each with cause and downtime), checkpoints, goodput, final digest, and what its time
    cost (``cost_options``: price, run_for, nodes, failures_per_day; see :mod:`.cost`)."""
    job = attach(name, backend)
    out = job.summary()
    p = cost.pricing(job.spec, **cost_options)
    seconds = {k[:-2]: v for k, v in out["goodput"].items() if k.endswith("_s") and k != "wall_s"}
    out["cost"] = cost.account(seconds, len(out["restart_events"]), job.spec.world_size, job.spec.nnodes, p)
    out["checkpoint_floor"] = ckpt_floor.floor(job.monitor, job.spec.world_size)
    return out


def logs(name: str, lines: int = 200, debug: bool = False, backend: str | None = None) -> str:
    return attach(name, backend).logs(lines, debug)


def finished_jobs(backend: str = "local") -> list[str]:
    """The names of the backend's ended jobs (what ``rm --finished`` removes)."""
    return [r["name"] for r in list_jobs(backend) if r["ended"]]


def remove_jobs(jobs: Sequence[tuple[str, str | None]]) -> list[Removal]:
    """``rm`` of many (name, backend) pairs, each job on the backend that holds it as it was launched (no
    backend: whichever holds it, see :mod:`.backends.whereabouts`): each removed or refused on its own (one
    unknown, still running, or a running resume loads from), a refusal stopping none of the others. A job
    removed leaves no record of where it lived."""
    jobs = list(dict.fromkeys(jobs))   # a job named twice is removed once
    said: dict[tuple[str, str | None], tuple[str, EksftError | None]] = {}
    found: dict[tuple[object, ...], tuple[Backend, list[tuple[str, str | None]]]] = {}
    for name, kind in jobs:
        try:
            b = whereabouts.find(name, kind)
        except EksftError as e:
            said[name, kind] = (kind or "local", e)
            continue
        where = (b.name, *sorted(whereabouts.recorded(b, name).items()))   # its backend's settings
        found.setdefault(where, (b, []))[1].append((name, kind))
    for b, group in found.values():   # one call per backend: it may look across its jobs once for many
        for (name, kind), error in zip(group, b.remove_many([n for n, _ in group])):
            said[name, kind] = (b.name, error)
            if error is None:
                whereabouts.forget(b.name, name)
    return [{"name": n, "backend": said[n, k][0], "removed": said[n, k][1] is None,
             "message": f"removed {n}" if said[n, k][1] is None else str(said[n, k][1])} for n, k in jobs]


def resilience_test(spec: JobSpec, faults: str | None = None, expect: str | None = None,
                    **options: Any) -> dict[str, Any]:
    """Run ``spec`` fault-free, then ``repeat`` times per fault kind that applies (``faults``:
    "sigkill,hang"), and check each trial against ``expect``; the report card (see :mod:`.resilience.card`).
    ``options``: those of :func:`.resilience.run.campaign` (repeat, manifest, recheck, price...)."""
    from .resilience import run

    return dict(run.campaign(launch, spec, faults, expect, **options))


def whatif(name: str, *, ckpt_every: str | Sequence[int] | None = None, inprocess: bool | None = None,
           ckpt_mode: str | None = None, spares: int | None = None, backend: str | None = None,
           **cost_options: Any) -> dict[str, Any]:
    """The ETTR and time breakdown a job would have had under other settings, replayed from its
    events, with a recommended checkpoint interval (see :mod:`.resilience.whatif`), each setting priced
    (``cost_options``: price, run_for, nodes, failures_per_day; see :mod:`.cost`)."""
    from .resilience import whatif as model
    from .resilience import whatif_cost

    job = attach(name, backend)
    settings = model.parse_settings(ckpt_every, inprocess, ckpt_mode, spares)
    p = cost.pricing(job.spec, **cost_options)
    return whatif_cost.priced(model.replay(job.refresh(), job.spec, settings), job.spec, p)


def spec_from_options(values: Mapping[str, Any], base: JobSpec | None = None,
                      validate: bool = True) -> JobSpec:
    """``base`` (default: the defaults) with dotted spec fields changed, validated unless a launch will
    (``validate=False``). A string value is read as the option's text would be (``"100"`` for ``steps``);
    other values must have the field's type."""
    options = {o.path: o for o in spec_options()}
    changes = {}
    for path, raw in values.items():
        opt = options.get(path)
        if opt is None:
            raise SpecError(f"unknown spec field {shown(path)}", f"did you mean {closest(path, options)}?")
        changes[path] = parse_option_value(opt, raw) if isinstance(raw, str) else raw
    spec = base or JobSpec()
    spec = spec.replace(**changes) if changes else spec
    return spec.validate() if validate else spec
