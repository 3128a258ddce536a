"""Bounded, append-only plot data: what keeps a 100k-step dashboard light.

A :class:`Series` holds one plotted quantity as two parts, each drawn by its own plotly trace:
the *tail* (the newest points, in full, re-sent on every update) and the *history* (everything
older, re-sent only when a full tail is folded into it). Once the history holds more than
``budget`` points its older half is thinned 2:1, keeping each bucket's extremes, so recent
history stays exact, old history gets coarser, and spikes (a throughput dip, a slow save) survive.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np


class Series:
    """Columns of equal length (``x`` first), split into history and tail.

    ``key`` names the numeric columns whose sum decides which points survive thinning (their
    minimum and maximum per bucket); with no key, evenly spaced points survive. ``join`` repeats the
    last history point at the start of the tail so a line has no gap between the two traces.
    """

    def __init__(self, columns: Sequence[str], key: Sequence[str] = (), tail: int = 500, budget: int = 3000,
                 join: bool = False) -> None:
        if budget < 8 or tail < 2:
            raise ValueError("budget must be >= 8 and tail >= 2")
        self.columns, self.key, self.tail_limit, self.budget, self.join = tuple(columns), tuple(key), tail, budget, join
        self.history: dict[str, list[Any]] = {c: [] for c in self.columns}
        self.tail: dict[str, list[Any]] = {c: [] for c in self.columns}
        self.appended = 0                 # points ever appended
        self.dirty: set[str] = set()      # parts changed since take_dirty(): "tail", "history"

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

    def _fold(self) -> None:
        """Move the tail into the history (keeping its last point as the next tail's start if joined)."""
        start = 1 if self.join and self.history[self.columns[0]] else 0
        for c in self.columns:
            self.history[c].extend(self.tail[c][start:])
            self.tail[c] = [self.tail[c][-1]] if self.join else []
        while len(self.history[self.columns[0]]) > self.budget:
            self._thin_older_half()
        self.dirty |= {"history", "tail"}

    def _thin_older_half(self) -> None:
        n = len(self.history[self.columns[0]])
        half = n // 2
        keep = thin_indices(half, half // 2, self._key(half))
        for c in self.columns:
            col = self.history[c]
            self.history[c] = [col[i] for i in keep] + col[half:]

    def _key(self, n: int) -> np.ndarray | None:
        """The thinning key of the first ``n`` history points (None: no key)."""
        if not self.key:
            return None
        return np.sum([np.asarray(self.history[k][:n], dtype=np.float64) for k in self.key], axis=0)


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
