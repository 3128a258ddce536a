"""Part 2, recovery: from a fault to the first step completed after recovery, split into phases,
per fault type and level, for eksft and for the plain-torchrun baseline (:mod:`eksft_nb.resilience.torchrun`).

Phases are the product's (:data:`eksft_nb.events.RESTART_PHASES`): eksft's from its ``restart``
events, the baseline's from the same split (:meth:`eksft_nb.incidents.Incident.phases`) of its
events, with torchrun's exit as the detection. The product's downtime ends where the first step
after recovery starts; here ``first_step`` also counts that step, to its completion.

- detection: fault -> the failure is known (eksft: the supervisor's ``failure.detected_at``;
  baseline: torchrun has exited, its own teardown of the surviving rank included)
- teardown: -> the new incarnation's ranks begin (process start, or re-entry after an in-process
  restart; the latest rank counts)
- reformation: -> its process groups are formed (interpreter, imports, rendezvous)
- restore: -> the model is rebuilt and the checkpoint chosen, verified and loaded (from the ranks'
  in-memory copies, their checksums included, or from storage; ``resume.source`` says which)
- first_step: -> the first step after recovery is completed

Then a lost node (``kill-launcher``) in 2-node jobs, with a hot spare and without (a job restart),
interleaved so that both see the same load: whether the spare recovers at or under the job restart.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import psutil

from eksft_nb import procs
from eksft_nb.events import RESTART_PHASES, Event, EventTail, read_all
from eksft_nb.incidents import Incident
from eksft_nb.jobdir import JobDir, jobs_root
from eksft_nb.job import launch
from eksft_nb.launcher import ZYGOTE_MODULE
from eksft_nb.resilience.torchrun import PlainTorchrunJob
from eksft_nb.spec import JobSpec

from .common import FULL, QUICK, SMOKE, fmt, load_avg, med, ratio, stat, table

PHASES = RESTART_PHASES
# fault type -> seconds, fault to the next completed step (issue 9; a hang is found by the soft
# timeout, 4 s by default, so its target stays the earlier in-process one)
TARGETS_S = {"exception": 1.5, "hang": 5.0, "sigkill": 3.0, "segfault": 3.0, "kill-launcher": 4.0}
# fault type -> the level eksft is meant to heal it at
FAULT_TYPES = {"exception": "inprocess", "hang": "inprocess", "sigkill": "injob", "segfault": "injob",
               "kill-launcher": "job"}
# plain torchrun has no hang detection: the peer waits in the collective until the process-group
# timeout the trainer sets without in-process restart (10 minutes), so a hang is not run there
BASELINE_SKIPPED = {"hang": "not run: plain torchrun has no hang detection; the healthy rank waits out the "
                            "trainer's 600 s gloo timeout before anything restarts"}
FAULT_RANK = {"exception": 0, "hang": 0, "sigkill": 1, "segfault": 0, "kill-launcher": None}
SPEC = {"model.preset": "small", "steps": 100_000, "checkpoint.every": 5, "ft.max_injob_restarts": 20,
        "ft.max_job_restarts": 10}
# a lost node with a hot spare against the same loss without one (a job restart): 2 nodes of 1 rank each
SPARE_SPEC = {"nnodes": 2, "nproc_per_node": 1}
TIMEOUT_S = 300  # per fault: to become ready for it, and to recover from the last one
WARM_WINDOW_S = 3.0  # how long the warm processes' CPU is sampled while the job trains


@dataclass
class Recovery:
    fault: str
    level: str
    at_step: int
    resumed_step: int
    phases: dict[str, float]
    total_s: float
    source: str | None = None  # where the checkpoint was loaded from: memory (the ranks' copies) or storage


QUICK_KINDS = ["exception", "sigkill", "kill-launcher"]   # one fault of each level


def run(size: str) -> dict[str, Any]:
    """Every fault type ``repeats`` times, interleaved, in one eksft job; then the same under the baseline,
    and a lost node with a hot spare against one without. ``smoke`` runs the eksft job alone, on the tiny
    model: the baseline's and the spare's arithmetic is the tests' (on recorded events), their jobs are
    the quick run's."""
    repeats = 3 if size == FULL else 1
    kinds = list(FAULT_TYPES) if size == FULL else QUICK_KINDS
    baseline_kinds = {FULL: [k for k in FAULT_TYPES if k not in BASELINE_SKIPPED], QUICK: ["sigkill"],
                      SMOKE: []}[size]
    changes = {"model.preset": "tiny"} if size == SMOKE else {}
    before = load_avg()
    warm: list[dict[str, Any]] = []
    eksft = eksft_job("rec-eksft", kinds * repeats, warm, changes)
    base = baseline_job("rec-baseline", baseline_kinds * repeats) if baseline_kinds else []
    spare = None if size == SMOKE else spare_vs_job(repeats)
    return summary(kinds, repeats, eksft, base, spare, warm,
                   {"load_avg_before": before, "load_avg_after": load_avg()})


