"""Safe loading of a DCP checkpoint folder that anyone who can write the folder may have crafted.

What the loader trusts, and nothing more (README, Security):

- it opens only the files that ``commit.json`` lists (which verification lstat'ed and checksummed),
  ``.metadata`` included, with ``O_NOFOLLOW | O_NONBLOCK``, and reads one only if the open
  descriptor is a regular file of the recorded size (a symlink, FIFO or device is refused, never
  waited on); ``.metadata``'s bytes must also match the recorded checksum;
- ``.metadata`` weighs no more than DCP's metadata for the records the data files can hold, and is
  unpickled by :class:`~.unpickle.MetadataUnpickler`, which cannot change anything and whose work is
  linear in the file (a budget of opcodes, no hash collisions, nothing reached twice);
- every record is then type-checked, and every storage record must name a listed data file, lie
  within its recorded size apart from every other record, and for a tensor be as long as the
  tensor's bytes plus a bounded serialization overhead; a chunk must lie within its tensor; no
  transform (compression extension) is accepted;
- a tensor or bytes entry is a ``torch.save`` archive read with ``weights_only=True`` and only if
  every entry in it is stored (a compressed entry could inflate to any size).

Any failure is one line (:class:`JobError`); the restore records it and tries the next checkpoint.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import io
import json
import os
import pathlib
import pickle
import stat
import zipfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ...checkpoint_folders import COMMIT, CheckpointInfo, parse_commit, plain_name, verify
from ...errors import JobError
from .unpickle import MetadataUnpickler, byte_cap, plain_key, records_room

METADATA = ".metadata"
# what torch.save adds to a tensor's bytes (its archive's records, names and alignment), with room to spare
ARCHIVE_OVERHEAD = 1 << 16
_FIX = "the folder was not written by a DCP save (or was tampered with): resume from another checkpoint"


# ---- opening only what commit.json lists ----------------------------------------------------

def listed_files(path: Path) -> dict[str, dict[str, Any]]:
    """The files ``path/commit.json`` lists (name -> size and sha256), read without following links."""
    from ...checkpoint_folders import STEP_DIR, _read_plain

    m = STEP_DIR.match(Path(path).name)
    try:
        commit = parse_commit(json.loads(_read_plain(Path(path) / COMMIT)), int(m.group(1)) if m else -1)
    except (OSError, ValueError, RecursionError) as e:
        commit = f"{COMMIT} cannot be read ({type(e).__name__})"
    if isinstance(commit, str):
        raise JobError(f"refusing to load {path}: {commit}", _FIX)
    return commit["files"]


@contextlib.contextmanager
def open_listed(folder: Path, name: str, files: dict[str, dict[str, Any]]) -> Iterator[io.BufferedReader]:
    """``folder/name`` open for reading if commit.json lists it and it is, once open, a regular file of
    the recorded size: no link is followed and a FIFO or device is never waited on."""
    if not plain_name(name) or name not in files:
        raise OSError(f"{str(name)[:80]!r} is not a file commit.json lists")
    fd = os.open(Path(folder) / name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise OSError(f"{name} is not a regular file")
        if st.st_size != files[name]["size"]:
            raise OSError(f"{name} has {st.st_size} bytes, commit.json says {files[name]['size']}")
    except BaseException:
        os.close(fd)
        raise
    with os.fdopen(fd, "rb") as f:
        yield f


def refusal(info: CheckpointInfo) -> str | None:
    """Why a restore would refuse the committed checkpoint ``info`` before reading a tensor (its files'
    sizes and checksums, what commit.json lists, the metadata), or None. For the control plane, which
    picks a resume point before it launches (the folder must be readable from here)."""
    reason = verify(info)
    if reason is None:
        try:
            read_metadata(info.path, info.files)
        except JobError as e:
            reason = e.problem
    return reason


# ---- the metadata ---------------------------------------------------------------------------

def read_metadata(path: Path, files: dict[str, dict[str, Any]] | None = None,
                  progress: Callable[[], Any] | None = None) -> Any:
    """The DCP ``.metadata`` of the checkpoint folder ``path``, read as the module docstring says and
    checked record by record. ``files``: what commit.json lists (read from the folder if not given);
    ``progress``: called as it goes. Raises :class:`JobError` with one line otherwise."""
    path = Path(path)
    f = path / METADATA
    try:
        files = listed_files(path) if files is None else files
        if METADATA not in files:
            raise ValueError(f"{COMMIT} does not list {METADATA}")
        listed = files[METADATA]
        records = records_room(_data_bytes(path, files))
        if listed["size"] > byte_cap(records):
            raise ValueError(f"it weighs {listed['size']:,} bytes, more than DCP's metadata for the "
                             f"{records:,} records its data files can hold (at most {byte_cap(records):,})")
        with open_listed(path, METADATA, files) as fh:
            data = fh.read(listed["size"] + 1)
        if len(data) != listed["size"] or hashlib.sha256(data).hexdigest() != listed["sha256"]:
            raise ValueError(f"{METADATA} changed since it was verified")
        metadata = MetadataUnpickler(data, records, progress).load()
        _check(metadata, files)
    except JobError:
        raise
    except Exception as e:  # noqa: BLE001 - whatever a crafted file raises, the answer is one line
        plain = isinstance(e, (pickle.UnpicklingError, OSError, ValueError))
        why = str(e) if plain else f"{type(e).__name__}: {e}"
        raise JobError(f"refusing to load {f}: {' '.join(why.split())}"[:400], _FIX) from None
    return metadata


def _data_bytes(path: Path, files: dict[str, dict[str, Any]]) -> int:
    """The bytes of the data files commit.json lists that are there as regular files of that size
    (what the records of ``.metadata`` may take; a listed file that is not there holds none)."""
    total = 0
    for name, meta in files.items():
        if name == METADATA or not plain_name(name):
            continue
        try:
            st = os.lstat(path / name)
        except OSError:
            continue
        if stat.S_ISREG(st.st_mode) and st.st_size == meta["size"]:
            total += st.st_size
    return total


def _is_count(v: Any) -> bool:
    return type(v) is int and 0 <= v < 1 << 62


def _is_size(v: Any) -> bool:
    return type(v) is torch.Size and all(_is_count(x) for x in v)


def _check(md: Any, files: dict[str, dict[str, Any]]) -> None:
    """Every record of ``md`` has the type DCP gives it; every storage record names a listed data file
    and lies within it apart from every other record (so a load reads no byte twice), and a tensor
    chunk's record is as long as the chunk (plus the archive's overhead). The chunks are looked up
    through their hashes, which must differ (offsets crafted to collide would make it quadratic)."""
    from torch.distributed.checkpoint import filesystem as fs
    from torch.distributed.checkpoint import metadata as m

    def bad(what: str) -> ValueError:
        return ValueError(f"its {what} is not what a DCP save writes")

    if type(md) is not m.Metadata:
        raise ValueError(f"it holds a {type(md).__name__}, not DCP metadata")
    fields = vars(md)
    if set(fields) != {f.name for f in dataclasses.fields(m.Metadata)}:
        raise bad("set of fields")
    if type(md.state_dict_metadata) is not dict or type(md.storage_data) is not dict:
        raise bad("state dict or storage record")
    chunks: dict[tuple[str, tuple[int, ...]], int] = {}
    hashes: set[int] = set()
    taken: dict[str, list[tuple[int, int]]] = {}  # file -> the (offset, length) of its records
    for fqn, entry in md.state_dict_metadata.items():
        if type(fqn) is not str:
            raise bad("state dict key")
        if type(entry) is m.BytesStorageMetadata:
            continue
        if (type(entry) is not m.TensorStorageMetadata or not _is_size(entry.size)
                or type(entry.chunks) is not list):
            raise bad(f"entry for {fqn[:80]!r}")
        p = entry.properties
        if (type(p) is not m.TensorProperties or type(p.dtype) is not torch.dtype
                or type(p.layout) is not torch.layout):
            raise bad(f"tensor properties of {fqn[:80]!r}")
        itemsize = p.dtype.itemsize
        for c in entry.chunks:
            if type(c) is not m.ChunkStorageMetadata or not _is_size(c.offsets) or not _is_size(c.sizes) \
                    or len(c.offsets) != len(entry.size) or len(c.sizes) != len(entry.size):
                raise bad(f"chunk of {fqn[:80]!r}")
            n = itemsize
            for s in c.sizes:
                n *= s
            key = (fqn, tuple(c.offsets))
            if hash(key) in hashes:
                raise ValueError(f"two chunks of {fqn[:80]!r} share a hash (a repeated chunk, or offsets "
                                 "crafted to collide)")
            hashes.add(hash(key))
            chunks[key] = n
    for index, record in md.storage_data.items():
        if type(index) is not m.MetadataIndex or not plain_key(index) or type(record) is not fs._StorageInfo:
            raise bad("storage record")
        name = getattr(record, "relative_path", None)
        if not plain_name(name) or name == METADATA or name not in files:
            raise ValueError(f"it points at {str(name)[:80]!r}, which is not a data file of the checkpoint "
                             f"folder (outside the checkpoint folder, or not in {COMMIT})")
        offset, length = getattr(record, "offset", None), getattr(record, "length", None)
        if not _is_count(offset) or not _is_count(length) or offset + length > files[name]["size"]:
            raise ValueError(f"a storage record of {index.fqn[:80]!r} lies outside {name}")
        taken.setdefault(name, []).append((offset, length))
        if getattr(record, "transform_descriptors", None):
            raise ValueError(f"a storage record of {index.fqn[:80]!r} asks for a transform (compression)")
        entry = md.state_dict_metadata.get(index.fqn)
        if type(entry) is m.TensorStorageMetadata:
            want = chunks.get((index.fqn, tuple(index.offset or ())))
            if want is None or not want <= length <= want + ARCHIVE_OVERHEAD:
                raise ValueError(f"the storage record of {index.fqn[:80]!r} has {length} bytes, its tensor "
                                 f"{want if want is not None else 'no matching chunk'}")
        elif entry is None:
            raise bad(f"storage record for {index.fqn[:80]!r}")
    for name, spans in taken.items():
        spans.sort()
        if any(o + n > next_o for (o, n), (next_o, _) in zip(spans, spans[1:])):
            raise ValueError(f"two storage records share bytes of {name} (a DCP save writes each item once)")
    sm = md.storage_meta
    ids = (getattr(sm, "checkpoint_id", None), getattr(sm, "save_id", None), getattr(sm, "load_id", None))
    if sm is not None and (type(sm) is not m.StorageMeta
                           or not all(v is None or type(v) in (str, pathlib.PosixPath) for v in ids)
                           or type(sm.modules) is not list or not all(type(x) is str for x in sm.modules)):
        raise bad("storage meta")
    pd = md.planner_data
    if pd is not None and (type(pd) is not dict or not all(
            type(k) is str and type(v) is tuple and all(type(x) in (str, int) for x in v)
            for k, v in pd.items())):
        raise bad("planner data")
    if type(md.version) not in (str, type(None)):
        raise bad("version")


# ---- tensors and bytes ----------------------------------------------------------------------

class _Window(io.RawIOBase):
    """``length`` bytes of ``file`` from ``offset``, as a seekable file of its own (for the zip check)."""

    def __init__(self, file: Any, offset: int, length: int) -> None:
        self.file, self.offset, self.length, self.pos = file, offset, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, pos: int, whence: int = 0) -> int:
        self.pos = max(0, pos if whence == 0 else self.pos + pos if whence == 1 else self.length + pos)
        return self.pos

    def tell(self) -> int:
        return self.pos

    def readinto(self, b: Any) -> int:
        n = max(0, min(len(b), self.length - self.pos))
        self.file.seek(self.offset + self.pos)
        data = self.file.read(n)
        b[:len(data)] = data
        self.pos += len(data)
        return len(data)


def check_archive(file: Any, offset: int, length: int) -> None:
    """Refuse a ``torch.save`` archive (``length`` bytes at ``offset``) unless every entry is stored
    as it is and fits in it: ``torch.load`` would inflate a compressed one to any size."""
    with zipfile.ZipFile(_Window(file, offset, length)) as z:
        total = 0
        for info in z.infolist():
            if info.compress_type != zipfile.ZIP_STORED or info.compress_size != info.file_size:
                raise ValueError(f"an entry ({info.filename[:60]!r}) is compressed")
            total += info.file_size
        if total > length:
            raise ValueError("its entries are larger than the archive")


def _reader_and_planner(path: Path, files: dict[str, dict[str, Any]], metadata: Any) -> tuple[Any, Any]:
    from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
    from torch.distributed.checkpoint.filesystem import FileSystem

    class ListedFiles(FileSystem):
        @contextlib.contextmanager
        def create_stream(self, p: str | os.PathLike, mode: str) -> Iterator[io.IOBase]:
            if mode != "rb" or Path(p).parent != Path(path):
                raise OSError(f"{str(p)[:80]!r} is not a file of the checkpoint folder")
            with open_listed(Path(path), Path(p).name, files) as f:
                yield f

    class SafeReader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            if getattr(metadata, "storage_meta", None) is not None:
                metadata.storage_meta.load_id = self.load_id
            return metadata

        def _slice_file(self, file: Any, sinfo: Any) -> Any:
            check_archive(file, sinfo.offset, sinfo.length)
            return super()._slice_file(file, sinfo)

    class SafePlanner(DefaultLoadPlanner):
        def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
            obj = torch.load(value, weights_only=True)
            if self.flatten_state_dict:
                from torch.distributed.checkpoint._traverse import set_element

                set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
            else:
                self.state_dict[read_item.dest_index.fqn] = obj

    reader = SafeReader(str(path))
    reader.fs = ListedFiles()
    return reader, SafePlanner()


def load(path: Path, state: dict[str, Any], group: dist.ProcessGroup | None,
         progress: Callable[[], Any] | None = None) -> None:
    """Load the DCP checkpoint in ``path`` into ``state`` in place (tensors are filled, plain values
    replaced), trusting only what the module docstring says; ``progress`` is called while the metadata
    is read. Raises :class:`JobError` with one line."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    path = Path(path)
    files = listed_files(path)
    metadata = read_metadata(path, files, progress)  # fail with the reason, before any collective
    reader, planner = _reader_and_planner(path, files, metadata)
    try:
        dcp.load(state, storage_reader=reader, planner=planner, process_group=group)
    except (Exception, CheckpointException) as e:  # noqa: BLE001 - files that verify yet do not load
        causes = list(e.failures.values()) if isinstance(e, CheckpointException) else [(e, None)]
        why = " ".join("; ".join(f"{type(c).__name__}: {c}" for c, _ in causes).split())[:300]
        raise JobError(f"cannot load the checkpoint in {path}: {why}",
                       "it does not match this job's model and optimizer, or its files were replaced: "
                       "resume from another checkpoint") from None
