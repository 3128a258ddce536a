"""What one engine's run of a fault plan cost, from its events alone: ETTR with its time breakdown, each
fault's recovery with its phases, the steps it lost and the samples it skipped, and its final loss.

Every engine's events go through the same goodput (:func:`eksft_nb.goodput.compute`), so a term means the
same on each; ETTR is its productive share of the wall time (the what-if's). Its ``skipped`` term is what
only torchft loses: while a replica group is away, or heals from a peer, the others commit steps without
its batches (:func:`eksft_nb.goodput.missing_batches`, the one count of them). A recovery that rolls nothing
back has its phases from the group's own events (the failure the supervisor saw, the new process's start,
its heal), as a restart's phases come from the ranks'.
"""

from __future__ import annotations

from collections.abc import Sequence
from statistics import median
from typing import Any

from ..events import RESTART_LEVELS, Event
from ..goodput import CATEGORIES, compute, missing_batches
from ..incidents import Incident
from ..monitor import JobMonitor

TERMS = CATEGORIES  # goodput's terms: each means the same on every engine
LAST_LOSSES = 5  # the final loss: the mean of the last steps' (one step's loss is one batch's, noisy)


def ledger(events: Sequence[Event], world_size: int, batch: int) -> dict[str, Any]:
    """One engine's account of a run (``world_size`` ranks of ``batch`` sequences a step)."""
    mon = JobMonitor()
    mon.update(events)
    gp = compute(mon)
    seconds = gp.seconds()
    clean = median(mon.steps.step_time) if len(mon.steps) else 0.0
    skipped_batches = missing_batches(mon)
    steps_lost = sum(r["rolled_back_steps"] for r in mon.restarts)
    return {
        "state": mon.state.value,
        "reason": mon.reason,
        "steps_done": mon.last_step,
        "wall_s": round(gp.wall_s, 3),
        "ettr": round(gp.goodput, 5),
        "terms": {t: round(seconds[t], 4) for t in TERMS},
        "clean_step_s": round(clean, 5),
        "faults": [recovery(f, mon, events) for f in mon.faults],
        "steps_lost": steps_lost,
        "skipped_batches": skipped_batches,
        "samples_skipped": skipped_batches * batch,
        "lost_step_equivalents": round(steps_lost + skipped_batches / world_size, 3),
        "final_loss": None if (final := final_loss(mon)) is None else round(final, 5),
        "digest": mon.digest,
    }


def final_loss(mon: JobMonitor) -> float | None:
    """The mean of the last steps' losses (None: they reported none)."""
    losses = [x for x in mon.steps.loss[-LAST_LOSSES:] if x is not None]
    return sum(losses) / len(losses) if losses else None


def recovery(fault: dict[str, Any], mon: JobMonitor, events: Sequence[Event]) -> dict[str, Any]:
    """How the job got over one fault: its restart (matched by the fault's time), or a replica group that
    threw the step away and healed without one; ``level`` None: no recovery of its own was seen (the job
    ended first, or one restart healed it with an earlier fault); ``away_s``: a failure was seen and no
    recovery, the seconds from the fault to the job's last event (a torchft group still rejoining at the
    end). ``skipped_batches``: the batches the recovering group reported it skipped."""
    row = {"fault": fault["fault"], "rank": fault["rank"], "step": fault["step"], "level": None,
           "restored_from": None, "detection_s": None, "stall_s": None, "recovery_s": None, "phases": {},
           "steps_lost": 0, "skipped_batches": 0, "away_s": None}
    restart = next((r for r in mon.restarts if abs(r["fault_time"] - fault["t"]) < 1e-6), None)
    if restart is not None and restart.get("recovered") is False:
        restart = _through_failed(restart, mon.restarts)   # None: no restart after it recovered
    if restart is None and any(abs(f["fault_time"] - fault["t"]) < 1e-6 for f in mon.failures):
        return {**row, "away_s": round((mon.last_event_t or fault["t"]) - fault["t"], 4)}
    if restart is not None:
        phases = restart.get("phases") or _group_phases(restart, events)
        return {**row, "level": restart["level"], "restored_from": restart.get("restored_from"),
                "detection_s": round(restart["detection_s"], 4), "stall_s": round(restart["downtime_s"], 4),
                "recovery_s": round(sum(phases.values()), 4), "phases": phases,
                "steps_lost": restart["rolled_back_steps"],
                "skipped_batches": restart.get("skipped_batches", 0)}
    rank, t = fault["rank"], fault["t"]
    thrown = _first(events, "step_discarded", rank, t)
    heal = _first(events, "heal", rank, thrown.t if thrown else t)
    if thrown is None or heal is None:
        return row
    incident = Incident("none", "", rank, t, thrown.t, 0, grouped=heal.t - heal["heal_s"], restored=heal.t)
    phases = incident.phases(heal.t)
    return {**row, "level": "none", "restored_from": "peer", "detection_s": round(thrown.t - t, 4),
            "stall_s": 0.0, "recovery_s": round(sum(phases.values()), 4), "phases": phases,
            "skipped_batches": heal["skipped_batches"]}


def _through_failed(first: dict[str, Any], restarts: list[dict[str, Any]]) -> dict[str, Any] | None:
    """A fault's recovery whose first restarts failed before a step: from its restart through the first one
    that recovered, as one (the highest level, the downtimes, phases and steps lost summed); None when
    none recovered."""
    chain = restarts[restarts.index(first):]
    last = next((i for i, r in enumerate(chain) if r.get("recovered", True)), None)
    if last is None:
        return None
    chain = chain[:last + 1]
    phases = {p: round(sum((r.get("phases") or {}).get(p, 0.0) for r in chain), 4)
              for p in chain[-1].get("phases") or {}}
    return {**chain[-1], "level": max((r["level"] for r in chain), key=RESTART_LEVELS.index),
            "detection_s": first["detection_s"], "downtime_s": sum(r["downtime_s"] for r in chain),
            "rolled_back_steps": sum(r["rolled_back_steps"] for r in chain), "phases": phases}


def _group_phases(restart: dict[str, Any], events: Sequence[Event]) -> dict[str, float]:
    """A replica group's recovery (torchft): detection (fault -> the supervisor saw its process gone),
    teardown (-> the new process started), reformation (-> its first quorum began: imports, model, the
    group's store and manager), restore (the quorum and the fetch of a peer's state), up to its heal."""
    group, fault_time = restart.get("replica_group", restart["blame_rank"]), restart["fault_time"]
    start = _first(events, "rank_start", group, fault_time)
    heal = _first(events, "heal", group, fault_time)
    end = heal.t if heal is not None else fault_time + restart["downtime_s"]
    incident = Incident(restart["level"], restart["cause"], group, fault_time,
                        fault_time + restart["detection_s"], 0,
                        entered=start.get("t_enter", start.t) if start is not None else None,
                        grouped=heal.t - heal["heal_s"] if heal is not None else None, restored=end)
    return incident.phases(end)


def _first(events: Sequence[Event], kind: str, rank: int | None, after: float) -> Event | None:
    return next((e for e in events if e.kind == kind and e.rank == rank and e.t > after), None)
