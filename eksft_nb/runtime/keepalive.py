"""Liveness for a rank while it does long I/O: a thread that beats for it, within a budget.

A restore of a large model reads every file twice (hash, then load) at the storage's throughput:
minutes on FSx. The rank sends no heartbeat and no in-process ``ping`` meanwhile, so ft_launcher's
heartbeat timeout and the in-process soft/hard timeouts would take it for a hang and restart it,
again and again. The thread beats for it while the body runs, but only for ``budget`` seconds: a
load that never ends is still a hang, caught once the beats stop and the timeouts run out.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any


@contextlib.contextmanager
def keepalive(beat: Callable[[], Any], *, budget: float, interval: float = 1.0,
              on_overrun: Callable[[float], Any] | None = None) -> Iterator[None]:
    """Call ``beat()`` every ``interval`` seconds from a daemon thread while the body runs, for at
    most ``budget`` seconds; then stop beating and call ``on_overrun(budget)`` once. ``beat`` must be
    safe to call from another thread (see ``MonitorLink.beat``); an exception in it ends the beats."""
    done = threading.Event()

    def run() -> None:
        deadline = time.monotonic() + budget
        while not done.wait(interval):
            if time.monotonic() >= deadline:
                if on_overrun is not None:
                    on_overrun(budget)
                return
            try:
                beat()
            except Exception:  # noqa: BLE001 - a closed monitor link: the rank's own code will fail and say so
                return

    thread = threading.Thread(target=run, name="eksft-keepalive", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()
