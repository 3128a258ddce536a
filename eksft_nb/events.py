"""The telemetry schema shared by the ranks that emit events and the monitors that read them.

One event is one JSON object on one line::

    {"v": 1, "t": 1764403200.12, "kind": "step", "job": "demo", "rank": 0, "step": 12, ...}

Ranks and the supervisor append events to ``<job>/events.jsonl`` (one ``write()`` per line, under
the file's lock, so concurrent writers never interleave and a full disk leaves no torn line) and,
on Kubernetes, print them to stdout behind :data:`LOG_PREFIX` so the pod logs carry them. Readers
accept unknown kinds and extra fields, so adding a field or a kind keeps the version; renaming or
removing one bumps :data:`SCHEMA_VERSION`.
"""

from __future__ import annotations

import fcntl
import json
import math
import os
import re
import sys
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .states import RECORDED_ENDS, JobState, RestartLevel

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
    "job_start": {"spec_digest": str, "world_size": int, "steps": _opt_int, "backend": str, "host": str,
                  "pid": int},
    "launch": {"attempt": int, "node": int, "pid": int, "pgid": int},
    "failure": {"level": str, "cause": str, "blame_rank": _opt_int, "fault_time": _num, "detected_at": _num},
    "restart": {"level": str, "cause": str, "blame_rank": _opt_int, "fault_time": _num, "detection_s": _num,
                "downtime_s": _num, "rolled_back_steps": int, "resumed_step": int},
    "job_end": {"state": str, "reason": str, "final_step": int},
    # NVRx 0.6+'s own record of one worker-group cycle of a launch attempt (end: None while it runs)
    "nvrx_cycle": {"attempt": int, "cycle": int, "start": _num, "end": (int, float, type(None))},
    # ranks
    "rank_start": {"pid": int, "host": str, "job_attempt": int, "injob_restart": int,
                   "inprocess_iteration": int,
                   "world_size": int, "start_step": int},
    "resume": {"step": int, "path": str, "load_s": _num, "skipped": list},
    # a user script's steps, counted by the optimizer-step hook, have no known loss or tokens (None)
    "step": {"step": int, "loss": _opt_num, "tokens": _opt_int, "step_time": _num},
    "checkpoint": {"phase": str, "step": int},
    "fault": {"fault": str, "id": str, "target_rank": _opt_int, "at_step": _opt_int},
    "command_rejected": {"id": str, "reason": str},   # a command file that cannot fire, set aside
    "rank_error": {"error": str, "step": _opt_int, "origin": str},
    "rank_end": {"final_step": int},
    # local rank 0 of each node (eksft_nb.gpuhealth): a reading of its GPUs (gpus: [] with a note where
    # there is no NVML), and the onset of an XID, a double-bit ECC error or a clock throttle
    "gpu_health": {"node": int, "host": str, "gpus": list},
    "gpu_fault": {"node": int, "host": str, "gpu": int, "uuid": str, "fault": str, "detail": str},
    # a rank's one-line warning that the job outgrows its settings (a save longer than the checkpoint
    # interval, a restore longer than the timeouts allow); what: a short key, message: the line
    "warning": {"what": str, "message": str},
    # rank 0, when SIGTERM (a drain, a preemption) stopped the ranks: every rank saved this step;
    # committed: whether that save (or an earlier one of the same step) is committed
    "drain": {"step": int, "committed": bool},
    # every rank, when it takes a live settings change (eksft_nb.settings) at the start of step's save
    # decision: seq numbers the change, changes: name -> [old, new], values: every live setting in force
    "setting": {"seq": int, "step": int, "changes": dict, "values": dict},
    # torchft (eksft_nb.engines.torchft), a replica group's rank 0: its quorum changed (participants: replica
    # groups in it, step: the quorum's step); it healed from a peer (from_step: its own step before, step: the
    # peer's; skipped_batches: its ranks' batches that no committed step holds, see engines.torchft.heal); a
    # step it threw away (its gradients were not applied: an error in the step, or the quorum did not commit)
    "quorum": {"quorum_id": int, "participants": int, "step": int},
    "heal": {"from_step": int, "step": int, "skipped_batches": int, "heal_s": _num},
    "step_discarded": {"step": int, "reason": str},
    # torchft: a peer one of the job's servers refused, because it did not prove it holds the job's secret,
    # or a quorum member that is not one of the job's groups (where: the lighthouse's gateway, a group's
    # manager server or checkpoint transport, a quorum; peer: host:port; reason: what it did)
    "intruder": {"where": str, "peer": str, "reason": str},
    # any writer, once it can write again after failing to (a full disk): what the events file lacks
    "events_lost": {"count": int, "first_t": _num, "last_t": _num, "error": str},
    # every rank under NVRx's in-process Wrapper: the seconds it added to the rank's process (phase in
    # WRAPPER_PHASES): what a run without in-process restart would not spend (see resilience.whatif)
    "inprocess_wrapper": {"phase": str, "seconds": _num},
}

