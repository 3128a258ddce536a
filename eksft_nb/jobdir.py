"""The job folder: everything a local job owns, in one private directory.

Layout (root: ``$EKSFT_HOME/jobs``, default ``~/.eksft/jobs``)::

    <root>/<name>/
        spec.json          the JobSpec this job runs
        settings.json      the live settings in force (see settings.py), once one was changed
        events.jsonl       telemetry (see events.py)
        supervisor.json    identities (pid, start time) of the supervisor, its keeper and the launchers; state
        supervisor.lock    held by the keeper that looks after the supervisor (one per job)
        logs/              supervisor.log, launcher-<attempt>-<node>.log, zygote-<attempt>.<node>.log,
        per-rank logs control/pending/   fault commands waiting to fire; control/fired/ marks the ones that
        did control/rejected/  command files that failed the checks, each with its .reason (never fired)
        control/settings.json  the newest live settings request, for rank 0 to propose
        progress/          per-rank progress beacons (last step, where the main thread is)
        warm/              the warm-rank zygotes' sockets, <attempt>.<node>.sock (see runtime/zygote.py)
        ckpt/              step_<N>/ checkpoints (unless checkpoint.dir points elsewhere)
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .errors import JobError, UnknownJobError, shown
from .spec import JobSpec
from .spec_checks import valid_name


def eksft_home() -> Path:
    return Path(os.environ.get("EKSFT_HOME", Path.home() / ".eksft")).expanduser()


def jobs_root() -> Path:
    return eksft_home() / "jobs"


def atomic_write(path: Path, text: str, mode: int = 0o600) -> None:
    """Write a file so that readers see the old content or the new one, never a torn mix."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(fd, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


@dataclass(frozen=True)
class JobDir:
    path: Path

    @classmethod
    def for_name(cls, name: str, root: Path | None = None) -> JobDir:
        return cls((root or jobs_root()) / name)

    @classmethod
    def existing(cls, name: str, root: Path | None = None) -> JobDir:
        jd = cls.for_name(name, root) if valid_name(name) else None
        if jd is None or not jd.spec_path.is_file():
            known = ", ".join(sorted(p.name
                                     for p in (root or jobs_root()).glob("*") if (p / "spec.json").is_file()))
            raise UnknownJobError(f"no job named {shown(name)} under {root or jobs_root()}",
                                  f"pick one of: {known}" if known
                                  else "launch one first with `python -m eksft_nb run`")
        return jd

    @property
    def name(self) -> str:
        return self.path.name

    @property
    def spec_path(self) -> Path:
        return self.path / "spec.json"

    @property
    def events_path(self) -> Path:
        return self.path / "events.jsonl"

    @property
    def supervisor_path(self) -> Path:
        return self.path / "supervisor.json"

    @property
    def logs(self) -> Path:
        return self.path / "logs"

    @property
    def pending(self) -> Path:
        return self.path / "control" / "pending"

    @property
    def fired(self) -> Path:
        return self.path / "control" / "fired"

    @property
    def progress(self) -> Path:
        return self.path / "progress"

    @property
    def warm(self) -> Path:
        return self.path / "warm"

    def ckpt_dir(self, spec: JobSpec) -> Path:
        return Path(spec.checkpoint.dir).expanduser() if spec.checkpoint.dir else self.path / "ckpt"

    def create(self, spec: JobSpec) -> None:
        """Make the private folder tree and write the spec (fails if the job exists)."""
        self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        try:
            self.path.mkdir(mode=0o700)
        except FileExistsError:
            raise JobError(f"a job named {self.name!r} already exists in {self.path.parent}",
                           "choose another --name, or remove it with "
                           f"`python -m eksft_nb rm {self.name}`") from None
        try:
            for sub in (self.logs, self.pending, self.fired, self.progress):
                sub.mkdir(parents=True, mode=0o700)
            os.chmod(self.path / "control", 0o700)
            try:
                self.ckpt_dir(spec).mkdir(parents=True, exist_ok=True, mode=0o700)
            except OSError as e:
                raise JobError(f"cannot make the checkpoint folder {self.ckpt_dir(spec)} ({e.strerror or e})",
                               "pass a --ckpt-dir you can create, or leave it out") from None
            atomic_write(self.spec_path, spec.to_json())
        except (OSError, JobError) as e:
            # nothing half-made is left: a folder without a spec is no job that `rm` could remove
            shutil.rmtree(self.path, ignore_errors=True)
            if isinstance(e, JobError):
                raise
            raise JobError(f"cannot make the job folder {self.path} ({e.strerror or e})",
                           "check that the folder is writable and has room") from None

    def spec(self) -> JobSpec:
        return JobSpec.from_json(self.spec_path.read_text())

    def supervisor(self) -> dict[str, Any]:
        try:
            record = json.loads(self.supervisor_path.read_text())
        except (OSError, ValueError):
            return {}
        return record if isinstance(record, dict) else {}

    def keeper_lock(self) -> int | None:
        """Take the job's keeper lock (held for life by the process that looks after the job's
        supervisor, and by ``stop`` while it ends the job); None when another holds it."""
        fd = os.open(self.path / "supervisor.lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return None
        return fd
