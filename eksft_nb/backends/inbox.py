"""Faults and live settings for a job whose folder this machine can write (local jobs, Slurm jobs on
the shared disk): checked against the job, then queued in its ``control/`` folder for its ranks."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .. import settings
from ..control import FaultCommand, submit
from ..errors import ControlError, JobError
from ..events import EventTail
from ..jobdir import JobDir
from ..monitor import JobMonitor
from ..states import ACTIVE, ENDED, JobState


def queue_fault(jd: JobDir, state: JobState, command: FaultCommand) -> FaultCommand:
    """Queue ``command`` (checked against the job by the command layer) for the job in ``jd``, which is in
    ``state``; a fault for a step must lie ahead of the job's last step."""
    spec = jd.spec()
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


def queue_settings(jd: JobDir, state: JobState, changes: Mapping[str, int]) -> dict[str, Any]:
    """Queue checked live ``changes`` for the running job in ``jd`` (see :func:`settings.write_request`)."""
    spec = jd.spec()
    if spec.script:
        raise ControlError(f"job {spec.name!r} runs a script: its own loop decides when it saves",
                           "live settings go to the built-in trainer; change the script's own interval")
    if state not in ACTIVE:
        how = "has already ended" if state in ENDED else "is not running"
        raise JobError(f"job {spec.name!r} {how} ({state}): live settings only go to a running job",
                       "resume it (it starts with the settings in force when it stopped) or launch anew")
    return settings.write_request(jd, spec, changes)


def settings_in_force(jd: JobDir) -> dict[str, Any]:
    """The live settings in force (the spec's until a change) and the step they took effect at."""
    seq, values, step = settings.in_force(jd, jd.spec())
    return {"seq": seq, "values": values, "step": step}