# kind -> optional field -> accepted types, for the optional fields readers compute with
OPTIONAL: dict[str, dict[str, tuple[type, ...] | type]] = {
    # the ranks' batches the step trained, where some may be missing (torchft: the replica groups that took
    # part); absent: all of the job's world_size
    "step": {"batches": int},
    "checkpoint": {"blocked_s": (*_num, type(None)), "background_s": (*_num, type(None)), "bytes": _opt_int,
                   "copy_s": _num,
                   "path": _opt_str, "mode": str, "error": _opt_str, "reason": _opt_str},
    "fault": {"node": _opt_int, "path": _opt_str},
    "rank_end": {"digest": _opt_str},
    # where a restore came from (memory: the ranks' in-memory copies; storage: the checkpoint folder),
    # and, from storage, why not from memory and the seconds that check took
    "resume": {"source": str, "verify_s": _num, "memory": _opt_str, "memory_s": _num},
    "job_end": {"digest": _opt_str, "restarts": dict},
    # fatal: no restart can help (the checkpoint the job starts from is gone): the line the job ends with;
    # where: the file and line the error was raised at (eksft_nb.rank_errors.raised_at)
    "rank_error": {"waiting": bool, "fatal": str, "where": str},
    # when the incarnation began (process start, or re-entry after an in-process restart) and when its
    # process groups were formed; a torchft group's process: each set-up phase -> when it ended (imports,
    # session, model, manager, wiring; see eksft_nb.engines.torchft.trainer)
    "rank_start": {"t_enter": _num, "t_group": _num, "t_setup": dict},
    # phases: phase -> seconds (RESTART_PHASES), summing to downtime_s; restored_from: the resume's source
    # recovered: false for a restart that happened but failed before its first step (the next failure's
    # incident follows it; absent: true)
    "restart": {"phases": dict, "restored_from": _opt_str, "recovered": bool},
    "gpu_health": {"note": _opt_str, "interval_s": _num},
    "gpu_fault": {"xid": _opt_int, "count": _opt_int, "throttle": _opt_int},
    # NVRx's record of the cycle (eksft_nb.nvrx_cycles): the nodes that trained, the hot spares that waited
    "nvrx_cycle": {"active_nodes": str, "standby_nodes": str, "active_ranks": str},
    "intruder": {"claimed": _opt_str},   # the replica id it gave, if any
}

RESTART_LEVELS = tuple(level.value for level in RestartLevel)
# a recovery's downtime, fault to the first step's start, in order (see eksft_nb.incidents)
RESTART_PHASES = ("detection", "teardown", "reformation", "restore", "first_step")
# setup: from the Wrapper's import to the wrapped function's first call; exit: from its last return
# to the Wrapper's
WRAPPER_PHASES = ("setup", "exit")
CHECKPOINT_PHASES = ("begin", "staged", "committed", "failed", "rejected")
JOB_STATES = tuple(s.value for s in JobState if s in RECORDED_ENDS)   # what a job_end event may say
GPU_FAULTS = ("xid", "ecc", "throttle")
# where a torchft job refused an intruder: its Lighthouse's gateway, a group's manager server or checkpoint
# transport, a quorum a group would not take part in
INTRUDER_PLACES = ("lighthouse", "manager", "transport", "quorum")


