"""Storage that fails: event writes on a full disk, and the disk-full / slow-storage fault commands."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from eksft_nb.control import FAULTS, FaultCommand, parse_fault
from eksft_nb.errors import ControlError
from eksft_nb.events import EventWriter, read_all


def _step(w: EventWriter, step: int) -> None:
    w.emit("step", step=step, loss=1.0, tokens=8, step_time=0.1)


def test_a_full_disk_drops_events_without_stopping_training_and_says_how_many(tmp_path: Path, capfd) -> None:
    path = tmp_path / "events.jsonl"
    w = EventWriter(path, "job", rank=0)
    _step(w, 1)
    back = os.dup(w._fd)
    full = os.open("/dev/full", os.O_WRONLY)
    os.dup2(full, w._fd)  # the disk is full: every write of the events file fails with the kernel's ENOSPC
    for step in (2, 3, 4):
        _step(w, step)  # never raises: telemetry must not kill training
    os.dup2(back, w._fd)  # room again
    _step(w, 5)
    w.close()
    os.close(full)
    os.close(back)
    evs = read_all(path)
    assert [(e.kind, e.get("step")) for e in evs] == [("step", 1), ("events_lost", None), ("step", 5)]
    lost = evs[1]
    assert lost["count"] == 3 and "No space left" in lost["error"]
    assert evs[0].t <= lost["first_t"] <= lost["last_t"] <= evs[2].t
    assert capfd.readouterr().err.count("cannot write events") == 1  # warned once, not per event


def test_events_lost_until_the_end_are_reported_at_close(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    w = EventWriter(path, "job", rank=1)
    w.divert("/dev/full")
    _step(w, 1)
    _step(w, 2)
    w.divert(None)
    w.close()
    [lost] = read_all(path)
    assert lost.kind == "events_lost" and lost["count"] == 2 and lost.rank == 1


def test_storage_faults_are_fault_kinds_with_checked_parameters() -> None:
    assert FAULTS["disk-full"][0] == FAULTS["slow-storage"][0] == "rank"
    full = parse_fault("disk-full:1@20").validate(world_size=2, nnodes=1)
    assert (full.rank, full.step, full.params) == (1, 20, {"duration": 10})
    slow = FaultCommand("slow-storage", rank=0, params={"delay": 0.5}).validate(2, 1)
    assert slow.params == {"delay": 0.5, "duration": 10}
    for params in ({"duration": 0}, {"duration": "x"}, {"duration": True}, {"delay": -1}, {"delay": "slow"},
                   {"delay": 10**9}):
        with pytest.raises(ControlError, match="slow-storage parameter (duration|delay) is"):
            FaultCommand("slow-storage", rank=0, params=dict(params)).validate(2, 1)
    with pytest.raises(ControlError, match="out of range"):
        FaultCommand("disk-full", rank=5).validate(2, 1)


def test_the_dashboard_and_the_cli_offer_the_storage_faults(capsys) -> None:
    from eksft_nb.cli import main
    from eksft_nb.dashboard.parts import FaultControls

    controls = FaultControls(world_size=2)
    controls.fault.value, controls.target.value, controls.when.value = "disk-full", 1, "step 30"
    command = controls.command()
    assert command == {"fault": "disk-full", "rank": 1, "step": 30, "after": None}
    assert FaultCommand(**command).validate(2, 1).params == {"duration": 10}
    assert "slow-storage" in controls.fault.options and "disk-full" in controls.fault.options
    with pytest.raises(SystemExit):
        main(["inject", "--help"])
    assert "disk-full" in "".join(capsys.readouterr().out.split())  # however the help is wrapped
