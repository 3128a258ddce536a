"""The one command layer under every front end (``python -m eksft_nb``, the magics, the JupyterLab
server extension): typed operations that return JSON-ready models and print nothing, and :data:`ARGS`,
the one table of their arguments from which the CLI's and the magics' parsers are built.

Bad input raises the :class:`~eksft_nb.errors.EksftError` the CLI shows (``str(e)`` is the one line),
before anything is written.

About 500 lines, one idea: every operation the front ends share, beside the table that parses them.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypedDict

from .backends import JobSummary, get_backend, whereabouts
from .control import FAULTS, FaultCommand
from .errors import ControlError, EksftError, SpecError, closest, shown
from .goodput import compute
from .engines.registry import engine_of
from .job import Job, attach
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

def job_row(job: Job, status: tuple[JobState, str] | None = None, spec: JobSpec | None = None) -> JobRow:
    """The row of a job whose events this process can read (any local job, an EKS job by name): what the
    list, the status line, the side panel and the dashboard's header show. ``status``: the state and
    detail of a job whose events the caller has just folded in (the dashboard: its thread alone feeds
    its monitor); ``spec``: the job's, where the caller holds it (on EKS reading it is an API call)."""
    mon = job.refresh() if status is None else job.monitor
    state, detail = job.status() if status is None else status
    spec = spec or job.spec
    committed = mon.last_committed
    return {"name": job.name, "backend": job.backend.name, "state": state.value, "step": mon.last_step,
            "total_steps": None if spec.script else (mon.total_steps or spec.steps),
            "restarts": mon.restarts_by_level(), "goodput": compute(mon).goodput if mon.t_start else None,
            "last_checkpoint": committed.step if committed else None, "script": spec.script,
            "ended": state.ended, "detail": detail}


def list_jobs(backend: str = "local") -> list[JobRow]:
    """Every job of ``backend``, oldest first. On EKS a job's events come from its pods' logs, which
    is too slow for a listing: its row holds the workload's state only (``status`` has the rest)."""
    b = get_backend(backend)
    rows: list[JobRow] = []
    for j in b.jobs():
        try:
            rows.append(job_row(Job(j.name, b)) if backend in ("local", "slurm")
                        else summary_row(j, j.detail))
        except EksftError as e:   # one unreadable job folder hides no other job
            rows.append(summary_row(j, str(e)))
    return rows


def summary_row(j: JobSummary, detail: str) -> JobRow:
    """A row from the backend's view alone (no events read)."""
    state = JobState(j.state) if j.state in set(JobState) else JobState.FAILED
    return {"name": j.name, "backend": j.backend, "state": state.value, "step": 0, "total_steps": None,
            "restarts": {level.value: 0 for level in RestartLevel}, "goodput": None, "last_checkpoint": None,
            "script": None, "ended": state.ended, "detail": detail}


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


def summary(name: str, backend: str | None = None) -> dict[str, Any]:
    """Steps, restarts (each with cause and downtime), checkpoints, goodput, final digest."""
    return attach(name, backend).summary()


def logs(name: str, lines: int = 200, debug: bool = False, backend: str | None = None) -> str:
    return attach(name, backend).logs(lines, debug)


def remove(name: str, backend: str | None = None) -> None:
    """Delete an ended job (its folder or workload, checkpoints included)."""
    b = whereabouts.find(name, backend)
    b.remove(name)
    whereabouts.forget(b.name, name)


def resilience_test(spec: JobSpec, faults: str | None = None, expect: str | None = None, *,
                    at_step: int | None = None, loss_tolerance: float | None = None,
                    say: Callable[[str], object] = lambda text: None,
                    on_row: Callable[[Any], object] = lambda card: None) -> dict[str, Any]:
    """Run ``spec`` fault-free, then once per fault kind that applies (``faults``: "sigkill,hang"),
    and check each case against ``expect``; the report card (see :mod:`.resilience.card`)."""
    from .resilience import card, plan, run

    tolerance = card.LOSS_TOLERANCE if loss_tolerance is None else loss_tolerance
    if not (isinstance(tolerance, (int, float)) and 0 < tolerance < 1):
        raise EksftError(f"--loss-tol {shown(loss_tolerance)} is not a fraction",
                         "use e.g. --loss-tol 0.02 (2 %)")
    return dict(run.run_test(launch, spec, plan.parse_kinds(faults), expect, at_step=at_step, say=say,
                             on_row=on_row, tolerance=tolerance))