# what a number of a known field may be: finite, and >= 0 unless SIGNED names it; below MAX_TIME if
# TIMES names it (a Unix time), else below MAX_SECONDS where the field takes floats (a duration) and
# below MAX_COUNT where it takes ints only (a step, rank, count or size). A genuine writer never writes
# NaN or an infinity (Event.to_json refuses them); a forged one would reach every sum and ratio.
MAX_TIME = 1e11          # the year 5138
MAX_SECONDS = 1e7        # 116 days: longer than any step, save, restore or recovery
MAX_COUNT = 1 << 53      # exact as a float too
TIMES = frozenset({"fault_time", "detected_at", "start", "end", "first_t", "last_t", "t_enter", "t_group"})
SIGNED = frozenset({("step", "loss")})   # a user's loss may be below zero


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
    if kind not in KINDS:
        raise SchemaError(f"unknown event kind {kind!r}")
    check(kind, data)
    for key, value in data.items():
        if isinstance(value, float) and value != value:  # NaN is not JSON
            data[key] = None
    return Event(kind, time.time() if t is None else t, job, rank, data)


def check(kind: str, data: dict[str, Any]) -> None:
    """Raise :class:`SchemaError` unless ``data`` has what a ``kind`` event needs, with the right types."""
    for key, types in KINDS.get(kind, {}).items():
        if key not in data:
            raise SchemaError(f"{kind} event lacks {key!r}")
        _check_type(kind, key, data[key], types)
        _check_range(kind, key, data[key], types)
    for key, types in OPTIONAL.get(kind, {}).items():
        if key in data:
            _check_type(kind, key, data[key], types)
            _check_range(kind, key, data[key], types)
    if kind == "job_end" and "restarts" in data and not all(
            level in RESTART_LEVELS and type(n) is int and 0 <= n < MAX_COUNT
            for level, n in data["restarts"].items()):
        raise SchemaError("job_end.restarts is not restart level -> a count >= 0")
    if kind == "rank_start" and "t_setup" in data and not all(
            type(t) in (int, float) and 0 <= t < MAX_TIME for t in data["t_setup"].values()):
        raise SchemaError("rank_start.t_setup is not phase -> a Unix time")
    if kind == "restart" or kind == "failure":
        if data["level"] not in RESTART_LEVELS:
            raise SchemaError(f"{kind}.level {data['level']!r} not in {RESTART_LEVELS}")
    if kind == "restart" and "phases" in data:
        _check_phases(data["phases"])
    if kind == "checkpoint" and data["phase"] not in CHECKPOINT_PHASES:
        raise SchemaError(f"checkpoint.phase {data['phase']!r} not in {CHECKPOINT_PHASES}")
    if kind == "inprocess_wrapper" and (data["phase"] not in WRAPPER_PHASES
                                        or not 0 <= data["seconds"] < math.inf):
        raise SchemaError(f"inprocess_wrapper {data['phase']!r} {data['seconds']!r}: not a phase of "
                          f"{WRAPPER_PHASES} with seconds >= 0")
    if kind == "gpu_fault" and data["fault"] not in GPU_FAULTS:
        raise SchemaError(f"gpu_fault.fault {data['fault']!r} not in {GPU_FAULTS}")
    if kind == "intruder" and data["where"] not in INTRUDER_PLACES:
        raise SchemaError(f"intruder.where {str(data['where'])[:40]!r} not in {INTRUDER_PLACES}")
    if kind == "job_end" and data["state"] not in JOB_STATES:
        raise SchemaError(f"job_end.state {data['state']!r} not in {JOB_STATES}")


def _check_phases(phases: dict[Any, Any]) -> None:
    for name, seconds in phases.items():
        if name not in RESTART_PHASES:
            raise SchemaError(f"restart.phases has {str(name)[:40]!r}, not one of {RESTART_PHASES}")
        if type(seconds) not in (int, float) or not 0 <= seconds < math.inf:
            raise SchemaError(f"restart.phases.{name} is not a finite number of seconds >= 0")


