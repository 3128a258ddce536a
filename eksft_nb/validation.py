"""The one validation of what a front end sends, under the command layer (which re-exports it) and the
Python API (:mod:`.job`, which :mod:`.commands` imports): a launch's spec and scheduled faults, and a
fault command for a running job. Backends assert what passed here; they do not check again."""

from __future__ import annotations

from collections.abc import Iterable

from .backends import Backend, get_backend
from .control import FaultCommand, parse_fault
from .engines.registry import engine_of
from .errors import ControlError, SpecError
from .preflight.check import check
from .spec import JobSpec


def check_fault(command: FaultCommand, spec: JobSpec, backend: Backend) -> FaultCommand:
    """The one check of a fault command a front end sends: against the job's ranks, nodes and steps (one
    for a step the built-in trainer never reaches would wait silently forever), its engine, and whether
    ``backend`` can deliver its kind (the fault registry's ``refused_by``)."""
    command.validate(spec.world_size, spec.nnodes)
    if command.step is not None and not spec.script and command.step > spec.steps:
        raise ControlError(f"step {command.step} is past the last step of the job ({spec.steps}): "
                           f"{command.fault} would never fire",
                           f"use a step from 1 to {spec.steps}, or omit the step to inject now")
    engine_of(spec).check_faults(spec, [command])   # what the job's engine cannot fire
    if command.fault in backend.refused_faults:
        raise ControlError(f"{command.fault} is a local fault: on {backend.name} no eksft supervisor runs",
                           "use kill-launcher to lose a node, or sigkill to lose a rank")
    return command


def check_settings(spec: JobSpec) -> None:
    """The one check of a live settings change a front end sends (set, whatif --apply): what the job's
    engine cannot take is refused before anything is queued."""
    engine_of(spec).check_settings(spec)


def faults_for(spec: JobSpec, faults: Iterable[str | FaultCommand]) -> list[FaultCommand]:
    """Scheduled faults (``sigkill:1@30`` or commands), checked against the job they go to."""
    backend = get_backend(spec.backend)
    return [check_fault(parse_fault(f) if isinstance(f, str) else f, spec, backend) for f in faults]


def prepare(spec: JobSpec, faults: Iterable[str | FaultCommand] = (),
            launching: bool = True) -> tuple[JobSpec, list[FaultCommand]]:
    """The one validation of a launch (or, not ``launching``, a dry run), for every front end: the spec,
    what its engine and its backend refuse of it (:meth:`Backend.check`), a contradiction of its
    timeouts that guarantees failure (the pre-flight's refusals, :mod:`.preflight.check`), then the
    scheduled faults."""
    spec = spec.validate()
    engine_of(spec).check(spec, launching)   # what the job's engine does not take
    refused = check(spec).refusals
    if refused:
        raise SpecError(refused[0].problem, refused[0].fix)
    spec = get_backend(spec.backend).check(spec, launching)
    return spec, faults_for(spec, faults)
