"""The words every front end, backend and event share: job states, restart levels, fault kinds.

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


class FaultScope(_Str):
    """What a fault targets: one rank, one node's launcher and ranks, or the job as a whole."""

    RANK = "rank"
    NODE = "node"
    JOB = "job"


class FaultKind(_Str):
    """Every fault that can be injected; :attr:`scope` says what it targets, :attr:`description` what it does."""

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

    @property
    def scope(self) -> FaultScope:
        return _FAULTS[self][0]

    @property
    def description(self) -> str:
        return _FAULTS[self][1]


_FAULTS: dict[FaultKind, tuple[FaultScope, str]] = {
    FaultKind.EXCEPTION: (FaultScope.RANK, "raise an exception in the training loop"),
    FaultKind.HANG: (FaultScope.RANK, "stop making progress (sleep forever inside the step; a user script's rank "
                                      "fired by time is stopped with SIGSTOP)"),
    FaultKind.SIGKILL: (FaultScope.RANK, "the rank process is killed (SIGKILL), like the OOM killer"),
    FaultKind.SIGTERM: (FaultScope.RANK, "the rank process receives SIGTERM"),
    FaultKind.SEGFAULT: (FaultScope.RANK, "the rank process crashes with a segmentation fault"),
    FaultKind.SLOW_RANK: (FaultScope.RANK, "the rank sleeps `delay` seconds per step for `duration` steps "
                                           "(a straggler)"),
    FaultKind.SAVE_FAILURE: (FaultScope.RANK, "the rank's next checkpoint write fails; training continues, "
                                              "the save is retried"),
    FaultKind.DISK_FULL: (FaultScope.RANK, "the rank's disk is full for `duration` steps: its checkpoint and event "
                                           "writes fail (ENOSPC); saves are retried, lost events are counted"),
    FaultKind.SLOW_STORAGE: (FaultScope.RANK, "the rank's checkpoint writes start `delay` seconds late for "
                                              "`duration` steps"),
    FaultKind.KILL_LAUNCHER: (FaultScope.NODE, "the node's ft_launcher and all its ranks die at once "
                                               "(a node is lost)"),
    FaultKind.CORRUPT_CHECKPOINT: (FaultScope.JOB, "flip bytes in the latest committed checkpoint "
                                                   "(resume must skip it)"),
    FaultKind.KILL_SUPERVISOR: (FaultScope.JOB, "the job's supervisor is killed (SIGKILL); a new one adopts the "
                                                "running job"),
}
