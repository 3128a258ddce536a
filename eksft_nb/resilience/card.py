"""The report card of a resilience test: one row per trial, built from the trial job's events and the
reference run's, scored per fault kind (:mod:`.scoring`), shown as a table, JSON, and JUnit XML (a CI gates
on its failures)."""

from __future__ import annotations

import math
import re
import xml.etree.ElementTree as ET
from collections.abc import Sequence
from typing import Any, TypedDict

from .. import cost as costs
from ..events import RESTART_PHASES, Event
from ..goodput import missing_batches
from ..incidents import phases_text
from ..monitor import JobMonitor
from ..nvrx import NVRx
from ..states import JobState
from .expect import LEVELS, Expectation
from .ledger import final_loss, recovery
from .plan import Case
from .scoring import kinds_text

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
    restored_from: str | None  # where the healed state came from: memory, storage, peer (torchft)
    skipped_batches: int       # the batches the kept steps lacked (torchft: a group away or healing)
    state_check: str           # match | consistent (torchft: see groups_state_check) | differs | unchecked
    state_detail: str
    passed: bool
    why: list[str]
    note: str
    trial: int                 # its number among its kind's trials
    expected_level: str | None  # the ground truth: the level that should heal it (None: not said)
    fired_t: float | None      # when the fault fired (its event's time)
    fired_step: int | None     # the step it fired at
    lost_gpu_s: float | None   # what it cost the job in GPU-seconds (see scoring.price_trial)
    cost: dict[str, float | None]   # gpu_h, usd (None without a price)


class Card(TypedDict, total=False):
    job: str
    expect: list[str]
    reference: dict[str, Any]
    rows: list[Row]
    skipped: dict[str, str]
    problem: str
    passed: bool
    kinds: list[Any]           # scoring.KindRow per kind that applies
    plan: dict[str, Any]       # seed, repeat, window, plan_id, manifest
    cost: dict[str, Any]       # the pricing, the reference's checkpoints, the scaled model
    note: str   # about the whole card: what in-job restart costs where NVRx deprecates in-process ("": none)


def inprocess_note(nvrx_version: str | None, inprocess: bool, rows: Sequence[Row]) -> str:
    """Where the job used in-process restart on an NVRx that deprecates it (0.6+): what in-job restart,
    NVRx's way forward, costs instead, as this card measured it (its cases healed in-job)."""
    if not inprocess or not nvrx_version or NVRx(nvrx_version).inprocess != "deprecated":
        return ""

    def mean(level: str) -> float | None:
        took = [r["downtime_s"] for r in rows if r["level"] == level and r["downtime_s"] is not None]
        return sum(took) / len(took) if took else None

    injob, inprocess_s = mean("injob"), mean("inprocess")
    said = f"NVRx {nvrx_version} deprecates in-process restart (inprocess.Wrapper): "
    if injob is None:
        return said + ("what an in-job restart costs instead was not measured here (a sigkill case "
                       "measures it)")
    also = f", an in-process one {inprocess_s:.2f}s" if inprocess_s is not None else ""
    return said + f"an in-job restart took {injob:.2f}s here{also} (--no-inprocess: every recovery in-job)"


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
        tolerance: float = LOSS_TOLERANCE, state: JobState | None = None,
        events: Sequence[Event] | None = None) -> Row:
    """The card's row for a case job whose events ``mon`` has folded; ``end``: why waiting stopped
    ("" when the job ended by itself); ``state``: how it ended (default: as its events say); ``events``:
    a torchft job's events (its groups recover without a restart of the job, and each reports its end)."""
    ids = {f.id for f in case.faults}
    fired = [f for f in mon.faults if f["id"] in ids]
    state = state or mon.state
    ended_well = bool(fired) and state == JobState.SUCCEEDED
    outcome, why = _restarts(fired, mon, ended_well) if events is None else \
        _group_recoveries(fired, mon, events, ended_well)
    if state != JobState.SUCCEEDED:
        check = "unchecked"
        detail = f"the job ended {state.value}" + (f" ({mon.reason})" if mon.reason else "")
    elif events is None:
        check, detail = state_check(mon, reference, tolerance)
    else:
        check, detail = groups_state_check(mon, reference, events, case.step, tolerance)
    note = "; ".join(n for n in (case.note, outcome.pop("note", "")) if n)
    first = min(fired, key=lambda f: f["t"], default=None)
    out: Row = {"case": case.kind.value, "job": case.job, "fault": case.kind.value, "target": case.target,
                "at_step": case.step, "fired": len(fired) == len(case.faults), "level": outcome["level"],
                "detection_s": outcome["detection_s"], "downtime_s": outcome["downtime_s"],
                "phases": outcome["phases"], "lost": outcome["lost"],
                "restored_from": outcome["restored_from"],
                "skipped_batches": missing_batches(mon), "state_check": check, "state_detail": detail,
                "passed": False, "why": [], "note": note, "trial": case.trial,
                "expected_level": case.expected,
                "fired_t": first["t"] if first else None, "fired_step": first["step"] if first else None,
                "lost_gpu_s": None, "cost": {"gpu_h": None, "usd": None}}
    why = ([end] if end else []) + why
    if len(fired) < len(case.faults):
        why.append(f"the fault never fired (scheduled at step {case.step}; the job reached step "
                   f"{mon.max_step})")
    if state != JobState.SUCCEEDED:
        why.append(f"the job did not heal: it ended {state.value}"
                   + (f" ({mon.reason})" if mon.reason else ""))
    if not why:
        if case.expected is not None and out["level"] != case.expected:
            why.append(f"healed at level {out['level']}, where the plan expects {case.expected}")
        why += [w for w in (e.check(out) for e in expect) if w]
    out["why"], out["passed"] = why, not why
    return out


