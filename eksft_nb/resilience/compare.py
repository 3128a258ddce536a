"""``compare``: one seeded fault plan run on every engine side by side, in one run, so that each meets the
same faults at the same steps under the same load: NVRx (restart the group, resume from a checkpoint),
torchft (the healthy replica groups train on, a lost one heals from a peer) and plain ``torchrun``
resubmitted from its last checkpoint (:mod:`.torchrun`, the baseline). Each engine's events are then read
the same way (:mod:`.ledger`): ETTR and its breakdown, each fault's recovery and its phases, steps lost,
samples skipped, final loss.

The plan is drawn from the one fault registry: the kinds in :data:`CANDIDATES` that every engine fires, in
turn, one in each equal stretch of the run between the first committed checkpoint and its second half
(which is left for the last recovery: a torchft group restarted cold under load took 27 s to rejoin, while
its peer trained on at full speed; forked from its zygote, 3-6 s), at a seeded step off the save steps and
on a seeded rank. A kind joins the plan, by name, once every engine fires it; the kinds left out say why.
"""

from __future__ import annotations

import os
import random
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from ..control import FaultCommand, parse_fault
from ..engines.registry import ENGINES
from ..errors import EksftError
from ..events import RESTART_PHASES, read_all
from ..fault_registry import REGISTRY
from ..job import launch
from ..jobdir import JobDir, jobs_root
from ..spec import JobSpec
from ..states import EngineName, FaultKind, FaultScope
from .ledger import TERMS, ledger
from .torchrun import PlainTorchrunJob

BASELINE = "torchrun"   # plain torchrun, resubmitted: the run each engine is compared with
LABELS = {**{name: engine.label for name, engine in ENGINES.items()}, BASELINE: "torchrun + resubmit"}
# the kinds a plan draws from, in the order it takes them
CANDIDATES = (FaultKind.SIGKILL, FaultKind.EXCEPTION, FaultKind.HANG, FaultKind.KILL_LAUNCHER)
# what the baseline cannot recover from in a run's time
BASELINE_CANNOT = {FaultKind.HANG: "plain torchrun has no hang detection: the healthy rank waits out the "
                                   "trainer's 600 s gloo timeout"}
# each term's column heading
SHORT = {**{t: t for t in TERMS}, "checkpoint_stall": "ckpt stall", "checkpoint_interference": "interference",
         "restart_downtime": "downtime"}
RESTARTS = 10  # each engine's restarts allowed (NVRx's in-job and job restarts, torchft's per group)


@dataclass(frozen=True)
class FaultPlan:
    seed: int
    steps: int
    every: int                                   # the checkpoint interval the plan was drawn for
    faults: tuple[str, ...]                      # kind[:rank]@step, in order
    skipped: dict[str, str] = field(default_factory=dict)   # kind -> why no engine-wide case of it

    def commands(self) -> list[FaultCommand]:
        """The plan's faults as new commands (each job gets its own)."""
        return [parse_fault(f) for f in self.faults]


def kinds() -> tuple[list[FaultKind], dict[str, str]]:
    """The candidate kinds every engine fires, and why each other one is left out."""
    chosen, skipped = [], {}
    for kind in CANDIDATES:
        if refusing := [e.label for e in ENGINES.values() if kind.value not in e.faults]:
            skipped[kind.value] = f"the {refusing[0]} engine cannot fire it yet"
        elif kind in BASELINE_CANNOT:
            skipped[kind.value] = BASELINE_CANNOT[kind]
        else:
            chosen.append(kind)
    return chosen, skipped


def plan(seed: int = 0, steps: int = 120, faults: int = 2, every: int = 10, world_size: int = 2) -> FaultPlan:
    """``faults`` faults for a ``steps``-step job that saves every ``every`` steps (see the module's
    docstring); the same arguments give the same plan."""
    chosen, skipped = kinds()
    first, tail = 2 * every + 1, steps // 2
    span = (steps - tail - first) // max(1, faults)
    if faults < 1 or span < 4:
        raise EksftError(f"{faults} fault(s) do not fit in {steps} steps saved every {every}",
                         f"use more steps (each fault needs 4 after step {first}, and half the run is left "
                         "for the last recovery) or fewer faults")
    rng = random.Random(seed)
    out = []
    for i in range(faults):
        lo = first + i * span
        step = rng.choice([s for s in range(lo, lo + span) if s % every not in (0, 1)])
        kind = chosen[i % len(chosen)]
        rank = f":{rng.randrange(world_size)}" if REGISTRY[kind].scope == FaultScope.RANK else ""
        out.append(f"{kind.value}{rank}@{step}")
    return FaultPlan(seed, steps, every, tuple(out), skipped)


def engine_specs(name: str, base: JobSpec) -> dict[str, JobSpec]:
    """The same job for each engine: ``base``'s model, data, steps and world size; torchft with one
    replica group per rank."""
    restarts = {"ft.max_job_restarts": RESTARTS, "ft.max_injob_restarts": RESTARTS}
    nvrx = base.replace(name=f"{name}-nvrx", engine=EngineName.NVRX.value, **restarts)
    return {EngineName.NVRX: nvrx,
            EngineName.TORCHFT: base.replace(name=f"{name}-torchft", engine=EngineName.TORCHFT.value,
                                             nnodes=base.world_size, nproc_per_node=1, **restarts),
            BASELINE: nvrx.replace(name=f"{name}-{BASELINE}")}


