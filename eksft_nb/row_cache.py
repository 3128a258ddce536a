"""An ended job's row, kept in its folder (``row.json``) by the first reader that folded its events.

A listing folds every job's events to say its step, restarts and goodput: for 300 ended jobs of 500 steps
that took 14-20 s on 2 shared cores, at every ``list`` and at every start of the lab panel. Once a job's
events record its end, its row can no longer change: the reader that folded it keeps it beside the events,
and the next listing reads that small file instead (see bench/jobs_panel.py for the figures).

The row is keyed by what it was folded from, the size and modification time of the spec and the events
file, taken before the fold: a file changed since (a job appended to, a folder rewritten) makes it stale,
and the job is folded again. The folder is the job's, writable by its processes: the file is read
bounded, and one whose fields do not have :class:`~eksft_nb.commands.JobRow`'s types is no row (the
callers pass that type: this module imports nothing of theirs).
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import os
import types
import typing
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from .jobdir import TMP_SUFFIX, JobDir
from .states import JobState

if TYPE_CHECKING:
    from .job import Job

Row = dict[str, Any]   # a commands.JobRow (its TypedDict is the ``model`` the callers pass)

FILE = "row.json"
MAX_BYTES = 64 * 1024     # a row with a long reason is a few KB
VERSION = 1

Key = list[int]


def row_of(job: Job, fold: Callable[[Job], Any], model: type) -> Any:
    """The row of a job whose folder this machine reads (local, Slurm), as a listing needs it: an ended
    job's kept row where it holds, else ``fold(job)`` (commands.job_row, whose type is ``model``), kept
    once its events record its end."""
    folder = job.backend.folder(job.name)   # type: ignore[attr-defined]
    kept = read(folder, model)
    if kept is not None:
        return {"name": job.name, "backend": job.backend.name, **kept}
    before = key(folder)
    row = fold(job)
    if job.monitor.finished:
        write(folder, row, before)
    return row


def key(jd: JobDir) -> Key | None:
    """What a row of the job is folded from, as it is now (take it before folding); None while a file is
    missing (a folder still being made, or removed)."""
    try:
        return [n for path in (jd.spec_path, jd.events_path)
                for st in (os.stat(path),) for n in (st.st_size, st.st_mtime_ns)]
    except OSError:
        return None


def read(jd: JobDir, model: type) -> Row | None:
    """The kept row (without name and backend: the caller knows them), if it is still the job's: None when
    there is none, it is stale, or it does not read as a ``model`` (commands.JobRow)."""
    now = key(jd)
    if now is None:
        return None
    try:
        with open(jd.path / FILE, "rb") as f:
            record = json.loads(f.read(MAX_BYTES + 1)[:MAX_BYTES])
    except (OSError, ValueError, RecursionError):
        return None
    if not isinstance(record, dict) or record.get("v") != VERSION or record.get("key") != now:
        return None
    row = record.get("row")
    return row if _is_row(row, model) else None


def write(jd: JobDir, row: Row, folded_from: Key | None) -> None:
    """Keep the row of a job whose events record its end, keyed by ``folded_from`` (:func:`key` before the
    fold). Best effort and not synced: a row lost or torn is folded again."""
    if folded_from is None or not row["ended"]:
        return
    kept = {k: v for k, v in row.items() if k not in ("name", "backend")}
    path = jd.path / FILE
    tmp = path.with_name(f".{FILE}.{os.getpid()}{TMP_SUFFIX}")
    try:
        tmp.write_text(json.dumps({"v": VERSION, "key": folded_from, "row": kept}))
        os.replace(tmp, path)
    except OSError:
        with contextlib.suppress(OSError):
            tmp.unlink()


@functools.cache
def _kept_fields(model: type) -> dict[str, Any]:
    """The row's fields but name and backend, with their types."""
    return {k: t for k, t in typing.get_type_hints(model).items() if k not in ("name", "backend")}


def _is_row(row: Any, model: type) -> bool:
    """Whether ``row`` has exactly the model's fields (but name and backend), each of its type, and is
    ended."""
    hints = _kept_fields(model)
    return (isinstance(row, dict) and set(row) == set(hints)
            and all(_fits(row[k], t) for k, t in hints.items())
            and row["state"] in {s.value for s in JobState if s.ended} and row["ended"] is True)


def _fits(value: Any, hint: Any) -> bool:
    """Whether a JSON value has the type ``hint`` (str, int, float, bool, None, unions, dict, list) and is
    finite where a number."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return any(_fits(value, a) for a in args)
    if origin is dict:
        return isinstance(value, dict) and all(_fits(k, args[0]) and _fits(v, args[1])
                                               for k, v in value.items())
    if origin is list:
        return isinstance(value, list) and all(_fits(v, args[0]) for v in value)
    if hint is type(None):
        return value is None
    if hint is float:
        return type(value) in (int, float) and math.isfinite(value)
    if hint is int:
        return type(value) is int
    return type(value) is hint

