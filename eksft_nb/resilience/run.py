"""Run a resilience test: the job's fault-free reference run, then one real job per trial of the plan
(``repeat`` per fault kind), each in its own folder, launched through the command layer and followed
through its events; the outcome is a :class:`~eksft_nb.resilience.card.Card`, scored per kind, priced
(:mod:`eksft_nb.cost`), and kept as a campaign manifest (:mod:`.manifest`) when asked. A re-check
(``recheck``: a manifest read back) runs the manifest's trials again and names what moved."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from .. import cost as costs
from ..backends import whereabouts
from ..engines.registry import engine_of
from ..errors import EksftError, shown
from ..goodput import compute
from ..job import Job
from ..monitor import JobMonitor
from ..spec import JobSpec
from ..states import FaultKind, JobState
from ..timeouts import resolved
from . import card as cards
from . import expect as expectations
from . import manifest as manifests
from . import scoring
from .plan import MAX_REPEAT, Case, build, engine_refuses, job_name, parse_kinds

POLL_S = 0.5
REFERENCE_TIMEOUT_S = 3600.0


def run_test(launch: Callable[..., object], spec: JobSpec, kinds: Sequence[FaultKind] | None = None,
             expect: str | None = None, *, at_step: int | None = None,
             tolerance: float = cards.LOSS_TOLERANCE, repeat: int = 1, seed: int = 0,
             pricing: costs.Pricing | None = None, manifest: Path | None = None,
             recheck: manifests.Manifest | None = None,
             say: Callable[[str], object] = lambda text: None,
             on_row: Callable[[cards.Card], object] = lambda card: None) -> cards.Card:
    """Test ``spec`` (its name is the test's: the jobs are NAME-ref and NAME-KIND, or NAME-KIND-N for
    ``repeat`` trials a kind), each job started with ``launch(spec, faults)`` (the command layer's).
    ``manifest``: write the campaign's manifest there (after each trial); ``recheck``: run its plan again.
    ``say`` narrates; ``on_row`` gets the card after each trial (a live view)."""
    checks = expectations.parse(expect)
    spec = spec.validate()
    pricing = pricing or costs.Pricing()
    if recheck is not None:
        kinds, repeat, seed = [FaultKind(k) for k in recheck.kinds], recheck.repeat, recheck.seed
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
    trial_numbers = [None] if repeat == 1 else list(range(1, repeat + 1))
    names = [f"{spec.name}-ref", *(job_name(spec.name, k, n) for k in (kinds or list(FaultKind))
                                   for n in trial_numbers)]
    if recheck is not None:
        again = manifests.cases(recheck, spec.name)
        shape = f"{recheck.spec.nnodes} node(s) x {recheck.spec.nproc_per_node}"
        for case in again:   # its injections must fit this version of the job, said up front
            for f in case.faults:
                try:
                    f.validate(spec.world_size, spec.nnodes)
                except EksftError as e:
                    raise EksftError(f"the manifest's trial {case.kind.value} #{case.trial} does not fit "
                                     f"this job: {e.problem}",
                                     f"re-check a job of its shape ({shape})") from None
        names += [c.job for c in again if c.job not in names]
    taken = sorted({j.name for j in backend.jobs()} & set(names))
    if taken:
        shown_ = ", ".join(taken[:5]) + (f" and {len(taken) - 5} more" if len(taken) > 5 else "")
        raise EksftError(f"jobs {shown_} already exist",
                         "choose another --name, or remove them with `python -m eksft_nb rm NAME`")
    folders = _work_folders(spec, backend.name, names)
    card: cards.Card = {"job": spec.name, "expect": [c.text for c in checks], "reference": {}, "rows": [],
                        "skipped": {}, "problem": "", "passed": False, "note": "", "kinds": [],
                        "plan": {"seed": seed, "repeat": repeat, "window": None, "plan_id": None,
                                 "recheck": recheck.plan_id if recheck is not None else None,
                                 "manifest": str(manifest) if manifest else None},
                        "cost": {"gpus": spec.world_size, "pricing": pricing.to_dict()}}
    ref_name = names[0]
    most = len([k for k in kinds or FaultKind
                if k.value not in backend.refused_faults and not engine_refuses(k, spec)]) * repeat
    say(f"running the fault-free reference {ref_name} first: up to {most} trial job(s) follow, each about as "
        "long as it plus a recovery (its checkpoints set the steps the faults fire at)")
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
    ref_cost = scoring.reference_costs(ref, spec.world_size, pricing)
    card["cost"].update(checkpoints=ref_cost["checkpoints"], ckpt_share=ref_cost["ckpt_share"],
                        step_s=ref_cost["step_s"])
    plan = build(spec, ref, spec.name, kinds, refused=backend.refused_faults, at_step=at_step, repeat=repeat,
                 seed=seed)
    if recheck is not None and not plan.problem:
        plan.cases, plan.window = manifests.cases(recheck, spec.name), recheck.window
    card["skipped"], card["problem"] = plan.skipped, plan.problem
    card["plan"]["window"] = list(plan.window) if plan.window else None
    expected = {c.kind.value: c.expected for c in plan.cases}
    expected_then = {(t.kind, t.trial): t.observed for t in recheck.trials} if recheck is not None else {}

    def scored() -> None:
        card["kinds"] = scoring.score(card["rows"], plan.kinds, repeat, expected, plan.problem, pricing,
                                      spec.world_size)
        card["passed"] = bool(card["rows"]) and not plan.problem and all(k["ok"] for k in card["kinds"])
        card["cost"]["projection"] = scoring.projection(card["cost"], card["kinds"], card["rows"], pricing,
                                                        spec.world_size, spec.nnodes)
        m = manifests.build(card, spec, plan.cases, seed, repeat, plan.window, plan.kinds, tolerance)
        card["plan"]["plan_id"] = m["plan_id"]   # with or without a manifest written: the card names its plan
        if manifest is not None:
            manifests.write(manifest, m)

    if plan.problem:
        say(f"no case can run: {plan.problem}")
        scored()
        return card
    expected_s = plan.expected_s(wall, spec)
    kinds_text = ", ".join(dict.fromkeys(c.kind.value for c in plan.cases))
    where = f"each fault at step {plan.fault_step}" if repeat == 1 and recheck is None else \
        f"{repeat} trial(s) a kind at steps {plan.window[0]}-{plan.window[1]} (seed {seed})" if plan.window \
        else "the manifest's steps"
    say(f"plan: {len(plan.cases)} trial(s) ({kinds_text}), {where}; the reference took {wall:.0f}s, so "
        f"expect about {_minutes(expected_s)} in all")
    for case in plan.cases:
        label = case.kind.value if repeat == 1 else f"{case.kind.value} #{case.trial}"
        say(f"case {label}: {case.job}, {case.kind.value} on {case.target} at step {case.step}"
            + (f" ({case.note})" if case.note else ""))
        case_spec = _in(spec, folders, case.job)
        r = _run_case(launch, case_spec, case, ref, checks, wall, tolerance)
        scoring.price_trial(r, ref_cost["step_s"], spec.world_size, pricing)   # type: ignore[arg-type]
        if recheck is not None:
            then = expected_then.get((case.kind.value, case.trial))
            r["why"] += manifests.differences(then, r)   # type: ignore[arg-type]
            r["note"] = "; ".join(n for n in (r["note"], *manifests.changes(then, r)) if n)  # type: ignore
            r["passed"] = not r["why"]
        card["rows"].append(r)
        healed = "absorbed without a restart" if r["level"] == "none" else \
            f"healed at level {r['level'] or '-'}"
        healed += f", restored from {r['restored_from']}" if r["restored_from"] else ""
        why = f"; {'; '.join(r['why'])}" if r["why"] else ""
        say(f"  {'pass' if r['passed'] else 'FAIL'}: {healed}, cost {costs.text(r['cost'])}{why}")
        scored()
        on_row(card)
    scored()
    card["note"] = cards.inprocess_note(ref.nvrx, spec.ft.inprocess, card["rows"])
    if card["note"]:
        say(card["note"])
    return card


def campaign(launch: Callable[..., object], spec: JobSpec, faults: str | None = None,
             expect: str | None = None, *, at_step: int | None = None,
             loss_tolerance: float | None = None, repeat: int = 1, plan_seed: int = 0,
             manifest: str | None = None, recheck: manifests.Manifest | None = None,
             say: Callable[[str], object] = lambda text: None,
             on_row: Callable[[cards.Card], object] = lambda card: None, **cost_options: Any) -> cards.Card:
    """The command layer's test: its options checked (``faults``: "sigkill,hang"; ``manifest``: where to
    write the campaign manifest; ``recheck``: a manifest (:func:`.manifest.test_base`) whose plan runs again;
    ``cost_options``: price, run_for, nodes, failures_per_day), then :func:`run_test`."""
    tolerance = cards.LOSS_TOLERANCE if loss_tolerance is None else loss_tolerance
    if not (isinstance(tolerance, (int, float)) and 0 < tolerance < 1):
        raise EksftError(f"--loss-tol {shown(loss_tolerance)} is not a fraction",
                         "use e.g. --loss-tol 0.02 (2 %)")
    replanned = recheck is not None and (faults, repeat) != (None, 1)
    path = check_campaign(repeat, plan_seed, manifest, replanned)
    pricing = costs.pricing(spec, **cost_options)
    return run_test(launch, spec, parse_kinds(faults), expect, at_step=at_step, say=say, on_row=on_row,
                    tolerance=tolerance, repeat=repeat, seed=plan_seed, pricing=pricing, manifest=path,
                    recheck=recheck)


def check_campaign(repeat: int, seed: int, manifest: str | None, replanned: bool = False) -> Path | None:
    """The command layer's check of a campaign's options: the trials a kind, the seed, the manifest's folder
    (found out now, not after the test's jobs), no plan of its own beside a re-check's; the manifest's
    path."""
    if isinstance(repeat, bool) or not isinstance(repeat, int) or not 1 <= repeat <= MAX_REPEAT:
        raise EksftError(f"--repeat {shown(repeat)} is not a number of trials from 1 to {MAX_REPEAT}",
                         "write e.g. --repeat 3")
    if isinstance(seed, bool) or not isinstance(seed, int) or abs(seed) >= 2**63:
        raise EksftError(f"--plan-seed {shown(seed)} is not a whole number", "write e.g. --plan-seed 7")
    path = Path(manifest).expanduser() if manifest else None
    if path is not None and not path.parent.is_dir():
        raise EksftError(f"--manifest {shown(manifest)}: folder {path.parent} does not exist",
                         "create it first")
    if replanned:   # a re-check with --faults or --repeat
        raise EksftError("--recheck runs the manifest's own plan", "leave out --faults and --repeat")
    return path


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