def compare(fault_plan: FaultPlan, base: JobSpec | None = None, name: str = "compare",
            timeout: float = 1800.0, say: Callable[[str], object] = lambda text: None) -> dict[str, Any]:
    """Run ``fault_plan`` on every engine at once (jobs ``NAME-nvrx``, ``NAME-torchft``, and
    ``NAME-torchrun`` beside the job folders), wait for them to end, and account for each."""
    base = (base or JobSpec()).replace(steps=fault_plan.steps, **{"checkpoint.every": fault_plan.every})
    specs = {k: s.validate() for k, s in engine_specs(name, base).items()}
    root = jobs_root().parent / "baseline"
    taken = [s.name for k, s in specs.items() if (root if k == BASELINE else jobs_root()).joinpath(s.name)
             .exists()]
    if taken:
        raise EksftError(f"jobs {', '.join(taken)} exist already", "choose another name for the comparison")
    before, t0 = _load(), time.time()
    baseline = PlainTorchrunJob.create(root, specs[BASELINE])
    jobs = {}
    try:
        for key in ENGINES:
            jobs[key] = launch(specs[key], fault_plan.commands())
        for command in fault_plan.commands():
            baseline.inject(command)
        baseline.start(timeout)
        say(f"running {', '.join(s.name for s in specs.values())} side by side, each with "
            f"{', '.join(fault_plan.faults)}")
        states = {key: job.wait(timeout) for key, job in jobs.items()}
        states[BASELINE] = baseline.wait(timeout)
    finally:
        for job in jobs.values():
            if not job.state.ended:
                job.stop()
        baseline.stop()
    say(f"ended after {time.time() - t0:.0f}s: " + ", ".join(f"{LABELS[k]} {s}" for k, s in states.items()))
    engines = {}
    for key, spec in specs.items():
        path = baseline.jd.events_path if key == BASELINE else JobDir.for_name(spec.name).events_path
        engines[key] = {"label": LABELS[key], "job": spec.name,
                        **ledger(read_all(path), spec.world_size, spec.batch)}
    return {"plan": asdict(fault_plan), "model": base.model.preset, "world_size": base.world_size,
            "batch": base.batch, "seq": base.seq, "engines": engines, "wall_s": round(time.time() - t0, 1),
            "load_avg_before": before, "load_avg_after": _load()}


def _load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def text(result: dict[str, Any]) -> str:
    """The comparison as two plain tables: each engine's ETTR and breakdown (seconds), then each fault's
    recovery on each engine with its phases (seconds)."""
    p = result["plan"]
    head = (f"{'engine':<20}{'state':>10}{'ETTR':>7}{'wall':>7}" + "".join(f"{SHORT[t]:>13}" for t in TERMS)
            + f"{'steps lost':>11}{'batches skipped':>16}{'lost, in steps':>15}{'final loss':>11}")
    lines = [f"{p['steps']} steps, checkpoint every {p['every']}, faults {', '.join(p['faults'])} "
             f"(seed {p['seed']}); ETTR = productive / wall, samples skipped counted as lost", head]
    for e in result["engines"].values():
        lines.append(f"{e['label']:<20}{e['state']:>10}{100 * e['ettr']:>6.1f}%{e['wall_s']:>7.1f}"
                     + "".join(f"{e['terms'][t]:>13.2f}" for t in TERMS)
                     + f"{e['steps_lost']:>11}{e['skipped_batches']:>16}{e['lost_step_equivalents']:>15.1f}"
                     + f"{_num(e['final_loss'], '.4f'):>11}")
    lines += ["", "each fault's recovery: level (none: no restart; rejoining, away: a torchft group, or "
              "another engine's job, not back when the job ended, its recovery at least the fault's time "
              "to the end), restored from, the job's stall, the recovery (fault -> the failed part trains "
              "again) and its phases, steps lost, batches skipped",
              f"{'fault':<18}{'engine':<20}{'level':>10}{'from':>9}{'stall':>7}{'recovery':>9}"
              + "".join(f"{ph.replace('_', ' '):>13}" for ph in RESTART_PHASES)
              + f"{'lost':>6}{'skipped':>9}"]
    for i, fault in enumerate(p["faults"]):
        for key, e in result["engines"].items():
            r = e["faults"][i] if i < len(e["faults"]) else None
            if r is None:
                lines.append(f"{fault:<18}{e['label']:<20}{'not fired':>10}")
                continue
            if r.get("away_s") is not None:   # lost, and not back when the job ended
                lines.append(f"{fault:<18}{e['label']:<20}{'rejoining' if _heals_alone(key) else 'away':>10}"
                             f"{'-':>9}{'-':>7}{'>' + format(r['away_s'], '.2f'):>9}  (not back when the job "
                             "ended)")
                continue
            lines.append(f"{fault:<18}{e['label']:<20}{r['level'] or '-':>10}{r['restored_from'] or '-':>9}"
                         f"{_num(r['stall_s'], '.2f'):>7}{_num(r['recovery_s'], '.2f'):>9}"
                         + "".join(f"{_num(r['phases'].get(ph), '.2f'):>13}" for ph in RESTART_PHASES)
                         + f"{r['steps_lost']:>6}{r['skipped_batches']:>9}")
    if p["skipped"]:
        lines.append("kinds not in the plan: " + "; ".join(f"{k} ({why})" for k, why in p["skipped"].items()))
    return "\n".join(lines)


def _heals_alone(key: str) -> bool:
    """Whether the engine compared under ``key`` restarts a lost part alone (torchft: a replica group)."""
    return key in ENGINES and ENGINES[EngineName(key)].heals_alone


def _num(v: float | None, spec: str) -> str:
    return "-" if v is None else f"{v:{spec}}"
