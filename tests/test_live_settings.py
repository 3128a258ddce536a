"""Live settings (``set NAME ckpt-every=6``): every rank takes a change at the same step, the change
holds across in-process, in-job and job-level restarts and into a resumed job, and anything else is
refused with one line."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from eksft_nb import commands, settings
from eksft_nb.errors import ControlError
from eksft_nb.job import attach
from eksft_nb.jobdir import JobDir
from eksft_nb.monitor import JobMonitor
from eksft_nb.runtime.live import LiveSettings
from eksft_nb.spec import JobSpec
from jobs import cli, events, job_dir, story, wait_for

# ---- the parser and the records (no job) ---------------------------------------------------------


@given(st.lists(st.text(max_size=30), max_size=5))
def test_any_words_parse_to_checked_values_or_one_line(words: list[str]) -> None:
    try:
        values = settings.parse_assignments(words)
    except ControlError as e:
        assert "\n" not in str(e) and str(e).strip()
        return
    assert set(values) <= set(settings.LIVE) and values
    for name, value in values.items():
        assert settings.LIVE[name].low <= value <= settings.MAX_VALUE


@given(st.sampled_from(list(settings.LIVE)), st.integers(-10, 2 * settings.MAX_VALUE))
def test_a_value_is_taken_exactly_when_it_is_in_range(name: str, value: int) -> None:
    ok = settings.LIVE[name].low <= value <= settings.MAX_VALUE
    try:
        assert settings.parse_assignments([f"{name}={value}"]) == {name: value} and ok
    except ControlError as e:
        assert not ok and "out of range" in str(e)


@pytest.mark.parametrize(
    "word, said",
    [
        ("world-size=4", "world-size cannot change while the job runs"),
        ("ckpt-mode=sync", "ckpt-mode cannot change while the job runs"),
        ("backend=eks", "backend cannot change while the job runs"),
        ("nnodes=2", "nnodes cannot change while the job runs"),
        ("lr=0.1", "lr cannot change while the job runs (the ranks read it once, when they start)"),
        ("ckpt-evry=5", "unknown setting 'ckpt-evry': did you mean ckpt-every?"),
        ("ckpt-every=five", "ckpt-every='five' is not an integer"),
        ("keep-last=1", "keep-last=1 is out of range"),
        ("ckpt-every", "'ckpt-every' is not NAME=VALUE"),
    ],
)
def test_settings_that_cannot_change_live_are_refused_in_one_line(word: str, said: str) -> None:
    with pytest.raises(ControlError) as e:
        settings.parse_assignments([word])
    assert str(e.value).startswith(said) and "\n" not in str(e.value)


def test_other_spellings_name_the_same_setting() -> None:
    assert settings.parse_assignments(["--ckpt-every=7", "checkpoint.keep_last=5"]) == {
        "ckpt-every": 7,
        "keep-last": 5,
    }
    with pytest.raises(ControlError, match="ckpt-every is given twice"):
        settings.parse_assignments(["ckpt-every=7", "ckpt_every=8"])


@given(
    st.one_of(
        st.none(),
        st.integers(),
        st.text(max_size=20),
        st.lists(st.integers(), max_size=3),
        st.dictionaries(st.text(max_size=12), st.one_of(st.integers(), st.text(max_size=5)), max_size=4),
    )
)
def test_any_json_values_are_checked_or_refused(values: object) -> None:
    try:
        checked = settings.check_values(values)
    except ControlError as e:
        assert "\n" not in str(e)
        return
    assert set(checked) <= set(settings.LIVE)


def _job_folder(tmp_path: Path) -> tuple[JobDir, JobSpec]:
    spec = JobSpec(name="j").validate()
    jd = JobDir(tmp_path / "j")
    for sub in (jd.pending, jd.fired):
        sub.mkdir(parents=True)
    jd.spec_path.write_text(spec.to_json())
    return jd, spec


@pytest.mark.parametrize(
    "content",
    [
        "not json",
        "[]",
        '{"v": 2, "seq": 1, "values": {"ckpt-every": 5}}',
        '{"v": 1, "seq": 1, "values": {"ckpt-mode": "sync"}}',
        '{"v": 1, "seq": 0, "values": {"ckpt-every": 5}}',
        '{"v": 1, "seq": 1, "values": {"ckpt-every": -5}}',
    ],
)
def test_a_bad_request_file_changes_nothing_and_is_said(tmp_path: Path, content: str) -> None:
    jd, spec = _job_folder(tmp_path)
    settings.request_path(jd).write_text(content)
    warned: list[str] = []
    live = [
        LiveSettings(jd, spec, rank, lambda *a, **k: None, lambda what, msg: warned.append(msg))
        for rank in (0, 1)
    ]
    reduced = [sum(v) for v in zip(*(r.proposal() for r in live))]
    assert [r.agree(reduced, 3) for r in live] == [None, None]
    assert live[0].values == settings.of_spec(spec) and not settings.effective_path(jd).exists()
    assert (
        len(warned) == 1
        and "\n" not in warned[0]
        and warned[0].startswith("a live settings request was refused")
    )


def test_ranks_take_rank_zeros_proposal_from_the_sum_and_the_next_start_reads_it(tmp_path: Path) -> None:
    """The agreement itself, as the trainer's all-reduce carries it: only rank 0 reads the request."""
    jd, spec = _job_folder(tmp_path)
    emitted: list[tuple[int, dict]] = []
    live = [
        LiveSettings(jd, spec, rank, lambda kind, rank=rank, **d: emitted.append((rank, d)), print)
        for rank in (0, 1, 2)
    ]
    asked = settings.write_request(jd, spec, {"ckpt-every": 25})
    assert asked["seq"] == 1 and asked["before"]["ckpt-every"] == 10
    reduced = [sum(v) for v in zip(*(r.proposal() for r in live))]
    assert [r.agree(reduced, 7) for r in live] == [{"ckpt-every": [10, 25]}] * 3
    assert {(rank, d["step"], d["seq"]) for rank, d in emitted} == {(0, 7, 1), (1, 7, 1), (2, 7, 1)}
    assert settings.in_force(jd, spec) == (1, {"ckpt-every": 25, "keep-last": 3}, 7)
    # a restarted rank starts with it, and the same request is not taken twice
    again = LiveSettings(jd, spec, 0, lambda *a, **k: None, print)
    assert again.values["ckpt-every"] == 25 and again.agree(again.proposal(), 9) is None
    # setting what is in force writes nothing
    assert settings.write_request(jd, spec, {"ckpt-every": 25})["seq"] is None