def summary(kinds: Sequence[str], repeats: int, eksft: list[Recovery], base: list[Recovery],
            spare: dict[str, Any] | None, warm: list[dict[str, Any]],
            extra: dict[str, Any]) -> dict[str, Any]:
    """The part's result from its recoveries: per fault type, eksft's and the baseline's, side by side."""
    by_type = {}
    for kind in kinds:
        mine, theirs = [r for r in eksft if r.fault == kind], [r for r in base if r.fault == kind]
        entry = {"expected_level": FAULT_TYPES[kind], "eksft": summarise(mine), "baseline": summarise(theirs)}
        if kind in BASELINE_SKIPPED:
            entry["baseline_note"] = BASELINE_SKIPPED[kind]
        entry["vs_baseline"] = ratio(med(entry["eksft"]["total_s"]), med(entry["baseline"]["total_s"]))
        by_type[kind] = entry
    return {"repeats": repeats, "phases": list(PHASES), "targets_s": TARGETS_S, "by_fault": by_type,
            "targets_met": targets_met(by_type), **extra, "warm_processes": warm, "spare": spare,
            "raw": {"eksft": [asdict(r) for r in eksft], "baseline": [asdict(r) for r in base]}}


def spare_vs_job(repeats: int) -> dict[str, Any]:
    """A node lost (kill-launcher) in a 2-node job with a hot spare (an in-job restart with the spare)
    and without (a job restart), one fault per job, the two interleaved so that both see the same load."""
    runs: dict[str, list[Recovery]] = {"spare": [], "job": []}
    for i in range(repeats):
        runs["job"] += eksft_job(f"rec-nospare-{i}", ["kill-launcher"], None, SPARE_SPEC)
        runs["spare"] += eksft_job(f"rec-spare-{i}", ["kill-launcher"], None,
                                   {**SPARE_SPEC, "spare_nodes": 1})
    return spare_summary(runs)


def spare_summary(runs: dict[str, list[Recovery]]) -> dict[str, Any]:
    """The spare's recoveries and the job restart's, and whether the spare's median is at or under."""
    out = {who: summarise(recs) for who, recs in runs.items()}
    spare, job = med(out["spare"]["total_s"]), med(out["job"]["total_s"])
    out["spare_at_or_under_job"] = None if spare is None or job is None else spare <= job
    return out


def eksft_job(name: str, kinds: Sequence[str], warm: list[dict[str, Any]] | None,
              changes: dict[str, Any] | None = None) -> list[Recovery]:
    """``warm`` (unless None) receives the cost of the job's warm processes, measured before the first
    fault; ``changes`` to :data:`SPEC` (e.g. 2 nodes and a spare)."""
    spec = JobSpec().replace(name=name, **{**SPEC, **(changes or {})}).validate()
    job = launch(spec)

    def fire(kind: str) -> None:
        if warm is not None and not warm:
            jd = JobDir.for_name(name)
            deadline = time.time() + TIMEOUT_S  # the standby zygotes import torch once the ranks have started
            while time.time() < deadline and not all(
                "ready" in p.read_text() for p in jd.logs.glob("zygote-1.*.log")):
                time.sleep(0.5)
            record = jd.supervisor()
            warm.extend(warm_costs(record.get("job_uid", ""), record.get("pid", 0)))
        job.inject(kind, rank=FAULT_RANK[kind])

    try:
        Injector(JobDir.for_name(name).events_path, fire, lambda: job.state).run(kinds)
    finally:
        job.stop()
    return restarts(read_all(JobDir.for_name(name).events_path))


