"""The unpickler of a DCP ``.metadata`` that anyone who can write the checkpoint folder may have crafted:
what the pickle may do, and how much work it may cost.

What it may do: name only DCP's metadata classes, torch sizes, dtypes and layouts, paths and
``OrderedDict`` (no function), build only fresh instances of those classes with their own fields (no
slot state, never a class or a shared object), fill only dicts and lists it made, with keys of the
kinds DCP writes (strings and DCP's ``MetadataIndex`` records).

How much (issue 34: one dict of 100,000 int keys in one hash bucket took 111 s, and the time grows
with the square of the size): every opcode costs a bounded amount of work, and the opcodes are
counted against a budget set by the checkpoint's data, so any ``.metadata`` is answered in time
linear in what the folder holds:

- only the opcodes Python's pickler writes for DCP metadata (protocols 4 and 5): no text forms, no
  PUT to a chosen memo slot, no DUP, no 8-byte lengths;
- at most :func:`op_budget` opcodes for the records the data files can hold (:func:`records_room`);
- no two keys of one dict share a hash (a crafted collision makes each insert compare with every
  key before it; a repeated key is no DCP record either), checked through a set of the hashes;
- the memo gives back only immutable values (strings, numbers, sizes, dtypes, layouts, the allowed
  classes): never a container or a record this load made, so nothing is reached twice and a walk of
  the result (the record checks, DCP's planner) costs at most MAX_DIMS steps per opcode;
- a size has at most :data:`MAX_DIMS` dimensions, a path at most 4096 characters, marks nest at most
  :data:`MAX_DEPTH` deep and one level of the stack holds at most :data:`MAX_STACK` items.

The budgets, measured on torch 2.13 saves: a record (a tensor's chunk or a bytes entry) is a
``torch.save`` archive of at least 1,261 bytes in a data file, so the data files hold at most one
record per KiB (:func:`records_room`). DCP's metadata takes, per KiB of data, 10 opcodes and 23 bytes
for a 2-rank FSDP2 job (53 KB for 216 records) and at worst 65 opcodes and 580 bytes (1,000 tiny
tensors with 400-character names). :func:`op_budget` allows 256 opcodes and :func:`byte_cap` 2 KiB
per KiB of data, plus a fixed allowance: 4x and 3.5x that worst case, 25x and 90x the job's. An
opcode holds at most about 80 bytes of memory (measured: empty dicts kept by the memo).
"""

from __future__ import annotations

import collections
import dataclasses
import io
import pathlib
import pickle
import pickletools
from collections.abc import Callable
from typing import Any

import torch

RECORD_BYTES = 1 << 10        # a record takes at least this much of a data file (1,261 bytes measured)
OPS_BASE, OPS_PER_RECORD = 4 << 10, 256
BYTES_BASE, BYTES_PER_RECORD = 64 << 10, 2 << 10
MAX_DIMS = 64                 # a size's dimensions (DCP writes one per dimension of a tensor)
MAX_PATH = 4096               # a path's characters (PATH_MAX)
MAX_DEPTH = 32                # marks open at once (DCP metadata nests about 6 deep)
MAX_STACK = 4096              # items on one level of the stack (the pickler writes 1,000 pairs at a time)
PROGRESS_EVERY = (1 << 16) - 1  # progress() after every 65,536 opcodes (about a tenth of a second)

# the opcodes Python's pickler writes for DCP metadata at protocols 4 and 5, and the few it writes
# for other shapes of plain values (POP, POP_MARK, floats, bytes): each costs O(1) per item it takes
_WRITTEN = {"PROTO", "FRAME", "STOP", "MARK", "POP", "POP_MARK", "MEMOIZE", "BINGET", "LONG_BINGET", "NONE",
            "NEWTRUE", "NEWFALSE", "BININT", "BININT1", "BININT2", "LONG1", "BINFLOAT", "SHORT_BINUNICODE",
            "BINUNICODE", "SHORT_BINBYTES", "BINBYTES", "EMPTY_TUPLE", "TUPLE", "TUPLE1", "TUPLE2",
            "TUPLE3", "EMPTY_LIST", "APPEND", "APPENDS", "EMPTY_DICT", "SETITEM", "SETITEMS",
            "STACK_GLOBAL", "REDUCE", "NEWOBJ", "NEWOBJ_EX", "BUILD"}
