"""The interface every backend implements (local processes, Amazon EKS, Slurm)."""

from __future__ import annotations

import re
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from ..checkpoint_folders import CheckpointInfo
from ..control import FaultCommand
from ..errors import ControlError, EksftError, JobError
from ..events import Event
from ..fault_registry import refused
from ..spec import JobSpec
from ..states import JobState


# launcher and library lines a user does not need (shown with --debug); NVRx 0.4.1 tags its records
# "[ft_launcher123@host]" / "[RankMonServer...]", 0.6 "[workload:0(0) infra:?(?)] file.py:123"
_NOISE = re.compile(
    r"\[ft_launcher\d*@|\[RankMonServer|\[workload:[^\]]* infra:[^\]]*\]|NVML|Health "
    r"check|socket\.cpp|waitForInput|pynvml|FutureWarning|"
    r"^\*+$|OMP_NUM_THREADS|Rendezvous "
    r"info|--rdzv-backend|^\s+(entrypoint|min_nodes|max_nodes|nproc_per_node|"
    r"run_id|rdzv_backend|rdzv_endpoint|rdzv_configs|max_restarts|restart_policy|monitor_interval|log_dir|"
    r"metrics_cfg)\s+:|^\[rank\d+\]:\s+(File |\^|Traceback|\s)|^\s*$|inprocess|GLHF|resource_tracker|leaked "
    r"semaphore|warnings\.warn\(")


def is_noise(line: str) -> bool:
    """A launcher or library line a user does not need to read (``logs --debug`` shows them)."""
    return _NOISE.search(line) is not None


# the rest of a multi-line record (a traceback NVRx logs with its message, a config dump)
_CONTINUATION = re.compile(r"^(\s|Traceback \(most recent call last\):|During handling of the above|"
                           r"The above exception was the direct cause|[\w.]+(Error|Exception|NotFound)\b|$)")


def quiet_lines(lines: list[str]) -> list[str]:
    """``lines`` without noise: noisy lines and the continuation lines of their records (NVRx 0.6
    logs the NVML health check's traceback under one noisy line)."""
    out, in_noise = [], False
    for line in lines:
        if is_noise(line) or (in_noise and _CONTINUATION.match(line)):
            in_noise = True
            continue
        in_noise = False
        out.append(line)
    return out


_RANK_PREFIX = re.compile(r"^\[rank\d+\]:\s?")
_TRACEBACK = "Traceback (most recent call last):"
# lines that introduce a traceback (asyncio's "exception was never retrieved" reports, chained errors)
_TRACEBACK_INTRO = re.compile(r"^(handle: <Handle |Exception in callback |Task exception was never retrieved|"
                              r"future: <Task |During handling of the above exception|"
                              r"The above exception was the direct cause)")
_LIBRARY_FRAME = re.compile(r'^\s*File "[^"]*/lib/python3[^"]*"')


def readable(lines: list[str]) -> list[str]:
    """What a user reads of a log: no noise lines and no tracebacks. A traceback block goes as a
    whole; of one that passes through code outside the Python installation (the trainer, the user's
    script) the last line, the error itself, stays. A library's own (NVRx's rank monitor cancelled
    at a stop) leaves nothing."""
    lines = quiet_lines(lines)
    out: list[str] = []
    i = 0
    while i < len(lines):
        if _RANK_PREFIX.sub("", lines[i]) != _TRACEBACK:
            if not is_noise(lines[i]):
                out.append(lines[i])
            i += 1
            continue
        while out and _TRACEBACK_INTRO.match(_RANK_PREFIX.sub("", out[-1])):
            out.pop()
        j, frames = i + 1, []
        while j < len(lines) and _RANK_PREFIX.sub("", lines[j])[:1] in (" ", "\t"):
            frames.append(_RANK_PREFIX.sub("", lines[j]))
            j += 1
        own_code = any(f.lstrip().startswith("File ") and not _LIBRARY_FRAME.match(f) for f in frames)
        if j < len(lines) and own_code and not is_noise(lines[j]):
            out.append(lines[j])
        i = j + 1
    return [line for line in out if not _TRACEBACK_INTRO.match(_RANK_PREFIX.sub("", line))]


class EventSource(Protocol):
    """Incremental events of one job: each ``read()`` returns what arrived since the last call."""

    def read(self) -> list[Event]: ...


@dataclass
class JobSummary:
    name: str
    backend: str
    state: JobState
    detail: str = ""
    orphaned: bool = False   # its processes run and nothing supervises them: :meth:`Backend.adopt` starts one
    # when the wait ``detail`` names began (pods pending, queue admission, the rendezvous), where the
    # backend knows it: every front end then says since when, and the lab panel counts it up live
    since: float | None = None