def restarts(events: list[Event]) -> list[Recovery]:
    """One :class:`Recovery` per restart of an eksft job that has its fault and a step after it: the
    product's phases, with the first step counted to its completion."""
    out = []
    for restart in (e for e in events if e.kind == "restart"):
        fault = next((e for e in events if e.kind == "fault" and e.t == restart["fault_time"]), None)
        start = restart["fault_time"] + restart["downtime_s"]
        first = next((e for e in events if e.kind == "step" and e.t >= start), None)
        if fault is None or first is None or restart.get("phases") is None:
            continue
        out.append(Recovery(fault["fault"], restart["level"], fault["at_step"], restart["resumed_step"],
                            _to_completion(restart["phases"], first), first.t - fault.t,
                            restart.get("restored_from")))
    return out


def baseline_job(name: str, kinds: Sequence[str]) -> list[Recovery]:
    spec = JobSpec().replace(name=name, **SPEC).validate()
    job = PlainTorchrunJob.create(jobs_root().parent / "baseline", spec)
    job.start(timeout=TIMEOUT_S * (len(kinds) + 1))
    try:
        Injector(job.jd.events_path, lambda kind: job.inject(kind, FAULT_RANK[kind]),
                 lambda: job.state).run(kinds)
    finally:
        job.stop()
    return recoveries(read_all(job.jd.events_path), [(t, "resubmit") for t in job.exits])


@dataclass
class Injector:
    """Fires faults one at a time, each once the job has recovered from the previous one and committed
    a checkpoint since (so every recovery has a checkpoint to load and the restarts make progress)."""

    events_path: Path
    fire: Callable[[str], Any]
    state: Callable[[], str]

    def __post_init__(self) -> None:
        self.tail = EventTail(self.events_path)
        self.events: list[Event] = []

    def run(self, kinds: Sequence[str]) -> None:
        for i, kind in enumerate(kinds):
            self._wait(self._ready, f"a checkpoint committed before fault {i + 1} ({kind})")
            self.fire(kind)
            self._wait(lambda n=i + 1: self._count("fault") >= n, f"fault {i + 1} ({kind}) to fire")
        self._wait(self._recovered, "recovery from the last fault")

    def _wait(self, predicate: Callable[[], bool], what: str) -> None:
        deadline = time.time() + TIMEOUT_S
        while True:
            self.events += self.tail.read()
            if predicate():
                return
            state = self.state()
            if state in ("failed", "stopped", "lost", "succeeded") or time.time() > deadline:
                raise RuntimeError(f"gave up waiting for {what}: the job is {state}")
            time.sleep(0.2)

    def _count(self, kind: str) -> int:
        return sum(e.kind == kind for e in self.events)

    def _since_last_start(self) -> list[Event]:
        """Events since the newest rank_start that follows the last fault (empty before it)."""
        faults = [e.t for e in self.events if e.kind == "fault"]
        since = faults[-1] if faults else 0.0
        starts = [i for i, e in enumerate(self.events) if e.kind == "rank_start" and e.t > since]
        return self.events[starts[-1]:] if starts else []

    def _ready(self) -> bool:
        after = self._since_last_start()
        commit = next((i for i,
                       e in enumerate(after) if e.kind == "checkpoint" and e["phase"] == "committed"), None)
        return commit is not None and sum(e.kind == "step" for e in after[commit:]) >= 2

    def _recovered(self) -> bool:
        return any(e.kind == "step" for e in self._since_last_start())


