"""Who a torchft job's servers refused, said as ``intruder`` events, without letting a flood of refused
connections flood the job's events.

A refusal is reported once per place, peer host and kind (what the peer did, as the reason begins) every
:data:`REPEAT_S` seconds (the count of those held back goes with the next report), and at most
:data:`MAX_REPORTS` times per process; each also goes to the process's log (stderr) on the same terms."""

from __future__ import annotations

import json
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPEAT_S = 30.0
MAX_REPORTS = 50
KIND_CHARS = 60   # how much of a reason tells one kind of refusal from another (an HTTP request's line...)


class Alarm:
    def __init__(self, emit: Callable[..., Any] | None) -> None:
        self.emit = emit
        self._lock = threading.Lock()
        self._last: dict[tuple[str, str, str], float] = {}
        self._held: dict[tuple[str, str, str], int] = {}
        self.reports = 0

    @classmethod
    def for_job(cls, folder: Path | None) -> Alarm:
        """An alarm that appends to the events of the job in ``folder`` (None: to the log only)."""
        if folder is None:
            return cls(None)
        from ...events import EventWriter

        try:
            name = json.loads((folder / "spec.json").read_text())["name"]
            writer = EventWriter(folder / "events.jsonl", str(name), rank=None)
        except (OSError, ValueError, KeyError, TypeError):
            return cls(None)
        return cls(writer.emit)

    def reporter(self, where: str) -> Callable[[str, str], None]:
        """What a :class:`~.wire.Server` calls with (peer, reason) for each peer it refused."""
        return lambda peer, reason: self.refused(where, peer, reason)

    def refused(self, where: str, peer: str, reason: str, claimed: str | None = None) -> None:
        """Report that ``peer`` (host:port) was refused at ``where``
        (:data:`~eksft_nb.events.INTRUDER_PLACES`) for ``reason``; ``claimed``: the replica id it gave."""
        host = peer.rsplit(":", 1)[0]
        now = time.monotonic()
        with self._lock:
            key = (where, host, reason[:KIND_CHARS])
            if self.reports >= MAX_REPORTS or now - self._last.get(key, -REPEAT_S) < REPEAT_S:
                self._held[key] = self._held.get(key, 0) + 1
                return
            self._last[key], held = now, self._held.pop(key, 0)
            self.reports += 1
            last = self.reports == MAX_REPORTS
        more = f" ({held} more from {host} since the last report)" if held else ""
        line = f"refused {peer} at the {where}: {reason}{more}"
        if last:
            line += f"; this was the last of {MAX_REPORTS} reports: later refusals are not reported"
        print(f"eksft: {line}", file=sys.stderr, flush=True)
        if self.emit is not None:
            self.emit("intruder", where=where, peer=peer[:100], reason=(reason + more)[:400],
                      claimed=None if claimed is None else claimed[:200])