def _restarts(fired: list[dict[str, Any]], mon: JobMonitor,
              ended_well: bool) -> tuple[dict[str, Any], list[str]]:
    """An NVRx job's recovery: the restarts since the first fault (a fault may be healed with the next)."""
    first_t = min((f["t"] for f in fired), default=None)
    healed = [r for r in mon.restarts if first_t is not None and r["fault_time"] >= first_t - 1.0]
    level = max((r["level"] for r in healed), key=LEVELS.index, default="none") if ended_well else None
    none = level == "none"   # absorbed without a restart: nothing detected, down or lost
    phases = {p: round(sum((r.get("phases") or {}).get(p, 0.0) for r in healed), 3) for p in RESTART_PHASES}
    return {"level": level,
            "detection_s": round(healed[0]["detection_s"], 3) if healed else (0.0 if none else None),
            "downtime_s": round(sum(r["downtime_s"] for r in healed), 3) if healed else
            (0.0 if none else None),
            "phases": phases if healed else {},
            "lost": sum(r["rolled_back_steps"] for r in healed) if healed else (0 if none else None),
            "restored_from": next((r["restored_from"] for r in healed if r.get("restored_from")), None)}, []


def _group_recoveries(fired: list[dict[str, Any]], mon: JobMonitor, events: Sequence[Event],
                      ended_well: bool) -> tuple[dict[str, Any], list[str]]:
    """A torchft job's recovery, each fault's read as ``compare`` reads it (:func:`.ledger.recovery`): a
    group lost is restarted by the backend (level ``job``) and heals from a peer; a step thrown away is
    healed from a peer without a restart (``none``); nothing rolls back. The job's downtime is the other
    groups' stall; the phases are the lost group's way back. A group still away at the job's end failed."""
    recs = [recovery(f, mon, events) for f in fired]
    seen = [r for r in recs if r["level"] is not None]
    why = [f"the replica group of rank {r['rank']} was lost and had not healed from a peer when the job "
           f"ended, {r['away_s']:.1f}s after the fault" for r in recs if r["away_s"] is not None]
    level = max((r["level"] for r in seen), key=LEVELS.index, default="none") if ended_well and not why \
        else None
    none = level == "none" and not seen   # absorbed (a straggler): nothing detected, down or lost
    back = sum(r["recovery_s"] for r in seen if r["level"] == "job")
    return {"level": level,
            "detection_s": round(seen[0]["detection_s"], 3) if seen else (0.0 if none else None),
            "downtime_s": round(sum(r["stall_s"] for r in seen), 3) if seen else (0.0 if none else None),
            "phases": {p: round(sum(r["phases"].get(p, 0.0) for r in seen), 3) for p in RESTART_PHASES}
            if seen else {},
            "lost": sum(r["steps_lost"] for r in seen) if seen else (0 if none else None),
            "restored_from": next((r["restored_from"] for r in seen if r["restored_from"]), None),
            "note": f"downtime is the other groups' stall; the lost group was back {back:.2f}s after the "
                    "fault (its phases)" if back else ""}, why


