"""The fault plan of a resilience test: which fault kinds apply to a job, at which step each case
fires, and how long the whole test should take.

The kinds and their scopes come from :class:`~eksft_nb.states.FaultKind` (the one registry), and what
the job's engine fires from the engine (:meth:`~eksft_nb.engines.base.Engine.fires`); this module only
says what a kind needs of a job to mean anything. The plan is built from the job's fault-free reference
run, so it is the same on every backend.
"""

from __future__ import annotations

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


@dataclass(frozen=True)
class Case:
    """One case: a real job that runs the reference job with ``faults`` scheduled."""

    kind: FaultKind
    job: str
    step: int
    faults: tuple[FaultCommand, ...]
    note: str = ""

    @property
    def target(self) -> str:
        return self.faults[0].target


@dataclass
class Plan:
    cases: list[Case]
    skipped: dict[str, str] = field(default_factory=dict)   # kind -> why it does not apply
    fault_step: int | None = None
    problem: str = ""          # why no case can run (the job never checkpoints): the card fails with it

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
          refused: Iterable[str] = (), at_step: int | None = None) -> Plan:
    """The cases for ``spec`` given its reference run. ``refused``: kinds the backend cannot deliver;
    ``at_step``: fire here instead (a script whose own saves eksft cannot see)."""
    eksft_saves = any(c.state == CheckpointState.COMMITTED for c in reference.checkpoints.values())
    step = at_step if at_step is not None else fault_step(reference)
    plan = Plan([], fault_step=step)
    last = reference.max_step
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
    refused = set(refused)
    chosen = list(kinds) if kinds is not None else list(FaultKind)
    for kind in chosen:
        why = _why_not(kind, spec, eksft_saves, refused)
        if why:
            plan.skipped[kind.value] = why
            continue
        plan.cases.append(_case(kind, spec, f"{base}-{kind.value}"[:63].rstrip("-"), step))
    if kinds is not None and plan.skipped:   # asked for by name: not applying is a failure, said up front
        bad = ", ".join(f"{k} ({why})" for k, why in plan.skipped.items())
        raise EksftError(f"--faults names kinds that do not apply to this job: {bad}", "leave them out")
    return plan


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


def _case(kind: FaultKind, spec: JobSpec, job: str, step: int) -> Case:
    rank = engine_of(spec).target_rank(spec)
    faults = [_command(kind, rank, step)]
    note = ""
    if kind in FOLLOW_UP:
        faults.append(_command(FOLLOW_UP[kind], rank, step + 1))
        note = f"then {FOLLOW_UP[kind].value} one step later, so the restore must skip the corrupted save"
    return Case(kind, job, step, tuple(faults), note)


def _command(kind: FaultKind, rank: int, step: int) -> FaultCommand:
    if REGISTRY[kind].scope == FaultScope.RANK:
        return FaultCommand(kind.value, rank=rank, step=step)
    return FaultCommand(kind.value, step=step)
