"""The newest in-memory copy of a rank's checkpoint: restore from RAM instead of storage.

An async save stages the state into shared-memory buffers (see ``checkpoint.staging.Stager``). Each
buffer lives in a named file of its own, ``/dev/shm/eksft-<job_uid>-<rank>.<index>``, so they outlive the
rank process: after an in-process, in-job or (same node) job-level restart the next incarnation maps
the files and, if they hold the newest committed step, copies them back into its local shards without
reading the checkpoint from storage. A file per buffer, not one per rank, keeps each buffer a storage
of its own: NVRx's writer clones every CPU tensor that is a view into a larger storage, on the
training thread, and the kept save plan needs the staged buffers themselves. Beside them,
``eksft-<job_uid>-<rank>.json`` records which step the buffers hold (written only once that save committed
and the buffers' checksums were computed, off the training thread) and their layout; it is removed
before the buffers are overwritten by the next save.

The files are input like any checkpoint folder (another job's, a stale run's, truncated, garbage):
everything is checked and any doubt means "restore from storage", with one line saying why. The
job's supervisor removes them when the job ends (:func:`remove_copies`).

Torch is imported inside the functions that need it: the supervisor imports this module for cleanup.

Over 500 lines, one idea: writing, checking and restoring the copy share its file format and checks.
"""

from __future__ import annotations

import contextlib
import json
import math
import mmap
import os
import queue
import re
import stat
import threading
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..jobdir import atomic_write

SHM = Path("/dev/shm")
FORMAT, VERSION = "eksft-memory-copy", 2
HEADER_MAX = 64 << 20          # a layout larger than this is not one we wrote
_JOB_UID = re.compile(r"[A-Za-z0-9_.-]{1,64}")
CHUNK = 16 << 20               # the buffers' checksums: one CRC-32 per 16 MiB


def copy_path(job_uid: str, rank: int) -> Path | None:
    """The base name of ``rank``'s copy in job ``job_uid`` (its record is ``<base>.json``, its buffers
    ``<base>.<index>``); None without a usable job uid (no copy kept)."""
    usable = _JOB_UID.fullmatch(job_uid or "") and job_uid not in (".", "..")
    return SHM / f"eksft-{job_uid}-{rank}" if usable else None


def buffer_path(base: Path, index: int) -> Path:
    """The file of buffer ``index`` of the copy ``base``."""
    return base.with_name(f"{base.name}.{index}")


def remove_copies(job_uid: str | None) -> int:
    """Remove every in-memory copy file of job ``job_uid`` (the job ended or was stopped or removed);
    return how many. Never touches another job's files."""
    return _remove(lambda owner: owner == job_uid) if job_uid else 0


def remove_stale_copies(live: set[str]) -> int:
    """Remove this user's in-memory copy files of local-backend jobs (16 hex digit uids) that have no
    live process (``live``: the marks of those that do): a job whose supervisor could not clean up
    (killed with it) leaves no memory behind once the next job is launched."""
    return _remove(lambda owner: re.fullmatch(r"[0-9a-f]{16}", owner) is not None and owner not in live)


def _remove(doomed: Callable[[str], bool]) -> int:
    """Remove this user's copy files (buffers, record, a record's temporary file) whose job_uid is
    ``doomed``."""
    removed = 0
    for path in SHM.glob("*eksft-*"):
        m = re.fullmatch(r"\.?eksft-(.+)-\d+(\.\d+|\.json(\.\d+\.tmp)?)?", path.name)
        try:
            if m and doomed(m.group(1)) and path.lstat().st_uid == os.geteuid():
                path.unlink()
                removed += 1
        except OSError:
            pass
    return removed


# ---- the header --------------------------------------------------------------------------------

@dataclass(frozen=True)
class Entry:
    key: str
    dtype: str
    shape: tuple[int, ...]
    file: int                        # its file is buffer_path(copy_path(job_uid, rank), file)
    nbytes: int
    digest: str                      # the file's checksums (see digest)
    dtensor: dict[str, Any] | None   # the DTensor layout (global shape, mesh, placements, coordinate)


