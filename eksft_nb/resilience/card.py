"""The report card of a resilience test: one row per case, built from the case job's events and the
reference run's, shown as a table, JSON, and JUnit XML (a CI gates on its failures)."""

from __future__ import annotations

import math
import xml.etree.ElementTree as ET
from collections.abc import Sequence
from typing import Any, TypedDict

from ..events import RESTART_PHASES
from ..incidents import phases_text
from ..monitor import JobMonitor
from ..states import JobState
from .expect import LEVELS, Expectation
from .plan import Case

LOSS_TOLERANCE = 0.02   # a job without a digest: each step's loss within 2 % of the reference's


class Row(TypedDict):
    case: str
    job: str
    fault: str
    target: str
    at_step: int | None
    fired: bool
    level: str | None          # who healed it: none, inprocess, injob, job (None: not healed)
    detection_s: float | None
    downtime_s: float | None
    phases: dict[str, float]
    lost: int | None
    state_check: str           # match | differs | unchecked
    state_detail: str
    passed: bool
    why: list[str]
    note: str


class Card(TypedDict):
    job: str
    expect: list[str]
    reference: dict[str, Any]
    rows: list[Row]
    skipped: dict[str, str]
    problem: str
    passed: bool


def state_check(case: JobMonitor, reference: JobMonitor,
                tolerance: float = LOSS_TOLERANCE) -> tuple[str, str]:
    """(match | differs | unchecked, why): the final digest where both runs report one (a deterministic
    job), else each step's loss (its last execution) within ``tolerance`` of the reference's, else
    (neither reported) whether it ran all of the reference's steps."""
    if case.digest and reference.digest:
        if case.digest == reference.digest:
            return "match", f"final digest {case.digest} as the reference's"
        return "differs", f"final digest {case.digest}, the reference's {reference.digest}"
    ref, got = _losses(reference), _losses(case)
    if not ref:
        return _steps_run(case, reference)
    missing = sorted(set(ref) - set(got))
    if missing:
        return "differs", f"{len(missing)} of the reference's steps never ran (first: step {missing[0]})"
    worst = max(ref, key=lambda s: _rel(got[s], ref[s]))
    if _rel(got[worst], ref[worst]) > tolerance:
        return "differs", (f"loss at step {worst} is {got[worst]:.5g}, the reference's {ref[worst]:.5g} "
                           f"(tolerance {100 * tolerance:g} %)")
    return "match", f"loss curve within {100 * tolerance:g} % of the reference's at all {len(ref)} steps"


def _steps_run(case: JobMonitor, reference: JobMonitor) -> tuple[str, str]:
    """A job that reports neither a final digest nor its loss (an unmodified script) shows of its state
    only the optimizer steps it ran, repeats after a restore included: fewer than the reference's means
    it stopped early (e.g. a script that leaves its loop on SIGTERM and exits 0)."""
    ran, want = len(case.steps.step), len(reference.steps.step)
    unreported = "it reports neither a final digest nor its loss"
    if not want:
        return "unchecked", f"{unreported}, and the reference ran no step"
    if ran < want:
        return "differs", (f"it ran {ran} optimizer steps, fewer than the reference's {want}: it stopped "
                           f"early ({unreported})")
    return "match", f"it ran {ran} optimizer steps (repeats included), at least the reference's {want} " \
                    f"({unreported}, so its weights are not compared)"


def _losses(mon: JobMonitor) -> dict[int, float]:
    return {s: x for s, x in zip(mon.steps.step, mon.steps.loss) if x is not None and math.isfinite(x)}


def _rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)


