"""Tests' holds on a rank (a torchft replica group's, or the built-in NVRx trainer's), so that a test forces
each outcome of a race (which group reaches the next quorum first, which ranks a drain's step counts)
instead of accepting either.

With ``EKSFT_TEST_HOLD`` naming a folder, a rank waits while a file of that folder names the point it is at:
``rank-R.step-S`` before it begins step S (at the top of its training loop, its last step ended: it does
not read as hung), ``rank-R.restart-N`` before the N-th restart of its group sets up (no Manager yet, so the
Lighthouse does not count it). The test removes the file to let it go. Unset, as in every real job, a point
costs one look at the environment.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path

HOLD_ENV = "EKSFT_TEST_HOLD"
POLL_S = 0.05
BEAT_S = 1.0


def step_point(rank: int, step: int) -> str:
    return f"rank-{rank}.step-{step}"


def restart_point(rank: int, restart: int) -> str:
    return f"rank-{rank}.restart-{restart}"


def hold(point: str, beat: Callable[[], object] | None = None) -> None:
    """Wait while the test's hold folder holds ``point``; ``beat``: the rank's liveness, given every
    :data:`BEAT_S` meanwhile (the NVRx trainer's heartbeat and in-process ping: held is not hung)."""
    folder = os.environ.get(HOLD_ENV)
    if not folder:
        return
    path, beaten = Path(folder) / point, time.monotonic()
    while path.exists():
        time.sleep(POLL_S)
        if beat is not None and time.monotonic() - beaten >= BEAT_S:
            beat()
            beaten = time.monotonic()
