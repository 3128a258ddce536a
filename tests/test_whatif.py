"""What-if replay: the model checked term by term against event streams whose answers can be worked
out by hand, then one prediction against a real job's measurement."""

from __future__ import annotations

import json
import math

import pytest

from eksft_nb import commands
from eksft_nb.errors import EksftError
from eksft_nb.events import make
from eksft_nb.monitor import JobMonitor
from eksft_nb.resilience.whatif import (Setting, Settings, format_report, measure, parse_settings, predict,
                                       replay)
from eksft_nb.resilience.whatif_view import view
from eksft_nb.spec import JobSpec

T0 = 1_000_000.0


def stream(steps: int = 20, every: int = 5, mode: str = "sync", fault_at: int | None = 13,
           level: str = "injob", detection: float = 1.0, downtime: float = 4.0, step_s: float = 1.0,
           save_s: float = 0.5,
           commit_s: float = 2.5, startup: float = 2.0, first_save_s: float | None = None,
           last_save_s: float | None = None, lost_s: float | None = None,
           commit_gap_s: float = 0.0, nvrx: str | None = None, abandon: bool = False,
           wrapper: tuple[float, float, float] | None = None) -> JobMonitor:
    """The events of a job on a perfectly regular clock: a fault at the start of step ``fault_at``
    rolls back to the newest save committed by then (async saves commit ``commit_s`` after they begin).
    The first save after each start blocks ``first_save_s``, the last step's ``last_save_s`` (default
    ``save_s``). A (sync) job's steps the fault will roll back take ``lost_s`` (default ``step_s``); each
    save but the last is followed by ``commit_gap_s`` between steps that is not its stall. ``abandon``: an
    in-job restart kills the async save in flight (never committed), and the rollback saves its step again,
    as a real job does. ``wrapper``: the in-process Wrapper's set-up at the start and in an in-job restart,
    and its exit (seconds; rank 1's set-up a little longer, its exit a little shorter), as a job with
    in-process restart reports them."""
    plain_save_s = save_s
    evs = [make("job_start", "j", t=T0, spec_digest="x", world_size=2, steps=steps, backend="local", host="h",
                pid=1, **({"nvrx": nvrx} if nvrx else {}))]
    t, step, faulted, commits, fresh, committed = T0 + startup, 0, False, {}, True, {}
    if wrapper:   # reported at the wrapped function's first call, before the first step
        evs += [make("inprocess_wrapper", "j", rank=r, t=t - 0.5, phase="setup", seconds=wrapper[0] + 0.1 * r)
                for r in (0, 1)]
    doomed = range((fault_at - 1) // every * every + 1, fault_at) if fault_at and every else range(0)
    while step < steps:
        if step + 1 == fault_at and not faulted:
            faulted = True
            resumed = max([s for s, c in commits.items() if c <= t or level == "inprocess"] or [0])
            evs.append(make("failure", "j", t=t + detection, level=level, cause="injected sigkill on rank 1",
                            blame_rank=1, fault_time=t, detected_at=t + detection))
            evs.append(make("restart", "j", t=t + downtime, level=level, cause="injected sigkill on rank 1",
                            blame_rank=1, fault_time=t, detection_s=detection, downtime_s=downtime,
                            rolled_back_steps=step - resumed, resumed_step=resumed))
            if wrapper and level == "injob":
                evs += [make("inprocess_wrapper", "j", rank=r, t=t + downtime - 0.5, phase="setup",
                             seconds=wrapper[1] + 0.1 * r) for r in (0, 1)]
            for late in [s for s, c in commits.items() if c > t] if abandon and level != "inprocess" else []:
                evs.remove(committed.pop(late))
                del commits[late]
            t, step, fresh = t + downtime, resumed, True
            continue
        step += 1
        took = lost_s if lost_s is not None and step in doomed and not faulted else step_s
        t += took
        evs.append(make("step", "j", rank=0, t=t, step=step, loss=1.0, tokens=8, step_time=took))
        if every and (step % every == 0 or step == steps) and step not in commits:
            save_s = (last_save_s if step == steps and last_save_s is not None else
                      first_save_s if fresh and first_save_s is not None else plain_save_s)
            fresh = False
            evs.append(make("checkpoint", "j", rank=0, t=t, phase="begin", step=step, mode=mode))
            if mode == "sync":
                evs.append(make("checkpoint", "j", rank=0, t=t + save_s, phase="committed", step=step,
                                mode=mode, blocked_s=save_s))
                commits[step] = t + save_s
                t += save_s + (commit_gap_s if step < steps else 0.0)
            else:
                evs.append(make("checkpoint", "j", rank=0, t=t + save_s, phase="staged", step=step, mode=mode,
                                blocked_s=save_s))
                evs.append(make("checkpoint", "j", rank=0, t=t + commit_s, phase="committed", step=step,
                                mode=mode, blocked_s=save_s, background_s=commit_s - save_s))
                committed[step] = evs[-1]
                commits[step] = t + commit_s
                t += save_s
    if wrapper:
        evs += [make("inprocess_wrapper", "j", rank=r, t=t + wrapper[2] / 2, phase="exit",
                     seconds=wrapper[2] - 0.1 * r) for r in (0, 1)]
        t += wrapper[2]
    evs.append(make("job_end", "j", t=t, state="succeeded", reason="", final_step=steps))
    mon = JobMonitor()
    mon.update(sorted(evs, key=lambda e: e.t))
    return mon


def spec(every: int = 5, mode: str = "sync", inprocess: bool = True, spares: int = 0) -> JobSpec:
    return JobSpec(name="j", spare_nodes=spares).replace(
        **{"checkpoint.every": every, "checkpoint.mode": mode, "ft.inprocess": inprocess})


def as_run(s: JobSpec) -> Setting:
    return Setting(s.checkpoint.every, s.ft.inprocess, s.checkpoint.mode, s.spare_nodes)


def test_the_inputs_are_what_the_events_measured() -> None:
    inp = measure(stream(), spec())
    # 20 steps of 1 s; saves at 5, 10, 15, 20 blocking 0.5 s; the fault at step 13's start lost 11 and 12
    assert (inp.steps, inp.step_s, inp.saves, inp.stall_per_save_s) == (20, 1.0, 4, 0.5)
    assert inp.failures == [{"step": 12, "level": "injob", "cause": "injected sigkill on rank 1",
                             "downtime_s": 4.0, "detection_s": 1.0, "lost": 2,
                             "node_loss": False, "phases": {}, "wrapper_s": None, "committed": 10}]
    assert inp.wall_s == pytest.approx(2 + 22 + 2.0 + 4.0)   # startup + steps run + stall + downtime
    assert (inp.mtbf_s, inp.recovery_s, inp.detection_s) == (pytest.approx(30.0), 4.0, 1.0)
    assert inp.other_s == pytest.approx(0.0, abs=1e-9)


def test_the_replay_at_the_jobs_own_settings_is_its_measurement() -> None:
    mon, s = stream(), spec()
    report = replay(mon, s).to_dict()
    row = report["measured"]["predicted_as_run"]
    assert row["terms"] == pytest.approx(report["measured"]["terms"], abs=1e-6)
    assert row["ettr"] == pytest.approx(20 / 30, abs=1e-4) == report["measured"]["ettr"]


@pytest.mark.parametrize(("every", "saves", "lost", "wall"), [
    (10, 2, 2, 2 + 20 + 1.0 + 4 + 2),     # saves at 10, 20; the fault at 12 rolls back to 10
    (4, 5, 0, 2 + 20 + 2.5 + 4 + 0),      # a save at 12 itself: nothing lost
    (3, 7, 0, 2 + 20 + 3.5 + 4 + 0),      # saves at 3..18 and the last step's
    (7, 3, 5, 2 + 20 + 1.5 + 4 + 5),      # saves at 7, 14, 20; the fault at 12 rolls back to 7
])
def test_other_intervals_by_hand(every: int, saves: int, lost: int, wall: float) -> None:
    s = spec()
    row = predict(measure(stream(), s), as_run(s), as_run(s).__class__(every, True, "sync", 0))
    assert (row.saves, row.lost_steps) == (saves, lost)
    assert sum(row.terms.values()) == pytest.approx(wall)
    assert row.ettr == pytest.approx(20 / wall, abs=1e-4)
    assert row.terms["recomputed"] == lost * 1.0 and row.terms["checkpoint_stall"] == saves * 0.5


def test_an_async_save_is_loadable_only_once_committed() -> None:
    # saves begin at 5, 10 and commit 2.5 s later (3 steps of 1 s): the fault at step 12's start (after
    # step 11) finds 10 still in flight, so the in-job restart loads 5 and loses 6 steps
    mon, s = stream(mode="async", fault_at=12, save_s=0.1), spec(mode="async")
    inp = measure(mon, s)
    assert inp.commit_lag_steps == 3 and inp.failures[0]["lost"] == 6
    assert predict(inp, as_run(s), as_run(s)).lost_steps == 6                     # 11 % 5 = 1 < 3: back 6
    assert predict(inp, as_run(s), Setting(4, True, "async", 0)).lost_steps == 3  # 11 % 4 = 3: committed
    # sync from async: a save blocks for its staging and its write (0.1 + 2.4 s)
    sync = predict(inp, as_run(s), Setting(5, True, "sync", 0))
    assert sync.terms["checkpoint_stall"] == pytest.approx(sync.saves * 2.5) and sync.lost_steps == 1
    assert "blocks for the observed staging + write" in sync.notes[0]


def test_a_start_s_first_save_and_the_last_one_cost_what_they_cost_at_any_interval() -> None:
    """The first save after each start of the ranks waits for a fresh writer and the last step's for its
    write: a longer interval does not save their stall (bench part 7: twice as many saves measured
    0.40 s of stall per save, half as many 0.81 s, as the same job's few costly saves were split
    over fewer)."""
    s = spec().replace(steps=20)
    inp = measure(stream(first_save_s=3.0, last_save_s=2.0), s)
    assert predict(inp, as_run(s), as_run(s)).terms["checkpoint_stall"] == pytest.approx(8.5)  # as measured
    # every 10: saves at 10 (the start's first) and 20 (the last; the restart from 10 saves next there)
    row = predict(inp, as_run(s), Setting(10, True, "sync", 0))
    assert row.terms["checkpoint_stall"] == pytest.approx(5.0)
    # every 4: 4 and 16 (the first after the restart from 12) at 3 s, 8 and 12 at 0.5 s, 20 at 2 s
    row = predict(inp, as_run(s), Setting(4, True, "sync", 0))
    assert (row.saves, row.lost_steps, row.terms["checkpoint_stall"]) == (5, 0, pytest.approx(9.0))
    # saves at 5 (the start's first), 10, 15 (the first after the restart from 10) and 20 (the last)
    assert (inp.first_save_stall_s, inp.last_save_stall_s, inp.stall_per_save_s) == (3.0, 2.0, 0.5)


def test_a_recomputed_step_and_a_save_s_commit_cost_what_the_job_showed() -> None:
    """A step a fault throws away ran right after a save (beside its write), slower than the mean step, and a
    save costs time between steps beyond its stall (an async save's commit): both as observed (bench part 7
    measured 1.02 s per lost step against a mean 0.88 s, and more time between steps with twice the saves)."""
    s = spec().replace(steps=20)
    inp = measure(stream(lost_s=1.5, commit_gap_s=0.2), s)
    # every 7: the fault at step 12's start rolls back to 7, 5 steps at 1.5 s; saves at 7, 14 and 20,
    # one fewer than the 4 run, so one commit gap fewer
    row = predict(inp, as_run(s), Setting(7, True, "sync", 0))
    assert (row.saves, row.lost_steps) == (3, 5)
    assert row.terms["recomputed"] == pytest.approx(7.5) and row.terms["other"] == pytest.approx(0.4)
    measured = replay(stream(lost_s=1.5, commit_gap_s=0.2), s).to_dict()["measured"]["terms"]
    assert predict(inp, as_run(s), as_run(s)).terms == pytest.approx(measured, abs=1e-3)
    assert (inp.recompute_step_s, inp.other_per_save_s) == (pytest.approx(1.5), pytest.approx(0.2))


def test_young_daly_from_the_measured_costs() -> None:
    report = replay(stream(), spec()).to_dict()
    rec = report["recommendation"]
    # C 0.5 s, M 30 s (one failure in 30 s), R 4 s: tau = sqrt(2 * 0.5 * 34) - 0.5 = 5.33 s = 5 steps of 1 s
    assert rec["tau_s"] == pytest.approx(math.sqrt(34) - 0.5, abs=1e-3)
    assert rec["young_daly"] == 5 and rec["gain_points"] == 0.0 and rec["every"] is None   # the job's own
    assert rec["text"] == "keep every 5: it is Young/Daly's interval for this job's measured costs"
    # the formula's interval is one of the rows
    assert 5 in [r["setting"]["ckpt_every"] for r in report["rows"]]
    # recovery 10 s: every 6 steps replays at +3.3 points, so it is recommended (what Apply sets)
    rec = replay(stream(downtime=10.0), spec()).to_dict()["recommendation"]
    assert (rec["every"], rec["young_daly"]) == (6, 6) and rec["gain_points"] > 0
    assert rec["text"] == f"every 6 steps: {rec['gain_points']:+.1f} points ETTR (now every 5)"


@pytest.mark.parametrize("version, pays", [("0.4.1", True), ("0.5.0", False), ("0.7.0", True)])
def test_spares_get_no_figure_where_the_jobs_nvrx_cannot_hand_a_node_over(version: str, pays: bool) -> None:
    """NVRx 0.5's barrier rendezvous closes the job when a spare joins (0.4 hands a node over through
    eksft's supervisor, 0.6+ through its own standby nodes): a row with spares says so and has no ETTR,
    whether the job ran with a spare or not; the recommendation never carries one."""
    for as_run in (0, 1):
        report = replay(stream(nvrx=version), spec(spares=as_run), Settings((5, 10), spares=1)).to_dict()
        for row in report["rows"]:
            assert (row["ettr"] is not None) == pays, row
            assert ("hot spares do not pay off with this job's NVRx: NVRx 0.5.0" in row["why"]) == (
                not pays), row
        assert "spare" not in report["recommendation"]["text"]
    if not pays:
        text = format_report(replay(stream(nvrx=version), spec(), Settings((5,), spares=1)).to_dict())
        assert "cannot estimate: hot spares do not pay off" in text


def test_the_interval_is_never_shorter_than_the_detection_latency() -> None:
    # detection 8 s: wall 2 + 22 + 2 + 10 = 36, tau = sqrt(2 * 0.5 * 46) - 0.5 = 6.28 s < 8 s
    rec = replay(stream(detection=8.0, downtime=10.0), spec()).to_dict()["recommendation"]
    assert rec["tau_s"] == pytest.approx(math.sqrt(46) - 0.5, abs=1e-3)
    assert rec["young_daly"] == 8 and rec["floor_s"] == 8.0


def test_saves_due_while_a_write_runs_come_one_per_commit_lag() -> None:
    """An async save due while the write before it runs waits for it: a job saving every 3 steps with a
    3-step commit lag would make no more saves at 'every 1' or 'every 2' (the old model predicted 20 and
    10 saves, and ETTR for writes that never happen)."""
    mon = stream(every=3, mode="async", commit_s=2.5)
    assert measure(mon, spec(3, "async")).commit_lag_steps == 3
    rows = replay(mon, spec(3, "async"), Settings((1, 2, 3, 6))).to_dict()["rows"]
    by = {r["setting"]["ckpt_every"]: r for r in rows}
    assert by[1]["saves"] == by[2]["saves"] == by[3]["saves"] and by[1]["ettr"] == by[3]["ettr"]
    assert by[6]["saves"] < by[3]["saves"]
    assert "one is made every 3" in " ".join(by[1]["notes"]) and not by[3]["notes"]


def test_an_interval_that_loses_on_the_replay_is_said_never_recommended() -> None:
    """Issue 19: where a setting does not pay off, the what-if says so and never recommends it. With
    detection at 8 s, Young/Daly's floor (8 steps) replays at -2.2 points against the job's 5."""
    report = replay(stream(detection=8.0, downtime=10.0), spec()).to_dict()
    rec = report["recommendation"]
    assert rec["young_daly"] == 8 and rec["gain_points"] < 0 and rec["every"] is None
    assert rec["text"] == (f"keep every 5: Young/Daly's every 8 steps would give {rec['gain_points']:+.1f} "
                           "points ETTR on the replay of this job's failures")
    assert view(report)["every"] is None   # nothing for Apply to set


def test_what_the_events_cannot_tell_is_said_not_guessed() -> None:
    # an in-process recovery without in-process restart needs an in-job one to copy: there is none
    s = spec()
    report = replay(stream(level="inprocess"), s, Settings((5,), inprocess=False)).to_dict()
    [row] = report["rows"]
    assert row["ettr"] is None and "shows no in-job recovery" in row["why"]
    # in-process restart on, where the job ran without: none was observed
    off = spec(inprocess=False)
    [row] = replay(stream(), off, Settings((5,), inprocess=True)).to_dict()["rows"]
    assert row["ettr"] is None and "in-process restart was off" in row["why"]
    # async from sync saves: their staging and interference are unknown
    [row] = replay(stream(), s, Settings((5,), ckpt_mode="async")).to_dict()["rows"]
    assert row["ettr"] is None and "no async save was observed" in row["why"]
    # a lost node with a spare: no takeover was observed
    [row] = replay(stream(level="job"), s, Settings((5,), spares=1)).to_dict()["rows"]
    assert row["ettr"] is None and "spare's takeover was never observed" in row["why"]
    # no failure: no failure rate, no recommendation
    rec = replay(stream(fault_at=None), s).to_dict()["recommendation"]
    assert rec["every"] is None and "no failure observed" in rec["text"]
    assert "cannot estimate" in format_report(replay(stream(level="inprocess"), s,
                                                     Settings((5,), inprocess=False)).to_dict())


def test_the_job_s_own_interval_restores_the_save_it_had_committed_not_the_median_lag() -> None:
    # async saves commit 2.5 steps after they begin (lag 3 steps), yet the save at 10 was committed
    # before the fault at step 13's start (it overlapped the stall): the job lost 2 steps, not 7
    s = spec(mode="async")
    inp = measure(stream(mode="async", commit_s=2.5), s)
    assert inp.commit_lag_steps == 3 and inp.failures[0]["lost"] == 2
    assert predict(inp, as_run(s), as_run(s)).lost_steps == 2
    # another interval has no observed saves: the median lag decides (12 % 4 = 0 < 3: back to 8)
    assert predict(inp, as_run(s), Setting(4, True, "async", 0)).lost_steps == 4


def test_a_save_committed_between_the_fault_and_the_restore_is_what_the_job_lost_to() -> None:
    """The save at 10 committed just after the fault (the survivor committed it as the peer died), before
    the restore read the folder: the job lost 2 steps, and its own settings replay 2, not the 7 back to
    the save committed when it failed (the real-job test below failed so, now and then, under load)."""
    s = spec(mode="async")
    inp = measure(stream(mode="async", commit_s=2.5), s)
    inp.failures[0]["committed"] = 5   # what the events say when the commit's event came after the fault's
    assert inp.failures[0]["lost"] == 2
    assert predict(inp, as_run(s), as_run(s)).lost_steps == 2
    # without in-process restart the recovery's level is the same (in-job): as observed too
    assert predict(inp, as_run(s), Setting(5, False, "async", 0)).lost_steps == 2


def test_an_in_process_recovery_becomes_an_in_job_one_at_its_observed_cost() -> None:
    # two failures: an in-process one (0.5 s) and an in-job one (4 s); without in-process restart
    # both cost the in-job recovery's 4 s
    mon = stream(level="inprocess", downtime=0.5)
    mon.update([make("restart", "j", t=mon.t_end - 1, level="injob", cause="x", blame_rank=0,
                     fault_time=mon.t_end - 5, detection_s=1.0, downtime_s=4.0, rolled_back_steps=2,
                     resumed_step=15)])
    s = spec()
    row = predict(measure(mon, s), as_run(s), Setting(5, False, "sync", 0))
    assert row.terms["restart_downtime"] == pytest.approx(4.0 + 4.0)
    assert "becomes injob" in row.notes[0]


def test_a_step_saved_again_after_a_rollback_is_two_saves() -> None:
    """An in-job restart kills the async save in flight and the rollback saves its step again: the job made
    that save twice, and its own settings replay both (bench part 7's quick 'interval x2' pair replayed A at
    30.6 % against a measured 34.1 % when saves were counted by step)."""
    s = spec(mode="async")
    mon = stream(mode="async", fault_at=12, save_s=0.1, first_save_s=1.0, abandon=True)
    inp = measure(mon, s)
    # saves at 5 (the start's first), 10 (killed in flight), 10 again (the restart's first), 15, 20
    assert (inp.failures[0]["lost"], inp.saves, inp.first_saves) == (6, 5, 2)
    report = replay(mon, s).to_dict()
    row = report["measured"]["predicted_as_run"]
    assert (row["saves"], row["lost_steps"]) == (5, 6)
    assert row["terms"] == pytest.approx(report["measured"]["terms"], abs=1e-6)
    assert row["ettr"] == pytest.approx(report["measured"]["ettr"], abs=1e-5)
    # every 4 rolls back to 8 (11 % 4 = 3, not within the lag of 3), no save again: 4 (the start's first),
    # 8, 12 (the restart's first), 16, 20
    row = predict(inp, as_run(s), Setting(4, True, "async", 0))
    assert (row.saves, row.lost_steps) == (5, 3)
    assert row.terms["checkpoint_stall"] == pytest.approx(2 * 1.0 + 3 * 0.1)


def test_without_in_process_restart_the_wrappers_set_up_and_exit_are_not_spent() -> None:
    """NVRx's Wrapper sets up in every rank process before the first call (1.5 s here) and after each in-job
    restart (0.6 s), and completes after the last return (1.2 s): without in-process restart none of it is
    spent, and an in-process recovery becomes an in-job one at the in-job cost less the Wrapper's share
    (bench part 7, quiet: start-up 2.87 s against 4.81 s, in-job restarts 0.96-1.37 s against 1.77-1.99 s)."""
    mon = stream(level="inprocess", downtime=0.5, wrapper=(1.5, 0.6, 1.2))
    mon.update([make("inprocess_wrapper", "j", rank=r, t=mon.t_end - 1.5, phase="setup",
                     seconds=0.6 + 0.1 * r) for r in (0, 1)] +
               [make("restart", "j", t=mon.t_end - 1, level="injob", cause="x", blame_rank=0,
                     fault_time=mon.t_end - 5, detection_s=1.0, downtime_s=4.0, rolled_back_steps=2,
                     resumed_step=15)])
    s = spec()
    inp = measure(mon, s)
    # on the critical path: the set-up of the rank that waited least, the exit of the last to leave
    assert (inp.wrapper_startup_s, inp.wrapper_exit_s) == (1.5, 1.2)
    assert [f["wrapper_s"] for f in inp.failures] == [None, 0.6]
    measured = replay(mon, s).to_dict()["measured"]
    row = predict(inp, as_run(s), Setting(5, False, "sync", 0))
    assert row.terms["startup"] == pytest.approx(measured["terms"]["startup"] - 1.5)
    assert row.terms["restart_downtime"] == pytest.approx(3.4 + 3.4)
    assert "becomes injob (3.40s" in row.notes[0] and "Wrapper: its observed set-up (1.50s" in row.notes[1]
    # one in-job restart: its Wrapper set-up, the start-up's and the exit (the end's 'other') are not spent
    mon = stream(wrapper=(1.5, 0.6, 1.2))
    measured = replay(mon, s).to_dict()["measured"]["terms"]
    row = predict(measure(mon, s), as_run(s), Setting(5, False, "sync", 0))
    assert (measured["startup"], measured["restart_downtime"], measured["other"]) == \
        pytest.approx((2, 4, 1.2))
    assert row.terms == pytest.approx({**measured, "startup": 0.5, "restart_downtime": 3.4, "other": 0.0})
    # in-process restart still on: the Wrapper's share stays
    row = predict(inp, as_run(s), Setting(10, True, "sync", 0))
    assert row.terms["startup"] == pytest.approx(2.0)
    # a job whose events do not record the Wrapper (before they did): as observed, and said
    row = predict(measure(stream(), s), as_run(s), Setting(5, False, "sync", 0))
    assert row.terms["startup"] == pytest.approx(2.0) and "was not recorded" in row.notes[-1]


def test_in_process_restart_on_from_a_job_without_it_gets_no_figure() -> None:
    """A job without in-process restart never ran NVRx's Wrapper: its set-up cost is unknown, so even a
    job with no failure gets no figure for in-process restart on, and the reason."""
    off = spec(inprocess=False)
    [row] = replay(stream(fault_at=None), off, Settings((5,), inprocess=True)).to_dict()["rows"]
    assert row["ettr"] is None and "Wrapper never ran" in row["why"]
    assert "cannot estimate: in-process restart was off" in format_report(
        replay(stream(fault_at=None), off, Settings((5,), inprocess=True)).to_dict())


@pytest.mark.parametrize(("every", "problem"), [("5,x", "'x' is not a whole number"), ("0", "'0' is not"),
                                                 (",".join(map(str, range(1, 20))), "1 to 16 intervals")])
def test_bad_intervals_are_one_line(every: str, problem: str) -> None:
    with pytest.raises(EksftError) as e:
        parse_settings(every, None, None, None)
    assert problem in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(EksftError, match="--spares"):
        parse_settings(None, None, None, -1)


def test_a_job_with_no_step_is_refused() -> None:
    mon = JobMonitor()
    mon.update([make("job_start", "j", t=T0, spec_digest="x", world_size=2, steps=10, backend="local",
                     host="h", pid=1)])
    with pytest.raises(EksftError, match="has run no step yet"):
        measure(mon, spec())


def test_the_prediction_at_a_real_jobs_settings_matches_its_measurement(faulted_job: str) -> None:
    """A real 2-rank job killed once: the replay at its own settings must give back what it measured."""
    report = commands.whatif(faulted_job)
    json.dumps(report)   # JSON-ready
    measured, predicted = report["measured"], report["measured"]["predicted_as_run"]
    [failure] = report["inputs"]["failures"]
    assert failure["level"] == "injob"
    # the rollback replayed from the interval and the commit lag is the one the job had
    assert predicted["lost_steps"] == failure["lost"], (predicted, failure)
    assert abs(predicted["ettr"] - measured["ettr"]) <= 0.01, (predicted, measured)
    assert abs(predicted["wall_s"] - measured["wall_s"]) <= 0.05 * measured["wall_s"]


@pytest.fixture(scope="module")
def faulted_job() -> str:
    from jobs import run_job

    summary = run_job("whatif-real", "--steps", "30", "--ckpt-every", "5", "--fault", "sigkill:1@13")
    assert summary["state"] == "succeeded" and summary["restarts"]["injob"] == 1, summary
    return "whatif-real"


def test_every_setting_and_the_summary_carry_gpu_hours_and_dollars(faulted_job: str) -> None:
    """The real job's what-if and summary priced at p5.48xlarge and scaled to 30 days on 16 nodes."""
    from eksft_nb import cost
    from eksft_nb.goodput import compute
    from eksft_nb.job import attach
    from eksft_nb.resilience.whatif_cost import text

    scale = {"price": "p5.48xlarge", "run_for": "30d", "nodes": 16, "failures_per_day": 2.0}
    report = commands.whatif(faulted_job, ckpt_every="5,10", **scale)
    m = report["measured"]
    lost_s = sum(v for k, v in m["terms"].items() if k != "productive")
    assert m["cost"]["lost"]["gpu_h"] == pytest.approx(lost_s * 2 / 3600, abs=1e-5)
    assert m["cost"]["lost"]["usd"] == pytest.approx(m["cost"]["lost"]["gpu_h"] * 6.88, abs=1e-3)
    for row in [m["predicted_as_run"], *report["rows"]]:
        assert row["cost"]["lost"]["gpu_h"] > 0 and row["cost"]["lost"]["usd"] > 0, row
        proj = row["projection"]
        assert proj["gpus"] == 128 and proj["failures_expected"] == 60.0 and proj["lost"]["usd"] > 0
        assert "2 failures a day (given)" in proj["assumes"]
    [five, ten] = report["rows"]
    assert five["vs_as_run"]["gpu_h"] == pytest.approx(0.0, abs=1e-6)   # the job's own interval
    assert ten["vs_as_run"]["gpu_h"] == pytest.approx(ten["projection"]["lost"]["gpu_h"]
                                                     - five["projection"]["lost"]["gpu_h"], abs=1e-3)
    saving = report["cost"]["saving"]
    assert "over 30d at 16 x p5.48xlarge (a model" in saving, saving
    assert "every 10 steps instead of 5 saves ~$" in saving or "own settings" in saving, saving
    shown = text(report)
    assert "at scale: " in shown and "assumes:" in shown and "$" in shown
    summary = commands.summary(faulted_job, **scale)
    gp = compute(attach(faulted_job).refresh())
    a = summary["cost"]
    faults_s = gp.restart_downtime_s + gp.recomputed_s
    assert a["faults"]["gpu_h"] == pytest.approx(faults_s * 2 / 3600, abs=1e-5)
    assert a["checkpoints"]["usd"] == pytest.approx(
        (gp.checkpoint_stall_s + gp.checkpoint_interference_s) * 2 / 3600 * 6.88, abs=1e-3)
    assert a["projection"]["failures_expected"] == 60.0 and cost.PRICES_AS_OF in a["pricing"]["price"]
    # its saves against their floor: the ranks measured their copies while staging
    f = summary["checkpoint_floor"]
    assert f["saves"] >= 5 and f["copy_bps"] > 0 and 0 < f["stall_floor_s"] <= f["stall_s"], f
    assert 0 < f["write_floor_s"] <= f["write_s"], f


def test_the_dashboard_prices_the_goodput_bar_and_shows_the_saves_floor(faulted_job: str) -> None:
    """The widget dashboard on the same real job (no run of its own): the goodput bar's cost line at the
    price asked for, and the checkpoint table's line of the stall against its floor."""
    from eksft_nb.dashboard import Dashboard
    from eksft_nb.job import attach

    dash = Dashboard(attach(faulted_job), live=False, price="p5.48xlarge")
    try:
        dash.update()
        bar = dash.goodput.value
        assert "on 2 GPU(s): lost " in bar and "(faults " in bar and "$" in bar, bar
        assert "p5.48xlarge" in bar and "GPU-hours only" not in bar, bar
        floor = dash.checkpoints.floor
        assert floor.startswith("checkpoint stall ") and "x its floor" in floor and "GB/s" in floor, floor
    finally:
        dash.close()


def test_the_magic_shows_the_table_and_the_plot(faulted_job: str, ip: object,
                                                capsys: pytest.CaptureFixture) -> None:
    ip.run_line_magic("ftrain", f"whatif {faulted_job} --ckpt-every 5,10 --no-inprocess")
    out = capsys.readouterr().out
    assert "measured (as run)" in out and "every 10, async, in-process off" in out and "recommended:" in out
    [fig] = ip.shown
    [line, *_] = fig.data
    assert list(line.x) == [5, 10] and all(0 < y < 100 for y in line.y)   # ETTR in percent, per interval


def test_an_exception_healed_in_process_is_charged_as_the_jobs_own_in_job_restarts_of_its_cause() -> None:
    """In-process restart off: an exception healed in-process becomes an in-job restart; its downtime is
    learned from the job's in-job restarts caused by exceptions, else charged as those of other causes and
    the term said to be estimated (an exception's rank ends its process first, which a kill skips)."""
    from dataclasses import replace

    from eksft_nb.resilience.whatif import cause_kind

    s = spec()
    inp = measure(stream(level="inprocess", downtime=0.5), s)
    healed = {**inp.failures[0], "cause": "injected exception on rank 0"}
    injob = {**healed, "level": "injob", "step": 17, "wrapper_s": None}
    off = Setting(5, False, "sync", 0)
    killed = predict(replace(inp, failures=[healed, {**injob, "cause": "injected sigkill on rank 1",
                                                     "downtime_s": 3.0}]), as_run(s), off)
    assert killed.estimated == ["restart_downtime"] and killed.terms["restart_downtime"] == pytest.approx(6.0)
    said = "estimated: the inprocess recovery at step 12 becomes injob"
    assert any(n.startswith(said) for n in killed.notes), killed.notes
    kill = {**injob, "cause": "injected sigkill on rank 1", "downtime_s": 3.0}
    raised = predict(replace(inp, failures=[healed, {**injob, "downtime_s": 5.0}, kill]), as_run(s), off)
    assert raised.estimated == [] and raised.terms["restart_downtime"] == pytest.approx(5.0 + 5.0 + 3.0)
    assert any("the mean of the job's 1 exception-caused injob ones" in n for n in raised.notes), raised.notes
    assert raised.to_dict()["estimated"] == [] and killed.to_dict()["estimated"] == ["restart_downtime"]
    causes = ("injected exception on rank 0", "injected hang on rank 1", "injected segfault on rank 0",
              "rank 1 failed: ValueError: x", "hang: no heartbeat from rank 0 for 30s",
              "rank 0 killed by SIGKILL")
    assert [cause_kind(c) for c in causes] == ["exception", "hang", "loss", "exception", "hang", "loss"]


def test_the_plot_leaves_out_what_cannot_be_estimated() -> None:
    from eksft_nb.resilience.figures import whatif_figure

    report = replay(stream(level="inprocess"), spec(), Settings((5, 10), inprocess=False)).to_dict()
    fig = whatif_figure(report)
    assert list(fig.data[0].x) == [] and "2 setting(s) cannot be estimated" in fig.layout.title.text


@pytest.mark.parametrize("version", ["0.4.1", "0.7.0", None])
def test_in_process_restart_on_an_nvrx_that_deprecates_it_is_priced_as_in_job(version: str | None) -> None:
    """NVRx 0.6+ deprecates in-process restart: a job that used it gets one line on what in-job restart,
    NVRx's way forward, would have cost it (its measured in-job recovery); on 0.4.1 or an unknown NVRx,
    nothing."""
    mon = stream(level="inprocess", downtime=0.5, wrapper=(1.5, 0.6, 1.2), nvrx=version)
    mon.update([make("restart", "j", t=mon.t_end - 1, level="injob", cause="x", blame_rank=0,
                     fault_time=mon.t_end - 5, detection_s=1.0, downtime_s=4.0, rolled_back_steps=2,
                     resumed_step=15)])
    report = replay(mon, spec(), Settings((5,))).to_dict()
    text = format_report(report)
    off = report["measured"].get("without_inprocess")
    if version != "0.7.0":
        assert off is None and "deprecates in-process" not in text
        return
    assert off["setting"]["inprocess"] is False and off["ettr"] is not None and off["nvrx"] == "0.7.0"
    assert off["terms"]["restart_downtime"] == pytest.approx(4.0 + 4.0)   # both recoveries at in-job's cost
    points = 100 * (off["ettr"] - report["measured"]["predicted_as_run"]["ettr"])
    assert (f"NVRx 0.7.0 deprecates in-process restart; in-job restart instead (--no-inprocess): "
            f"{100 * off['ettr']:.1f}% ETTR ({points:+.1f} points)") in text.splitlines()