def recoveries(events: list[Event], detections: list[tuple[float, str]]) -> list[Recovery]:
    """One :class:`Recovery` per fault that was recovered from (a fault's window ends at the next fault)."""
    faults = [e for e in events if e.kind == "fault"]
    out = []
    for i, fault in enumerate(faults):
        end = faults[i + 1].t if i + 1 < len(faults) else float("inf")
        detected = next(((t, level) for t, level in detections if fault.t <= t < end), None)
        if detected is None:
            continue
        window = [e for e in events if detected[0] < e.t < end]
        rec = _recovery(fault, detected, window)
        if rec is not None:
            out.append(rec)
    return out


def _recovery(fault: Event, detected: tuple[float, str], window: list[Event]) -> Recovery | None:
    """The first step that follows a rank_start of a new incarnation ends the recovery."""
    started = False
    first = None
    for e in window:
        started = started or e.kind == "rank_start"
        if started and e.kind == "step":
            first = e
            break
    if first is None:
        return None
    before = [e for e in window if e.t < first.t]
    starts = [e for e in before if e.kind == "rank_start"]
    newest = [e for e in starts if _incarnation(e) == max(_incarnation(e) for e in starts)]
    incident = Incident(detected[1], "", None, fault.t, detected[0], fault["at_step"] or 0,
                        entered=max(e["t_enter"] for e in newest),
                        grouped=max(e.get("t_group", 0.0) for e in newest),
                        restored=max(e.t for e in newest))
    resume = next((e for e in reversed(before) if e.kind == "resume"), None)
    phases = incident.phases(first.t - first["step_time"])
    return Recovery(fault["fault"], detected[1], fault["at_step"], resume["step"] if resume else 0,
                    _to_completion(phases, first), first.t - fault.t,
                    resume.get("source") if resume else None)


def _to_completion(phases: dict[str, float], first: Event) -> dict[str, float]:
    """The product's phases (downtime to the first step's start) with that step counted to its end."""
    return {**phases, "first_step": phases["first_step"] + first["step_time"]}


def _incarnation(e: Event) -> tuple[int, int, int]:
    return (e["job_attempt"], e["injob_restart"], e["inprocess_iteration"])


def warm_costs(job_uid: str, supervisor: int, window_s: float = WARM_WINDOW_S) -> list[dict[str, Any]]:
    """What the processes kept warm for the next restart cost while the job trains: each zygote (this
    attempt's, which forked the ranks, and the standby one for the next attempt) and each standby
    ft_launcher (the supervisor's children). Memory: RSS, and PSS/USS (pages shared with the ranks a zygote
    forked count once, split between them); CPU: percent of one core over ``window_s``."""
    found = []
    for p in procs.marked(job_uid):
        try:
            if p.ppid() != supervisor:  # what a zygote forked (ranks, their helpers) carries its command line
                continue
            cmd = " ".join(p.cmdline())
            role = ("zygote" if ZYGOTE_MODULE in cmd
                    else "standby launcher" if "local.standby" in cmd else None)
            if role:
                found.append((p, role, p.environ().get(procs.NODE_MARK, "?"), sum(p.cpu_times()[:2])))
        except psutil.Error:
            continue
    time.sleep(window_s)
    out = []
    for p, role, tag, cpu0 in found:
        try:
            mem = p.memory_full_info()
            cpu = sum(p.cpu_times()[:2]) - cpu0
        except psutil.Error:
            continue
        out.append({"role": role, "node_tag": tag, "rss_mb": round(mem.rss / 2**20, 1),
                    "pss_mb": round(mem.pss / 2**20, 1),
                    "uss_mb": round(mem.uss / 2**20, 1), "cpu_pct": round(100 * cpu / window_s, 2)})
    return sorted(out, key=lambda r: (r["role"], r["node_tag"]))


def summarise(recs: list[Recovery]) -> dict[str, Any]:
    return {"n": len(recs), "levels": sorted({r.level for r in recs}),
            "total_s": stat([r.total_s for r in recs]),
            "phases_s": {p: stat([r.phases[p] for r in recs]) for p in PHASES},
            "rolled_back_steps": stat([r.at_step - 1 - r.resumed_step for r in recs]),
            "loaded_from": {src: sum((r.source or "-") == src
                                     for r in recs) for src in sorted({r.source or "-" for r in recs})}}


