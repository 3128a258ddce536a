"""Faults for a job whose folder this machine can write (local jobs, Slurm jobs on the shared disk):
checked against the job, then queued in its ``control/pending`` for its ranks to fire."""

from __future__ import annotations

from ..control import FaultCommand, submit
from ..errors import JobError
from ..events import EventTail
from ..jobdir import JobDir
from ..monitor import JobMonitor
from ..states import ACTIVE, ENDED, JobState


def queue_fault(jd: JobDir, state: JobState, command: FaultCommand) -> FaultCommand:
    """Queue ``command`` for the job in ``jd``, which is in ``state``; a fault for a step must lie ahead."""
    spec = jd.spec()
    command.validate(spec.world_size, spec.nnodes)
    if state not in ACTIVE:
        how = "has already ended" if state in ENDED else "is not running"
        raise JobError(f"job {spec.name!r} {how} ({state}): faults only go to a running job",
                       "launch a new job (or resume this one from a checkpoint) and inject into that")
    if command.step is not None:
        mon = JobMonitor()
        mon.update(EventTail(jd.events_path).read())
        command.validate(spec.world_size, spec.nnodes, current_step=mon.last_step)
    submit(jd.pending, command)
    return command