def _check_type(kind: str, key: str, value: Any, types: tuple[type, ...] | type) -> None:
    accepted = types if isinstance(types, tuple) else (types,)
    if not isinstance(value, accepted) or (isinstance(value, bool) and bool not in accepted):
        raise SchemaError(f"{kind}.{key} has type {type(value).__name__}")


def _check_range(kind: str, key: str, value: Any, types: tuple[type, ...] | type) -> None:
    """A number of a known field within the range of what it measures (see :data:`MAX_TIME`)."""
    if type(value) not in (int, float):
        return
    accepted = types if isinstance(types, tuple) else (types,)
    if key in TIMES:
        high, what = MAX_TIME, "a Unix time"
    elif float in accepted:
        high, what = MAX_SECONDS, f"seconds below {MAX_SECONDS:.0e}"
    else:
        high, what = MAX_COUNT, "a count below 2**53"
    if (kind, key) in SIGNED:
        ok = math.isfinite(value)
    else:
        ok = 0 <= value < high  # false for NaN; an infinity is out of range
    if not ok:
        signed = (kind, key) in SIGNED
        raise SchemaError(f"{kind}.{key} is {str(value)[:24]}: not {'a finite number' if signed else what}"
                          f"{'' if signed else ' (>= 0)'}")


# how a pod log carries an event: the marker at the start of the line, after the timestamp Kubernetes
# adds when asked (``timestamps=true``); the ranks print each event on a line of its own
LOG_LINE = re.compile(r"(?:\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(?:\.\d+)?(?:Z|[+-]\d\d:\d\d) )?"
                      + re.escape(LOG_PREFIX))


def decode(line: str, log: bool = False) -> Event | None:
    """Parse one line (a bare JSON event of an events file, or a log line that starts with
    :data:`LOG_PREFIX`, see :data:`LOG_LINE`); None if it is not one. ``log``: the line is a pod log's,
    where only the marker makes an event (a user's program may print JSON, or the marker mid-line).

    Lines come from files and pod logs anyone in the job can write: an event of a known kind without
    its fields (or with wrong types or numbers out of range, see :data:`MAX_TIME`, whatever its version
    says), or with a time or rank out of range, is no event (:func:`check` says why). Unknown kinds pass
    (newer emitters may add kinds)."""
    line = line.rstrip()
    marked = LOG_LINE.match(line)
    if marked:
        line = line[marked.end():]
    elif log:
        return None
    if not line.startswith("{"):
        return None
    try:
        obj = json.loads(line)
    except (ValueError, RecursionError):
        obj = _after_torn(line)
    if not isinstance(obj, dict):
        return None
    v, kind, t = obj.pop("v", SCHEMA_VERSION), obj.pop("kind", None), obj.pop("t", None)
    job, rank = obj.pop("job", ""), obj.pop("rank", None)
    if type(v) is not int or v < 1 or not isinstance(kind, str) or not isinstance(job, str) \
            or not (rank is None or (type(rank) is int and 0 <= rank < MAX_COUNT)) \
            or type(t) not in (int, float) or not 0 <= t < MAX_TIME:
        return None
    try:
        check(kind, obj)
    except SchemaError:
        return None
    return Event(kind, float(t), job, rank, obj, v)


RECORD_START = '{"v":'   # how every record a writer appends begins (see Event.to_json)
TORN_TRIES = 4


def _after_torn(line: str) -> Any:
    """The record in a line that a torn write left in front of it (a writer that wrote part of a
    record and then failed, then another append): parsed from a later record start, or None."""
    at = 0
    for _ in range(TORN_TRIES):
        at = line.find(RECORD_START, at + 1)
        if at < 0:
            return None
        try:
            return json.loads(line[at:])
        except (ValueError, RecursionError):
            continue
    return None