def row(case: Case, mon: JobMonitor, reference: JobMonitor, expect: Sequence[Expectation], end: str,
        tolerance: float = LOSS_TOLERANCE, state: JobState | None = None) -> Row:
    """The card's row for a case job whose events ``mon`` has folded; ``end``: why waiting stopped
    ("" when the job ended by itself); ``state``: how it ended (default: as its events say)."""
    ids = {f.id for f in case.faults}
    fired = [f for f in mon.faults if f["id"] in ids]
    first_t = min((f["t"] for f in fired), default=None)
    healed = [r for r in mon.restarts if first_t is not None and r["fault_time"] >= first_t - 1.0]
    state = state or mon.state
    level: str | None = None
    if fired and state == JobState.SUCCEEDED:
        level = max((r["level"] for r in healed), key=LEVELS.index, default="none")
    phases = {p: round(sum((r.get("phases") or {}).get(p, 0.0) for r in healed), 3) for p in RESTART_PHASES}
    check, detail = state_check(mon, reference, tolerance) if state == JobState.SUCCEEDED else \
        ("unchecked", f"the job ended {state.value}" + (f" ({mon.reason})" if mon.reason else ""))
    none = level == "none"   # absorbed without a restart: nothing detected, down or lost
    out: Row = {"case": case.kind.value, "job": case.job, "fault": case.kind.value, "target": case.target,
                "at_step": case.step, "fired": len(fired) == len(case.faults), "level": level,
                "detection_s": round(healed[0]["detection_s"], 3) if healed else (0.0 if none else None),
                "downtime_s": round(sum(r["downtime_s"] for r in healed), 3) if healed else
                (0.0 if none else None),
                "phases": phases if healed else {},
                "lost": sum(r["rolled_back_steps"] for r in healed) if healed else (0 if none else None),
                "state_check": check, "state_detail": detail, "passed": False, "why": [], "note": case.note}
    why = [end] if end else []
    if len(fired) < len(case.faults):
        why.append(f"the fault never fired (scheduled at step {case.step}; the job reached step "
                   f"{mon.max_step})")
    if state != JobState.SUCCEEDED:
        why.append(f"the job did not heal: it ended {state.value}"
                   + (f" ({mon.reason})" if mon.reason else ""))
    if not why:
        why = [w for w in (e.check(out) for e in expect) if w]
    out["why"], out["passed"] = why, not why
    return out


def table(card: Card) -> str:
    """The card as text: one line per case, its phases and why it failed under it."""
    lines = [f"resilience test of {card['job']}: " + ("PASSED" if card["passed"] else "FAILED"),
             f"expect: {', '.join(card['expect'])}"]
    if card["problem"]:
        lines.append(f"  FAIL  {card['problem']}")
    head = f"  {'fault':<20}{'target':<9}{'step':>5}  {'level':<10}{'detect':>8}{'downtime':>10}" \
           f"{'lost':>6}  " \
           f"{'state':<10}result"
    if card["rows"]:
        lines.append(head)
    for r in card["rows"]:
        lines.append(f"  {r['fault']:<20}{r['target']:<9}{r['at_step'] or '-':>5}  {r['level'] or '-':<10}"
                     f"{_s(r['detection_s']):>8}{_s(r['downtime_s']):>10}{_n(r['lost']):>6}  "
                     f"{r['state_check']:<10}{'pass' if r['passed'] else 'FAIL'}")
        if r["phases"]:
            lines.append(f"      phases: {phases_text(r['phases'])}")
        if r["note"]:
            lines.append(f"      note: {r['note']}")
        lines += [f"      why: {w}" for w in r["why"]]
    lines += [f"  skipped {k}: {why}" for k, why in card["skipped"].items()]
    return "\n".join(lines)


def _s(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}s"


def _n(v: int | None) -> str:
    return "-" if v is None else str(v)


def junit(card: Card) -> str:
    """JUnit XML: one testsuite, one testcase per case (a failed case carries a failure element);
    a card that could run no case has one failed testcase saying why."""
    rows = card["rows"]
    cases: list[tuple[str, str, list[str], str]] = [
        (r["case"], r["job"], r["why"], f"level {r['level'] or '-'}, downtime {_s(r['downtime_s'])}, "
                                          f"lost {_n(r['lost'])}, state {r['state_check']}") for r in rows]
    if card["problem"]:
        cases.append(("plan", card["job"], [card["problem"]], ""))
    suite = ET.Element("testsuite", name=f"resilience.{card['job']}", tests=str(len(cases)),
                       failures=str(sum(bool(why) for _, _, why, _ in cases)), errors="0", skipped="0")
    for name, job, why, out in cases:
        tc = ET.SubElement(suite, "testcase", classname=f"resilience.{card['job']}", name=name)
        if why:
            failure = ET.SubElement(tc, "failure", message=why[0][:500], type="ResilienceFailure")
            failure.text = "\n".join(why)
        ET.SubElement(tc, "system-out").text = f"job {job}: {out}" if out else f"job {job}"
    return ET.tostring(suite, encoding="unicode", xml_declaration=True)