def whatif(name: str, *, ckpt_every: str | Sequence[int] | None = None, inprocess: bool | None = None,
           ckpt_mode: str | None = None, spares: int | None = None,
           backend: str | None = None) -> dict[str, Any]:
    """The ETTR and time breakdown a job would have had under other settings, replayed from its
    events, with a recommended checkpoint interval (see :mod:`.resilience.whatif`)."""
    from .resilience import whatif as model

    job = attach(name, backend)
    settings = model.parse_settings(ckpt_every, inprocess, ckpt_mode, spares)
    return model.replay(job.refresh(), job.spec, settings).to_dict()


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


# ---- the argument table -----------------------------------------------------------------------

CLI, MAGIC = "cli", "magic"
BOTH = frozenset({CLI, MAGIC})


@dataclass(frozen=True)
class Arg:
    """One argument: argparse's names and keywords, the front ends that take it, and what differs in
    the magics (there a job NAME may be left out: the notebook's current job is meant)."""

    names: tuple[str, ...]
    kwargs: Mapping[str, Any]
    fronts: frozenset[str] = BOTH
    magic: Mapping[str, Any] = field(default_factory=dict)

    @property
    def flags(self) -> list[str]:
        return [n for n in self.names if n.startswith("-")]

    def add_to(self, parser: argparse.ArgumentParser | Any, front: str) -> None:
        parser.add_argument(*self.names, **{**self.kwargs, **(self.magic if front == MAGIC else {})})


def arg(*names: str, fronts: frozenset[str] = BOTH, magic: Mapping[str, Any] | None = None,
        **kwargs: Any) -> Arg:
    return Arg(names, kwargs, fronts, magic or {})


@dataclass(frozen=True)
class Verb:
    """A command: ``python -m eksft_nb NAME`` and ``%ftrain NAME`` (``magic_name`` where the notebook
    says it otherwise); ``run`` is the cell magic ``%%ftrain``, and also takes every spec field."""

    name: str
    help: str
    args: tuple[Arg, ...]
    fronts: frozenset[str] = BOTH
    magic_name: str | None = None

    def name_in(self, front: str) -> str:
        return self.magic_name or self.name if front == MAGIC else self.name

    def args_in(self, front: str) -> list[Arg]:
        return [a for a in self.args if front in a.fronts]


NAME = arg("name", help="the job",
           magic={"nargs": "?", "help": "the job (default: this notebook's current job)"})
BACKEND = arg("--backend", choices=("local", "eks", "slurm"),
              help="where the job runs (default: whichever backend holds a job of that name, as it was "
                   "launched from here; else eks: the kubeconfig's current context and namespace, slurm: the "
                   "jobs under $EKSFT_SHARED_DIR)",
              magic={"help": "where the job runs (default: the current job's, or whichever backend holds a "
                             "job of that name)"})
LIST_BACKEND = arg("--backend", choices=("local", "eks", "slurm"), default="local",
                   help="whose jobs (eks: the kubeconfig's current context and namespace; slurm: the jobs "
                        "under $EKSFT_SHARED_DIR and those launched from here)")
JSON = arg("--json", action="store_true", help="print JSON instead of text")
FAULT_KINDS = ", ".join(FAULTS)

