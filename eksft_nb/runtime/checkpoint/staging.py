"""Staging: an async save first copies the state into shared-memory buffers, allocated once and reused.

Training never races the writer: on CPU a "copy to host" is a no-op, so without staging the writer
would read parameters that the next optimizer step is already changing.
"""

from __future__ import annotations

import pickle
import time
from collections.abc import Callable
from typing import Any

import torch

from .. import memcopy


class Stager:
    """Copies a state dict into shared-memory buffers that are allocated on first use and reused.

    Each buffer lives in a named shared-memory file of its own, a storage of its own (see
    :mod:`.memcopy`): once a save of them commits, they are the newest in-memory copy of the
    checkpoint, which a restart of the rank (in the same process or the next one on the node)
    restores from instead of storage."""

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}
        # the staged DTensors, kept with their buffers (no new wrapper per save)
        self._dtensors: dict[str, Any] = {}
        self._values: dict[str, Any] = {}   # the plain values of the last staging, for the copy's record
        self._described: Callable[[], dict[str, Any]] | None = None  # the last staging's layout, to describe
        self._wanted: dict[str, tuple[torch.Size, torch.dtype]] = {}
        self._fits = True
        self.bytes = 0
        self.staged_bytes = 0
        self.copy_s = 0.0   # the last staging's copies alone: the state over the machine's copy bandwidth
        self.shelf = memcopy.Shelf()

    def stage(self, state: Any) -> Any:
        """The staged copy of ``state``; ``staged_bytes`` is then the size of its tensors."""
        self.shelf.begin()  # the buffers change now: the copy they held is gone
        staged = self._walk(state)
        if staged is None:  # the first save, or the state changed shape: lay the buffers out anew
            self._allocate()
            staged = self._walk(state)
        buffers, dtensors, values = self._buffers, dict(self._dtensors), self._values
        self._described = lambda: _describe(buffers, dtensors, values)
        return staged

    def checksum(self) -> None:
        """Sum the staged buffers for the in-memory copy's record, in the background. Called once the
        save no longer blocks training: the summing thread's own Python (the layout it describes)
        would hold the GIL the training thread needs to finish the save's hand-over."""
        if self._described is not None:
            self.shelf.staged(self._described)

    def _walk(self, state: Any) -> Any:
        """Stage ``state`` into the buffers; None if they do not fit it (``_wanted`` says what would)."""
        self.staged_bytes, self.copy_s, self._fits, self._wanted, self._values = 0, 0.0, True, {}, {}
        staged = self._stage(state, "")
        return staged if self._fits and self._wanted.keys() == self._buffers.keys() else None

    def _allocate(self) -> None:
        self._buffers = self.shelf.allocate(self._wanted)
        self._dtensors = {}

    def _stage(self, state: Any, prefix: str) -> Any:
        from torch.distributed.tensor import DTensor

        if _is_stateful(state):
            return self._stage(state.state_dict(), prefix)
        if isinstance(state, dict):
            return {k: self._stage(v, f"{prefix}/{k}") for k, v in state.items()}
        if isinstance(state, list):
            return [self._stage(v, f"{prefix}/{i}") for i, v in enumerate(state)]
        if isinstance(state, DTensor):
            buf = self._copy(prefix, state._local_tensor)
            if buf is None:
                return state
            staged = self._dtensors.get(prefix)
            if staged is None or staged._local_tensor is not buf or staged._spec != state._spec:
                staged = self._dtensors[prefix] = DTensor(buf, state._spec, requires_grad=False)
            return staged
        if isinstance(state, torch.Tensor):
            return self._copy(prefix, state)
        if type(state) in (str, int, float, bool, bytes, type(None)):  # immutable: nothing to copy
            self._values[prefix] = state
            return state
        self._values[prefix] = copy = pickle.loads(pickle.dumps(state))  # other plain values: a private copy
        return copy

    def _copy(self, key: str, src: torch.Tensor) -> torch.Tensor | None:
        self._wanted[key] = (src.shape, src.dtype)
        buf = self._buffers.get(key)
        if buf is None or buf.shape != src.shape or buf.dtype != src.dtype:
            self._fits = False
            return None
        t0 = time.perf_counter()
        buf.copy_(src.detach())
        self.copy_s += time.perf_counter() - t0
        self.staged_bytes += buf.numel() * buf.element_size()
        return buf

    def total_bytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._buffers.values())


def _describe(buffers: dict[str, torch.Tensor], dtensors: dict[str, Any],
              values: dict[str, Any]) -> dict[str, Any]:
    """The layout of a staged state, for the in-memory copy's record (run in the background; the
    shelf adds each buffer's file and checksums)."""
    entries = [{"key": key, "dtype": str(buf.dtype).removeprefix("torch."), "shape": list(buf.shape),
                "nbytes": buf.numel() * buf.element_size(),
                "dtensor": memcopy.dtensor_layout(dtensors[key]) if key in dtensors else None}
               for key, buf in buffers.items()]
    return {"entries": entries, "values": {key: memcopy.encode_value(v) for key, v in values.items()}}


def _is_stateful(obj: Any) -> bool:
    return callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))
