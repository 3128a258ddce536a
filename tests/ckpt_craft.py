"""What an attacker who can write a checkpoint folder does to it, for the loader's tests: files
replaced with their entries in commit.json recomputed, shards re-laid with their storage records."""

from __future__ import annotations

import hashlib
import io
import json
import pathlib
import pickle
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch


def rewrite(folder: Path, name: str, data: bytes | None, listed: bool = True) -> None:
    """Write ``folder/name`` (None: leave the file as it is) and record it in commit.json (``listed``)
    or drop it from there, as a writer of the folder can."""
    if data is not None:
        (folder / name).write_bytes(data)
    record = json.loads((folder / "commit.json").read_text())
    if listed:
        data = (folder / name).read_bytes()
        record["files"][name] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    else:
        record["files"].pop(name, None)
    (folder / "commit.json").write_text(json.dumps(record))


def relay(folder: Path, change: Callable[[str, bytes], bytes]) -> Any:
    """Rewrite every stored item (``change(fqn, archive)``) and lay the shards out anew, with the
    storage records' offsets and lengths, .metadata and commit.json to match. Returns the metadata."""
    metadata = pickle.loads((folder / ".metadata").read_bytes())  # our own save: plain pickle reads it
    by_file: dict[str, list[tuple[Any, Any]]] = {}
    for index, record in metadata.storage_data.items():
        by_file.setdefault(record.relative_path, []).append((index, record))
    for name, items in by_file.items():
        old = (folder / name).read_bytes()
        out = bytearray()
        for index, record in sorted(items, key=lambda x: x[1].offset):
            new = change(index.fqn, old[record.offset:record.offset + record.length])
            record.offset, record.length = len(out), len(new)
            out += new
        rewrite(folder, name, bytes(out))
    rewrite(folder, ".metadata", pickle.dumps(metadata))
    return metadata


def deflated(archive: bytes) -> bytes:
    """The same ``torch.save`` archive with every entry compressed."""
    src = zipfile.ZipFile(io.BytesIO(archive))
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", compression=zipfile.ZIP_DEFLATED) as dst:
        for info in src.infolist():
            dst.writestr(info.filename, src.read(info))
    return buf.getvalue()


def inflating(archive: bytes, nbytes: int) -> bytes:
    """``archive`` (a tensor's) with its data entry replaced by ``nbytes`` zeros, compressed to a
    thousandth of that: what ``torch.load`` would inflate in memory."""
    src = zipfile.ZipFile(io.BytesIO(archive))
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", compression=zipfile.ZIP_STORED) as dst:
        for info in src.infolist():
            if info.filename.endswith("/data/0"):
                dst.writestr(info.filename, bytes(nbytes), compress_type=zipfile.ZIP_DEFLATED)
            else:
                dst.writestr(info.filename, src.read(info))
    return buf.getvalue()


def text(value: str) -> bytes:
    raw = value.encode()
    return b"\x8c" + bytes([len(raw)]) + raw  # SHORT_BINUNICODE


def name(module: str, attr: str) -> bytes:
    return text(module) + text(attr) + b"\x93"  # STACK_GLOBAL


def build_on_class(module: str, cls: str, attr: str, genuine: bytes) -> bytes:
    """A ``.metadata`` that first BUILDs the class ``module.cls`` with slot state ``{attr: None}`` (the
    default BUILD then does ``setattr(cls, attr, None)``), pops it, then holds the genuine metadata."""
    assert genuine[:2] == b"\x80\x04"
    prefix = (b"\x80\x04" + name(module, cls)
              + b"N" + b"}" + text(attr) + b"N" + b"s" + b"\x86"   # (None, {attr: None}): slot state
              + b"b" + b"0")                                        # BUILD, POP
    return prefix + genuine[2:]


# what Python caches on a class the first time it is pickled (torch's collectives pickle DCP's plans)
CACHES = ("__slotnames__",)


def fingerprint() -> dict[str, Any]:
    """The attributes of the classes a crafted pickle could reach: pathlib's, torch's sizes, dtypes
    and layouts, DCP's metadata and file-system classes (by name and identity of each value)."""
    from torch.distributed.checkpoint import filesystem, metadata

    classes: list[Any] = [pathlib.Path, pathlib.PurePath, pathlib.PosixPath, pathlib.PurePosixPath,
                          torch.Size, torch.dtype, torch.layout, torch.Tensor]
    classes += [v for v in vars(metadata).values() if isinstance(v, type)]
    classes += [v for v in vars(filesystem).values() if isinstance(v, type)]
    out: dict[str, Any] = {}
    for c in classes:
        out[f"{c.__module__}.{c.__qualname__}"] = {k: id(v) for k, v in vars(c).items() if k not in CACHES}
    out["torch.dtypes"] = {str(v): sorted(getattr(v, "__dict__", {})) for v in vars(torch).values()
                           if isinstance(v, torch.dtype)}
    out["pathlib"] = {k: id(v) for k, v in vars(pathlib).items()}
    return out


def tensor_archive(t: torch.Tensor) -> bytes:
    buf = io.BytesIO()
    torch.save(t, buf)
    return buf.getvalue()