def targets_met(by_type: dict[str, Any]) -> dict[str, Any]:
    """Per fault type: within its level's target (median), and faster than the baseline (median)."""
    out = {}
    for kind, entry in by_type.items():
        total = med(entry["eksft"]["total_s"])
        limit = TARGETS_S[kind]
        out[kind] = {"within_target": total is not None and total <= limit,
                     "faster_than_baseline": None if entry["vs_baseline"] is None
                     else entry["vs_baseline"] < 1.0}
    return out


def report(result: dict[str, Any]) -> str:
    rows = []
    for kind, entry in result["by_fault"].items():
        for who in ("eksft", "baseline"):
            s = entry[who]
            if not s["n"]:
                if who == "baseline" and entry.get("baseline_note"):
                    rows.append([f"{kind} / baseline", "-", "0", *["-"] * (len(PHASES) + 2)])
                continue
            level = "/".join(s["levels"])
            phases = [fmt(med(s["phases_s"][p]), ".2f") for p in PHASES]
            tgt = f"<= {TARGETS_S[kind]:g}" if who == "eksft" else ""
            rows.append([f"{kind} / {who}", level, str(s["n"]), *phases, fmt(med(s["total_s"]), ".2f"), tgt])
    title = (f"2. recovery: fault -> first completed step after recovery, seconds (median of "
             f"{result['repeats']} per fault type; load "
             f"{result['load_avg_before'][0]}->{result['load_avg_after'][0]})")
    out = [table(title, ["fault / who", "level", "n", *PHASES, "total", "target"], rows)]
    for kind, met in result["targets_met"].items():
        vs = result["by_fault"][kind]["vs_baseline"]
        base = (f"{vs:.2f}x the baseline ({'faster' if met['faster_than_baseline'] else 'NOT faster'})"
                if vs is not None
                else result["by_fault"][kind].get("baseline_note", "no baseline"))
        out.append(f"  {kind}: {'within' if met['within_target'] else 'NOT within'} the {FAULT_TYPES[kind]} "
                   f"target ({TARGETS_S[kind]:g} s); {base}")
    loaded = [f"{kind} {', '.join(f'{src} {n}' for src, n in entry['eksft'].get('loaded_from', {}).items())}"
              for kind, entry in result["by_fault"].items() if entry["eksft"]["n"]]
    out.append("  eksft loaded the checkpoint from (memory: the ranks' in-memory copies): "
               f"{'; '.join(loaded)}")
    if result.get("spare"):
        out.append(spare_report(result["spare"]))
    warm = result.get("warm_processes") or []
    if warm:
        out.append(table("   warm processes while the job trains (attempt.node; CPU over "
                         f"{WARM_WINDOW_S:g} s)",
                         ["process", "RSS MB", "PSS MB", "USS MB", "CPU %"],
                         [[f"{w['role']} {w['node_tag']}", fmt(w["rss_mb"], ".0f"), fmt(w["pss_mb"], ".0f"),
                           fmt(w["uss_mb"], ".0f"), fmt(w["cpu_pct"], ".1f")] for w in warm]))
    return "\n".join(out) + "\n"


def spare_report(spare: dict[str, Any]) -> str:
    rows = []
    for who, label in (("spare", "hot spare (in-job)"), ("job", "no spare (job restart)")):
        s = spare[who]
        rows.append([label, "/".join(s["levels"]) or "-", str(s["n"]),
                     *[fmt(med(s["phases_s"][p]), ".2f") for p in PHASES], fmt(med(s["total_s"]), ".2f")])
    verdict = {True: "the spare recovers at or under the job restart",
               False: "the spare recovers SLOWER than the job "
               "restart", None: "not measured"}[spare["spare_at_or_under_job"]]
    return (table("   a lost node (kill-launcher), 2 nodes x 1 rank: median seconds",
                  ["who", "level", "n", *PHASES, "total"], rows) + f"\n  {verdict}")
