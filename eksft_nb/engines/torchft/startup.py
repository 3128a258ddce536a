"""At a torchft job's start, every replica group waits for the others before its first quorum.

The Lighthouse forms a quorum of the groups whose managers heartbeat: without this wait the first group up
would train alone from step 0 and the others heal from it, skipping batches for a slow start. Used by the
built-in trainer and by a user's script (after its Manager exists, so it heartbeats meanwhile)."""

from __future__ import annotations

import os
import time
from typing import Any

START_WAIT_S = 120  # at the job's start, for every group to be up


def all_groups_up(s: Any, group: int) -> None:
    """Mark replica group ``group`` up in the job folder and wait until every group is (``s``: the rank's
    session); after :data:`START_WAIT_S`, warn and go on (the late ones heal from a peer when they join)."""
    folder = s.job_dir.path / "torchft" / f"attempt-{s.info.job_attempt}"  # a job restart waits anew
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"up-{group}").touch()
    groups = int(os.environ["NUM_REPLICA_GROUPS"])
    deadline = time.monotonic() + START_WAIT_S
    while sum((folder / f"up-{g}").exists() for g in range(groups)) < groups:
        if time.monotonic() > deadline:
            s.warn(
                "slow-start",
                f"not every replica group was up after {START_WAIT_S} s: the first "
                "quorum forms without the late ones, which heal from a peer when they join",
            )
            return
        s.heartbeat()
        time.sleep(0.1)
