"""Tests' holds on a replica group's rank, so that a test forces each outcome of a race (which group reaches
the next quorum first) instead of accepting either.

With ``EKSFT_TEST_HOLD`` naming a folder, a rank waits while a file of that folder names the point it is at:
``rank-R.step-S`` before it begins step S (at the top of its training loop, its last step ended: it does
not read as hung), ``rank-R.restart-N`` before the N-th restart of its group sets up (no Manager yet, so the
Lighthouse does not count it). The test removes the file to let it go. Unset, as in every real job, a point
costs one look at the environment.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

HOLD_ENV = "EKSFT_TEST_HOLD"
POLL_S = 0.05


def step_point(rank: int, step: int) -> str:
    return f"rank-{rank}.step-{step}"


def restart_point(rank: int, restart: int) -> str:
    return f"rank-{rank}.restart-{restart}"


def hold(point: str) -> None:
    """Wait while the test's hold folder holds ``point``."""
    folder = os.environ.get(HOLD_ENV)
    if not folder:
        return
    path = Path(folder) / point
    while path.exists():
        time.sleep(POLL_S)
