"""The words every front end, backend and event share: job states, restart levels, engines, fault kinds.

``str`` enums: a member *is* its value (``JobState.RUNNING == "running"``, ``json.dumps`` writes the
value), so events on disk keep their strings and old readers keep working.
"""

from __future__ import annotations

import enum


class _Str(str, enum.Enum):
    def __str__(self) -> str:
        return self.value


class JobState(_Str):
    """Where a job stands. A monitor that has seen a failure but no restart yet says ``recovering``."""

    STARTING = "starting"
    RUNNING = "running"
    RECOVERING = "recovering"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    STOPPED = "stopped"
    LOST = "lost"        # the supervisor vanished without recording an end (the machine restarted)

    @property
    def ended(self) -> bool:
        return self in ENDED


# the one "job has ended" set: nothing of the job runs any more and nothing will change its state
ENDED: frozenset[JobState] = frozenset({JobState.SUCCEEDED, JobState.FAILED, JobState.STOPPED, JobState.LOST})
# the states a job_end event (and a supervisor's record) can hold: "lost" is only ever inferred by a reader
RECORDED_ENDS: frozenset[JobState] = ENDED - {JobState.LOST}
# a backend's view that overrides what the events say (they cannot tell a job is gone, or not yet started)
BACKEND_OVERRIDES: frozenset[JobState] = frozenset({JobState.LOST, JobState.STOPPED, JobState.FAILED,
                                                    JobState.STARTING})
ACTIVE: frozenset[JobState] = frozenset({JobState.STARTING, JobState.RUNNING})
# the ends that are a failure: the dashboard and the lab panel (nbext/src/model.ts FAILED) flag them
FAILED_ENDS: frozenset[JobState] = frozenset({JobState.FAILED, JobState.LOST})


class CheckpointState(_Str):
    """Where a checkpoint stands. A step folder on disk is committed, incomplete or rejected (by a
    restore); a save the monitor follows is in flight until it is committed, failed or rejected."""

    IN_FLIGHT = "in-flight"
    COMMITTED = "committed"
    INCOMPLETE = "incomplete"
    FAILED = "failed"
    REJECTED = "rejected"


class RestartLevel(_Str):
    """Who recovered the job: NVRx's in-process wrapper, ft_launcher (in-job), or the supervisor (job)."""

    INPROCESS = "inprocess"
    INJOB = "injob"
    JOB = "job"

    @property
    def label(self) -> str:
        """As the dashboard writes it: in-process, in-job, job."""
        return {"inprocess": "in-process", "injob": "in-job"}.get(self.value, self.value)


class EngineName(_Str):
    """Every engine, as ``--engine`` and a spec file name it (what each is: :mod:`eksft_nb.engines`)."""

    NVRX = "nvrx"
    TORCHFT = "torchft"


class FaultScope(_Str):
    """What a fault targets: one rank, one node's launcher and ranks, or the job as a whole."""

    RANK = "rank"
    NODE = "node"
    JOB = "job"


class FaultKind(_Str):
    """Every fault that can be injected; what each targets and does:
    :data:`~eksft_nb.fault_registry.REGISTRY`."""

    EXCEPTION = "exception"
    HANG = "hang"
    SIGKILL = "sigkill"
    SIGTERM = "sigterm"
    SEGFAULT = "segfault"
    SLOW_RANK = "slow-rank"
    SAVE_FAILURE = "save-failure"
    DISK_FULL = "disk-full"
    SLOW_STORAGE = "slow-storage"
    KILL_LAUNCHER = "kill-launcher"
    CORRUPT_CHECKPOINT = "corrupt-checkpoint"
    KILL_SUPERVISOR = "kill-supervisor"
