"""The fault plan of a resilience test: which fault kinds apply to a job, at which steps and on which ranks
each kind's trials fire, and how long the whole test should take.

A kind runs ``repeat`` times (``test --repeat N``): its first trial at the first step after the reference
run's first committed checkpoint, on the engine's target rank (the one case a single run has always had);
the others at distinct steps of the window from there to two steps before the end (a fault that lasts
``duration`` steps: early enough to end before the job does), on ranks and nodes drawn with the plan's
seed. The draw is a function of the seed, the kind, the window and the job's shape alone, so a seed gives
the same plan whenever the reference gives the same window (a campaign manifest keeps the plan itself:
:mod:`.manifest`).

The kinds and their scopes come from :class:`~eksft_nb.states.FaultKind` (the one registry), and what
the job's engine fires from the engine (:meth:`~eksft_nb.engines.base.Engine.fires`); this module only
says what a kind needs of a job to mean anything. The plan is built from the job's fault-free reference
run, so it is the same on every backend.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from ..control import FaultCommand
from ..engines.registry import engine_of
from ..errors import EksftError, closest, shown
from ..fault_registry import REGISTRY
from ..monitor import JobMonitor
from ..spec import JobSpec
from ..states import CheckpointState, FaultKind, FaultScope
from ..timeouts import resolved

# kinds that act on the checkpoints eksft writes: they apply where the reference run showed such saves
STORAGE_KINDS = frozenset({FaultKind.SAVE_FAILURE, FaultKind.DISK_FULL, FaultKind.SLOW_STORAGE,
                           FaultKind.CORRUPT_CHECKPOINT})
# a corrupted checkpoint only matters to a restore: that case loses a rank one step later to force one
FOLLOW_UP = {FaultKind.CORRUPT_CHECKPOINT: FaultKind.SIGKILL}
# seconds a recovery of each kind may take beyond the clean run, for the time estimate (hangs wait
# for a timeout; the rest restart at once)
HANG_KINDS = frozenset({FaultKind.HANG})
RESTART_ALLOWANCE_S = 20.0
MAX_REPEAT = 50
TAIL_STEPS = 2   # a trial's fault comes at least this many steps before the job's last


@dataclass(frozen=True)
class Case:
    """One trial: a real job that runs the reference job with ``faults`` scheduled. ``trial``: its number
    among its kind's (1-based); ``expected``: the level that should heal it (None: not said)."""

    kind: FaultKind
    job: str
    step: int
    faults: tuple[FaultCommand, ...]
    note: str = ""
    trial: int = 1
    expected: str | None = None

    @property
    def target(self) -> str:
        return self.faults[0].target


@dataclass
class Plan:
    cases: list[Case]
    skipped: dict[str, str] = field(default_factory=dict)   # kind -> why it does not apply
    fault_step: int | None = None
    problem: str = ""          # why no case can run (the job never checkpoints): the card fails with it
    repeat: int = 1
    seed: int = 0
    window: tuple[int, int] | None = None   # the steps trials may fire at (first, last)
    kinds: list[str] = field(default_factory=list)   # the kinds that apply (a card's rows, even with no case)

    def expected_s(self, reference_wall_s: float, spec: JobSpec) -> float:
        """Seconds the cases should take: each a reference run plus its recovery."""
        total, ft = 0.0, resolved(spec).ft
        for case in self.cases:
            extra = ft.heartbeat_timeout if case.kind in HANG_KINDS and not ft.inprocess else 0.0
            total += reference_wall_s + RESTART_ALLOWANCE_S * len(case.faults) + extra
        return total


def parse_kinds(text: str | Sequence[str] | None) -> list[FaultKind] | None:
    """``--faults sigkill,hang`` as kinds (None: every kind that applies). Unknown names are refused."""
    if text is None:
        return None
    words = [w.strip() for w in (text.split(",") if isinstance(text, str) else text) if w.strip()]
    if not words:
        raise EksftError("--faults names no fault", f"write e.g. --faults sigkill,hang (kinds: {_kinds()})")
    kinds = []
    for w in words:
        if w not in set(FaultKind):
            raise EksftError(f"unknown fault kind {shown(w)} in --faults",
                             f"did you mean {closest(w, [k.value for k in FaultKind])}? (kinds: {_kinds()})")
        kinds.append(FaultKind(w))
    return list(dict.fromkeys(kinds))


def _kinds() -> str:
    return ", ".join(k.value for k in FaultKind)


def fault_step(reference: JobMonitor) -> int | None:
    """The first step that starts after the reference run's first committed checkpoint (None: it
    committed none before its last step), plus one step of margin for a slower case run."""
    committed = sorted((c for c in reference.checkpoints.values()   # the final save protects no step
                        if c.state == CheckpointState.COMMITTED and c.t_done and c.step < reference.max_step),
                       key=lambda c: c.step)
    if not committed:
        return None
    first = committed[0]
    s = reference.steps
    after = [step for step, t, dt in zip(s.step, s.t, s.step_time) if t - dt >= first.t_done]
    return max(first.step + 1, (after[0] if after else first.step + 1) + 1)


