"""Goodput and ETTR on synthetic event streams: the breakdown, the checkpoint interference split
out of productive time, useful steps after a rollback."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from eksft_nb.events import Event, make
from eksft_nb.goodput import compute, ettr, missing_batches, steps_per_s, useful_steps
from eksft_nb.monitor import JobMonitor

CLEAN = 0.1  # the step time of a step that overlaps no background write


def _job(step_times: list[tuple[int, float]], saves: list[tuple[int, int, str]]) -> tuple[JobMonitor, float]:
    """A job whose steps run back to back from t=1 (``(step, seconds)`` in order) and whose saves
    ``(after step, steps the write overlaps, mode)`` are staged at the end of a step and written
    while the next steps run; returns the monitor and the end of the last step."""
    events: list[Event] = [make("job_start", "j", None, t=0.0, spec_digest="d", world_size=1, steps=None,
                                backend="local", host="h", pid=1)]
    ends: list[float] = []
    t = 1.0
    for step, seconds in step_times:
        t += seconds
        ends.append(t)
        events.append(make("step", "j", 0, t=t, step=step, loss=None, tokens=None, step_time=seconds))
    for after, overlap, mode in saves:
        staged = ends[after - 1]
        done = ends[min(after + overlap, len(ends)) - 1] - CLEAN / 2 if mode == "async" else staged
        events += [make("checkpoint", "j", 0, t=staged, phase="begin", step=after, mode=mode),
                   make("checkpoint", "j", 0, t=staged, phase="staged", step=after, blocked_s=0.0),
                   make("checkpoint", "j", 0, t=done, phase="committed", step=after, blocked_s=0.0,
                        background_s=done - staged)]
    mon = JobMonitor()
    mon.update(sorted(events, key=lambda e: e.t))
    return mon, t


@settings(max_examples=150, deadline=None)
@given(st.integers(4, 60), st.data())
def test_steps_slowed_by_a_background_write_count_as_interference_not_productive(
    n: int, data: st.DataObject) -> None:
    """Each async write overlaps the next steps, which run slower by a drawn amount; a sync save
    overlaps nothing. Interference is exactly the slowdown, productive exactly the clean time."""
    mode = data.draw(st.sampled_from(["async", "sync"]))
    starts = sorted(data.draw(st.sets(st.integers(1, n - 2), max_size=n // 4)))
    saves, slowed = [], {}
    for after in starts:  # writes do not overlap one another (one in flight at a time)
        overlap = data.draw(st.integers(1, 2))
        if any(after < s <= after + 2 for s in slowed) or after + overlap >= n or after in slowed:
            continue
        saves.append((after, overlap, mode))
        for s in range(after + 1, after + overlap + 1):
            slowed[s] = data.draw(st.floats(0.0, 1.0)) if mode == "async" else 0.0
    times = [(s, CLEAN + slowed.get(s, 0.0)) for s in range(1, n + 1)]
    mon, end = _job(times, saves)
    gp = compute(mon, now=end)
    assert gp.checkpoint_interference_s == pytest.approx(sum(slowed.values()), abs=1e-9)
    assert gp.productive_s == pytest.approx(n * CLEAN, abs=1e-9)
    assert all(v >= 0 for v in gp.seconds().values())
    assert sum(gp.seconds().values()) == pytest.approx(gp.wall_s)


@settings(max_examples=100, deadline=None)
@given(st.integers(2, 40), st.integers(0, 40), st.integers(1, 40))
def test_useful_steps_count_a_rolled_back_step_once(reached: int, back: int, more: int) -> None:
    """Steps 1..reached run, a rollback to ``resumed`` runs them again and ``more`` beyond: the
    result holds each step once, and the reruns cost ETTR against the run without the rollback."""
    resumed = max(0, reached - back)
    run = [*range(1, reached + 1), *range(resumed + 1, reached + more + 1)]
    mon, end = _job([(s, CLEAN) for s in run], [])
    assert useful_steps(mon) == reached + more
    clean, clean_end = _job([(s, CLEAN) for s in range(1, reached + more + 1)], [])
    reference = steps_per_s(clean, now=clean_end)
    assert ettr(clean, reference, now=clean_end) == pytest.approx(1.0)
    assert ettr(mon, reference,
                now=end) == pytest.approx((1 + (reached + more) * CLEAN) / (1 + len(run) * CLEAN))
    assert ettr(mon, 0.0, now=end) is None


def test_steps_rolled_back_and_not_yet_rerun_are_not_useful() -> None:
    mon, _ = _job([(s, CLEAN) for s in [1, 2, 3, 4, 5, 6, 3]], [])  # back to 2, step 3 running again
    assert useful_steps(mon) == 3


def test_a_slowed_step_that_a_rollback_ran_again_is_recomputed_not_interference() -> None:
    run = [(1, CLEAN), (2, CLEAN), (3, CLEAN + 0.5), (4, CLEAN), (3, CLEAN), (4, CLEAN), (5, CLEAN)]
    mon, end = _job(run, [(2, 1, "async")])  # the write overlaps the first run of step 3 only
    gp = compute(mon, now=end)
    assert gp.checkpoint_interference_s == 0.0
    assert gp.recomputed_s == pytest.approx(2 * CLEAN + 0.5) and gp.productive_s == pytest.approx(5 * CLEAN)


def test_batches_a_torchft_step_was_committed_without_are_lost_work_in_goodput_and_ettr() -> None:
    """Two replica groups of one rank: steps 3 to 8 committed by one group alone lack 6 batches, 3 steps'
    worth (half a step each): 0.3 s of the 10 kept steps was not productive, and ETTR counts 7 useful steps
    where 10 ran. A heal's own count of the batches it skipped is not a second count."""
    mon, end = _job([(s, CLEAN) for s in range(1, 11)], [])
    clean = compute(mon, now=end)
    reference = steps_per_s(mon, now=end)
    events = [make("job_start", "j", None, t=0.0, spec_digest="d", world_size=2, steps=None, backend="local",
                   host="h", pid=1)]
    for step, t, took in zip(mon.steps.step, mon.steps.t, mon.steps.step_time):
        events.append(make("step", "j", 0, t=t, step=step, loss=None, tokens=None, step_time=took,
                           batches=1 if 3 <= step <= 8 else 2))
    events.append(make("heal", "j", 1, t=end - 0.5, from_step=2, step=8, skipped_batches=7, heal_s=0.01))
    mon = JobMonitor()
    mon.update(events)
    assert missing_batches(mon) == 6
    gp = compute(mon, now=end)
    assert gp.skipped_s == pytest.approx(3 * CLEAN) and clean.skipped_s == 0.0
    assert gp.productive_s == pytest.approx(clean.productive_s - 3 * CLEAN)
    assert sum(gp.seconds().values()) == pytest.approx(gp.wall_s)
    assert ettr(mon, reference, now=end) == pytest.approx(7 / 10)


def test_only_a_kept_steps_last_execution_counts_its_missing_batches() -> None:
    """A step committed by one group, then rolled back (every group lost) and run again by both, lacks
    nothing; a step above the newest one run is not kept."""
    events = [make("job_start", "j", None, t=0.0, spec_digest="d", world_size=2, steps=None, backend="local",
                   host="h", pid=1)]
    for i, (step, batches) in enumerate([(1, 2), (2, 1), (3, 1), (2, 2), (3, 1)]):
        events.append(make("step", "j", 0, t=1.0 + i, step=step, loss=None, tokens=None, step_time=CLEAN,
                           batches=batches))
    mon = JobMonitor()
    mon.update(events)
    assert missing_batches(mon) == 1
    mon.update([make("step", "j", 0, t=9.0, step=2, loss=None, tokens=None, step_time=CLEAN, batches=2)])
    assert missing_batches(mon) == 0   # back to step 2 again: step 3 not kept (yet)