# ---- a real 2-rank job ---------------------------------------------------------------------------


def _last_step(name: str) -> int:
    return max((e["step"] for e in events(name, "step")), default=0)


def _queue_ahead(name: str, faults: list[tuple[str, int | None]]) -> None:
    """Queue ``faults`` (kind, rank) 12 steps apart, the first 12 ahead of the job, in one go through the
    command layer: they fire in that order whatever the machine's speed (a CLI call per fault, seconds
    each, once let the job pass the end before the last was aimed). A job that passed the first step
    while they were queued gets them again, further ahead."""
    for _ in range(10):
        ahead = _last_step(name) + 12
        try:
            for i, (fault, rank) in enumerate(faults):
                commands.inject(name, fault, rank=rank, step=ahead + 12 * i)
            return
        except ControlError as e:
            assert "has already passed" in str(e) and i == 0, e
    raise AssertionError(f"the job kept passing the steps the faults were aimed at: {_last_step(name)}")


def test_a_live_interval_lands_on_every_rank_at_one_step_and_holds_across_restarts() -> None:
    name = "live-interval"
    proc = cli(
        "run",
        "--name",
        name,
        "--model",
        "tiny",
        "--steps",
        "150",
        "--ckpt-every",
        "10",
        "--ckpt-mode",
        "sync",
        "--seed",
        "0",
        "--detach",
    )
    assert proc.returncode == 0, proc.stderr
    # paced (rank 0 straggles 0.3 s a step until its first restart), so that the job cannot reach its end
    # while the CLI calls below start on a loaded machine (the faults are aimed ahead of the job by then)
    commands.inject(name, "slow-rank", rank=0, params={"delay": 0.3, "duration": 150})
    wait_for("the first steps", lambda: _last_step(name) >= 3, timeout=300)
    proc = cli("set", name, "ckpt-every=6", "keep-last=4", "--wait", "300", "--json")
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert result["applied"] and result["changes"] == {"ckpt-every": [10, 6], "keep-last": [3, 4]}, result
    at = result["step"]
    assert f"taken by all 2 ranks at step {at}" in result["message"]
    taken = [e for e in events(name, "setting")]
    assert sorted((e.rank, e["step"], e["seq"]) for e in taken) == [(0, at, 1), (1, at, 1)], taken

    # an in-process restart (exception), an in-job restart (sigkill), a job-level restart (kill-launcher)
    faults = (("exception", 0, "inprocess"), ("sigkill", 1, "injob"), ("kill-launcher", None, "job"))
    _queue_ahead(name, [(fault, rank) for fault, rank, _ in faults])
    # a setting that cannot change live is refused in one line, and changes nothing
    refused = cli("set", name, "ckpt-mode=async")
    assert refused.returncode != 0 and refused.stderr.strip().count("\n") == 0
    assert "ckpt-mode cannot change while the job runs" in refused.stderr
    def explain() -> str:
        return f"{story(name)}\nevents: {[(e.kind, e.rank, e.data) for e in events(name)][-30:]}"

    for _, _, level in faults:
        wait_for(
            f"the {level} restart",
            lambda level=level: any(e["level"] == level for e in events(name, "restart")),
            timeout=400,
            explain=explain,
        )
    state = attach(name).wait(timeout=600)
    assert state.value == "succeeded", story(name)

    restarts = events(name, "restart")
    assert [r["level"] for r in restarts] == ["inprocess", "injob", "job"], [r.data for r in restarts]
    # every incarnation after the change started with it, on both ranks
    starts = [e for e in events(name, "rank_start") if e.t > taken[0].t]
    assert {(e["inprocess_iteration"] > 0, e["injob_restart"], e["job_attempt"]) for e in starts} >= {
        (True, 0, 0),
        (False, 1, 0),
        (False, 0, 1),
    }, [e.data for e in starts]
    assert all(e["settings"] == {"ckpt-every": 6, "keep-last": 4} for e in starts), [e.data for e in starts]
    assert sorted({e.rank for e in starts}) == [0, 1]
    # and saved by it: every 10 steps before the change, every 6 from it on (the last step too)
    saves = [e["step"] for e in events(name, "checkpoint") if e["phase"] == "begin"]
    first_after = next(i for i, e in enumerate(events(name)) if e.kind == "setting")
    after = [
        e["step"] for e in events(name)[first_after:] if e.kind == "checkpoint" and e["phase"] == "begin"
    ]
    assert all(s % 10 == 0 for s in saves[: len(saves) - len(after)]), saves
    assert after and all(s % 6 == 0 or s == 150 for s in after), after
    assert any(s % 10 for s in after), after  # the new interval, not the old one
    assert not [e for e in events(name, "setting") if e["seq"] != 1 or e not in taken]  # taken once
    # keep-last 4: the four newest committed checkpoints are left
    kept = sorted(int(p.name.split("_")[1]) for p in (job_dir(name) / "ckpt").glob("step_*"))
    assert len(kept) == 4 and kept[-1] == 150, kept
    mon = JobMonitor()
    mon.update(events(name))
    assert mon.settings[1]["ranks"] == {0: at, 1: at} and mon.settings[1]["changes"]["ckpt-every"] == [10, 6]

    # an ended job takes no setting; a job resumed from it starts with the ones in force
    refused = cli("set", name, "ckpt-every=5")
    assert (
        refused.returncode != 0 and "has already ended" in refused.stderr and refused.stderr.count("\n") == 1
    )
    resumed = cli(
        "resume",
        name,
        "--step",
        str(kept[-2]),
        "--as",
        "live-resumed",
        "--steps",
        str(kept[-2] + 8),
        "--detach",
    )
    assert (
        resumed.returncode == 0
        and "with the live settings in force: ckpt-every=6 keep-last=4" in resumed.stdout
    )
    spec = JobDir(job_dir("live-resumed")).spec()
    assert (spec.checkpoint.every, spec.checkpoint.keep_last) == (6, 4)
    assert attach("live-resumed").wait(timeout=600).value == "succeeded", story("live-resumed")
    assert os.path.exists(job_dir("live-resumed") / "ckpt" / f"step_{kept[-2] + 6:08d}")


