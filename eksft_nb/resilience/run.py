"""Run a resilience test: the job's fault-free reference run, then one real job per case of the
plan, each in its own folder, launched through the command layer and followed through its events;
the outcome is a :class:`~eksft_nb.resilience.card.Card`."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from ..backends import whereabouts
from ..engines.registry import engine_of
from ..errors import EksftError
from ..goodput import compute
from ..job import Job
from ..monitor import JobMonitor
from ..spec import JobSpec
from ..states import FaultKind, JobState
from ..timeouts import resolved
from . import card as cards
from . import expect as expectations
from .plan import Case, build, engine_refuses

POLL_S = 0.5
REFERENCE_TIMEOUT_S = 3600.0


def run_test(launch: Callable[..., object], spec: JobSpec, kinds: Sequence[FaultKind] | None = None,
             expect: str | None = None, *, at_step: int | None = None,
             tolerance: float = cards.LOSS_TOLERANCE,
             say: Callable[[str], object] = lambda text: None,
             on_row: Callable[[cards.Card], object] = lambda card: None) -> cards.Card:
    """Test ``spec`` (its name is the test's: the jobs are NAME-ref and NAME-KIND), each job started
    with ``launch(spec, faults)`` (the command layer's). ``say`` narrates; ``on_row`` gets the card
    after each case (a live view)."""
    checks = expectations.parse(expect)
    spec = spec.validate()
    if spec.checkpoint.dir:
        raise EksftError("a resilience test gives each case its own checkpoints, but --ckpt-dir names "
                         "one folder for all", "leave --ckpt-dir unset")
    backend = whereabouts.of_spec(spec)   # the job's own settings (an EKS namespace)
    refused = sorted(k.value for k in kinds or () if k.value in backend.refused_faults)
    if refused:   # known before any job runs (whether a script's saves are eksft's: after its reference)
        raise EksftError(f"the {spec.backend} backend cannot deliver {', '.join(refused)}",
                         "leave it out of --faults")
    unfired = [k.value for k in kinds or () if engine_refuses(k, spec)]
    if unfired:   # known before any job runs too (the case's launch would refuse it after the reference)
        raise EksftError(f"--faults names kinds the {spec.engine} engine cannot fire: {', '.join(unfired)}",
                         f"leave them out of --faults (it fires {', '.join(engine_of(spec).fires(spec))})")
    names = [f"{spec.name}-ref",
             *(f"{spec.name}-{k.value}"[:63].rstrip("-") for k in (kinds or list(FaultKind)))]
    taken = sorted({j.name for j in backend.jobs()} & set(names))
    if taken:
        raise EksftError(f"jobs {', '.join(taken)} already exist",
                         "choose another --name, or remove them with `python -m eksft_nb rm NAME`")
    folders = _work_folders(spec, backend.name, names)
    card: cards.Card = {"job": spec.name, "expect": [c.text for c in checks], "reference": {}, "rows": [],
                        "skipped": {}, "problem": "", "passed": False}
    ref_name = names[0]
    most = len([k for k in kinds or FaultKind
                if k.value not in backend.refused_faults and not engine_refuses(k, spec)])
    say(f"running the fault-free reference {ref_name} first: up to {most} case(s) follow, each about as long "
        "as it plus a recovery (its checkpoints set the step the faults fire at)")
    if folders:
        say(f"each job runs the script in its own working folder under {folders[ref_name].parent}, so what "
            "it saves beside itself (its own checkpoints) never carries over from one job to the next")
    launch(_in(spec, folders, ref_name))
    ref, ref_state, end = _follow(Job(ref_name, backend), REFERENCE_TIMEOUT_S)
    wall = compute(ref).wall_s
    card["reference"] = {"job": ref_name, "state": ref_state.value, "wall_s": round(wall, 2),
                         "digest": ref.digest, "steps": ref.max_step}
    if end or ref_state != JobState.SUCCEEDED:
        ended = f"it ended {ref_state.value}" + (f" ({ref.reason})" if ref.reason else "")
        card["problem"] = f"the reference run {ref_name} did not succeed: {end or ended}"
        return card
    plan = build(spec, ref, spec.name, kinds, refused=backend.refused_faults, at_step=at_step)
    card["skipped"], card["problem"] = plan.skipped, plan.problem
    if plan.problem:
        say(f"no case can run: {plan.problem}")
        return card
    expected = plan.expected_s(wall, spec)
    kinds_text = ", ".join(c.kind.value for c in plan.cases)
    say(f"plan: {len(plan.cases)} case(s) ({kinds_text}), each fault at step "
        f"{plan.fault_step}; the reference took {wall:.0f}s, so expect about {_minutes(expected)} in all")
    for case in plan.cases:
        say(f"case {case.kind.value}: {case.job}, {case.kind.value} on {case.target} at step {case.step}"
            + (f" ({case.note})" if case.note else ""))
        case_spec = _in(spec, folders, case.job)
        card["rows"].append(_run_case(launch, case_spec, case, ref, checks, wall, tolerance))
        r = card["rows"][-1]
        healed = "absorbed without a restart" if r["level"] == "none" else \
            f"healed at level {r['level'] or '-'}"
        healed += f", restored from {r['restored_from']}" if r["restored_from"] else ""
        why = f"; {'; '.join(r['why'])}" if r["why"] else ""
        say(f"  {'pass' if r['passed'] else 'FAIL'}: {healed}{why}")
        on_row(card)
    card["passed"] = bool(card["rows"]) and all(r["passed"] for r in card["rows"])
    return card


def _run_case(launch: Callable[..., object], spec: JobSpec, case: Case, ref: JobMonitor,
              checks: list[expectations.Expectation], wall: float, tolerance: float) -> cards.Row:
    launch(spec.replace(name=case.job), list(case.faults))
    budget = 3 * wall + 300.0 + resolved(spec).ft.heartbeat_timeout * len(case.faults)
    backend = whereabouts.of_spec(spec)
    mon, state, end = _follow(Job(case.job, backend), budget)
    # a torchft job's groups recover without a restart of the job: its events tell how, and each group's end
    events = backend.events(case.job).read() if engine_of(spec).heals_alone else None
    return cards.row(case, mon, ref, checks, end, tolerance, state, events)


def _work_folders(spec: JobSpec, backend: str, names: list[str]) -> dict[str, Path]:
    """A script's working folder for each job of the test, ``WORKDIR/JOB`` (none may exist yet; each is
    made when its job starts). A script that resumes from files it writes in its folder (NVRx's
    examples: their ``checkpoint.pt``) would otherwise start each case from the previous job's end.
    EKS runs the script in the image's folder, so there each pod's own filesystem is fresh already."""
    if spec.script is None or backend == "eks":
        return {}
    base = Path(spec.workdir or os.getcwd()).expanduser().resolve()
    folders = {n: base / n for n in names}
    there = sorted(str(p) for p in folders.values() if p.exists())
    if there:
        raise EksftError(f"the test's working folders {', '.join(there)} exist already",
                         "remove them, or choose another --name")
    return folders


def _in(spec: JobSpec, folders: dict[str, Path], name: str) -> JobSpec:
    """``spec`` as the test's job ``name``, in its working folder if it has one (made now)."""
    spec = spec.replace(name=name)
    if name not in folders:
        return spec
    folders[name].mkdir(parents=True)
    return spec.replace(workdir=str(folders[name]))


def _follow(job: Job, timeout: float) -> tuple[JobMonitor, JobState, str]:
    """Fold the job's events until it ends (its state as :meth:`Job.status` tells it: the backend may
    know better than the events); past ``timeout`` seconds stop it and say so."""
    deadline = time.time() + timeout
    while True:
        state, _ = job.status()
        if state.ended:
            return job.refresh(), state, ""
        if time.time() > deadline:
            job.stop()
            why = f"it had not ended after {timeout:.0f}s, so the test stopped it"
            return job.refresh(), job.status()[0], why
        time.sleep(POLL_S)


def _minutes(seconds: float) -> str:
    return f"{seconds / 60:.1f} min" if seconds >= 90 else f"{seconds:.0f}s"
