"""Checkpoint folders as the control plane sees them: listing, verification, rejection (no torch).

A checkpoint is a ``step_<N>`` folder holding DCP files and a ``commit.json`` that records the step,
the world size and every file with its size and SHA-256. See ``runtime/checkpoint.py`` for saving.
"""

from __future__ import annotations

import hashlib
import json
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

COMMIT = "commit.json"
REJECTED = "rejected.json"
_STEP_DIR = re.compile(r"^step_(\d{8})$")


def step_dir(root: Path, step: int) -> Path:
    return Path(root) / f"step_{step:08d}"


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


@dataclass
class CheckpointInfo:
    step: int
    path: Path
    state: str                      # committed | incomplete | rejected
    bytes: int = 0
    time: float | None = None
    world_size: int | None = None
    reason: str = ""
    files: dict[str, dict[str, Any]] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"step": self.step, "path": str(self.path), "state": self.state, "bytes": self.bytes,
                "time": self.time, "world_size": self.world_size, "reason": self.reason}


def list_checkpoints(root: str | Path) -> list[CheckpointInfo]:
    """Every step folder under ``root``, oldest first."""
    out = []
    root = Path(root)
    if not root.is_dir():
        return out
    for p in root.iterdir():
        m = _STEP_DIR.match(p.name)
        if not m or not p.is_dir():
            continue
        info = CheckpointInfo(int(m.group(1)), p, "incomplete")
        try:
            commit = json.loads((p / COMMIT).read_text())
            info.state, info.bytes, info.time = "committed", commit["bytes"], commit["time"]
            info.world_size, info.files = commit["world_size"], commit["files"]
        except (FileNotFoundError, ValueError, KeyError):
            pass
        if (p / REJECTED).exists():
            info.state = "rejected"
            try:
                info.reason = json.loads((p / REJECTED).read_text())["reason"]
            except (ValueError, KeyError, FileNotFoundError):
                info.reason = "rejected"
        out.append(info)
    return sorted(out, key=lambda i: i.step)


def verify(info: CheckpointInfo) -> str | None:
    """None if every file of a committed checkpoint is present with its size and checksum, else why not."""
    if info.state != "committed":
        return info.reason or "no commit record (the save did not finish)"
    for name, meta in sorted(info.files.items()):
        f = info.path / name
        if not f.is_file():
            return f"{name} is missing"
        size = f.stat().st_size
        if size != meta["size"]:
            return f"{name} has {size} bytes, the commit record says {meta['size']}"
        if sha256_file(f) != meta["sha256"]:
            return f"checksum mismatch in {name}"
    return None


def reject(info: CheckpointInfo, reason: str) -> None:
    """Mark a checkpoint as unusable (kept for inspection; the next save of that step replaces it)."""
    (info.path / REJECTED).write_text(json.dumps({"reason": reason, "time": time.time()}))
    info.state, info.reason = "rejected", reason