# ---- the dashboard (a job folder written with the real event schema; no process runs) -----------


def test_the_dashboard_marks_a_change_on_the_timeline_and_shows_it_in_force() -> None:
    from test_dashboard import FakeJob, traces

    from eksft_nb.dashboard import Dashboard

    job = FakeJob("live-dash", steps=40)
    job.steps(1, 7)
    for rank in (1, 0):
        job.emit(
            "setting",
            rank=rank,
            seq=1,
            step=7,
            changes={"ckpt-every": [10, 25]},
            values={"ckpt-every": 25, "keep-last": 3},
        )
    job.steps(8, 9)
    dash = Dashboard(job.handle(), live=False)
    try:
        assert list(traces(dash, "settings")["tail"].text) == ["ckpt-every 10→25 @ step 7"]
        assert list(traces(dash, "settings")["tail"].y) == ["setting"]
        assert dash.settings.boxes["ckpt-every"].value == 25 and dash.settings.changes() == {}
        dash.set_settings(dash.settings.changes())
        assert "nothing to set" in dash.message.value
        dash.settings.boxes["keep-last"].value = 1  # below the box's minimum: it holds 2
        assert dash.settings.changes() == {"keep-last": 2}
    finally:
        dash.close()


def test_apply_whatif_without_a_recommendation_is_refused_in_one_line() -> None:
    """A job that never failed gives no failure rate: no interval to apply, and nothing is written."""
    from test_dashboard import FakeJob

    job = FakeJob("live-no-failure", steps=20)
    job.steps(1, 20)
    job.save(10, 0.01, 0.02)
    job.end()
    with pytest.raises(ControlError) as e:
        commands.apply_whatif("live-no-failure")
    assert str(e.value).startswith("the what-if recommends no interval (no failure observed")
    assert "\n" not in str(e.value) and not settings.request_path(job.dir).exists()