def build(spec: JobSpec, reference: JobMonitor, base: str, kinds: Iterable[FaultKind] | None = None, *,
          refused: Iterable[str] = (), at_step: int | None = None, repeat: int = 1, seed: int = 0) -> Plan:
    """The trials for ``spec`` given its reference run. ``refused``: kinds the backend cannot deliver;
    ``at_step``: the first trial fires here instead (a script whose own saves eksft cannot see)."""
    eksft_saves = any(c.state == CheckpointState.COMMITTED for c in reference.checkpoints.values())
    step = at_step if at_step is not None else fault_step(reference)
    plan = Plan([], fault_step=step, repeat=repeat, seed=seed)
    last = reference.max_step
    refused = set(refused)
    chosen = list(kinds) if kinds is not None else list(FaultKind)
    for kind in chosen:
        why = _why_not(kind, spec, eksft_saves, refused)
        if why:
            plan.skipped[kind.value] = why
        else:
            plan.kinds.append(kind.value)
    if step is None:
        plan.problem = ("the job never committed a checkpoint before its last step in its fault-free run, so "
                        "any fault loses all of its work")
        if spec.script is not None:
            plan.problem += "; if the script saves its own, pass --at-step N (a step after its first save)"
        return plan
    if last and step >= last:
        plan.problem = f"the job ends at step {last}, before a fault can follow its first checkpoint " \
                       f"(step {step})"
        return plan
    if kinds is not None and plan.skipped:   # asked for by name: not applying is a failure, said up front
        bad = ", ".join(f"{k} ({why})" for k, why in plan.skipped.items())
        raise EksftError(f"--faults names kinds that do not apply to this job: {bad}", "leave them out")
    plan.window = (step, max(step, last - TAIL_STEPS) if last else step)
    plan.cases = draw(spec, base, [FaultKind(k) for k in plan.kinds], plan.window, repeat, seed)
    return plan


def draw(spec: JobSpec, base: str, kinds: Sequence[FaultKind], window: tuple[int, int], repeat: int,
         seed: int) -> list[Case]:
    """Each kind's ``repeat`` trials in ``window``: the first at its first step on the engine's target, the
    rest at distinct steps (while the window has them) and on ranks and nodes drawn with ``seed``."""
    engine = engine_of(spec)
    ranks = list(engine.trial_ranks(spec)) or [engine.target_rank(spec)]
    cases = []
    for kind in kinds:
        rng = random.Random(f"{seed}:{kind.value}")   # a kind's draw does not move with the kinds asked
        lo, hi = window
        # a fault that lasts steps (a straggler, a full disk) ends before the job does: its trial tests the
        # recovery, not the job's end
        lasts = REGISTRY[kind].params.get("duration")
        if lasts is not None:
            hi = max(lo, min(hi, hi + TAIL_STEPS - lasts.default))
        later = list(range(lo + 1, hi + 1))
        steps = [lo, *rng.sample(later, min(len(later), repeat - 1))]
        steps += [rng.randint(lo, hi) for _ in range(repeat - len(steps))]   # a narrow window repeats steps
        for i, step in enumerate(steps):
            rank = engine.target_rank(spec) if i == 0 else rng.choice(ranks)
            node = 0 if i == 0 else rng.randrange(spec.nnodes)
            name = job_name(base, kind, i + 1 if repeat > 1 else None)
            cases.append(_case(kind, spec, name, step, rank, node, i + 1))
    return cases


def job_name(base: str, kind: FaultKind, trial: int | None) -> str:
    """``BASE-KIND`` (a single run) or ``BASE-KIND-N``, within a job name's 63 characters (the base cut)."""
    suffix = f"-{kind.value}" + (f"-{trial}" if trial is not None else "")
    return f"{base[:63 - len(suffix)].rstrip('-')}{suffix}"


def engine_refuses(kind: FaultKind, spec: JobSpec) -> str:
    """Why ``spec``'s engine cannot fire ``kind`` ("" when it can): the engine's own list."""
    engine = engine_of(spec)
    takes = engine.fires(spec)
    if kind.value in takes:
        return ""
    return f"the {engine.name} engine cannot fire it{' in a --script' if spec.script else ''} (it fires " \
           f"{', '.join(takes)})"


def _why_not(kind: FaultKind, spec: JobSpec, eksft_saves: bool, refused: set[str]) -> str:
    if kind.value in refused:
        return f"the {spec.backend} backend cannot deliver it"
    if why := engine_refuses(kind, spec):
        return why
    if kind in STORAGE_KINDS and not eksft_saves:
        return "it acts on checkpoints eksft writes, and the reference run showed none"
    return ""


def _case(kind: FaultKind, spec: JobSpec, job: str, step: int, rank: int, node: int, trial: int) -> Case:
    faults = [_command(kind, rank, node, step)]
    note = ""
    if kind in FOLLOW_UP:
        faults.append(_command(FOLLOW_UP[kind], rank, node, step + 1))
        note = f"then {FOLLOW_UP[kind].value} one step later, so the restore must skip the corrupted save"
    return Case(kind, job, step, tuple(faults), note, trial, engine_of(spec).expected_level(kind.value, spec))


def _command(kind: FaultKind, rank: int, node: int, step: int) -> FaultCommand:
    scope = REGISTRY[kind].scope
    if scope == FaultScope.RANK:
        return FaultCommand(kind.value, rank=rank, step=step)
    return FaultCommand(kind.value, step=step, node=node) if scope == FaultScope.NODE else \
        FaultCommand(kind.value, step=step)