_OPCODES = {op.code.encode("latin-1")[0]: op.name for op in pickletools.opcodes}


def records_room(data_bytes: int) -> int:
    """The most records data files of ``data_bytes`` bytes can hold (each takes at least a KiB)."""
    return max(0, data_bytes) // RECORD_BYTES


def op_budget(records: int) -> int:
    """The opcodes a ``.metadata`` may take for ``records`` records (see the module docstring)."""
    return OPS_BASE + OPS_PER_RECORD * records


def byte_cap(records: int) -> int:
    """The bytes a ``.metadata`` may weigh for ``records`` records (see the module docstring)."""
    return BYTES_BASE + BYTES_PER_RECORD * records


def _classes() -> dict[tuple[str, str], Any]:
    """(module, name) -> the object a ``.metadata`` may name: DCP's metadata dataclasses and enum,
    the file-system storage record, torch sizes, dtypes and layouts, paths and OrderedDict. Measured
    on torch 2.13 with FSDP2 model and optimizer state, bytes and plain values."""
    from torch.distributed.checkpoint import filesystem, metadata

    meta = "torch.distributed.checkpoint.metadata"
    out: dict[tuple[str, str], Any] = {
        (meta, c.__name__): c for c in (metadata.Metadata, metadata.TensorStorageMetadata,
                                        metadata.BytesStorageMetadata, metadata.ChunkStorageMetadata,
                                        metadata.TensorProperties, metadata.MetadataIndex,
                                        metadata.StorageMeta, metadata._MEM_FORMAT_ENCODING)}
    out |= {("torch.distributed.checkpoint.filesystem", "_StorageInfo"): filesystem._StorageInfo,
            ("torch", "Size"): torch.Size, ("torch.serialization", "_get_layout"): _get_layout,
            ("collections", "OrderedDict"): collections.OrderedDict,
            ("pathlib", "PosixPath"): pathlib.PosixPath, ("pathlib", "PurePosixPath"): pathlib.PurePosixPath,
            ("pathlib._local", "PosixPath"): pathlib.PosixPath}
    out |= {("torch", name): value for name, value in vars(torch).items() if isinstance(value, torch.dtype)}
    return out


def _get_layout(name: Any) -> torch.layout:
    """Stands for ``torch.serialization._get_layout`` in :func:`_classes`; the unpickler answers it
    from its own table of the layouts torch has (see ``load_reduce``)."""
    raise pickle.UnpicklingError("a layout is named only through the unpickler")


def plain_key(key: Any) -> bool:
    """A dict key of a kind DCP writes, whose hash runs no code of the pickle's and cannot recurse: a
    string, or a DCP index of a string and a size (its ``index`` hint is no part of its hash)."""
    from torch.distributed.checkpoint.metadata import MetadataIndex

    if type(key) is str:
        return True
    return (type(key) is MetadataIndex and type(key.fqn) is str and type(key.index) in (int, type(None))
            and (key.offset is None or (type(key.offset) is torch.Size)))


def _refusing(what: str) -> Any:
    def op(self: MetadataUnpickler) -> None:
        self.refuse(what)
    return op


def _counted(load: Any) -> Any:
    """``load`` (one opcode's), counted against the budget, on a stack no taller than MAX_STACK."""
    def op(self: MetadataUnpickler) -> None:
        self.ops += 1
        if self.ops & PROGRESS_EVERY == 0 and self.progress is not None:
            self.progress()
        if self.ops > self.budget:
            raise pickle.UnpicklingError(
                f"it takes more than {self.budget:,} unpickling steps, more than DCP's metadata for the "
                f"{self.records:,} records its data files can hold")
        if len(self.stack) > MAX_STACK:
            self.refuse(f"more than {MAX_STACK} items at once")
        load(self)
    return op