def test_an_eks_jobs_settings_are_refused_before_any_pod_is_asked_and_a_pods_refusal_is_one_line() -> None:
    """The EKS side of `set` (its real path: tests/test_eks_replay.py): a script's job and an ended one are
    refused as on the other backends, a pod's refusal comes back as its one line, anything else is said."""
    from types import SimpleNamespace

    from eksft_nb.backends.eks import live
    from eksft_nb.errors import JobError
    from eksft_nb.states import JobState

    answers: list[tuple[int, str]] = []
    cluster = SimpleNamespace(exec=lambda pod, container, argv: answers.pop(0))

    def backend(spec: JobSpec, state: JobState) -> SimpleNamespace:
        return SimpleNamespace(_job=lambda name: (cluster, spec, {}),
                               state=lambda name: SimpleNamespace(state=state),
                               _running_pods=lambda c, s, why: ["pod-0"], mount=None)

    running = backend(JobSpec(name="e", backend="eks"), JobState.RUNNING)
    with pytest.raises(ControlError, match="runs a script"):
        live.set_settings(backend(JobSpec(name="e", backend="eks", script="x.py"), JobState.RUNNING), "e", {})
    with pytest.raises(JobError, match="has already ended"):
        live.set_settings(backend(JobSpec(name="e", backend="eks"), JobState.SUCCEEDED), "e",
                          {"keep-last": 4})
    answers.append((0, 'noise\n{"seq": 2, "before": {"keep-last": 3}, "values": {"keep-last": 4}}\n'))
    assert live.set_settings(running, "e", {"keep-last": 4})["seq"] == 2
    answers.append((2, "eksft: error: keep-last=1 is out of range: use an integer from 2 to 1000000\n"))
    with pytest.raises(ControlError) as e:
        live.set_settings(running, "e", {"keep-last": 4})
    assert str(e.value) == "keep-last=1 is out of range: use an integer from 2 to 1000000"
    answers.append((1, "Traceback: no module named eksft_nb"))
    with pytest.raises(JobError, match="same eksft-nb version"):
        live.settings(running, "e")