@dataclass(frozen=True)
class Header:
    job_uid: str
    rank: int
    world_size: int
    step: int
    committed_at: float
    entries: dict[str, Entry]
    values: dict[str, Any]          # key -> encoded plain value (see encode_value)


_ITEMSIZE = {"float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "int64": 8, "int32": 4, "int16": 2,
             "int8": 1, "uint8": 1, "bool": 1, "complex64": 8, "complex128": 16, "float8_e4m3fn": 1,
             "float8_e5m2": 1}


def _int(value: Any, low: int = 0, high: int = 1 << 62) -> bool:
    return type(value) is int and low <= value <= high


def parse_header(text: str | bytes) -> Header | str:
    """The header of a copy, or why it cannot be used. Never raises: every field is checked (types,
    ranges, one file per buffer, sizes and checksums that fit shapes and dtypes)."""
    try:
        raw = json.loads(text)
    except (ValueError, RecursionError) as e:
        return f"its header is not JSON ({type(e).__name__})"
    if not isinstance(raw, dict) or raw.get("format") != FORMAT:
        return "its header is not an eksft memory copy"
    if raw.get("version") != VERSION:
        return f"its header has version {str(raw.get('version'))[:20]!r}, not {VERSION}"
    job_uid = raw.get("job_uid", raw.get("run"))   # "run": older jobs' name for it
    step, t = raw.get("step"), raw.get("committed_at")
    if not isinstance(job_uid, str) or not _int(raw.get("rank"), 0, 1 << 20) \
            or not _int(raw.get("world_size"), 1, 1 << 20):
        return "its header lacks the job uid, rank or world size"
    if not _int(step) or type(t) is not float or not math.isfinite(t):
        return "its header lacks the step or commit time"
    entries, values = raw.get("entries"), raw.get("values")
    if not isinstance(entries, list) or not isinstance(values,
                                                       dict) or not all(isinstance(k, str) for k in values):
        return "its header has no layout"
    parsed: dict[str, Entry] = {}
    files: set[int] = set()
    for item in entries:
        entry = _parse_entry(item)
        if isinstance(entry, str):
            return entry
        if entry.key in parsed or entry.key in values:
            return f"its layout names {entry.key[:80]!r} twice"
        if entry.file in files:
            return f"its buffer {entry.key[:80]!r} shares its file with another"
        parsed[entry.key] = entry
        files.add(entry.file)
    return Header(job_uid, raw["rank"], raw["world_size"], step, t, parsed, values)


