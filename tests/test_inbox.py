"""The ranks' command inbox on filesystems whose timestamps are coarse (Lustre: one second)."""

from __future__ import annotations

import os
import time
from pathlib import Path

from eksft_nb.control import CommandInbox, FaultCommand, submit


def test_a_command_renamed_in_within_the_mtime_tick_is_still_seen(tmp_path: Path) -> None:
    pending, fired = tmp_path / "pending", tmp_path / "fired"
    pending.mkdir()
    fired.mkdir()
    inbox = CommandInbox(pending, fired)
    assert inbox.poll() == []
    tick = os.stat(pending).st_mtime_ns
    command = FaultCommand("exception", rank=1, step=7)
    submit(pending, command)
    deadline = time.monotonic() + 30
    seen: list[FaultCommand] = []
    while not seen and time.monotonic() < deadline:
        os.utime(pending, ns=(tick, tick))  # the folder's mtime did not move: same tick as the last listing
        seen = inbox.poll()
        time.sleep(0.05)
    assert [c.id for c in seen] == [command.id]
    assert inbox.take(seen[0]) and inbox.poll() == []
