"""What the JupyterLab panel reads from the ``/eksft/`` routes beyond the command layer's own models,
typed: the words it learns from Python (fault kinds, restart level labels, the failed ends, the live
settings) and the replies made here. nbext/src/api.ts writes each as an interface of the same name
with an ``I`` before it; tests/test_wire_schema.py fails when the two differ.

The panel holds no copy of these words: a new fault kind, level or live setting reaches it from here.
"""

from __future__ import annotations

from typing import Any, TypedDict, cast

from ..commands import JobRow, Removal
from ..fault_registry import REGISTRY
from ..settings import LIVE, MAX_VALUE
from ..states import FAILED_ENDS, CheckpointState, FaultScope, JobState, RestartLevel


class FaultKindInfo(TypedDict):
    kind: str             # a FaultKind value
    scope: str            # a FaultScope value: what the fault targets
    target: str | None    # the inject request's field naming the rank or node it targets; None: the job
    help: str


class CheckpointRow(TypedDict):
    """One step folder of ``GET /eksft/jobs/NAME/checkpoints``; ``resumable``: a resume may start from it."""

    step: int
    state: str            # a CheckpointState value
    time: float | None
    resumable: bool


class CheckpointsReply(TypedDict):
    checkpoints: list[CheckpointRow]


class RemovalsReply(TypedDict):
    """``POST /eksft/rm``: each job's ``rm``, in the order asked (commands.remove_jobs)."""

    results: list[Removal]


class LiveSetting(TypedDict):
    """A setting a running job takes (eksft_nb.settings.LIVE): the panel's box for it."""

    name: str
    low: int
    high: int
    help: str


class _Listed(TypedDict):
    ok: bool


class BackendStatus(_Listed, total=False):
    """How listing a backend's jobs went (``error``: why not, one line; absent for local)."""

    error: str | None


class JobsReply(TypedDict):
    """``GET /eksft/jobs``: every job, how each backend's listing went, and the panel's words."""

    jobs: list[JobRow]
    backends: dict[str, BackendStatus]
    faults: list[FaultKindInfo]     # in the registry's order
    levels: dict[str, str]          # RestartLevel value -> its label, in the levels' order
    failed: list[str]               # the JobState values of an end that is a failure
    states: list[str]               # every JobState value, in the order the panel counts them
    settings: list[LiveSetting]


class SettingsInForce(TypedDict):
    """``GET /eksft/jobs/NAME/settings`` (commands.settings_in_force)."""

    job: str
    seq: int                  # 0: the spec's, no change made
    values: dict[str, int]
    step: int | None          # the step they took effect at (None: the spec's)


class Figure(TypedDict):
    data: list[Any]
    layout: Any


class WhatIfView(TypedDict):
    """``GET /eksft/jobs/NAME/whatif``: resilience.whatif_view's form, and the recommendation as live
    settings (empty: none recommended) for the Apply button to post to the settings route."""

    job: str
    line: str
    every: int | None
    formula: str
    columns: list[str]
    rows: list[list[str]]
    figure: Figure
    settings: dict[str, int]


def jobs_reply(jobs: list[JobRow], backends: dict[str, BackendStatus]) -> JobsReply:
    """The reply of ``GET /eksft/jobs``: ``jobs`` and ``backends`` with the words the panel learns here."""
    return {"jobs": jobs, "backends": backends,
            "faults": [FaultKindInfo(kind=k.value, scope=d.scope.value, help=d.description,
                                     target=None if d.scope == FaultScope.JOB else d.scope.value)
                       for k, d in REGISTRY.items()],
            "levels": {level.value: level.label for level in RestartLevel},
            "failed": [s.value for s in JobState if s in FAILED_ENDS],
            "states": [s.value for s in JobState],
            "settings": [LiveSetting(name=name, low=live.low, high=MAX_VALUE, help=live.help)
                         for name, live in LIVE.items()]}


def whatif_reply(shown: dict[str, Any]) -> WhatIfView:
    """``shown`` (whatif_view.view's) with the recommended interval as the live settings that apply it,
    as commands.apply_whatif sets it; empty where none is recommended."""
    every = shown["every"]
    return cast(WhatIfView, {**shown, "settings": {} if every is None else {"ckpt-every": every}})


def removals_reply(results: list[Removal]) -> RemovalsReply:
    return {"results": results}


def checkpoints_reply(rows: list[dict[str, Any]]) -> CheckpointsReply:
    """``commands.checkpoints``' rows as the panel reads them: which it may resume from is said here."""
    return {"checkpoints": [CheckpointRow(step=r["step"], state=str(r["state"]), time=r["time"],
                                          resumable=r["state"] == CheckpointState.COMMITTED) for r in rows]}
