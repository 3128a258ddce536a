"""SIGTERM as a drain: save, commit, then stop, instead of losing the work since the last commit.

A node drain, a Kueue preemption or the end of a Capacity Block sends SIGTERM (to ft_launcher, which
passes it to its ranks and waits ``--term-timeout`` before SIGKILL; the kubelet waits the pod's
``terminationGracePeriodSeconds``; both are the grace period of :mod:`eksft_nb.timeouts`). The
handler only records the request: the built-in trainer learns at its next step boundary whether any
rank has one (in the all-reduce it makes there anyway), so every rank saves the same step, commits
it and ends with a ``drain`` event. A rank that fails while draining (a peer is gone: the SIGTERM
was the launcher stopping its workers for a restart) dies of the signal at once, as it would have.
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any


class Drain:
    """The SIGTERM handler of a rank process (install it from the main thread)."""

    def __init__(self) -> None:
        self.requested_at: float | None = None

    def install(self) -> Drain:
        signal.signal(signal.SIGTERM, self._on_signal)
        return self

    def _on_signal(self, signum: int, frame: Any) -> None:
        if self.requested_at is None:
            self.requested_at = time.time()

    @property
    def requested(self) -> bool:
        return self.requested_at is not None

    def is_handler(self) -> bool:
        return signal.getsignal(signal.SIGTERM) == self._on_signal

    def die_if_requested(self) -> None:
        """End the process by SIGTERM's default action if a drain was asked for (it cannot finish)."""
        if self.requested:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)
