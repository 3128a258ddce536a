"""A slow save is progress, not a hang: NVRx's in-process soft timeout counts from the save's end, not
from the step before it (bench part 7, loaded: a soft timeout right after a save step, no fault
injected). A write stuck past the soft timeout is still one."""

from __future__ import annotations

from eksft_nb.control import FaultCommand
from eksft_nb.job import launch
from eksft_nb.spec import JobSpec
from eksft_nb.states import JobState
from jobs import events, story

SOFT_S = 6.0
SLOW_S = 3.6   # a save's write, then the next step: each well within the soft timeout, together past it


def test_a_slow_save_then_a_slow_step_is_not_a_hang() -> None:
    spec = JobSpec(name="slow-save").replace(**{
        "model.preset": "tiny", "steps": 20, "checkpoint.every": 8, "checkpoint.mode": "sync", "seed": 0,
        "ft.soft_timeout": SOFT_S, "ft.hard_timeout": 2 * SOFT_S, "ft.collective_timeout": 1.5 * SOFT_S})
    # from step 10: rank 0's writes start SLOW_S late (the save at 16); steps 16 and 17 sleep SLOW_S first
    # (a slow step, the slow save, then the slow step after it); rank 1 waits that long for it in a
    # collective, within its timeout. The slow steps before 16 would only repeat step 16's case.
    faults = [FaultCommand("slow-storage", rank=0, step=10, params={"delay": SLOW_S, "duration": 8}),
              FaultCommand("slow-rank", rank=0, step=16, params={"delay": SLOW_S, "duration": 2})]
    job = launch(spec, faults)
    try:
        state = job.wait(timeout=900)
    finally:
        if not job.state.ended:
            job.stop()
    assert state == JobState.SUCCEEDED, story("slow-save")
    fired = [(e["fault"], e["at_step"]) for e in events("slow-save", "fault")]
    assert sorted(fired) == [("slow-rank", 16), ("slow-storage", 10)], fired
    saves = [e for e in events("slow-save", "checkpoint") if e["phase"] == "committed"]
    # the save at 16 blocked for the slow write: slow, yet no failure and no restart
    [slow] = [e for e in saves if e["step"] == 16]
    assert slow["blocked_s"] >= SLOW_S
    assert events("slow-save", "failure") == [] and events("slow-save", "restart") == [], story("slow-save")
    assert [e["step"] for e in saves] == [8, 16, 20]