class MetadataUnpickler(pickle._Unpickler):  # the Python unpickler: its opcodes can be replaced one by one
    """Unpickles DCP metadata and cannot change anything in the process, in work linear in its length.

    Names resolve only by exact (module, name) pair, as one attribute (pickle's own lookup would
    follow a dotted name from an allowed module to anywhere). A class is called only by REDUCE with
    plain arguments (sizes, paths, the enum, OrderedDict) or created empty by NEWOBJ (the dataclasses);
    BUILD sets only the fields of an instance this unpickler made (never a class's attributes, never
    slot state); SETITEM(S)/APPEND(S) fill only dicts and lists it made; the memo gives back only
    immutable values; any opcode DCP's pickles lack is refused. ``records``: what the checkpoint's data
    files can hold (:func:`records_room`), which sets the budget of opcodes; ``progress``: called as it
    goes (a rank's keepalive: a large genuine file takes a second per MB or so)."""

    dispatch: dict[int, Any] = {}

    def __init__(self, data: bytes, records: int, progress: Callable[[], Any] | None = None) -> None:
        super().__init__(io.BytesIO(data))
        from torch.distributed.checkpoint import metadata

        self.records, self.budget, self.ops, self.progress = records, op_budget(records), 0, progress
        allowed = _classes()
        self._allowed = allowed
        self._globals = {id(v) for v in allowed.values()}
        self._dataclasses = {c for c in allowed.values()
                             if isinstance(c, type) and dataclasses.is_dataclass(c)}
        self._enum = metadata._MEM_FORMAT_ENCODING
        self._layouts = {str(v): v for v in vars(torch).values() if isinstance(v, torch.layout)}
        self._immutable = (str, bytes, int, float, bool, type(None), torch.Size, torch.dtype, torch.layout,
                           self._enum)
        self._made: dict[int, Any] = {}  # id -> instance made by NEWOBJ here (kept: no id is reused)
        # id -> (a dict of 8 keys or more, the hashes of its keys) (the dict kept: no id is reused)
        self._hashes: dict[int, tuple[Any, set[int]]] = {}

    def find_class(self, module: str, name: str) -> Any:
        found = self._allowed.get((module, name))  # a dotted name is never a key
        if found is None:
            raise pickle.UnpicklingError(f"it names {module}.{name}, which is not a DCP metadata class")
        return found

    def refuse(self, what: str) -> None:
        raise pickle.UnpicklingError(f"it uses {what}, which DCP metadata never does")

    def load_mark(self) -> None:
        if len(self.metastack) >= MAX_DEPTH:
            self.refuse(f"marks nested more than {MAX_DEPTH} deep")
        super().load_mark()

    def _memo_get(self, index: int) -> None:
        if index not in self.memo:
            raise pickle.UnpicklingError(f"it gets memo slot {index}, which holds nothing")
        value = self.memo[index]
        if type(value) not in self._immutable and id(value) not in self._globals:
            self.refuse(f"one {type(value).__name__} twice")
        self.append(value)

    def load_binget(self) -> None:
        self._memo_get(self.read(1)[0])

    def load_long_binget(self) -> None:
        self._memo_get(int.from_bytes(self.read(4), "little"))

    def load_reduce(self) -> None:
        args = self.stack.pop()
        func = self.stack[-1]
        if type(args) is not tuple:
            self.refuse("a call without an argument tuple")
        if func is torch.Size:
            ok = len(args) == 1 and type(args[0]) is tuple and all(type(x) is int for x in args[0])
            if ok and len(args[0]) > MAX_DIMS:
                self.refuse(f"a size of more than {MAX_DIMS} dimensions")
        elif func in (pathlib.PosixPath, pathlib.PurePosixPath):
            ok = all(type(a) is str for a in args)
            if ok and sum(len(a) for a in args) > MAX_PATH:
                self.refuse(f"a path of more than {MAX_PATH} characters")
        elif func is self._enum:
            ok = len(args) == 1 and type(args[0]) in (int, str)
        elif func is _get_layout:
            ok = len(args) == 1 and type(args[0]) is str and args[0] in self._layouts
            if ok:
                self.stack[-1] = self._layouts[args[0]]
                return
        elif func is collections.OrderedDict:
            ok = args == ()
        else:
            ok = False
        if not ok:
            self.refuse(f"a call of {getattr(func, '__name__', type(func).__name__)} with other arguments")
        self.stack[-1] = func(*args)

    def load_newobj(self) -> None:
        args = self.stack.pop()
        cls = self.stack.pop()
        self._new(cls, args, {})

    def load_newobj_ex(self) -> None:
        kwargs = self.stack.pop()
        args = self.stack.pop()
        cls = self.stack.pop()
        self._new(cls, args, kwargs)

    def _new(self, cls: Any, args: Any, kwargs: Any) -> None:
        if cls not in self._dataclasses or args != () or kwargs != {}:
            self.refuse(f"a new {getattr(cls, '__name__', type(cls).__name__)} with arguments")
        obj = cls.__new__(cls)
        self._made[id(obj)] = obj
        self.append(obj)

    def load_build(self) -> None:
        from torch.distributed.checkpoint.metadata import TensorProperties

        state = self.stack.pop()
        inst = self.stack[-1]
        if self._made.get(id(inst)) is not inst:
            self.refuse(f"BUILD on a {type(inst).__name__} it did not make")
        if type(inst) is TensorProperties:  # pickled through its own __getstate__: a tuple of five
            if not (type(state) is tuple and len(state) == 5 and type(state[0]) is torch.dtype
                    and type(state[1]) is torch.layout and type(state[2]) is bool
                    and type(state[3]) is self._enum and type(state[4]) is bool):
                self.refuse("BUILD of tensor properties with other state")
            inst.__setstate__(state)
            return
        fields = {f.name for f in dataclasses.fields(inst)}
        if type(state) is not dict or not all(type(k) is str and k in fields for k in state):
            self.refuse(f"BUILD of a {type(inst).__name__} with state other than its fields")
        inst.__dict__.update(state)

    def load_setitem(self) -> None:
        value = self.stack.pop()
        key = self.stack.pop()
        self._setitems(self.stack[-1], [key, value])

    def load_setitems(self) -> None:
        items = self.pop_mark()
        self._setitems(self.stack[-1], items)

    def _setitems(self, target: Any, items: list[Any]) -> None:
        if type(target) not in (dict, collections.OrderedDict):  # and so made here: the memo gives none
            self.refuse(f"SETITEM on a {type(target).__name__}")
        for i in range(0, len(items) - 1, 2):
            key = items[i]
            if not plain_key(key):
                self.refuse(f"a dict key of type {type(key).__name__}")
            h = hash(key)
            _, hashes = self._hashes.get(id(target), (None, None))
            if hashes is None and len(target) >= 8:  # a few keys are compared one by one; more, by a set
                hashes = {hash(k) for k in target}
                self._hashes[id(target)] = (target, hashes)
            if (h in hashes) if hashes is not None else any(hash(k) == h for k in target):
                self.refuse("two keys of one hash in a dict (a repeated key, or keys crafted to collide)")
            if hashes is not None:
                hashes.add(h)
            target[key] = items[i + 1]

    def load_append(self) -> None:
        value = self.stack.pop()
        self._extend(self.stack[-1], [value])

    def load_appends(self) -> None:
        items = self.pop_mark()
        self._extend(self.stack[-1], items)

    def _extend(self, target: Any, items: list[Any]) -> None:
        if type(target) is not list:
            self.refuse(f"APPEND on a {type(target).__name__}")
        target.extend(items)

    _own = {"MARK": load_mark, "BINGET": load_binget, "LONG_BINGET": load_long_binget, "REDUCE": load_reduce,
            "NEWOBJ": load_newobj, "NEWOBJ_EX": load_newobj_ex, "BUILD": load_build,
            "SETITEM": load_setitem, "SETITEMS": load_setitems,
            "APPEND": load_append, "APPENDS": load_appends}
    for _code in range(256):
        _name = _OPCODES.get(_code)
        if _name in _WRITTEN:
            dispatch[_code] = _counted(_own.get(_name) or pickle._Unpickler.dispatch[_code])
        elif _name in ("PERSID", "BINPERSID"):
            dispatch[_code] = _refusing("a persistent id")
        else:
            dispatch[_code] = _refusing(f"opcode {_name or hex(_code)}")
    del _code, _name, _own