class EventWriter:
    """Appends events to a job's events file and, optionally, to stdout with the log prefix.

    Telemetry never stops training: a write that fails (a full disk) drops the event, warns once
    on stderr, and once writing works again an ``events_lost`` event says how many were lost (per
    kind), from when to when, and why."""

    def __init__(self, path: str | Path | None, job: str, rank: int | None = None,
                 to_stdout: bool = False) -> None:
        self.job, self.rank, self.to_stdout = job, rank, to_stdout
        self.path = path
        self._fd = None
        self.lost = 0                   # events dropped since the last events_lost record
        self._lost_kinds: dict[str, int] = {}
        self._lost_span: tuple[float, float, str] = (0.0, 0.0, "")
        self._warned = False
        self._last_error = ""
        self._torn = False              # the last append wrote part of a record only
        if path is not None:
            self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)

    def emit(self, kind: str, **data: Any) -> Event:
        event = make(kind, self.job, self.rank, **data)
        self.write(event)
        return event

    def write(self, event: Event) -> None:
        line = event.to_json() + "\n"
        if self._fd is not None:
            if self.lost and self._append(self._lost_record(event.t)):
                self.lost = 0
            if self.lost or not self._append(line):  # never an event ahead of the record of those lost
                self._dropped(event, self._last_error)
        if self.to_stdout:
            sys.stdout.write(LOG_PREFIX + line)
            sys.stdout.flush()

    def _append(self, line: str) -> bool:
        """Append one whole record, or none of it: a short write is continued until all of it is
        written, and one that fails part-way (a full disk) is cut off again, under the file's lock, which
        every writer of the job takes to append. Where it cannot be cut off, the torn line is left and
        the next record ends it first (so it is not swallowed; readers skip it)."""
        lead = b"\n" if self._torn else b""
        data = memoryview(lead + line.encode())
        written = 0
        locked = _lock(self._fd)
        try:
            while written < len(data):
                n = os.write(self._fd, data[written:])
                if n <= 0:
                    raise OSError(0, "short write")
                written += n
            self._torn = False
            return True
        except OSError as e:
            self._last_error = e.strerror or type(e).__name__
            if written > len(lead):
                self._torn = not (locked and _cut(self._fd, written - len(lead)))
        finally:
            if locked:
                fcntl.flock(self._fd, fcntl.LOCK_UN)
        return False

    def _lost_record(self, now: float) -> str:
        first, last, error = self._lost_span
        return make("events_lost", self.job, self.rank, t=now, count=self.lost, first_t=first, last_t=last,
                    error=error, kinds=dict(self._lost_kinds)).to_json() + "\n"

    def _dropped(self, event: Event, error: str) -> None:
        first = self._lost_span[0] if self.lost else event.t
        if not self.lost:
            self._lost_kinds = {}
        self.lost += 1
        self._lost_kinds[event.kind] = self._lost_kinds.get(event.kind, 0) + 1
        self._lost_span = (first, event.t, error)
        if not self._warned:
            self._warned = True
            print(f"eksft: cannot write events to {self.path} ({error}); training goes on, and the lost "
                  "events are counted and reported once writing works again", file=sys.stderr, flush=True)

    def divert(self, target: str | None) -> None:
        """Point the events file descriptor at ``target`` (the ``disk-full`` fault: ``/dev/full``),
        or back at the events file when ``target`` is None."""
        if self._fd is None:
            return
        fd = os.open(target or self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        os.dup2(fd, self._fd)
        os.close(fd)

    def close(self) -> None:
        if self._fd is not None:
            if self.lost:
                self._append(self._lost_record(time.time()))
            os.close(self._fd)
            self._fd = None


LOCK_WAIT_S = 0.5   # an append waits this long at most for the lock (held a few microseconds per record)


def _lock(fd: int) -> bool:
    """Take the events file's append lock; False where it cannot be had (a file that takes no lock, e.g.
    ``/dev/full``, or a network filesystem without locking) or is not given up in :data:`LOCK_WAIT_S`
    (its holder stopped, SIGSTOP): the record is then appended without it, never waited on for good."""
    deadline = time.monotonic() + LOCK_WAIT_S
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.001)
        except OSError:
            return False


def _cut(fd: int, torn: int) -> bool:
    """Remove the last ``torn`` bytes of the file (a record this writer wrote part of), if they are
    still its end; whether it was cut."""
    try:
        end = os.fstat(fd).st_size
        if os.lseek(fd, 0, os.SEEK_CUR) != end:
            return False
        os.ftruncate(fd, end - torn)
    except OSError:
        return False
    return True


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
        except OSError:   # not there (yet), or not a readable file: nothing to read
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