def _parse_entry(item: Any) -> Entry | str:
    if not isinstance(item, dict) or not isinstance(item.get("key"), str):
        return "its layout has an entry without a key"
    key, dtype, shape = item["key"], item.get("dtype"), item.get("shape")
    dt, sums = item.get("dtensor"), item.get("digest")
    if not isinstance(dtype, str) or dtype not in _ITEMSIZE or not isinstance(shape, list) \
            or len(shape) > 64 or not all(_int(n, 0, 1 << 40) for n in shape):
        return f"its layout entry {key[:80]!r} has no valid dtype and shape"
    if not _int(item.get("file"), 0, 1 << 30) or not _int(item.get("nbytes")):
        return f"its layout entry {key[:80]!r} has no valid file and size"
    if item["nbytes"] != math.prod(shape) * _ITEMSIZE[dtype]:
        return (f"its layout entry {key[:80]!r} has {item['nbytes']} bytes, its shape and dtype need "
                "another size")
    if not isinstance(sums, str) or len(sums) != 8 * -(-item["nbytes"] // CHUNK) \
            or not re.fullmatch(r"[0-9a-f]*", sums):
        return f"its layout entry {key[:80]!r} has no checksums of its buffer"
    if dt is not None and not isinstance(dt, dict):
        return f"its layout entry {key[:80]!r} has an invalid DTensor layout"
    return Entry(key, dtype, tuple(shape), item["file"], item["nbytes"], sums, dt)


def encode_value(value: Any) -> Any:
    """A plain value as JSON: scalars as they are, bytes, tuples, lists and str-keyed dicts tagged.
    Raises TypeError for anything else (then no copy is kept: storage has it)."""
    if value is None or type(value) in (bool, int, float, str):
        return value
    if type(value) is bytes:
        return {"b": value.hex()}
    if type(value) in (tuple, list):
        return {"t" if type(value) is tuple else "l": [encode_value(v) for v in value]}
    if type(value) is dict and all(type(k) is str for k in value):
        return {"d": {k: encode_value(v) for k, v in value.items()}}
    raise TypeError(f"a {type(value).__name__} value")


def decode_value(raw: Any, depth: int = 0) -> Any:
    """The value :func:`encode_value` encoded; raises ValueError for anything it cannot have written."""
    if raw is None or type(raw) in (bool, int, float, str):
        return raw
    if type(raw) is not dict or len(raw) != 1 or depth > 32:
        raise ValueError("an unknown value")
    (tag, inner), = raw.items()
    if tag == "b" and isinstance(inner, str):
        return bytes.fromhex(inner)
    if tag in ("t", "l") and isinstance(inner, list):
        items = [decode_value(v, depth + 1) for v in inner]
        return tuple(items) if tag == "t" else items
    if tag == "d" and isinstance(inner, dict):
        return {k: decode_value(v, depth + 1) for k, v in inner.items()}
    raise ValueError("an unknown value")


def dtensor_layout(dt: Any) -> dict[str, Any]:
    """What fixes which part of a DTensor this rank holds: its global shape, mesh, placements and
    this rank's coordinate in the mesh."""
    spec = dt._spec
    coordinate = spec.mesh.get_coordinate()
    return {"shape": list(spec.shape), "mesh": list(spec.mesh.shape),
            "placements": [str(p) for p in spec.placements],
            "coordinate": list(coordinate) if coordinate is not None else None}


def digest(buffer: Any, size: int, tick: Callable[[], Any] = lambda: None) -> str:
    """The checksums of the first ``size`` bytes of ``buffer``: a CRC-32 per :data:`CHUNK`, in hex.
    They catch a copy overwritten or corrupted since (a newer save's staging cut short, stray
    writes) at about 6 GB/s, four times SHA-256's speed here; whose file it is is checked apart
    (owner, mode, job_uid, rank, step, commit time). zlib releases the GIL while it sums."""
    view, sums = memoryview(buffer), []
    for start in range(0, size, CHUNK):
        sums.append(f"{zlib.crc32(view[start:min(size, start + CHUNK)]):08x}")
        tick()
    view.release()
    return "".join(sums)


def _open_checked(path: Path, flags: int) -> tuple[int, os.stat_result] | str:
    """A file descriptor of ``path`` if it is a regular file of ours only (not a link), or why not."""
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return f"there is none ({path} does not exist)"
    except OSError as e:
        return f"{path} cannot be opened ({e.strerror})"
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
        os.close(fd)
        return f"{path} is not a private file of this user"
    return fd, st


# ---- keeping a copy (the writing side) -----------------------------------------------------------

def reserve(path: Path, nbytes: int) -> Any:
    """A new file ``path`` of ``nbytes``, reserved in full, as a shared untyped storage; or why not
    (/dev/shm is full or limited: then no file is left)."""
    import torch

    try:  # a new file: whatever still maps the old one (a previous incarnation's, the writer) keeps it
        path.unlink(missing_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except OSError as e:
        return f"{path} cannot be created ({e.strerror})"
    try:
        os.posix_fallocate(fd, 0, nbytes)  # reserve now: a full /dev/shm fails here, not with SIGBUS later
        return torch.UntypedStorage._new_shared_fd_cpu(fd, nbytes)
    except OSError as e:
        path.unlink(missing_ok=True)
        return f"{nbytes / 1e6:.0f} MB do not fit in {path.parent} ({e.strerror}): no in-memory copy is kept"
    finally:
        os.close(fd)


class Shelf:
    """The named shared-memory files the stager's buffers live in (one per buffer), and the record
    of what they hold.

    ``begin`` (before the buffers change) removes the record; ``staged`` hashes the buffers in a
    background thread; ``committed`` notes the committed step. The record is written once both
    are in and no newer staging has begun: a copy is published only for the step it holds."""

    def __init__(self) -> None:
        self.path: Path | None = None       # the copy's base path, once the buffers live in its files
        self.identity: tuple[str, int, int] | None = None   # (job_uid, rank, world size) it belongs to
        self._files: dict[str, tuple[int, int]] = {}        # key -> (file index, bytes) of each buffer
        self._lock = threading.Lock()
        self._generation = 0
        self._hashed: tuple[int, dict[str, Any]] | None = None   # (generation, layout with checksums)
        self._commit: tuple[int, int, float] | None = None       # (generation, step, committed at)
        self.note = ""                      # why no copy is kept, if none is
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()   # stagings to sum, for the worker thread
        self._worker = 0                    # the pid whose worker thread takes them (0: none started)

    def bind(self, job_uid: str, rank: int, world_size: int) -> None:
        """Keep copies for ``rank`` of job ``job_uid``; a different job or rank drops the current buffers."""
        if self.identity != (job_uid, rank, world_size):
            self.identity, self.path, self._files = (job_uid, rank, world_size), None, {}

    def allocate(self, wanted: dict[str, tuple[Any, Any]]) -> dict[str, Any]:
        """A buffer per key (``wanted``: key -> shape and dtype), each a shared storage of its own:
        in its own named file when the job has a job uid and /dev/shm has room for them all, else
        (no copy is then kept) anonymous shared memory. A zero-byte buffer has no file."""
        import torch

        self.begin()
        base = copy_path(*self.identity[:2]) if self.identity else None
        self.path, self._files = None, {}
        if base is not None:
            for old in SHM.glob(f"{base.name}.*"):  # a previous layout's buffers: their memory goes
                if old.name[len(base.name) + 1:].isdigit():
                    with contextlib.suppress(OSError):
                        old.unlink()
        storages: dict[str, Any] = {}
        files = {key: (i, math.prod(shape) * dtype.itemsize)
                 for i, (key, (shape, dtype)) in enumerate(wanted.items())}
        why = "" if base is not None else "the job has no job uid"
        for key, (i, nbytes) in files.items() if base is not None else ():
            reserved = reserve(buffer_path(base, i), nbytes) if nbytes else None
            if isinstance(reserved, str):
                why = reserved
                break
            if reserved is not None:
                storages[key] = reserved
        if why:  # all or none: what was reserved goes
            for key in storages:
                buffer_path(base, files[key][0]).unlink(missing_ok=True)
            self.note = why
            return {key: torch.empty(shape, dtype=dtype).share_memory_() for key,
                    (shape, dtype) in wanted.items()}
        self.path, self._files, self.note = base, files, ""
        return {key: torch.empty(0, dtype=dtype).set_(storages[key], 0, tuple(shape)) if key in storages
                else torch.empty(shape, dtype=dtype).share_memory_() for key,
                (shape, dtype) in wanted.items()}

    def begin(self) -> int:
        """The buffers are about to change: the copy they held is no longer valid."""
        with self._lock:
            self._generation += 1
            self._hashed = self._commit = None
            if self.path is not None:
                with contextlib.suppress(OSError):
                    os.unlink(_header_path(self.path))
            return self._generation

    def staged(self, layout: Callable[[], dict[str, Any]]) -> None:
        """The buffers hold a staged state: sum them (and describe them) in the background, on one
        thread kept for it (starting a thread per save would add to the training stall)."""
        if self.path is None:
            return
        if self._worker != os.getpid():  # none yet in this process (a forked one has none either)
            self._jobs, self._worker = queue.SimpleQueue(), os.getpid()
            threading.Thread(target=self._work, args=(self._jobs,), daemon=True,
                             name="eksft-memory-copy").start()
        with self._lock:
            self._jobs.put((self._generation, layout, self.path, self._files))

    def _work(self, jobs: queue.SimpleQueue) -> None:
        while True:
            generation, *job = jobs.get()
            if generation == self._generation:  # else a newer staging has begun: nothing to sum
                self._hash(generation, *job)

    def _hash(self, generation: int, layout: Callable[[], dict[str, Any]], base: Path,
              files: dict[str, tuple[int, int]]) -> None:
        try:
            described = layout()
            for entry in described["entries"]:
                index, nbytes = files[entry["key"]]
                entry["file"], entry["digest"] = index, ""
                if nbytes:
                    with open(buffer_path(base, index),
                              "rb") as f, mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as m:
                        entry["digest"] = digest(m, nbytes)
        except (OSError, ValueError, TypeError, KeyError) as e:
            if generation == self._generation:  # else these buffers were replaced while being summed
                self.note = f"no in-memory copy: {type(e).__name__}: {e}"[:200]
            return
        with self._lock:
            if generation == self._generation:
                self._hashed = (generation, described)
                self._publish()

    def committed(self, step: int, committed_at: float) -> None:
        """The staged state was committed as ``step`` (at ``committed_at``, the commit record's time)."""
        with self._lock:
            self._commit = (self._generation, step, committed_at)
            self._publish()

    def _publish(self) -> None:
        if self._hashed is None or self._commit is None or self._hashed[0] != self._commit[0] \
                or self._commit[0] != self._generation or self.path is None:
            return
        (_, described), (_, step, t) = self._hashed, self._commit
        job_uid, rank, world_size = self.identity
        header = {"format": FORMAT, "version": VERSION, "job_uid": job_uid, "rank": rank,
                  "world_size": world_size, "step": step, "committed_at": t, **described}
        try:
            atomic_write(_header_path(self.path), json.dumps(header))
        except OSError as e:
            self.note = f"the in-memory copy's header cannot be written ({e.strerror})"


# ---- restoring from a copy (the reading side) ----------------------------------------------------

def prepare(job_uid: str, rank: int, world_size: int, step: int, committed_at: float | None, state: Any,
            tick: Callable[[], Any] = lambda: None) -> tuple[Callable[[], None] | None, str | None, float]:
    """Check this rank's copy against the checkpoint to restore (``step``, committed at
    ``committed_at``) and against ``state``'s own layout: (a function that loads it into ``state``,
    None, seconds spent hashing) if every check passes, else (None, why not, seconds)."""
    path = copy_path(job_uid, rank)
    if path is None:
        return None, "the job has no job uid", 0.0
    opened = _open_checked(_header_path(path), os.O_RDONLY)
    if isinstance(opened, str):
        return None, opened, 0.0
    fd, st = opened
    try:
        if st.st_size > HEADER_MAX:
            return None, f"its header has {st.st_size} bytes", 0.0
        text = os.read(fd, st.st_size + 1)  # one read: a header is written whole (atomic rename)
    finally:
        os.close(fd)
    header = parse_header(text)
    if isinstance(header, str):
        return None, header, 0.0
    if (header.job_uid, header.rank, header.world_size) != (job_uid, rank, world_size):
        return None, (f"it is of job {header.job_uid[:40]!r} rank {header.rank} of {header.world_size}, "
                      f"not rank {rank} of {world_size} of this job"), 0.0
    if (header.step, header.committed_at) != (step, committed_at):
        return None, f"it holds step {header.step}, not the newest committed checkpoint (step {step})", 0.0
    targets = _targets(state)
    why = _mismatch(header, targets)
    if why:
        return None, why, 0.0
    t0, data = time.perf_counter(), {}
    for entry in header.entries.values():
        mapped = _map_checked(buffer_path(path, entry.file), entry, tick) if entry.nbytes else None
        if isinstance(mapped, str):
            for m in data.values():
                m.close()
            return None, mapped, time.perf_counter() - t0
        if mapped is not None:
            data[entry.key] = mapped
    return (lambda: _apply(header, targets, data)), None, time.perf_counter() - t0


def _map_checked(path: Path, entry: Entry, tick: Callable[[], Any]) -> mmap.mmap | str:
    """A private mapping of buffer file ``path`` if it is ours, has the entry's size and matches its
    checksums; or why not."""
    opened = _open_checked(path, os.O_RDONLY)
    if isinstance(opened, str):
        return opened
    fd, st = opened
    try:
        if st.st_size != entry.nbytes:
            return f"its buffer file {path.name} has {st.st_size} bytes, the header says {entry.nbytes}"
        data = mmap.mmap(fd, 0, access=mmap.ACCESS_COPY)
    finally:
        os.close(fd)
    if digest(data, entry.nbytes, tick) != entry.digest:
        data.close()
        return f"its buffers do not match their checksums ({path.name}: overwritten or corrupted)"
    return data


@dataclass
class _Targets:
    tensors: dict[str, Any]                  # key -> the tensor to fill (a DTensor's local shard)
    layouts: dict[str, dict[str, Any]]       # key -> DTensor layout, for DTensor keys
    values: dict[str, tuple[Any, Any]]       # key -> (container, index) of a plain value
    owners: list[tuple[Any, Any]]            # (stateful object, its state dict), innermost first


def _targets(state: Any) -> _Targets:
    """Walk ``state`` as the stager does (same keys), collecting what a load fills."""
    from torch.distributed.tensor import DTensor
    import torch

    found = _Targets({}, {}, {}, [])

    def walk(node: Any, prefix: str, container: Any, index: Any) -> None:
        if callable(getattr(node, "state_dict", None)) and callable(getattr(node, "load_state_dict", None)):
            sd = node.state_dict()
            walk(sd, prefix, None, None)
            found.owners.append((node, sd))
        elif isinstance(node, dict):
            for k, v in node.items():
                walk(v, f"{prefix}/{k}", node, k)
        elif isinstance(node, list):
            for i, v in enumerate(node):
                walk(v, f"{prefix}/{i}", node, i)
        elif isinstance(node, DTensor):
            found.tensors[prefix], found.layouts[prefix] = node._local_tensor, dtensor_layout(node)
        elif isinstance(node, torch.Tensor):
            found.tensors[prefix] = node
        elif container is not None:
            found.values[prefix] = (container, index)
    walk(state, "", None, None)
    return found


def _mismatch(header: Header, targets: _Targets) -> str | None:
    """Why the copy's layout is not this rank's state's, or None."""
    if set(header.entries) != set(targets.tensors) or set(header.values) != set(targets.values):
        missing = sorted(
            (set(targets.tensors) | set(targets.values)) - set(header.entries) - set(header.values))
        return f"its layout differs from this job's state{f' (no {missing[0][:80]!r})' if missing else ''}"
    for key, entry in header.entries.items():
        t = targets.tensors[key]
        if entry.dtype != str(t.dtype).removeprefix("torch.") or entry.shape != tuple(t.shape):
            return (f"its {key[:80]!r} is {entry.dtype}{list(entry.shape)}, this rank's is "
                    f"{t.dtype}{list(t.shape)}")
        if entry.dtensor != targets.layouts.get(key):
            return f"its {key[:80]!r} is sharded differently from this rank's"
    for key, raw in header.values.items():
        try:
            decode_value(raw)
        except (ValueError, RecursionError):
            return f"its value {key[:80]!r} is not one eksft wrote"
    return None


def _apply(header: Header, targets: _Targets, data: dict[str, mmap.mmap]) -> None:
    """Copy the buffers into the local tensors, set the plain values, then hand each stateful
    object its filled state dict (what DCP's load does with what it reads)."""
    import torch

    try:
        for key, entry in header.entries.items():
            if entry.nbytes:
                dtype = getattr(torch, entry.dtype)
                src = torch.frombuffer(data[key], dtype=dtype, count=entry.nbytes // dtype.itemsize)
                targets.tensors[key].copy_(src.view(entry.shape))
        for key, raw in header.values.items():
            container, index = targets.values[key]
            container[index] = decode_value(raw)
        for owner, sd in targets.owners:
            owner.load_state_dict(sd)
    finally:
        for m in data.values():
            with contextlib.suppress(BufferError):  # a view still held: the mapping goes with it
                m.close()


def _header_path(path: Path) -> Path:
    return path.with_name(path.name + ".json")