def groups_state_check(case: JobMonitor, reference: JobMonitor, events: Sequence[Event], fault_step: int,
                       tolerance: float = LOSS_TOLERANCE) -> tuple[str, str]:
    """A torchft job's final state: ``match`` where every group ended with the reference's digest. A group
    healed from a peer legitimately ends elsewhere (the steps it was away trained without its batches), so
    otherwise ``consistent`` where what a healthy job keeps holds: every rank's final digest (its
    ``rank_end``) the same, every step of the reference's committed, each loss before the fault within
    ``tolerance`` of the reference's (the same job until then), and the final loss within ``tolerance`` plus
    the share of batches skipped; else ``differs``."""
    ends = {e.rank: (e.get("replica_group", e.rank), e.get("digest")) for e in events
            if e.kind == "rank_end" and e.rank is not None}
    silent = [r for r in range(case.world_size or 0) if not ends.get(r, (None, None))[1]]
    if silent or not ends:
        who = f"rank(s) {', '.join(map(str, silent))}" if silent else "no rank"
        return "differs", f"{who} reported no final digest: their replica group did not train to the end"
    digests = {d for _, d in ends.values()}
    if len(digests) > 1:
        shown = ", ".join(f"group {g} {d}" for g, d in sorted(set(ends.values())))
        return "differs", f"the replica groups ended with different weights ({shown})"
    digest = digests.pop()
    if digest == reference.digest:
        return "match", f"every replica group's final digest {digest} is the reference's"
    missing = sorted(set(reference.steps.step) - set(case.steps.step))
    if missing:
        return "differs", f"{len(missing)} of the reference's steps never committed (first: {missing[0]})"
    ref, got, skipped = _losses(reference), _losses(case), missing_batches(case)
    loss = "the job reports no loss (a script), so its loss is not compared"
    if ref:
        early = [s for s in ref if s < fault_step and s in got and _rel(got[s], ref[s]) > tolerance]
        if early:
            return "differs", (f"loss at step {early[0]}, before the fault, is {got[early[0]]:.5g}, the "
                               f"reference's {ref[early[0]]:.5g} (tolerance {100 * tolerance:g} %)")
        final, ref_final = final_loss(case), final_loss(reference)
        share = skipped / max(1, len(ref) * (case.world_size or 1))   # of the reference's batches
        allowed = f"{100 * tolerance:g} % + {100 * share:.1f} % (the batches skipped)"
        if final is None or ref_final is None or _rel(final, ref_final) > tolerance + share:
            return "differs", f"final loss {_g(final)}, the reference's {_g(ref_final)} (tolerance {allowed})"
        loss = (f"the loss before the fault within {100 * tolerance:g} % of the reference's, the final loss "
                f"{final:.4g} within {allowed} of its {ref_final:.4g}")
    why = f": the steps a group was away trained without its {skipped} batches" if skipped else \
        ", though no batch was skipped"
    steps = len(set(reference.steps.step))
    return "consistent", (f"every replica group ended with digest {digest} (not the reference's "
                          f"{reference.digest}{why}); all {steps} of the reference's steps committed; {loss}")


def _g(v: float | None) -> str:
    return "none" if v is None else f"{v:.5g}"


def table(card: Card) -> str:
    """The card as text: one line per case, its phases and why it failed under it."""
    plan = card.get("plan") or {}
    repeat = plan.get("repeat", 1)
    lines = [f"resilience test of {card['job']}: " + ("PASSED" if card["passed"] else "FAILED")
             + (f" ({repeat} trials per kind, seed {plan.get('seed', 0)}, plan {plan.get('plan_id')}"
                + (f", a re-check of plan {plan['recheck']})" if plan.get("recheck") else ")")
                if repeat > 1 or plan.get("recheck") else ""),
             f"expect: {', '.join(card['expect'])}"]
    if card["problem"]:
        lines.append(f"  FAIL  {card['problem']}")
    lines += kinds_text(card)
    names = [r["fault"] if repeat == 1 else f"{r['fault']} #{r.get('trial', 1)}" for r in card["rows"]]
    cost_texts = [costs.text(r.get("cost") or {}) for r in card["rows"]]
    wide = max([20, *(len(n) + 2 for n in names)])   # columns as wide as their longest entry, and a gap
    cost_wide = max([24, *(len(c) + 2 for c in cost_texts)])
    head = f"  {'fault':<{wide}}{'target':<9}{'step':>5}  {'level':<10}{'detect':>8}{'downtime':>10}" \
           f"{'lost':>6}  " \
           f"{'state':<12}{'cost':<{cost_wide}}result"
    if card["rows"]:
        lines.append(head)
    for r, name, cost in zip(card["rows"], names, cost_texts):
        lines.append(f"  {name:<{wide}}{r['target']:<9}{r['at_step'] or '-':>5}  {r['level'] or '-':<10}"
                     f"{_s(r['detection_s']):>8}{_s(r['downtime_s']):>10}{_n(r['lost']):>6}  "
                     f"{r['state_check']:<12}{cost:<{cost_wide}}"
                     f"{'pass' if r['passed'] else 'FAIL'}")
        if r["phases"]:
            lines.append(f"      phases: {phases_text(r['phases'])}")
        if r["restored_from"] or r["skipped_batches"]:
            lines.append(f"      restored from {r['restored_from'] or '-'}; {r['skipped_batches']} batches "
                         "skipped (steps trained without them)")
        if r["state_check"] == "consistent":
            lines.append(f"      state: {r['state_detail']}")
        if r["note"]:
            lines.append(f"      note: {r['note']}")
        lines += [f"      why: {w}" for w in r["why"]]
    lines += [f"  skipped {k}: {why}" for k, why in card["skipped"].items()]
    lines += cost_lines(card)
    if card.get("note"):
        lines.append(f"  note: {card['note']}")
    return "\n".join(lines)


