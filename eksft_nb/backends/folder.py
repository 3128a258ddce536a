"""The queries of a job whose folder this machine reads (local jobs, Slurm jobs on the shared disk):
its spec, events and checkpoints are files in that folder, read the same way for both backends."""

from __future__ import annotations

from abc import abstractmethod

from ..checkpoint_folders import CheckpointInfo, list_checkpoints
from ..events import EventTail
from ..jobdir import JobDir
from ..spec import JobSpec


class FolderJobs:
    """A backend whose jobs are folders: it says where a job's folder is (:meth:`_jd`), this reads it."""

    @abstractmethod
    def _jd(self, name: str) -> JobDir:
        """The folder of job ``name``; an unknown name is an :class:`~eksft_nb.errors.UnknownJobError`."""

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