ARGS: dict[str, Verb] = {v.name: v for v in (
    Verb("run", "launch a job (and follow it)", (
        arg("--spec", dest="spec_file", help="a YAML or JSON job spec; the spec options override it"),
        arg("--fault", action="append", default=[], metavar="KIND[:RANK][@STEP]",
            help=f"schedule a fault, e.g. sigkill:1@30 (kinds: {FAULT_KINDS})"),
        arg("--detach", action="store_true", fronts=frozenset({CLI}),
            help="return at once; the job keeps running"),
        arg("--dry-run", action="store_true",
            help="show what would run (EKS: the manifests); launch nothing"),
        arg("--kueue-objects", action="store_true",
            help="with --dry-run --queue NAME: also print a Kueue LocalQueue, "
            "ClusterQueue and ResourceFlavors (p5/p4d) for it, for an admin to adapt and apply"),
        arg("--json", action="store_true", fronts=frozenset({CLI}), help="print the final summary as JSON"),
    )),
    Verb("list", "jobs and their state", (LIST_BACKEND, JSON)),
    Verb("status", "state and progress of a job", (NAME, BACKEND, JSON)),
    Verb("watch",
         "follow a job: the CLI its progress, the notebook its dashboard (its whole history, then live)",
         (NAME, BACKEND), magic_name="attach"),
    Verb("summary", "steps, restarts, goodput, digest", (NAME, BACKEND, JSON)),
    Verb("ckpts", "checkpoints of a job: committed, incomplete, rejected", (NAME, BACKEND, JSON)),
    Verb("logs", "the job's log (library noise filtered unless --debug)", (
        NAME, BACKEND,
        arg("-n", "--lines", type=int, default=200, help="how many lines (the last ones)"),
        arg("--debug", action="store_true", help="show everything, launcher and library lines included"))),
    Verb("inject", "inject a fault into a running job", (
        NAME,
        arg("fault", help=f"one of: {FAULT_KINDS}"),
        BACKEND,
        arg("--rank", type=int, help="target rank (rank faults; default 0)"),
        arg("--step", type=int,
            help="fire at the start of this step (a script's: optimizer step; default: now)"),
        arg("--after", type=float, metavar="SECONDS", help="fire this many seconds from now"),
        arg("--node", type=int, default=0, help="target node (kill-launcher)"),
        arg("--delay", type=float, help="slow-rank, slow-storage: seconds added per step or write"),
        arg("--duration", type=int, help="slow-rank, disk-full, slow-storage: for this many steps"))),
    Verb("resume", "start a new job from a checkpoint of this one", (
        NAME, BACKEND,
        arg("--step", type=int,
            help="checkpoint step (default: the newest that loads; each newer one refused is said)"),
        arg("--as", dest="new_name", help="name of the new job (default: NAME-from-STEP)"),
        arg("--steps", type=int, help="train to this many steps in total"),
        arg("--detach", action="store_true", fronts=frozenset({CLI}),
            help="return at once; the job keeps running"))),
    Verb("set", "change live settings of a running job; every rank takes them at the same step, and they "
         "hold across restarts (live: ckpt-every, keep-last)", (
        NAME,
        arg("assignments", nargs="+", metavar="SETTING=VALUE", help="e.g. ckpt-every=25 keep-last=5"),
        BACKEND,
        arg("--wait", type=float, default=30.0, metavar="SECONDS",
            help="wait this long for every rank to take it (default 30; 0: return once queued)"),
        JSON)),
    Verb("stop", "stop a job; nothing of it keeps running", (NAME, BACKEND)),
    Verb("rm", "delete an ended job (its folder or workload; checkpoints included)", (NAME, BACKEND)),
    Verb("test", "prove a job survives each fault: a fault-free reference run, then one job per fault kind, "
         "checked against expectations; a report card (exit code 1 when a case fails)", (
        arg("--spec", dest="spec_file", help="a YAML or JSON job spec; the spec options override it"),
        arg("--faults", metavar="KIND[,KIND...]", help="the fault kinds to test (default: every kind that "
            f"applies to the job; kinds: {FAULT_KINDS})"),
        arg("--expect", metavar="CLAUSES", help="what each case must show, e.g. \"level<=injob, downtime<5s, "
            "lost<=10, state=reference\" (default: state=reference)"),
        arg("--at-step", type=int, metavar="STEP", help="fire every fault at this step (default: the "
            "first step after the reference run's first committed checkpoint; a script whose saves eksft "
            "cannot see needs it)"),
        arg("--loss-tol", type=float, metavar="FRACTION", help="a job without a final digest: each step's "
            "loss within this fraction of the reference's (default 0.02)"),
        arg("--junit", metavar="FILE", help="also write the card as JUnit XML to FILE"),
        JSON)),
    Verb("whatif", "replay a job's failures under other settings: ETTR and time breakdown per setting, and a "
         "recommended checkpoint interval", (
        NAME, BACKEND,
        arg("--ckpt-every", metavar="N[,N...]", help="checkpoint intervals to compare, in steps (default: "
            "the job's, half and double it, and the recommendation)"),
        arg("--inprocess", action=argparse.BooleanOptionalAction, default=None,
            help="with or without in-process restart (default: as the job ran)"),
        arg("--ckpt-mode", choices=("async", "sync"), help="checkpoint mode (default: as the job ran)"),
        arg("--spares", type=int, metavar="N", help="hot spare nodes (default: as the job ran)"),
        arg("--apply", action="store_true", help="set the recommended checkpoint interval on the running "
            "job, live (as `set NAME ckpt-every=N`)"),
        JSON)),
    Verb("check", "pre-flight of a job's fault-tolerance settings: every timeout acting on it and each "
         "contradiction between them (exit code 1 when run would refuse the spec)", (
        arg("--spec", dest="spec_file", help="a YAML or JSON job spec; the spec options override it"),
        arg("--from", dest="from_job", metavar="JOB", help="size the step and save times from this job's "
            "events (what it measured)"),
        arg("--from-backend", dest="from_backend", choices=("local", "eks", "slurm"),
            help="where --from's job ran (default: whichever backend holds a job of that name)"),
        JSON)),
    Verb("doctor", "the versions found here (Python, torch, CUDA, NCCL, NVRx, torchft, EFA), what each "
         "supports, and what a spec would be refused (exit code 1 when something is)", (
        arg("--spec", dest="spec_file", help="a YAML or JSON job spec; the spec options override it"),
        arg("--on-node", action="store_true",
            help="the ranks run here (an EKS pod, a Slurm node): refuse what this node cannot run"),
        JSON)),
    Verb("metrics", "serve Prometheus metrics of jobs (all, or the ones named)", (
        arg("names", nargs="*", metavar="NAME", help="the jobs (default: all)"),
        arg("--port", type=int, default=9400),
        arg("--addr", default="127.0.0.1", help="address to listen on (default: loopback only)"),
        arg("--root", help="the jobs folder (default: $EKSFT_HOME/jobs; in an EKS pod: the shared volume)")),
        fronts=frozenset({CLI})),
)}

