"""Live settings on the ranks: every rank takes a change at the same step.

Rank 0 alone reads the request (``control/settings.json``, see :mod:`eksft_nb.settings`) and puts its
sequence number and values in the all-reduce the trainer makes at every step boundary; the other
ranks put zeros there, so every rank reads rank 0's proposal from the same sum and applies it before
that step's "save now?". Nothing depends on a rank's own clock or on when it saw the file.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from typing import Any

from ..errors import ControlError
from ..jobdir import JobDir
from ..settings import LIVE, in_force, of_spec, read_record, request_path, write_effective
from ..spec import JobSpec

RELIST_S = 1.0  # the request is re-read at least this often (coarse file timestamps, see CommandInbox)


class LiveSettings:
    """The settings in force on one rank; built at each (re)start from the effective record."""

    def __init__(
        self,
        jd: JobDir | None,
        spec: JobSpec,
        rank: int,
        emit: Callable[..., Any],
        warn: Callable[[str, str], Any],
    ) -> None:
        self.jd, self.rank, self.emit, self.warn = jd, rank, emit, warn
        self.seq, self.values = 0, of_spec(spec)
        if jd is not None:
            try:
                self.seq, self.values, _ = in_force(jd, spec)
            except (OSError, ControlError) as e:  # the spec's values, said
                warn(
                    "settings",
                    f"the live settings record cannot be read ({e}); the spec's settings are in force",
                )
        self._proposed = (self.seq, dict(self.values))
        self._seen: tuple[int, int] | None = None
        self._read_at = -float("inf")

    def proposal(self) -> list[float]:
        """This rank's part of the step's all-reduce: [seq, value...] on rank 0, zeros elsewhere."""
        if self.rank != 0:
            return [0.0] * (1 + len(LIVE))
        self._poll()
        seq, values = self._proposed
        return [float(seq), *(float(values[name]) for name in LIVE)]

    def _poll(self) -> None:
        """Read the request when it changed (or :data:`RELIST_S` passed); a newer one is proposed."""
        if self.jd is None:
            return
        path = request_path(self.jd)
        try:
            st = os.stat(path)
        except OSError:
            return
        now = time.monotonic()
        if (st.st_mtime_ns, st.st_size) == self._seen and now - self._read_at < RELIST_S:
            return
        self._seen, self._read_at = (st.st_mtime_ns, st.st_size), now
        try:
            record = read_record(path)
        except (OSError, ControlError) as e:
            self.warn("settings-request", f"a live settings request was refused: {e}")
            return
        if record is not None and record["seq"] > self._proposed[0]:
            self._proposed = (record["seq"], {**self.values, **record["values"]})

    def agree(self, reduced: Sequence[float], step: int) -> dict[str, list[int]] | None:
        """Take rank 0's proposal from the reduced values at ``step``; the changes, when there are any."""
        seq = round(reduced[0])
        if seq == self.seq:
            return None
        new = {name: round(v) for name, v in zip(LIVE, reduced[1:])}
        changes = {name: [self.values[name], new[name]] for name in LIVE if self.values[name] != new[name]}
        self.seq, self.values = seq, new
        self._proposed = (seq, dict(new))
        if self.rank == 0 and self.jd is not None:
            try:
                write_effective(self.jd, seq, new, step)
            except OSError as e:
                self.warn(
                    "settings-record",
                    f"the live settings cannot be recorded ({e.strerror or e}): they "
                    "hold until the next restart, which starts with the ones recorded before",
                )
        self.emit("setting", seq=seq, step=step, changes=changes, values=new)
        return changes
