"""The interface every backend implements (local processes, Amazon EKS)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Protocol

from ..checkpoints import CheckpointInfo
from ..control import FaultCommand
from ..events import Event
from ..spec import JobSpec


class EventSource(Protocol):
    """Incremental events of one job: each ``read()`` returns what arrived since the last call."""

    def read(self) -> list[Event]: ...


@dataclass
class JobSummary:
    name: str
    backend: str
    state: str        # starting | running | succeeded | failed | stopped | lost
    detail: str = ""


class Backend(ABC):
    name: str

    @abstractmethod
    def render(self, spec: JobSpec) -> str:
        """What ``launch`` would start, as text (the dry run)."""

    @abstractmethod
    def launch(self, spec: JobSpec, faults: list[FaultCommand] | None = None) -> None:
        """Validate everything, then start the job detached (it outlives the caller)."""

    @abstractmethod
    def jobs(self) -> list[JobSummary]:
        """Known jobs, oldest first."""

    @abstractmethod
    def spec(self, name: str) -> JobSpec: ...

    @abstractmethod
    def state(self, name: str) -> JobSummary:
        """Where the job's processes (or pods) stand, independently of its events."""

    @abstractmethod
    def events(self, name: str) -> EventSource: ...

    @abstractmethod
    def inject(self, name: str, command: FaultCommand) -> FaultCommand:
        """Deliver a validated fault command to a running job."""

    @abstractmethod
    def checkpoints(self, name: str) -> list[CheckpointInfo]: ...

    @abstractmethod
    def logs(self, name: str, lines: int = 200, debug: bool = False) -> str: ...

    @abstractmethod
    def stop(self, name: str, timeout: float = 60.0) -> None:
        """End the job; returns once nothing of it runs."""
