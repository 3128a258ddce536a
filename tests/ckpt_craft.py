"""What an attacker who can write a checkpoint folder does to it, for the loader's tests: files
replaced with their entries in commit.json recomputed, shards re-laid with their storage records."""

from __future__ import annotations

import functools
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


# ---- hash floods: pickles whose dicts take quadratic time to fill (issue 34) -----------------

META = "torch.distributed.checkpoint.metadata"
MEMOIZE, POP = b"\x94", b"0"


def integer(value: int) -> bytes:
    """The opcode Python's pickler uses for ``value``."""
    if 0 <= value < 1 << 8:
        return b"K" + bytes([value])  # BININT1
    if 0 <= value < 1 << 16:
        return b"M" + value.to_bytes(2, "little")  # BININT2
    if -(1 << 31) <= value < 1 << 31:
        return b"J" + value.to_bytes(4, "little", signed=True)  # BININT
    raw = value.to_bytes((value.bit_length() + 8) // 8, "little", signed=True)
    return b"\x8a" + bytes([len(raw)]) + raw  # LONG1


def get(index: int) -> bytes:
    return b"h" + bytes([index]) if index < 256 else b"j" + index.to_bytes(4, "little")  # (LONG_)BINGET


def dict_of(pairs: list[tuple[bytes, bytes]]) -> bytes:
    """A dict filled from (key, value) opcodes in batches of 1000, as Python's pickler writes one."""
    out = [b"}"]
    for i in range(0, len(pairs), 1000):
        out.append(b"(" + b"".join(k + v for k, v in pairs[i:i + 1000]) + b"u")  # MARK ... SETITEMS
    return b"".join(out)


def metadata_pickle(fields: dict[str, bytes], prelude: bytes = b"") -> bytes:
    """A protocol-4 ``.metadata``: DCP's Metadata, each field's value given as opcodes (``prelude``:
    opcodes run first, to memoize what the fields get)."""
    body = b"".join(text(k) + v for k, v in fields.items())
    return (b"\x80\x04" + prelude + name(META, "Metadata") + b")\x81"  # NEWOBJ
            + b"}(" + body + b"u" + b"b.")                               # BUILD its fields, STOP


def colliding_ints(n: int) -> list[int]:
    """``n`` different ints of one hash: an int hashes to itself modulo 2**61 - 1."""
    return [k * ((1 << 61) - 1) for k in range(1, n + 1)]


@functools.cache
def colliding_offsets(n: int) -> list[tuple[int, int]]:
    """``n`` pairs of non-negative ints whose tuples (and ``torch.Size``s, and so DCP's MetadataIndex
    keys of one fqn) share one hash: Python's tuple hash (xxHash's round) can be run backwards."""
    mask, p1, p2, p5 = (1 << 64) - 1, 11400714785074694791, 14029467366897019727, 2870177450012600261

    def rotl(x: int, r: int) -> int:
        return ((x << r) | (x >> (64 - r))) & mask

    want, inv2 = rotl(0x5EED * pow(p1, -1, 1 << 64) & mask, 33), pow(p2, -1, 1 << 64)  # before the last round
    out, a = [], 0
    while len(out) < n:
        first = rotl((p5 + a * p2) & mask, 31) * p1 & mask
        b = (want - first) * inv2 & mask
        if b < (1 << 61) - 1:  # an int hashes to itself below the modulus
            out.append((a, b))
        a += 1
    assert len({hash(t) for t in out[:50]}) == 1
    return out


def flooded_metadata(n: int, keys: str) -> bytes:
    """The issue's crafted ``.metadata``: one dict of ``n`` keys that all fall in one hash bucket.
    ``keys``: "int" (the issue's: state_dict_metadata keyed by ints) or "index" (storage_data keyed by
    DCP MetadataIndex records of one fqn whose offsets collide, the kind of key DCP writes there)."""
    if keys == "int":
        flood = dict_of([(integer(k), b"N") for k in colliding_ints(n)])
        return metadata_pickle({"state_dict_metadata": flood, "planner_data": b"N", "storage_data": b"}",
                                "storage_meta": b"N", "version": b"N"})
    # memo: 0 MetadataIndex, 1 torch.Size, 2 the fqn, 3 "fqn", 4 "offset"
    prelude = b"".join(op + MEMOIZE + POP for op in (name(META, "MetadataIndex"), name("torch", "Size"),
                                                        text("model.weight"), text("fqn"), text("offset")))
    pairs = [(get(0) + b")\x81" + b"}(" + get(3) + get(2) + get(4)                 # MetadataIndex(fqn=,
              + get(1) + integer(a) + integer(b) + b"\x86\x85R" + b"ub", b"N")     # offset=Size((a, b)))
             for a, b in colliding_offsets(n)]
    return metadata_pickle({"state_dict_metadata": b"}", "planner_data": b"N", "storage_data": dict_of(pairs),
                            "storage_meta": b"N", "version": b"N"}, prelude)


def _size(values: tuple[int, ...], size_op: bytes = name("torch", "Size")) -> bytes:
    return size_op + b"(" + b"".join(integer(v) for v in values) + b"t\x85R"  # Size((values...))


def _list_of(items: list[bytes]) -> bytes:
    return b"]" + b"".join(b"(" + b"".join(items[i:i + 1000]) + b"e" for i in range(0, len(items), 1000))


def _colliding_chunks(n: int) -> tuple[bytes, bytes]:
    """(prelude, state_dict_metadata) of one tensor whose ``n`` chunks have offsets of one hash: the
    unpickler sees no key, but the record checks look each chunk up by its offsets."""
    offsets = colliding_offsets(n)
    # memo: 0 ChunkStorageMetadata, 1 torch.Size, 2 "offsets", 3 "sizes"
    memo = (name(META, "ChunkStorageMetadata"), name("torch", "Size"), text("offsets"), text("sizes"))
    prelude = b"".join(op + MEMOIZE + POP for op in memo)
    chunks = [get(0) + b")\x81}(" + get(2) + _size((a, b), get(1)) + get(3) + _size((1, 1), get(1)) + b"ub"
              for a, b in offsets]
    properties = (name(META, "TensorProperties") + b")\x81" + b"(" + name("torch", "float32")
                  + name("torch.serialization", "_get_layout") + text("torch.strided") + b"\x85R" + b"\x89"
                  + name(META, "_MEM_FORMAT_ENCODING") + b"K\x00\x85R" + b"\x89" + b"tb")
    limit = (max(a for a, _ in offsets) + 1, (1 << 62) - 1)
    tensor = (name(META, "TensorStorageMetadata") + b")\x81}(" + text("properties") + properties
              + text("size") + _size(limit) + text("chunks") + _list_of(chunks) + b"ub")
    return prelude, b"}" + text("model.weight") + tensor + b"s"


FLOODS = ("int-keys", "index-keys", "repeated-keys", "chunk-offsets", "shared-list", "deep-marks",
          "deep-lists", "many-dicts", "long-size", "long-path")


def flood(shape: str, n: int) -> bytes:
    """A ``.metadata`` of one of the shapes (FLOODS) that would make an unpickler, or what walks its
    result, work more than linearly or without bound; ``n``: how many keys, how deep or how long."""
    if shape in ("int-keys", "index-keys"):
        return flooded_metadata(n, shape.split("-")[0])
    fields = {"state_dict_metadata": b"}", "planner_data": b"N", "storage_data": b"}", "storage_meta": b"N",
              "version": b"N"}
    prelude = b""
    if shape == "repeated-keys":
        fields["state_dict_metadata"] = dict_of([(text("model.weight"), b"N")] * n)
    elif shape == "chunk-offsets":
        prelude, fields["state_dict_metadata"] = _colliding_chunks(n)
    elif shape == "shared-list":  # one list (memo 0) under n keys: each walk of them walks it again
        shared = [(text(f"k{i}"), b"]" + MEMOIZE if i == 0 else get(0)) for i in range(n)]
        fields["planner_data"] = dict_of(shared)
    elif shape == "deep-marks":
        fields["version"] = b"(" * n + b"N" + b"t" * n
    elif shape == "deep-lists":
        fields["version"] = b"]" * n + b"a" * (n - 1)
    elif shape == "many-dicts":  # the most memory per opcode: empty dicts, each kept by the memo
        fields["planner_data"] = _list_of([b"}" + MEMOIZE] * n)
    elif shape == "long-size":
        fields["version"] = _size(tuple(range(n)))
    elif shape == "long-path":
        fields["version"] = name("pathlib", "PosixPath") + b"(" + text("/") + text("d" * 99) * n + b"tR"
    else:
        raise ValueError(shape)
    return metadata_pickle(fields, prelude)
