"""Bounded, append-only plot data: what keeps a 100k-step dashboard light.

A :class:`Series` holds one plotted quantity as parts, each drawn by its own plotly trace: the
*tail* (the newest points, in full, re-sent on every update) and a few *history* chunks (everything
older). A full tail becomes a new chunk; once every chunk slot is taken, two neighbouring chunks
(the oldest pair of equal coarseness, else the oldest pair) are merged and thinned 2:1, keeping each
bucket's extremes. So recent history stays exact, old history gets coarser, spikes (a throughput
dip, a slow save) survive, and a fold re-sends at most two chunks and the tail, never the whole
history: what an update costs stays bounded however long the job runs.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass
class _Chunk:
    slot: int                    # the history trace that draws it
    level: int                   # how many times it was thinned 2:1
    cols: dict[str, list[Any]]


class Series:
    """Columns of equal length (``x`` first), split into history chunks and a tail.

    ``key`` names the numeric columns whose sum decides which points survive thinning (their
    minimum and maximum per bucket); with no key, evenly spaced points survive. ``join`` starts each
    chunk and the tail with the last point of the part before, so a line has no gap between traces.
    The history holds at most ``budget`` points, in ``budget // (tail + 1)`` chunks (at least 2).
    """

    def __init__(self, columns: Sequence[str], key: Sequence[str] = (), tail: int = 500, budget: int = 3000,
                 join: bool = False) -> None:
        if budget < 8 or tail < 2:
            raise ValueError("budget must be >= 8 and tail >= 2")
        self.columns, self.key = tuple(columns), tuple(key)
        self.tail_limit, self.budget, self.join = tail, budget, join
        self.slots = max(2, budget // (tail + 1))
        self.parts = tuple(f"history{i}" for i in range(self.slots)) + ("tail",)
        self.chunks: list[_Chunk] = []    # in time order
        self.tail: dict[str, list[Any]] = {c: [] for c in self.columns}
        self.appended = 0                 # points ever appended
        self.dirty: set[str] = set()      # parts changed since take_dirty()

    def append(self, *values: Any) -> None:
        for c, v in zip(self.columns, values, strict=True):
            self.tail[c].append(v)
        self.appended += 1
        self.dirty.add("tail")
        if len(self.tail[self.columns[0]]) > self.tail_limit:
            self._fold()

    def take_dirty(self) -> set[str]:
        dirty, self.dirty = self.dirty, set()
        return dirty

    def data(self, part: str) -> dict[str, list[Any]]:
        """The columns one part draws (an unused history slot: empty columns)."""
        if part == "tail":
            return self.tail
        chunk = next((ch for ch in self.chunks if f"history{ch.slot}" == part), None)
        return chunk.cols if chunk else {c: [] for c in self.columns}

    @property
    def history(self) -> dict[str, list[Any]]:
        """The whole history in time order (the points a join repeats, once)."""
        out: dict[str, list[Any]] = {c: [] for c in self.columns}
        for i, ch in enumerate(self.chunks):
            skip = 1 if self.join and i else 0
            for c in self.columns:
                out[c].extend(ch.cols[c][skip:])
        return out

    def _fold(self) -> None:
        """Make the tail a new chunk (keeping its last point as the next tail's start if joined)."""
        if len(self.chunks) == self.slots:
            self._merge_one()
        used = {ch.slot for ch in self.chunks}
        slot = min(s for s in range(self.slots) if s not in used)
        self.chunks.append(_Chunk(slot, 0, self.tail))
        self.tail = {c: [v[-1]] if self.join else [] for c, v in self.tail.items()}
        self.dirty |= {f"history{slot}", "tail"}

    def _merge_one(self) -> None:
        """Merge the oldest neighbours of equal level (else the two oldest chunks), thinned 2:1."""
        levels = [ch.level for ch in self.chunks]
        i = next((i for i in range(len(levels) - 1) if levels[i] == levels[i + 1]), 0)
        a, b = self.chunks[i], self.chunks.pop(i + 1)
        skip = 1 if self.join else 0
        cols = {c: a.cols[c] + b.cols[c][skip:] for c in self.columns}
        n = len(cols[self.columns[0]])
        key = np.sum([np.asarray(cols[k], dtype=np.float64) for k in self.key], axis=0) if self.key else None
        keep = thin_indices(n, self.tail_limit, key)
        a.cols = {c: [v[j] for j in keep] for c, v in cols.items()}
        a.level = max(a.level, b.level) + 1
        self.dirty |= {f"history{a.slot}", f"history{b.slot}"}


def thin_indices(n: int, target: int, key: np.ndarray | None = None) -> list[int]:
    """About ``target`` of ``n`` indices, in order: the first and the last, and in between, per bucket,
    the points where ``key`` is smallest and largest (with no key, evenly spaced points)."""
    if n <= target:
        return list(range(n))
    if key is None or target < 6:
        step = -(-n // max(target - 1, 1))
        idx = list(range(0, n - 1, step))
        return idx + [n - 1]
    key = np.nan_to_num(np.asarray(key, dtype=np.float64))
    edges = np.linspace(1, n - 1, (target - 2) // 2 + 1).astype(np.int64)
    out = [0]
    for lo, hi in zip(edges[:-1], edges[1:]):
        if hi > lo:
            seg = key[lo:hi]
            out.extend(sorted({int(lo) + int(np.argmin(seg)), int(lo) + int(np.argmax(seg))}))
    out.append(n - 1)
    return out


class Throttle:
    """At most one action per ``interval`` seconds: :meth:`delay` says how long to wait before the next."""

    def __init__(self, interval: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.interval, self.clock = interval, clock
        self.last: float | None = None

    def delay(self) -> float:
        if self.last is None:
            return 0.0
        return max(0.0, self.last + self.interval - self.clock())

    def mark(self) -> None:
        self.last = self.clock()
