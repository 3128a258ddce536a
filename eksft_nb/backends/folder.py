"""What a backend does the same way for every job whose folder this machine reads (local jobs, Slurm
jobs on the shared disk): its spec, events and checkpoints are files in that folder, and faults and live
settings are queued in its inbox there (the ranks take them)."""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Mapping
from typing import Any

from ..checkpoint_folders import CheckpointInfo, list_checkpoints
from ..control import FaultCommand
from ..events import EventTail
from ..jobdir import JobDir
from ..spec import JobSpec
from .base import JobSummary
from .inbox import queue_fault, queue_settings, settings_in_force


class FolderJobs:
    """A backend whose jobs are folders: it says where a job's folder is (:meth:`_jd`) and where the job
    stands (:meth:`state`); this reads the folder, and writes to its inbox."""

    @abstractmethod
    def _jd(self, name: str) -> JobDir:
        """The folder of job ``name``; an unknown name is an :class:`~eksft_nb.errors.UnknownJobError`."""

    @abstractmethod
    def state(self, name: str) -> JobSummary:
        """Where the job's processes stand (see :meth:`.base.Backend.state`)."""

    def folder(self, name: str) -> JobDir:
        """The folder of job ``name`` (an unknown name is an :class:`~eksft_nb.errors.UnknownJobError`)."""
        return self._jd(name)

    def spec(self, name: str) -> JobSpec:
        return self._jd(name).spec()

    def events(self, name: str) -> EventTail:
        return EventTail(self._jd(name).events_path)

    def checkpoints(self, name: str) -> list[CheckpointInfo]:
        jd = self._jd(name)
        return list_checkpoints(jd.ckpt_dir(jd.spec()))

    def inject(self, name: str, command: FaultCommand) -> FaultCommand:
        """Queue the fault in the job's inbox (the ranks fire it); ``command`` was checked for this job."""
        assert command.fault not in self.refused_faults   # type: ignore[attr-defined]   # Backend's
        return queue_fault(self._jd(name), self.state(name).state, command)

    def set_settings(self, name: str, changes: Mapping[str, int]) -> dict[str, Any]:
        return queue_settings(self._jd(name), self.state(name).state, changes)

    def settings(self, name: str) -> dict[str, Any]:
        return settings_in_force(self._jd(name))
