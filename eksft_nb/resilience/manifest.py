"""A test campaign's manifest: the ground truth of every injection beside what was observed, as versioned
JSON, so that a card can be re-checked (``test --recheck FILE`` runs the same plan again, on the same job or
a new version of it) and two versions of a job compared trial by trial.

It holds the job's spec, the plan (seed, repeat, the window of steps, the kinds, the expectations), the
reference run, and per trial: its kind and number, its job, each injection (the fault command: kind, rank or
node, step), the level that should heal it, and what happened (when the fault fired and at which step, the
level that healed it, detection, downtime, steps lost, the state check, pass or fail and why, its cost).
``plan_id`` is a digest of the plan alone: two campaigns with the same id ran the same injections.

A manifest read back is untrusted input (a file anyone may have edited): it is refused in one line unless
it is a version-:data:`VERSION` manifest of known fields with well-typed, in-range values, its injections
valid for its spec, at most :data:`MAX_BYTES` long.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..control import FaultCommand
from ..errors import ControlError, EksftError, SpecError, shown
from ..jobdir import atomic_write
from ..spec import JobSpec
from ..states import FaultKind
from .expect import LEVELS
from .plan import MAX_REPEAT, Case, job_name

FORMAT, VERSION = "eksft-campaign", 1
MAX_BYTES = 8 << 20
MAX_TRIALS = 1000
FIX = "write it with `python -m eksft_nb test --manifest FILE`, or pass the file such a test wrote"
TOP = {"format", "version", "job", "created", "spec", "plan", "plan_id", "reference", "trials", "passed"}
PLAN = {"seed", "repeat", "window", "kinds", "expect", "loss_tolerance"}
TRIAL = {"kind", "trial", "job", "injections", "expected_level", "observed"}
INJECTION = {"fault", "rank", "step", "node", "params"}
# what a trial observed, as the card's row has it (a manifest keeps these; the rest of a row is in its job)
OBSERVED = ("fired", "fired_t", "fired_step", "level", "detection_s", "downtime_s", "lost", "restored_from",
            "skipped_batches", "state_check", "state_detail", "passed", "why", "lost_gpu_s", "cost")


@dataclass(frozen=True)
class Trial:
    kind: str
    trial: int
    job: str
    injections: tuple[FaultCommand, ...]
    expected_level: str | None
    observed: Mapping[str, Any] | None


@dataclass(frozen=True)
class Manifest:
    job: str
    spec: JobSpec
    seed: int
    repeat: int
    window: tuple[int, int] | None
    kinds: tuple[str, ...]
    expect: tuple[str, ...]
    loss_tolerance: float
    trials: tuple[Trial, ...]
    plan_id: str
    reference: Mapping[str, Any]


def injection(command: FaultCommand) -> dict[str, Any]:
    """A fault command as the manifest keeps it: what it does and where, not its id."""
    out: dict[str, Any] = {"fault": command.fault, "step": command.step}
    if command.rank is not None:
        out["rank"] = command.rank
    if command.scope == "node":
        out["node"] = command.node
    if command.params:
        out["params"] = dict(command.params)
    return out


def plan_id(plan: Mapping[str, Any], trials: Sequence[Mapping[str, Any]]) -> str:
    """A digest of the plan and its injections (never of what was observed)."""
    canonical = {"plan": plan, "trials": [{k: t[k] for k in ("kind", "trial", "injections", "expected_level")}
                                          for t in trials]}
    return hashlib.sha256(json.dumps(canonical, sort_keys=True).encode()).hexdigest()[:16]


def build(card: Mapping[str, Any], spec: JobSpec, cases: Sequence[Case], seed: int, repeat: int,
          window: tuple[int, int] | None, kinds: Sequence[str], tolerance: float) -> dict[str, Any]:
    """The manifest of a campaign as far as it ran: every planned trial, observed where its row is in
    ``card`` (a trial not run yet has ``observed`` null)."""
    rows = {r["job"]: r for r in card["rows"]}
    plan = {"seed": seed, "repeat": repeat, "window": list(window) if window else None, "kinds": list(kinds),
            "expect": list(card["expect"]), "loss_tolerance": tolerance}
    trials = []
    for c in cases:
        row = rows.get(c.job)
        trials.append({"kind": c.kind.value, "trial": c.trial, "job": c.job,
                       "injections": [injection(f) for f in c.faults], "expected_level": c.expected,
                       "observed": None if row is None else {k: row.get(k) for k in OBSERVED}})
    return {"format": FORMAT, "version": VERSION, "job": card["job"],
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "spec": spec.to_dict(),
            "plan": plan, "plan_id": plan_id(plan, trials), "reference": dict(card["reference"]),
            "trials": trials, "passed": bool(card["passed"])}


def write(path: Path, manifest: Mapping[str, Any]) -> None:
    try:
        atomic_write(path, json.dumps(manifest, indent=1, sort_keys=True, allow_nan=False))
    except OSError as e:
        raise EksftError(f"cannot write the manifest {path} ({e.strerror})", "pick a writable file") from None


def test_base(args: argparse.Namespace) -> tuple[JobSpec | None, Manifest | None]:
    """What a test's spec options apply to (a ``--spec`` file, else a ``--recheck`` manifest's spec, read
    back and checked), and the manifest (None without ``--recheck``)."""
    m = read(args.recheck) if getattr(args, "recheck", None) else None
    return (JobSpec.load(args.spec_file) if args.spec_file else m.spec if m is not None else None), m


def read(path: str | os.PathLike[str]) -> Manifest:
    """The manifest in ``path``, checked whole (see the module's docstring); one line otherwise."""
    p = Path(path).expanduser()
    try:
        with open(p, "rb") as f:
            raw = f.read(MAX_BYTES + 1)
    except OSError as e:
        raise EksftError(f"cannot read the manifest {shown(str(path))} ({e.strerror})",
                         "give the file a test wrote with --manifest") from None
    if len(raw) > MAX_BYTES:
        raise EksftError(f"the manifest {p.name} is over {MAX_BYTES >> 20} MiB: not one a test wrote", FIX)
    return parse(raw, p.name)


def parse(raw: bytes | str, name: str = "the manifest") -> Manifest:
    """A manifest's text, checked whole; :class:`EksftError` (one line) otherwise."""
    try:
        data = json.loads(raw, parse_constant=_no_constant)
    except (ValueError, RecursionError):
        raise EksftError(f"{name} is not valid JSON", FIX) from None
    try:
        return _manifest(data)
    except (ControlError, SpecError) as e:
        raise EksftError(f"{name}: {e.problem}", e.fix) from None
    except _Bad as e:
        raise EksftError(f"{name}: {e}", FIX) from None


class _Bad(Exception):
    """A field of the manifest is missing, unknown or ill-typed (its message names it)."""


def _no_constant(word: str) -> None:
    raise ValueError(word)


def _manifest(d: Any) -> Manifest:
    _obj(d, "the manifest", TOP)
    if d.get("format") != FORMAT or d.get("version") != VERSION:
        raise _Bad(f"not a version-{VERSION} {FORMAT} manifest (format {shown(d.get('format'))}, version "
                   f"{shown(d.get('version'))})")
    job = _str(d.get("job"), "job", 63)
    if not isinstance(d.get("spec"), dict):
        raise _Bad("spec is not an object")
    spec = JobSpec.from_json(json.dumps(d["spec"])).validate()
    plan = _obj(d.get("plan"), "plan", PLAN)
    seed = _int(plan.get("seed"), "plan.seed", -(2**63), 2**63 - 1)
    repeat = _int(plan.get("repeat"), "plan.repeat", 1, MAX_REPEAT)
    window = plan.get("window")
    if window is not None:
        if not (isinstance(window, list) and len(window) == 2):
            raise _Bad("plan.window is not [first, last]")
        window = (_int(window[0], "plan.window", 1, 10**9), _int(window[1], "plan.window", 1, 10**9))
        if window[0] > window[1]:
            raise _Bad("plan.window ends before it begins")
    kinds = tuple(_kind(k, "plan.kinds") for k in _list(plan.get("kinds"), "plan.kinds", len(FaultKind)))
    expect = tuple(_str(x, "plan.expect", 200) for x in _list(plan.get("expect"), "plan.expect", 20))
    tol = plan.get("loss_tolerance")
    if not (isinstance(tol, (int, float)) and not isinstance(tol, bool) and 0 < tol < 1):
        raise _Bad(f"plan.loss_tolerance {shown(tol)} is not a fraction")
    trials = tuple(_trial(t, spec) for t in _list(d.get("trials"), "trials", MAX_TRIALS))
    if not trials:
        raise _Bad("it holds no trial")
    seen = {(t.kind, t.trial) for t in trials}
    if len(seen) != len(trials):
        raise _Bad("a trial is listed twice (the same kind and number)")
    reference = d.get("reference")
    if not isinstance(reference, dict):
        raise _Bad("reference is not an object")
    return Manifest(job, spec, seed, repeat, window, kinds, expect, float(tol), trials,
                    _str(d.get("plan_id"), "plan_id", 64), reference)


def _trial(t: Any, spec: JobSpec) -> Trial:
    _obj(t, "a trial", TRIAL)
    kind = _kind(t.get("kind"), "a trial's kind")
    number = _int(t.get("trial"), "a trial's number", 1, MAX_REPEAT)
    job = _str(t.get("job"), "a trial's job", 63)
    injections = []
    for i in _list(t.get("injections"), "a trial's injections", 4):
        _obj(i, "an injection", INJECTION)
        command = FaultCommand.from_dict({k: v for k, v in i.items() if k != "params" or v})
        if command.step is None:
            raise _Bad(f"an injection of {command.fault} has no step")
        injections.append(command.validate(spec.world_size, spec.nnodes))
    if not injections or injections[0].fault != kind:
        raise _Bad(f"trial {kind} #{number} does not inject {kind} first")
    level = t.get("expected_level")
    if level is not None and level not in LEVELS:
        raise _Bad(f"expected_level {shown(level)} is not one of {', '.join(LEVELS)}")
    observed = t.get("observed")
    if observed is not None:
        _obj(observed, "a trial's observed", set(OBSERVED))
        for key in ("downtime_s", "detection_s", "lost_gpu_s", "fired_t"):
            v = observed.get(key)
            if v is not None and not (isinstance(v, (int, float)) and not isinstance(v, bool)
                                      and math.isfinite(v)):
                raise _Bad(f"observed {key} {shown(v)} is not a number")
        if observed.get("lost") is not None and (isinstance(observed["lost"], bool)
                                                 or not isinstance(observed["lost"], int)):
            raise _Bad(f"observed lost {shown(observed['lost'])} is not a number of steps")
        for key in ("state_check", "level", "restored_from", "state_detail"):
            if observed.get(key) is not None and not isinstance(observed[key], str):
                raise _Bad(f"observed {key} {shown(observed[key])} is not a text")
        if not all(isinstance(w, str) for w in _list(observed.get("why", []), "observed why", 50)):
            raise _Bad("observed why is not a list of texts")
        if observed.get("level") is not None and observed["level"] not in LEVELS:
            raise _Bad(f"observed level {shown(observed['level'])} is not one of {', '.join(LEVELS)}")
        if "passed" in observed and not isinstance(observed["passed"], bool):
            raise _Bad("observed passed is not true or false")
    return Trial(kind, number, job, tuple(injections), level, observed)


def _obj(v: Any, what: str, keys: set[str]) -> dict[str, Any]:
    if not isinstance(v, dict):
        raise _Bad(f"{what} is not an object")
    unknown = sorted(str(k) for k in v if k not in keys)
    if unknown:
        raise _Bad(f"{what} has unknown field(s) {shown(', '.join(unknown))}")
    return v


def _list(v: Any, what: str, most: int) -> list[Any]:
    if not isinstance(v, list) or len(v) > most:
        raise _Bad(f"{what} is not a list of at most {most}")
    return v


def _str(v: Any, what: str, most: int) -> str:
    if not isinstance(v, str) or not 0 < len(v) <= most:
        raise _Bad(f"{what} {shown(v)} is not a text of 1 to {most} characters")
    return v


def _int(v: Any, what: str, low: int, high: int) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or not low <= v <= high:
        raise _Bad(f"{what} {shown(v)} is not a whole number from {low} to {high}")
    return v


def _kind(v: Any, what: str) -> str:
    if not isinstance(v, str) or v not in {k.value for k in FaultKind}:   # a list or a dict is no kind
        raise _Bad(f"{what} {shown(v)} is not a fault kind")
    return v


# ---- a re-check: the same plan again --------------------------------------------------------------


def cases(m: Manifest, base: str) -> list[Case]:
    """The manifest's trials as cases of a new run named ``base`` (fresh command ids)."""
    out = []
    for t in m.trials:
        faults = tuple(FaultCommand(f.fault, rank=f.rank, step=f.step, node=f.node, params=dict(f.params))
                       for f in t.injections)
        note = f"then {faults[1].fault} one step later" if len(faults) > 1 else ""
        kind = FaultKind(t.kind)
        out.append(Case(kind, job_name(base, kind, t.trial if m.repeat > 1 else None),
                        t.injections[0].step or 0, faults, note, t.trial, t.expected_level))
    return out


def differences(then: Mapping[str, Any] | None, now: Mapping[str, Any]) -> list[str]:
    """What a trial observed now that differs from the manifest's record of it (a regression fails the
    trial: passed before and not now, or healed at another level)."""
    if not then:
        return []
    out = []
    if then.get("level") != now.get("level"):
        out.append(f"healed at level {now.get('level') or 'unknown'}, the manifest's run at "
                   f"{then.get('level') or 'unknown'}")
    if then.get("passed") and not now.get("passed"):
        out.append("passed in the manifest's run, fails now")
    return out


def changes(then: Mapping[str, Any] | None, now: Mapping[str, Any]) -> list[str]:
    """The measured figures that moved beyond noise (a note, not a failure): downtime, detection, steps
    lost, state check."""
    if not then:
        return []
    out = []
    for key, unit in (("downtime_s", "s"), ("detection_s", "s")):
        a, b = then.get(key), now.get(key)
        if a is not None and b is not None and abs(b - a) > max(1.0, 0.5 * abs(a)):
            out.append(f"{key[:-2]} {b:.2f}{unit}, {a:.2f}{unit} in the manifest's run")
    if then.get("lost") is not None and now.get("lost") is not None and then["lost"] != now["lost"]:
        out.append(f"lost {now['lost']} steps, {then['lost']} in the manifest's run")
    if then.get("state_check") != now.get("state_check"):
        out.append(f"state {now.get('state_check')}, {then.get('state_check')} in the manifest's run")
    return out
