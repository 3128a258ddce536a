"""The telemetry schema shared by the ranks that emit events and the monitors that read them.

One event is one JSON object on one line::

    {"v": 1, "t": 1764403200.12, "kind": "step", "job": "demo", "rank": 0, "step": 12, ...}

Ranks and the supervisor append events to ``<job>/events.jsonl`` (one ``write()`` per line, so
concurrent writers never interleave) and, on Kubernetes, print them to stdout behind
:data:`LOG_PREFIX` so the pod logs carry them. Readers accept unknown kinds and extra fields, so
adding a field or a kind keeps the version; renaming or removing one bumps :data:`SCHEMA_VERSION`.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SCHEMA_VERSION = 1
LOG_PREFIX = "@@eksft "

_num = (int, float)
_opt_int = (int, type(None))
_opt_str = (str, type(None))
_opt_num = (int, float, type(None))

# kind -> required field -> accepted types. Extra fields are allowed.
KINDS: dict[str, dict[str, tuple[type, ...] | type]] = {
    # supervisor / control plane
    # steps: None for a user script (its own loop decides)
    "job_start": {"spec_digest": str, "world_size": int, "steps": _opt_int, "backend": str, "host": str, "pid": int},
    "launch": {"attempt": int, "node": int, "pid": int, "pgid": int},
    "failure": {"level": str, "cause": str, "blame_rank": _opt_int, "fault_time": _num, "detected_at": _num},
    "restart": {"level": str, "cause": str, "blame_rank": _opt_int, "fault_time": _num, "detection_s": _num,
                "downtime_s": _num, "rolled_back_steps": int, "resumed_step": int},
    "job_end": {"state": str, "reason": str, "final_step": int},
    # ranks
    "rank_start": {"pid": int, "host": str, "job_attempt": int, "injob_restart": int, "inprocess_iteration": int,
                   "world_size": int, "start_step": int},
    "resume": {"step": int, "path": str, "load_s": _num, "skipped": list},
    # a user script's steps, counted by the optimizer-step hook, have no known loss or tokens (None)
    "step": {"step": int, "loss": _opt_num, "tokens": _opt_int, "step_time": _num},
    "checkpoint": {"phase": str, "step": int},
    "fault": {"fault": str, "id": str, "target_rank": _opt_int, "at_step": _opt_int},
    "rank_error": {"error": str, "step": _opt_int, "origin": str},
    "rank_end": {"final_step": int},
}

RESTART_LEVELS = ("inprocess", "injob", "job")
CHECKPOINT_PHASES = ("begin", "staged", "committed", "failed", "rejected")
JOB_STATES = ("succeeded", "failed", "stopped")


class SchemaError(ValueError):
    """An event does not match the schema (a bug in the emitter, never user input)."""


@dataclass(frozen=True)
class Event:
    kind: str
    t: float
    job: str
    rank: int | None
    data: dict[str, Any] = field(default_factory=dict)
    v: int = SCHEMA_VERSION

    def __getitem__(self, key: str) -> Any:
        return self.data[key]

    def get(self, key: str, default: Any = None) -> Any:
        return self.data.get(key, default)

    def to_json(self) -> str:
        return json.dumps({"v": self.v, "t": self.t, "kind": self.kind, "job": self.job, "rank": self.rank,
                           **self.data}, separators=(",", ":"), allow_nan=False, default=str)


def make(kind: str, job: str, rank: int | None = None, t: float | None = None, **data: Any) -> Event:
    """Build and validate an event."""
    schema = KINDS.get(kind)
    if schema is None:
        raise SchemaError(f"unknown event kind {kind!r}")
    for key, types in schema.items():
        if key not in data:
            raise SchemaError(f"{kind} event lacks {key!r}")
        value = data[key]
        if not isinstance(value, types) or (isinstance(value, bool) and types in (int, _num, _opt_int, _opt_num)):
            raise SchemaError(f"{kind}.{key} has type {type(value).__name__}")
    if kind == "restart" or kind == "failure":
        if data["level"] not in RESTART_LEVELS:
            raise SchemaError(f"{kind}.level {data['level']!r} not in {RESTART_LEVELS}")
    if kind == "checkpoint" and data["phase"] not in CHECKPOINT_PHASES:
        raise SchemaError(f"checkpoint.phase {data['phase']!r} not in {CHECKPOINT_PHASES}")
    if kind == "job_end" and data["state"] not in JOB_STATES:
        raise SchemaError(f"job_end.state {data['state']!r} not in {JOB_STATES}")
    for key, value in data.items():
        if isinstance(value, float) and value != value:  # NaN is not JSON
            data[key] = None
    return Event(kind, time.time() if t is None else t, job, rank, data)


def decode(line: str) -> Event | None:
    """Parse one line (a bare JSON event or a log line with :data:`LOG_PREFIX`); None if it is not one."""
    line = line.strip()
    if line.startswith(LOG_PREFIX):
        line = line[len(LOG_PREFIX):]
    elif LOG_PREFIX in line:  # a log line with a timestamp or pod prefix in front
        line = line.split(LOG_PREFIX, 1)[1]
    if not line.startswith("{"):
        return None
    try:
        obj = json.loads(line)
    except ValueError:
        return None
    if not isinstance(obj, dict) or "kind" not in obj or "t" not in obj:
        return None
    v = obj.pop("v", 1)
    kind, t = obj.pop("kind"), obj.pop("t")
    job, rank = obj.pop("job", ""), obj.pop("rank", None)
    return Event(kind, float(t), job, rank, obj, v)


class EventWriter:
    """Appends events to a job's events file and, optionally, to stdout with the log prefix."""

    def __init__(self, path: str | Path | None, job: str, rank: int | None = None,
                 to_stdout: bool = False) -> None:
        self.job, self.rank, self.to_stdout = job, rank, to_stdout
        self._fd = None
        if path is not None:
            self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)

    def emit(self, kind: str, **data: Any) -> Event:
        event = make(kind, self.job, self.rank, **data)
        self.write(event)
        return event

    def write(self, event: Event) -> None:
        line = event.to_json() + "\n"
        if self._fd is not None:
            os.write(self._fd, line.encode())
        if self.to_stdout:
            sys.stdout.write(LOG_PREFIX + line)
            sys.stdout.flush()

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


class EventTail:
    """Incremental reader of an events file: each :meth:`read` returns the events appended since."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.offset = 0

    def read(self) -> list[Event]:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                chunk = f.read()
        except FileNotFoundError:
            return []
        end = chunk.rfind(b"\n")
        if end < 0:
            return []
        self.offset += end + 1
        return list(decode_lines(chunk[: end + 1].decode(errors="replace").splitlines()))


def decode_lines(lines: Iterable[str]) -> Iterator[Event]:
    for line in lines:
        event = decode(line)
        if event is not None:
            yield event


def read_all(path: str | Path) -> list[Event]:
    return EventTail(path).read()
