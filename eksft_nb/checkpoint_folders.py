"""Checkpoint folders as the control plane sees them: listing, verification, rejection (no torch).

A checkpoint is a ``step_<N>`` folder holding DCP files and a ``commit.json`` that records the step,
the world size and every file with its size and SHA-256. See ``runtime/checkpoint/`` for saving.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import stat
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .jobdir import atomic_write
from .states import CheckpointState

COMMIT = "commit.json"
REJECTED = "rejected.json"
STEP_DIR = re.compile(r"^step_(\d{8})$")


def step_dir(root: Path, step: int) -> Path:
    return Path(root) / f"step_{step:08d}"


def sha256_file(path: Path, progress: Callable[[], Any] | None = None) -> str:
    """SHA-256 of a regular file (never through a symbolic link); ``progress()`` is called after each
    4 MiB block, so a long hash can keep heartbeats going."""
    h = hashlib.sha256()
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    with os.fdopen(fd, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
            if progress is not None:
                progress()
    return h.hexdigest()


def plain_name(name: Any) -> bool:
    """Whether ``name`` can only name a file directly inside a checkpoint folder (no path, no traversal)."""
    return (isinstance(name, str) and 0 < len(name) <= 255 and name.isprintable()
            and name not in (".", "..", COMMIT, REJECTED) and "/" not in name and "\\" not in name)


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 1 << 63


def parse_commit(data: Any, step: int) -> str | dict[str, Any]:
    """The commit record of checkpoint ``step``, checked field by field; a string says what is wrong."""
    if not isinstance(data, dict):
        return "commit.json is not a JSON object"
    for key in ("step", "world_size", "bytes", "time", "files"):
        if key not in data:
            return f"commit.json lacks {key!r}"
    if data["step"] != step or not _is_count(data["step"]):
        return f"commit.json names step {str(data['step'])[:40]}, its folder step {step}"
    if not _is_count(data["world_size"]) or data["world_size"] < 1:
        return "commit.json has an invalid world_size"
    if not _is_count(data["bytes"]):
        return "commit.json has an invalid byte count"
    t = data["time"]
    if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 <= t < 1e11:
        return "commit.json has an invalid time"
    files = data["files"]
    if not isinstance(files, dict) or not files:
        return "commit.json lists no files"
    for name, meta in files.items():
        if not plain_name(name):
            return f"commit.json lists {name[:60]!r}, which is not a file name inside the checkpoint folder"
        if (not isinstance(meta, dict) or not _is_count(meta.get("size"))
                or not isinstance(meta.get("sha256"),
                                  str) or not re.fullmatch(r"[0-9a-f]{64}", meta["sha256"])):
            return f"commit.json has no valid size and sha256 for {name}"
    for key in ("job_uid", "run", "mode"):   # "run": the job uid as older jobs wrote it
        if not isinstance(data.get(key, ""), str):
            return f"commit.json has an invalid {key}"
    return data


@dataclass
class CheckpointInfo:
    step: int
    path: Path
    state: CheckpointState          # committed | incomplete | rejected
    bytes: int = 0
    time: float | None = None
    world_size: int | None = None
    reason: str = ""
    files: dict[str, dict[str, Any]] = field(default_factory=dict)
    job_uid: str = ""               # the job that committed it (see runtime.checkpoint.job_uid)

    def to_dict(self) -> dict[str, Any]:
        return {"step": self.step, "path": str(self.path), "state": self.state, "bytes": self.bytes,
                "time": self.time, "world_size": self.world_size, "reason": self.reason}


def list_checkpoints(root: str | Path) -> list[CheckpointInfo]:
    """Every step folder under ``root``, oldest first. A folder whose commit record cannot be read or
    does not check out is listed as incomplete, with the reason."""
    out = []
    root = Path(root)
    if not root.is_dir():
        return out
    for p in root.iterdir():
        m = STEP_DIR.match(p.name)
        if not m or not p.is_dir():
            continue
        info = CheckpointInfo(int(m.group(1)), p, CheckpointState.INCOMPLETE)
        if p.is_symlink():
            info.reason = "the folder is a symbolic link (checkpoints are real folders)"
            out.append(info)
            continue
        try:
            commit = parse_commit(json.loads(_read_plain(p / COMMIT)), info.step)
        except FileNotFoundError:
            commit = ""
        except (OSError, ValueError, RecursionError) as e:
            commit = f"commit.json cannot be read ({type(e).__name__})"
        if isinstance(commit, dict):
            info.state, info.bytes, info.time = CheckpointState.COMMITTED, commit["bytes"], commit["time"]
            info.world_size, info.files = commit["world_size"], commit["files"]
            info.job_uid = commit.get("job_uid", commit.get("run", ""))   # "run": older jobs' name for it
        else:
            info.reason = commit
        if (p / REJECTED).exists():
            info.state = CheckpointState.REJECTED
            try:
                info.reason = str(json.loads(_read_plain(p / REJECTED))["reason"])[:500]
            except (OSError, ValueError, KeyError, TypeError, RecursionError):
                info.reason = "rejected"
        out.append(info)
    return sorted(out, key=lambda i: i.step)


def _read_plain(path: Path, limit: int = 1 << 26) -> str:
    """A small file's text, never through a symbolic link."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    with os.fdopen(fd, "rb") as f:
        data = f.read(limit + 1)
    if len(data) > limit:
        raise ValueError(f"{path.name} is larger than {limit} bytes")
    return data.decode()


