"""How a torchft job ends once every replica group's process did: succeeded only when what it claims was
seen (every step committed and a group's final weights reported, or a user's script exiting 0 in every
group)."""

from __future__ import annotations

from typing import Any

from ...spec import JobSpec
from ...states import JobState


def outcome(spec: JobSpec, mon: Any) -> tuple[JobState, str]:
    """The job's end (``mon``: its monitor, every event read), its groups' processes all ended: each with
    0, or training was done."""
    if spec.script:
        return JobState.SUCCEEDED, "the script exited 0 in every replica group"
    if mon.last_step < spec.steps:
        return JobState.FAILED, "the replica groups exited before training finished (see `logs --debug`)"
    if mon.digest is None:   # each group raised after the last step (its last quorum): none said its weights
        return JobState.FAILED, (f"all {spec.steps} steps were committed, but no replica group reported its "
                                 "final weights: each ended with an error after the last step (see `logs "
                                 "--debug`)")
    return JobState.SUCCEEDED, f"all {spec.steps} steps done"
