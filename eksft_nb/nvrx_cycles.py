"""NVRx's own record of each restart cycle (0.6+): what the restart timeline reads beside eksft's events.

With ``--ft-cycle-info-dir DIR`` the rendezvous host (the store-hosting ft_launcher, or ``nvrx-control``)
writes one JSON file per worker-group cycle, ``cycle_info.<job id>.<attempt>.<cycle>`` (protobuf's JSON
of ``NVRxCycleInfo``): when the cycle started and ended, the nodes that trained in it and the standby
nodes that waited (hot spares), and the active ranks. A file is rewritten (through ``.tmp`` and a
rename) when its cycle ends, and ``cycle_info.<job id>.current`` links the newest.

The files are another process's, on a disk that may be shared (a Slurm job's folder, an EKS volume):
untrusted input. A file that is not a cycle record is skipped, never an error; what is read is bounded
(the file, each text field), and a link is never followed.
"""

from __future__ import annotations

import json
import os
import re
import stat
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

MAX_FILE_BYTES = 65536     # a record is a few hundred bytes
MAX_TEXT = 1024            # a node list or rank range kept from a record (a long one is cut, with "...")
MAX_FILES = 4096           # records read from one folder (the newest cycles of a restart loop)
_NAME = re.compile(r"cycle_info\.(.*)\.(\d{1,9})\.(\d{1,9})")


@dataclass(frozen=True)
class CycleRecord:
    """One ``NVRxCycleInfo`` file: a cycle of one rendezvous's worker groups."""

    cycle: int
    start: float                # epoch seconds
    end: float | None           # None while the cycle runs
    job_id: str = ""            # NVRx's job id ("" outside Slurm, unless nvrx-control was given one)
    attempt: int = 0            # NVRx's attempt index (Slurm's restart count)
    active_nodes: str = ""      # e.g. "node[1-2]" (Slurm's host-list form)
    standby_nodes: str = ""     # the hot spares that waited through this cycle
    active_ranks: str = ""      # e.g. "0-1"

    def fields(self) -> dict[str, Any]:
        """The record as an ``nvrx_cycle`` event's fields (without eksft's attempt)."""
        return {"cycle": self.cycle, "start": self.start, "end": self.end, "active_nodes": self.active_nodes,
                "standby_nodes": self.standby_nodes, "active_ranks": self.active_ranks}


def _epoch(text: object) -> float | None:
    """``2026-05-01T12:00:00.123456Z`` -> epoch seconds; anything else -> None."""
    if not isinstance(text, str) or not text or len(text) > 64:
        return None
    try:
        when = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        return None
    try:
        return (when if when.tzinfo else when.replace(tzinfo=timezone.utc)).timestamp()
    except (OverflowError, OSError, ValueError):
        return None


def _count(value: object) -> int | None:
    """A non-negative integer as protobuf's JSON writes one (a number, or a string of digits for 64-bit
    fields); anything else -> None."""
    if isinstance(value, str) and value.isdigit() and len(value) <= 9:
        value = int(value)
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 10**9:
        return value
    return None


def _text(value: object) -> str:
    if not isinstance(value, str):
        return ""
    value = "".join(c if c.isprintable() else "?" for c in value[:MAX_TEXT + 1])
    return value if len(value) <= MAX_TEXT else value[:MAX_TEXT] + "..."


def parse_cycle_record(text: str) -> CycleRecord | None:
    """A cycle record from a file's text; None for anything that is not one (never raises: the
    file is written by another process and may be partial or foreign)."""
    if not isinstance(text, str) or len(text) > MAX_FILE_BYTES:
        return None
    try:
        data = json.loads(text)
    except (ValueError, RecursionError):
        return None
    if not isinstance(data, dict):
        return None
    # protobuf's JSON leaves out a field at its default only when asked to: 0 is the first cycle
    cycle, attempt = _count(data.get("cycle_number", 0)), _count(data.get("attempt_index", 0))
    start, end = _epoch(data.get("cycle_start_time")), _epoch(data.get("cycle_end_time"))
    if cycle is None or attempt is None or start is None:
        return None
    if end is not None and end < start:
        end = None   # a clock step back between the writes: the end is not known
    return CycleRecord(cycle, start, end, _text(data.get("job_id")), attempt, _text(data.get("active_nodes")),
                       _text(data.get("standby_nodes")), _text(data.get("active_ranks")))


def _read(path: Path) -> str | None:
    """A regular file's text, at most :data:`MAX_FILE_BYTES` + 1 bytes of it, never through a link
    (a FIFO, a device or a link placed there by someone else is not read)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        return os.read(fd, MAX_FILE_BYTES + 1).decode(errors="replace")
    except OSError:
        return None
    finally:
        os.close(fd)


def read_cycle_records(folder: Path, job_id: str | None = None) -> list[CycleRecord]:
    """The cycle records NVRx wrote under ``folder`` (``--ft-cycle-info-dir``), by attempt and cycle (then
    job id); with ``job_id``, only that job's (a folder may be shared). The name must agree with the record's
    own job, attempt and cycle: a file renamed or copied over another is not taken for it."""
    try:
        names = sorted((e.name for e in os.scandir(folder)), key=_order)[-MAX_FILES:]
    except OSError:
        return []
    records = {}
    for name in names:
        m = _NAME.fullmatch(name)
        if m is None or (job_id is not None and m.group(1) != job_id):
            continue
        text = _read(folder / name)
        record = parse_cycle_record(text) if text is not None else None
        if record is None or (record.job_id, record.attempt, record.cycle) != (
                m.group(1), int(m.group(2)), int(m.group(3))):
            continue
        records[(record.attempt, record.cycle, record.job_id)] = record
    return [records[k] for k in sorted(records)]


def _order(name: str) -> tuple[int, int, str]:
    m = _NAME.fullmatch(name)
    return (int(m.group(2)), int(m.group(3)), name) if m else (-1, -1, name)


def current_records(link: str | None) -> list[CycleRecord]:
    """The record of the cycle a worker runs in and of the one before it (with its end), from the path
    NVRx 0.6+ gives its workers (``NVRX_CURRENT_CYCLE_INFO``: a link, ``cycle_info.<job>.current``, to
    the current cycle's file beside it): how a rank relays NVRx's account where nothing else of eksft reads
    the folder (an EKS pod). The link is read, never followed: its target must be a record's name in the
    same folder."""
    if not link:
        return []
    try:
        target = os.readlink(link)
    except (OSError, ValueError):
        return []
    m = _NAME.fullmatch(target)
    if m is None or "/" in target:
        return []
    folder, (job, attempt, cycle) = Path(link).parent, (m.group(1), int(m.group(2)), int(m.group(3)))
    found = []
    for number in (cycle - 1, cycle):
        name = f"cycle_info.{job}.{attempt}.{number}"
        text = _read(folder / name) if number >= 0 else None
        record = parse_cycle_record(text) if text is not None else None
        if record is not None and (record.job_id, record.attempt, record.cycle) == (job, attempt, number):
            found.append(record)
    return found
