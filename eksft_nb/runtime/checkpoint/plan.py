"""The save plan: DCP's plan and NVRx's write buckets, made once and kept while the staged layout stays.

A kept plan lets later saves run no collective and hand the writer process only their folder and
plain values. The writer process keeps the plan it was sent (see :class:`ShardWrite`).
"""

from __future__ import annotations

import io
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch


def save_planner() -> Any:
    """DCP's default save planner, less a per-tensor cost: a staged DTensor's shard is its local
    tensor, taken as it is instead of through ``to_local()`` (an autograd call per tensor per save)."""
    from torch.distributed.checkpoint import DefaultSavePlanner
    from torch.distributed.tensor import DTensor

    class Planner(DefaultSavePlanner):
        def lookup_object(self, index: Any) -> Any:
            obj = self.state_dict.get(index.fqn)
            if isinstance(obj, DTensor) and type(obj._local_tensor) is torch.Tensor and not any(
                    p.is_partial() for p in obj.placements):
                return obj._local_tensor
            return super().lookup_object(index)

    return Planner()


def layout(staged: Any) -> tuple:
    """What a save plan depends on in the staged state: its nesting, keys and value types, and the
    identity of every staged tensor (the stager's reused buffers and DTensors, which it replaces when
    a shape, dtype or sharding changes). Plain values may change from save to save without changing
    the plan: they are serialized anew every save."""
    out: list[Any] = []

    def walk(o: Any) -> None:
        if isinstance(o, dict):
            out.append(("{", len(o)))
            for k, v in o.items():
                out.append(("k", k))
                walk(v)
        elif isinstance(o, list):
            out.append(("[", len(o)))
            for v in o:
                walk(v)
        elif isinstance(o, torch.Tensor):  # a reshaped or retyped buffer, a new spec: new objects (Stager)
            out.append((id(o), id(getattr(o, "_local_tensor", o))))
        else:
            out.append(type(o))
    walk(staged)
    return tuple(out)


@dataclass
class PlanCache:
    """A save plan kept while the staged state keeps its :func:`layout` on every rank: the DCP
    metadata (rank 0), this rank's files and the write items in each. A save with it hot skips DCP's
    flattening and planning and NVRx's write buckets, and hands the writer process only its folder
    and plain values: the writer keeps the plan, buffers included, under ``key``."""

    layout: tuple
    staged: Any  # holds the staged objects, so that no id in ``layout`` is reused while the plan is kept
    metadata: Any
    # name, bytes items and where, tensor items
    files: list[tuple[str, list[tuple[Any, tuple]], list[tuple[Any, torch.Tensor]]]]
    write_fn: Any
    key: str
    reused: int = 0

    @classmethod
    def of(cls, layout: tuple, staged: Any, writer: Any, planner: Any, metadata: Any,
           key: str) -> PlanCache | None:
        """The plan DCP and NVRx just made, to keep; None where it cannot be kept (another NVRx
        release's bucket format, or a write item that is not one of the staged buffers)."""
        buckets = getattr(writer, "write_buckets", None)
        if not isinstance(buckets, list) or not buckets:
            return None
        buffers = {getattr(t, "_local_tensor", t).data_ptr() for t in _tensors(staged)}
        files = []
        for _, name, (bytes_data, tensor_data) in buckets:
            # a copy, not a view of a staged buffer
            if any(t.data_ptr() not in buffers for _, t in tensor_data):
                return None
            where = [(item,
                      planner.mappings[item.index.fqn] if planner.flatten_state_dict else (item.index.fqn,))
                     for item, _ in bytes_data]
            files.append((name, where, list(tensor_data)))
        return cls(layout, staged, metadata, files, writer.get_save_function_and_args()[0], key)

    def write(self, staged: Any, path: Path, send_plan: bool) -> ShardWrite:
        """This save's part for the writer: its folder and the plain values (the writer serializes
        them), with the plan itself only if this writer process has not got it yet."""
        values = [[_element(staged, where) for _, where in bytes_items] for _, bytes_items, _ in self.files]
        plan = (self.write_fn,
                [(name, [item for item, _ in b], t) for name, b, t in self.files]) if send_plan else None
        return ShardWrite(self.key, plan, str(path), values)


def _tensors(o: Any) -> list[torch.Tensor]:
    if isinstance(o, dict):
        return [t for v in o.values() for t in _tensors(v)]
    if isinstance(o, list):
        return [t for v in o for t in _tensors(v)]
    return [o] if isinstance(o, torch.Tensor) else []


def _element(o: Any, where: tuple) -> Any:
    for k in where:
        o = o[k]
    return o


class _Held:
    """The plan the writer process was last sent, kept there for the saves that follow. The writer
    process's only state: NVRx's persistent loop hands a request no context of its own, so it lives
    with the process (this module as the writer imports it); the training process never sets it."""

    plan: tuple[str, Any] | None = None


class ShardWrite:
    """One save's write as the writer process gets it (see :meth:`PlanCache.write`)."""

    def __init__(self, key: str, plan: Any, directory: str, values: list[list[Any]]) -> None:
        self.key, self.plan, self.directory, self.values = key, plan, directory, values

    def resolve(self) -> tuple[Any, list[Any]]:
        """In the writer process: NVRx's write function and write buckets for this save."""
        if self.plan is not None:
            _Held.plan = (self.key, self.plan)
        if _Held.plan is None or _Held.plan[0] != self.key:
            raise RuntimeError("the checkpoint writer does not hold this save's plan")
        write_fn, files = _Held.plan[1]
        buckets = []
        for (name, bytes_items, tensor_data), values in zip(files, self.values):
            blobs = []
            for item, value in zip(bytes_items, values):
                blob = io.BytesIO()
                torch.save(value, blob)  # what DCP's planner does on the training thread
                blob.seek(0)
                blobs.append((item, blob))
            buckets.append((os.path.join(self.directory, name), name, (blobs, tensor_data)))
        return write_fn, buckets
