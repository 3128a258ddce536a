"""The state a replica group heals from, as data: a JSON tree and raw tensor bytes, never a pickle.

A state (what torchft's Manager hands its checkpoint transport: the user's state dicts and torchft's own
step) is flattened into a *tree* of JSON values, in which a tensor is ``{"T": i}`` (its bytes are the
``i``-th of the tensors that follow, described in the header's ``tensors`` table by dtype and shape), a
list ``{"L": [...]}``, a tuple ``{"U": [...]}``, a dict ``{"D": [[key, value], ...]}`` (keys: str, int,
float, bool or None); None, bools, ints, floats and strings are themselves. Anything else (a DTensor, a
module, an arbitrary object) is refused when the state is sent.

:func:`decode_header` is the only parser of what a peer sends: it builds nothing but those values and
checks every bound (depth, counts, dtypes, shapes that match their byte counts) before a byte of tensor
data is read. The peer's frames are authenticated (:mod:`.wire`); this is the second line.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

VERSION = 1
MAX_HEADER = 64 << 20       # bytes of the JSON header
MAX_DEPTH = 64
MAX_NODES = 4_000_000       # values in the tree, tensors included
MAX_DIMS = 16
MAX_TENSOR_BYTES = 1 << 40
DTYPES: dict[str, torch.dtype] = {str(d).removeprefix("torch."): d for d in (
    torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.complex64, torch.complex128,
    torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool)}
_NAMES = {d: n for n, d in DTYPES.items()}


class CodecError(ValueError):
    """A state that cannot be carried, or a header that is not one this module writes."""


@dataclass(frozen=True)
class TensorSpec:
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def flatten(state: Any) -> tuple[Any, list[torch.Tensor]]:
    """``state`` as a tree and its tensors (dense, contiguous, on the CPU), in the tree's order."""
    tensors: list[torch.Tensor] = []

    def walk(value: Any, depth: int) -> Any:
        if depth > MAX_DEPTH:
            raise CodecError(f"the state nests deeper than {MAX_DEPTH}")
        if value is None or type(value) in (bool, int, str):
            return value
        if type(value) is float:
            return value if math.isfinite(value) else {"F": repr(value)}
        if isinstance(value, torch.Tensor) and type(value) in (torch.Tensor, torch.nn.Parameter):
            if value.layout != torch.strided or value.dtype not in _NAMES:
                raise CodecError(f"the state holds a {value.layout} tensor of {value.dtype}, which the "
                                 "transport does not carry")
            tensors.append(value.detach().to("cpu").contiguous())
            return {"T": len(tensors) - 1}
        if isinstance(value, dict):
            items = []
            for k, v in value.items():
                if k is not None and type(k) not in (str, int, float, bool):
                    raise CodecError(f"the state has a dict key of type {type(k).__name__}")
                items.append([walk(k, depth + 1), walk(v, depth + 1)])
            return {"D": items}
        if type(value) in (list, tuple) or isinstance(value, torch.Size):
            return {"L" if type(value) is list else "U": [walk(v, depth + 1) for v in value]}
        raise CodecError(f"the state holds a {type(value).__module__}.{type(value).__qualname__}, which the "
                         "transport does not carry (tensors, numbers, strings, lists, tuples and dicts only)")

    return walk(state, 0), tensors


def encode_header(tree: Any, tensors: list[torch.Tensor]) -> bytes:
    table = [[_NAMES[t.dtype], list(t.shape)] for t in tensors]
    return json.dumps({"v": VERSION, "tree": tree, "tensors": table}, separators=(",", ":"),
                      allow_nan=False).encode()