def cost_lines(card: Card) -> list[str]:
    """The price the card used, what the reference's checkpoints cost, and the scaled model if asked."""
    c = card.get("cost")
    if not c:
        return []
    lines = [f"  cost: {c['gpus']} GPU(s) (one per rank); "
             + (f"priced at {c['pricing']['price']}" if c["pricing"]["price"] else
                "GPU-hours only (give --price INSTANCE or USD/h for dollars)")]
    if c.get("checkpoints"):
        lines.append(f"  the reference's checkpoints cost {costs.text(c['checkpoints'])} "
                     f"({100 * c['ckpt_share']:.1f}% of its steady training time)")
    if c.get("projection"):
        lines += ["  " + line for line in costs.projection_text(c["projection"])]
    return lines


def _s(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}s"


def _n(v: int | None) -> str:
    return "-" if v is None else str(v)


# a terminal's escape sequences (colours, titles, cursor moves), which a failure text may carry from a
# rank's output: CSI ... final byte, OSC ... BEL or ST, or ESC and one byte
ANSI = re.compile(r"\x1b(?:\[[0-?]*[ -/]*[@-~]|\][^\x07\x1b]*(?:\x07|\x1b\\)|[@-Z\\-_])")
# what XML 1.0 cannot hold: C0 controls but tab, newline and return, surrogates, U+FFFE and U+FFFF
NOT_XML = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\ud800-\udfff\ufffe\uffff]")


def xml_text(text: str) -> str:
    """``text`` as XML 1.0 can hold it: escape sequences dropped, any other character it cannot hold
    written as its code (``\\x00``), so that every JUnit reader parses the file."""
    return NOT_XML.sub(lambda m: f"\\x{ord(m.group()):02x}" if ord(m.group()) < 0x100
                       else f"\\u{ord(m.group()):04x}", ANSI.sub("", text))


def junit(card: Card) -> str:
    """JUnit XML: one testsuite, one testcase per case (a failed case carries a failure element);
    a card that could run no case has one failed testcase saying why. Every text goes through
    :func:`xml_text` (a failure's text may hold a rank's colour codes or a NUL)."""
    rows = card["rows"]
    cases: list[tuple[str, str, list[str], str]] = [
        (r["case"] if (card.get("plan") or {}).get("repeat", 1) == 1 else f"{r['case']} #{r.get('trial', 1)}",
         r["job"], r["why"], f"level {r['level'] or '-'}, downtime {_s(r['downtime_s'])}, "
                             f"lost {_n(r['lost'])}, state {r['state_check']}") for r in rows]
    if card["problem"]:
        cases.append(("plan", card["job"], [card["problem"]], ""))
    suite_name = xml_text(f"resilience.{card['job']}")
    suite = ET.Element("testsuite", name=suite_name, tests=str(len(cases)),
                       failures=str(sum(bool(why) for _, _, why, _ in cases)), errors="0", skipped="0")
    for name, job, why, out in cases:
        tc = ET.SubElement(suite, "testcase", classname=suite_name, name=xml_text(name))
        if why:
            failure = ET.SubElement(tc, "failure", message=xml_text(why[0])[:500], type="ResilienceFailure")
            failure.text = xml_text("\n".join(why))
        ET.SubElement(tc, "system-out").text = xml_text(f"job {job}: {out}" if out else f"job {job}")
    return ET.tostring(suite, encoding="unicode", xml_declaration=True)
