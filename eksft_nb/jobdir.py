"""The job folder: everything a local job owns, in one private directory.

Layout (root: ``$EKSFT_HOME/jobs``, default ``~/.eksft/jobs``)::

    <root>/<name>/
        spec.json          the JobSpec this job runs
        settings.json      the live settings in force (see settings.py), once one was changed
        events.jsonl       telemetry (see events.py)
        supervisor.json    identities (pid, start time) of the supervisor, its keeper and the launchers; state
        end.json           the job's end (state, reason), written in place into space reserved at its
                           creation, so that a full disk cannot keep it from being recorded
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

import contextlib
import fcntl
import json
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .errors import JobError, UnknownJobError, closest, shown
from .spec import JobSpec
from .spec_checks import valid_name


def eksft_home() -> Path:
    return Path(os.environ.get("EKSFT_HOME", Path.home() / ".eksft")).expanduser()


def jobs_root() -> Path:
    return eksft_home() / "jobs"


TMP_SUFFIX = ".tmp"
END_RESERVE_BYTES = 64 * 1024  # end.json's reserve: its record, and then room for the job's last records
END_RECORD_BYTES = 16 * 1024   # the most an end record takes (its reason is cut to fit)


def atomic_write(path: Path, text: str, mode: int = 0o600) -> None:
    """Write a file so that readers see the old content or the new one, never a torn mix; a write that
    fails (a full disk) leaves no temporary file behind."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}{TMP_SUFFIX}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


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
            where = root or jobs_root()
            known = sorted(p.name for p in where.glob("*") if (p / "spec.json").is_file())
            raise UnknownJobError(f"no job named {shown(name)} under {where}", _pick(name, known))
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
    def end_path(self) -> Path:
        return self.path / "end.json"

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
            self._reserve_end()
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
        """``supervisor.json``, with the job's end from ``end.json`` over it once one is recorded there
        (the end may be recorded only there: see :meth:`write_end`)."""
        try:
            record = json.loads(self.supervisor_path.read_text())
        except (OSError, ValueError):
            record = {}
        record = record if isinstance(record, dict) else {}
        return {**record, **self.ended()}

    def _reserve_end(self) -> None:
        """Reserve ``end.json``'s space now, while there is room: spaces (blank JSON), written and synced
        so that its blocks are allocated, which :meth:`write_end` overwrites without asking for more."""
        fd = os.open(self.end_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.write(fd, b" " * END_RESERVE_BYTES)
            os.fsync(fd)
        finally:
            os.close(fd)

    def ended(self) -> dict[str, Any]:
        """The end recorded in ``end.json`` (state and reason), or {} while none is."""
        try:
            with open(self.end_path, "rb") as f:
                record = json.loads(f.read(END_RECORD_BYTES) or b"null")
        except (OSError, ValueError):
            return {}
        if not isinstance(record, dict) or not isinstance(record.get("state"), str) \
                or not isinstance(record.get("reason"), str):
            return {}
        return {"state": record["state"], "reason": record["reason"]}

    def write_end(self, state: str, reason: str) -> bool:
        """Record the job's end in ``end.json``: in place, over the space reserved at the job's creation,
        so it needs no new block of a full disk (on a copy-on-write filesystem, btrfs or ZFS, it may
        still), then give the rest of the reserve back for the job's last records. False when even
        that failed (a folder gone read-only, an old job folder without a reserve on a full disk)."""
        text = json.dumps({"state": state, "reason": reason[:1000], "t": time.time()}).encode()
        try:
            fd = os.open(self.end_path, os.O_WRONLY | os.O_CREAT, 0o600)
        except OSError:
            return False
        try:
            if os.pwrite(fd, text, 0) != len(text):
                return False
            # recorded once written: trimming (the reserve's room back) and syncing are extras
            with contextlib.suppress(OSError):
                os.ftruncate(fd, len(text))
            with contextlib.suppress(OSError):
                os.fsync(fd)
        except OSError:
            return False
        finally:
            os.close(fd)
        return True

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


def _pick(name: str, known: list[str]) -> str:
    """The fix for an unknown name: the jobs there are while they fit in a line, else the closest and where
    to see the rest (a folder of hundreds of jobs must not make a one-line error a page)."""
    if not known:
        return "launch one first with `python -m eksft_nb run`"
    if len(known) <= _LISTED:
        return f"pick one of: {', '.join(known)}"
    return f"did you mean {closest(name, known)!r}? ({len(known)} jobs: `python -m eksft_nb list` names them)"


_LISTED = 8