class Backend(ABC):
    """The whole contract: every operation the command layer asks of a backend is here."""

    name: str
    # the keywords of its constructor that a job's record may hold (see :meth:`locator`)
    locator_keys: tuple[str, ...] = ()

    def locator(self, spec: JobSpec) -> dict[str, str]:
        """The settings (keywords of this backend's constructor, among :attr:`locator_keys`) with which a
        backend finds the job ``spec`` launched, from any process; {}: a default backend does (see
        :mod:`.whereabouts`)."""
        return {}

    def configured(self) -> bool:
        """Whether this machine is set up to reach the backend's jobs: a name is looked for there."""
        return True

    @property
    def refused_faults(self) -> frozenset[str]:
        """Fault kinds it cannot deliver (a resilience test skips them), from the fault registry."""
        return refused(self.name)

    def check(self, spec: JobSpec, launching: bool = True) -> JobSpec:
        """Refuse what this backend cannot run of a spec valid on its own; the spec as it runs here (paths
        resolved). ``launching``: the job starts from this machine now, so what it needs here (files, a
        mount, NVRx) must be here too; a dry run skips that. Only the command layer calls it, once per
        launch or dry run: ``render`` and ``launch`` take its result and assert, they do not check again."""
        return spec

    @abstractmethod
    def render(self, spec: JobSpec, queue_objects: bool = False) -> str:
        """What ``launch`` would start, as text (the dry run), of a spec :meth:`check` passed.
        ``queue_objects``: also the scheduler's queue objects for the job's queue, where the backend has
        a scheduler with them (EKS: Kueue)."""

    @abstractmethod
    def launch(self, spec: JobSpec, faults: list[FaultCommand] | None = None) -> None:
        """Start the job detached (it outlives the caller): a spec :meth:`check` passed, faults checked
        against it (see :func:`eksft_nb.commands.prepare`)."""

    @abstractmethod
    def jobs(self) -> list[JobSummary]:
        """Known jobs, oldest first."""

    @abstractmethod
    def spec(self, name: str) -> JobSpec: ...

    @abstractmethod
    def state(self, name: str) -> JobSummary:
        """Where the job's processes (or pods) stand, independently of its events."""

    def adopt(self, name: str) -> str:
        """Start a supervisor for an orphaned job (see :attr:`JobSummary.orphaned`); what was done. Only
        the local backend runs supervisors of its own: elsewhere nothing is ever orphaned."""
        return ""

    def settled(self, name: str) -> bool:
        """Whether nothing of a job whose events say it ended still runs: the end is recorded a moment
        before the last process exits. A cluster's pods are the cluster's to end: True."""
        return True

    @abstractmethod
    def events(self, name: str) -> EventSource: ...

    @abstractmethod
    def inject(self, name: str, command: FaultCommand) -> FaultCommand:
        """Deliver a validated fault command to a running job."""

    def set_settings(self, name: str, changes: Mapping[str, int]) -> dict[str, Any]:
        """Queue checked live settings for a running job (see :mod:`eksft_nb.settings`)."""
        raise ControlError(f"the {self.name} backend does not take live settings yet",
                           "stop the job and resume it with the new settings, or run it on local or slurm")

    def settings(self, name: str) -> dict[str, Any] | None:
        """The live settings in force: seq, values, and the step they took effect at (None: the spec's);
        None from a backend that keeps none."""
        return None

    @abstractmethod
    def checkpoints(self, name: str) -> list[CheckpointInfo]: ...

    @abstractmethod
    def logs(self, name: str, lines: int = 200, debug: bool = False) -> str: ...

    @abstractmethod
    def stop(self, name: str, timeout: float = 60.0) -> None:
        """End the job; returns once nothing of it runs."""

    @abstractmethod
    def remove(self, name: str) -> None:
        """Delete an ended job (its folder or workload); refuse one that still runs."""

    def remove_many(self, names: Sequence[str]) -> list[EksftError | None]:
        """:meth:`remove` of each of ``names``: None where it was removed, else why not (one refusal stops
        none of the others). A backend whose refusals look across jobs may look once for many."""
        out: list[EksftError | None] = []
        for name in names:
            try:
                self.remove(name)
            except EksftError as e:
                out.append(e)
            else:
                out.append(None)
        return out

    def signal(self, name: str, rank: int, signame: str = "SIGKILL") -> str:
        """Signal a rank process directly, from outside the job; where it ran. A backend that cannot
        reach the ranks' processes refuses: a fault command reaches them through the job's inbox."""
        raise JobError(f"the {self.name} backend cannot signal a rank's process directly",
                       f"inject a fault instead: python -m eksft_nb inject {name} sigkill --rank {rank}")

    def lose_node(self, name: str, node: int) -> str:
        """Take a node away at once, from outside the job (EKS: delete its pod); what was lost. A backend
        that cannot refuses: the kill-launcher fault loses a node from inside."""
        raise JobError(f"the {self.name} backend cannot take a node away from outside the job",
                       f"inject a fault instead: python -m eksft_nb inject {name} kill-launcher "
                       f"--node {node}")