# the verbs that take every spec field as an option
SPEC_VERBS = frozenset({"run", "test", "check", "doctor"})

# the sections of the spec options, as their help groups them
SPEC_GROUPS = {"": "job", "model.": "model", "checkpoint.": "checkpoints", "ft.": "fault tolerance",
               "eks.": "EKS",
               "slurm.": "Slurm"}


def _section(path: str) -> str:
    return path.rsplit(".", 1)[0] + "." if "." in path else ""


def add_spec_arguments(parser: argparse.ArgumentParser) -> None:
    """One option per spec field, grouped by section. No defaults are set: only the options given
    override the spec (the defaults, or a --spec file)."""
    groups: dict[str, Any] = {}
    for opt in sorted(spec_options(), key=lambda o: list(SPEC_GROUPS).index(_section(o.path))):
        title = SPEC_GROUPS[_section(opt.path)]
        group = groups.get(title) or groups.setdefault(
            title, parser.add_argument_group(f"{title} (job spec fields)"))
        if opt.type is bool:
            group.add_argument(opt.flag, dest=opt.path, action=argparse.BooleanOptionalAction,
                               default=argparse.SUPPRESS, help=f"{opt.help} (default: {opt.default})")
        else:
            choices = f" {{{','.join(opt.choices)}}}" if opt.choices else ""
            group.add_argument(opt.flag, dest=opt.path, default=argparse.SUPPRESS,
                               metavar=opt.flag[2:].upper(),
                               help=f"{opt.help}{choices} (default: {opt.default})")


def add_verb_arguments(parser: argparse.ArgumentParser, verb: str, front: str) -> None:
    """The arguments of ``verb`` that ``front`` takes (``run``: the spec options too)."""
    for a in ARGS[verb].args_in(front):
        a.add_to(parser, front)
    if verb in SPEC_VERBS:
        add_spec_arguments(parser)


def add_verbs(subparsers: Any, front: str, **kwargs: Any) -> None:
    """One sub-parser per verb ``front`` takes, but ``run`` (the cell magic is a parser of its own)."""
    for verb in ARGS.values():
        if front in verb.fronts and (front == CLI or verb.name != "run"):
            add_verb_arguments(subparsers.add_parser(verb.name_in(front), help=verb.help, **kwargs),
                               verb.name, front)


def flags(front: str, verbs: Iterable[str] | None = None) -> list[str]:
    """Every option flag ``front`` takes (of ``verbs``; default: all), for "did you mean"."""
    chosen = [ARGS[v] for v in verbs] if verbs is not None else list(ARGS.values())
    out = ["-h", "--help"]
    for verb in chosen:
        if front in verb.fronts:
            out += [f for a in verb.args_in(front) for f in a.flags]
            if verb.name in SPEC_VERBS:
                out += [o.flag for o in spec_options()] + [f"--no-{o.flag[2:]}"
                                                           for o in spec_options() if o.type is bool]
    return list(dict.fromkeys(out))


def positionals(verb: str, front: str) -> str:
    """The words a verb takes, as its usage line writes them: ``[NAME] FAULT``."""
    words = []
    for a in ARGS[verb].args_in(front):
        if not a.flags:
            kw = {**a.kwargs, **(a.magic if front == MAGIC else {})}
            word = kw.get("metavar") or a.names[0].upper()
            words.append(f"[{word}]" if kw.get("nargs") in ("?", "*") else word)
    return " ".join(words)


def spec_from_args(args: argparse.Namespace, base: JobSpec | None = None, validate: bool = True) -> JobSpec:
    """Apply the spec options present in ``args`` (parsed with :func:`add_spec_arguments`) to ``base``."""
    return spec_from_options({o.path: getattr(args, o.path) for o in spec_options() if hasattr(args, o.path)},
                             base,
                             validate)
