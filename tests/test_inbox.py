"""The ranks' command inbox on filesystems whose timestamps are coarse (Lustre: one second)."""

from __future__ import annotations

import os
import threading
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


def test_a_fifo_or_a_link_named_like_a_command_is_set_aside_without_blocking(tmp_path: Path) -> None:
    """A FIFO in ``control/pending`` would block a rank that opened it (until someone writes), a link
    would read a file from elsewhere: both are refused at once, with the reason, and set aside once;
    a genuine command beside them is still seen."""
    from eksft_nb.control import reject

    pending, fired = tmp_path / "pending", tmp_path / "fired"
    pending.mkdir()
    fired.mkdir()
    os.mkfifo(pending / "fifo.json")
    elsewhere = tmp_path / "elsewhere.json"
    elsewhere.write_text(FaultCommand("exception", rank=0, step=3, id="link").to_json())
    (pending / "link.json").symlink_to(elsewhere)
    command = FaultCommand("exception", rank=1, step=7)
    submit(pending, command)
    inbox = CommandInbox(pending, fired)
    result: list[list[FaultCommand]] = []
    poller = threading.Thread(target=lambda: result.append(inbox.poll()), daemon=True)
    poller.start()
    poller.join(timeout=60)
    if poller.is_alive():   # on a blocking open: let it go before failing
        os.close(os.open(pending / "fifo.json", os.O_WRONLY | os.O_NONBLOCK))
        poller.join(timeout=60)
        raise AssertionError("the rank's poll blocked on a FIFO in control/pending")
    assert [c.id for c in result[0]] == [command.id]
    assert "not a regular file" in inbox.rejected["fifo"] and "cannot be opened" in inbox.rejected["link"]
    for cid, why in inbox.rejected.items():
        assert reject(pending, fired, cid, why)
    assert sorted(p.name for p in (tmp_path / "rejected").iterdir()) == \
        ["fifo.json", "fifo.reason", "link.json", "link.reason"]