def verify(info: CheckpointInfo, names: list[str] | None = None,
           progress: Callable[[], Any] | None = None) -> str | None:
    """None if the files of a committed checkpoint (``names``, default all) are present as regular
    files with their recorded size and checksum, else why not."""
    if info.state != CheckpointState.COMMITTED:
        return info.reason or "no commit record (the save did not finish)"
    for name in sorted(info.files) if names is None else names:
        meta = info.files[name]
        f = info.path / name
        try:
            st = os.lstat(f)
        except FileNotFoundError:
            return f"{name} is missing"
        if not stat.S_ISREG(st.st_mode):
            return f"{name} is not a regular file"
        if st.st_size != meta["size"]:
            return f"{name} has {st.st_size} bytes, the commit record says {meta['size']}"
        try:
            digest = sha256_file(f, progress)
        except OSError as e:
            return f"{name} cannot be read ({e.strerror or type(e).__name__})"
        if digest != meta["sha256"]:
            return f"checksum mismatch in {name}"
    return None


def share(info: CheckpointInfo, rank: int, world_size: int) -> list[str]:
    """The files of ``info`` that ``rank`` verifies, so that every rank hashes a part in parallel."""
    return sorted(info.files)[rank::world_size]


def reject(info: CheckpointInfo, reason: str) -> None:
    """Mark a checkpoint as unusable (kept for inspection; the next save of that step replaces it).
    The record replaces whatever is there, a planted symbolic link included, instead of writing through it."""
    atomic_write(info.path / REJECTED, json.dumps({"reason": reason, "time": time.time()}))
    info.state, info.reason = CheckpointState.REJECTED, reason


def resume_origin(resume: str, first: dict[str, Any] | None) -> str:
    """Where a job started from another job's checkpoints, as 'from SRC step 10 (step 20 refused: why)'
    (every checkpoint refused before the one loaded is said: a fallback is never silent); '' for a job
    that starts from its own. ``resume``: the spec's; ``first``: its first resume event (None before it)."""
    if resume in ("latest", "none") or resume.startswith("step:"):
        return ""
    path = Path(resume)
    named = STEP_DIR.match(path.name)
    source = (path.parent.parent if named else path.parent).name
    if first is None:
        return f"from {source} " + (f"step {int(named.group(1))}" if named
                                    else "(its newest checkpoint that loads)")
    refused = "; ".join(f"step {s.get('step')} refused: {s.get('reason')}"
                        for s in first.get("skipped") or [])
    return f"from {source} step {first['step']}" + (f" ({refused})" if refused else "")