def decode_header(raw: bytes) -> tuple[Any, list[TensorSpec]]:
    """A header's tree and tensor table, checked (see the module's docstring); CodecError if it is not one
    :func:`encode_header` would write."""
    if len(raw) > MAX_HEADER:
        raise CodecError(f"the header is {len(raw)} bytes (at most {MAX_HEADER})")
    try:
        obj = json.loads(raw, parse_constant=_no_constant)
    except (ValueError, RecursionError, UnicodeDecodeError):
        raise CodecError("the header is not JSON") from None
    if not isinstance(obj, dict) or set(obj) != {"v", "tree", "tensors"} or obj["v"] != VERSION:
        raise CodecError("the header is not a state's (version, tree, tensors)")
    table = obj["tensors"]
    if not isinstance(table, list) or len(table) > MAX_NODES:
        raise CodecError("the header's tensor table is not a list of a bounded length")
    specs = [_spec(entry) for entry in table]
    used = [0] * len(specs)
    count = _check(obj["tree"], len(specs), used, 0, [0])
    if count > MAX_NODES:
        raise CodecError(f"the state has more than {MAX_NODES} values")
    if any(n != 1 for n in used):
        raise CodecError("the tree does not name each tensor of its table exactly once")
    return obj["tree"], specs


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _spec(entry: Any) -> TensorSpec:
    if not (isinstance(entry, list) and len(entry) == 2 and type(entry[0]) is str and entry[0] in DTYPES
            and isinstance(entry[1], list) and len(entry[1]) <= MAX_DIMS
            and all(type(n) is int and 0 <= n <= MAX_TENSOR_BYTES for n in entry[1])):
        raise CodecError("a tensor's entry is not [dtype, shape] of a known dtype and a bounded shape")
    spec = TensorSpec(DTYPES[entry[0]], tuple(entry[1]))
    if spec.nbytes > MAX_TENSOR_BYTES:
        raise CodecError(f"a tensor of {spec.nbytes} bytes is over the bound ({MAX_TENSOR_BYTES})")
    return spec


def _check(node: Any, n_tensors: int, used: list[int], depth: int, count: list[int]) -> int:
    """Validate a tree node (iteratively bounded by depth and count); return the values seen so far."""
    count[0] += 1
    if depth > MAX_DEPTH or count[0] > MAX_NODES:
        raise CodecError("the tree nests too deep or holds too many values")
    if node is None or type(node) in (bool, int, float, str):
        return count[0]
    if not isinstance(node, dict) or len(node) != 1:
        raise CodecError("a tree node is not a value or a one-key object")
    [(tag, body)] = node.items()
    if tag == "T":
        if type(body) is not int or not 0 <= body < n_tensors:
            raise CodecError("a tensor node names no tensor of the table")
        used[body] += 1
    elif tag == "F":
        if body not in ("nan", "inf", "-inf"):
            raise CodecError("a float node is not nan, inf or -inf")
    elif tag in ("L", "U"):
        if not isinstance(body, list):
            raise CodecError("a list node does not hold a list")
        for item in body:
            _check(item, n_tensors, used, depth + 1, count)
    elif tag == "D":
        if not isinstance(body, list):
            raise CodecError("a dict node does not hold a list of pairs")
        for pair in body:
            if not (isinstance(pair, list) and len(pair) == 2 and (
                    pair[0] is None or type(pair[0]) in (str, int, float, bool)
                    or (isinstance(pair[0], dict) and set(pair[0]) == {"F"}))):
                raise CodecError("a dict node's entry is not a [plain key, value] pair")
            _check(pair[0], n_tensors, used, depth + 1, count)
            _check(pair[1], n_tensors, used, depth + 1, count)
    else:
        raise CodecError(f"a tree node has an unknown tag {str(tag)[:8]!r}")
    return count[0]


def build(tree: Any, tensors: list[torch.Tensor]) -> Any:
    """The state a checked ``tree`` describes, its tensors taken from ``tensors`` (decode_header's order)."""
    if tree is None or type(tree) in (bool, int, float, str):
        return tree
    [(tag, body)] = tree.items()
    if tag == "T":
        return tensors[body]
    if tag == "F":
        return float(body)
    if tag == "L":
        return [build(v, tensors) for v in body]
    if tag == "U":
        return tuple(build(v, tensors) for v in body)
    return {build(k, tensors): build(v, tensors) for k, v in body}


def _bytes(t: torch.Tensor) -> memoryview:
    """A flat, writable view of a contiguous CPU tensor's bytes."""
    return memoryview(t.reshape(-1).view(torch.uint8).numpy()).cast("B")


def chunks(tensors: list[torch.Tensor], size: int) -> Iterator[memoryview]:
    """The tensors' bytes, in order, in pieces of at most ``size`` bytes."""
    for t in tensors:
        raw = _bytes(t) if t.numel() else memoryview(b"")
        for at in range(0, len(raw), size):
            yield raw[at:at + size]


def empty(spec: TensorSpec) -> tuple[torch.Tensor, memoryview]:
    """A tensor for ``spec`` and a writable view of its bytes (to receive them into)."""
    t = torch.empty(spec.shape, dtype=spec.dtype)
    return t, _bytes(t) if t.numel() else memoryview(bytearray())
