"""The resilience test's campaigns without a job: a seeded plan's trials, each kind scored over its trials
with their spread and cost, and the versioned manifest (ground truth beside what was observed) read back
strictly, its re-check naming what moved."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from eksft_nb.errors import EksftError
from eksft_nb.events import make
from eksft_nb.resilience import expect, plan
from eksft_nb.resilience.card import Row, junit, table
from eksft_nb.spec import JobSpec
from eksft_nb.states import FaultKind
from junit_xml import validate_junit
from reference_run import T0, reference


# ---- repeated trials, scoring, the campaign manifest ------------------------------------------------

KINDS = [FaultKind.SIGKILL, FaultKind.EXCEPTION]


def shape(p: plan.Plan) -> list[tuple]:
    return [(c.job, c.kind.value, c.trial, c.step, c.faults[0].rank, c.expected) for c in p.cases]


def test_a_seeded_plan_draws_each_kinds_trials_at_distinct_steps_and_ranks() -> None:
    spec = JobSpec(name="t", nproc_per_node=4)
    ref = reference(steps=30)
    p = plan.build(spec, ref, "t", KINDS, repeat=3, seed=7)
    assert p.window == (10, 28) and p.repeat == 3 and p.seed == 7 and p.kinds == ["sigkill", "exception"]
    assert shape(p) == shape(plan.build(spec, ref, "t", KINDS, repeat=3, seed=7))   # the seed is the plan
    assert shape(p) != shape(plan.build(spec, ref, "t", KINDS, repeat=3, seed=8))
    # a kind's draw does not move with the kinds asked for
    alone = plan.build(spec, ref, "t", [FaultKind.EXCEPTION], repeat=3, seed=7)
    assert shape(alone) == [s for s in shape(p) if s[1] == "exception"]
    for kind in ("sigkill", "exception"):
        trials = [c for c in p.cases if c.kind.value == kind]
        assert [c.job for c in trials] == [f"t-{kind}-1", f"t-{kind}-2", f"t-{kind}-3"]
        # the first trial is the single run's case: the first step after the first checkpoint, the last rank
        assert (trials[0].step, trials[0].faults[0].rank) == (10, 3)
        steps = [c.step for c in trials]
        assert len(set(steps)) == 3 and all(10 <= s <= 28 for s in steps)
        assert all(0 <= c.faults[0].rank < 4 for c in trials)
    assert {c.expected for c in p.cases if c.kind == FaultKind.SIGKILL} == {"injob"}
    assert {c.expected for c in p.cases if c.kind == FaultKind.EXCEPTION} == {"inprocess"}
    assert {c.expected for c in plan.build(spec.replace(**{"ft.inprocess": False}), ref, "t", KINDS).cases
            if c.kind == FaultKind.EXCEPTION} == {"injob"}
    # drawn over many seeds, the later trials reach every rank and the window's ends
    drawn = [c for s in range(40)
             for c in plan.build(spec, ref, "t", [FaultKind.SIGKILL], repeat=3, seed=s).cases if c.trial > 1]
    assert {c.faults[0].rank for c in drawn} == {0, 1, 2, 3} and {11, 28} <= {c.step for c in drawn}
    # a fault that lasts steps ends before the job does (a full disk 10 steps, a straggler 20, of 30)
    lasting = plan.build(spec, ref, "t", [FaultKind.DISK_FULL, FaultKind.SLOW_RANK], repeat=3, seed=7)
    assert all(10 <= c.step <= 20 for c in lasting.cases if c.kind == FaultKind.DISK_FULL)
    assert {c.step for c in lasting.cases if c.kind == FaultKind.SLOW_RANK} == {10}
    # one run a kind is the card as it always was; a long name keeps its trial's suffix
    assert [c.job for c in plan.build(spec, ref, "t", KINDS).cases] == ["t-sigkill", "t-exception"]
    assert plan.job_name("x" * 70, FaultKind.CORRUPT_CHECKPOINT, 12).endswith("x-corrupt-checkpoint-12")
    assert len(plan.job_name("x" * 70, FaultKind.CORRUPT_CHECKPOINT, 12)) == 63


def test_a_torchft_plan_draws_its_trials_on_the_first_rank_of_a_group_but_the_first() -> None:
    spec = JobSpec(name="t", engine="torchft", nnodes=3, nproc_per_node=2)
    p = plan.build(spec, reference(steps=30), "t", [FaultKind.SIGKILL], repeat=5, seed=1)
    assert {c.faults[0].rank for c in p.cases} <= {2, 4} and {c.expected for c in p.cases} == {"job"}


def trial_row(case: plan.Case, level: str = "injob", downtime: float = 4.0, lost: int = 4,
              detection: float = 0.5) -> Row:
    """The card's row of ``case`` run against :func:`reference`: its fault fired, then healed at ``level``."""
    from eksft_nb.resilience.card import row

    ref = reference()
    ref.digest = "d1"
    mon = reference()
    fault = case.faults[0]
    t = T0 + case.step - 0.5
    mon.update([make("fault", "t", rank=fault.rank, t=t, fault=fault.fault, id=fault.id,
                     target_rank=fault.rank, at_step=case.step),
                make("restart", "t", t=t + downtime, level=level, cause=f"injected {fault.fault}",
                     blame_rank=fault.rank, fault_time=t, detection_s=detection, downtime_s=downtime,
                     rolled_back_steps=lost, resumed_step=case.step - lost),
                make("job_end", "t", t=T0 + 30, state="succeeded", reason="", final_step=20, digest="d1")])
    return row(case, mon, ref, expect.parse("lost<=4, state=reference"), "")


def test_trials_are_scored_per_kind_with_their_spread_and_what_they_cost() -> None:
    from eksft_nb import cost
    from eksft_nb.resilience import scoring

    p = plan.build(JobSpec(name="t"), reference(), "t", [FaultKind.SIGKILL], repeat=3, seed=2)
    rows = [trial_row(p.cases[0], downtime=4.0, lost=2, detection=0.5),
            trial_row(p.cases[1], level="job", downtime=9.0, lost=3, detection=0.25),
            trial_row(p.cases[2], downtime=5.0, lost=6, detection=1.0)]
    pricing = cost.pricing(JobSpec(name="t"), "p5.48xlarge", "30d", 16)
    for r in rows:
        scoring.price_trial(r, 1.0, 2, pricing)   # a clean step of 1 s, 2 ranks
    assert [r["passed"] for r in rows] == [True, False, False]
    # a failed trial names what differed from the ground truth and from the expectations
    c1, c2 = p.cases[1], p.cases[2]
    assert rows[1]["why"] == ["healed at level job, where the plan expects injob"]
    assert rows[2]["why"] == ["lost 6 steps, expected lost<=4"]
    assert rows[0]["lost_gpu_s"] == (4.0 + 2 * 1.0) * 2
    assert rows[0]["cost"]["usd"] == pytest.approx(12 / 3600 * 6.88, abs=1e-4)
    assert rows[0]["fired_step"] == p.cases[0].step and rows[0]["trial"] == 1
    [k] = scoring.score(rows, ["sigkill"], 3, {"sigkill": "injob"}, "", pricing, 2)
    assert (k["passed"], k["trials"], k["ok"], k["levels"]) == (1, 3, False, {"injob": 2, "job": 1})
    assert k["downtime_s"] == {"n": 3, "min": 4.0, "median": 5.0, "max": 9.0}
    assert k["detection_s"] == {"n": 3, "min": 0.25, "median": 0.5, "max": 1.0}
    assert k["lost"] == {"n": 3, "min": 2.0, "median": 3.0, "max": 6.0}
    per = (12 + 24 + 22) / 3   # the mean GPU-seconds a fault cost
    assert k["cost"]["gpu_h"] == pytest.approx(per / 3600, abs=1e-6)
    # at the named scale, the mean fault stops all 128 GPUs for its seconds of the job
    assert k["cost_at_scale"]["gpu_h"] == pytest.approx(per / 2 * 128 / 3600, abs=1e-6)
    assert k["why"] == [f"trial 2 ({c1.target}, step {c1.step}): healed at level job, where the plan expects "
                        "injob",
                        f"trial 3 ({c2.target}, step {c2.step}): lost 6 steps, expected lost<=4"]
    card = {"job": "t", "expect": ["lost<=4"], "reference": {}, "rows": rows, "skipped": {}, "problem": "",
            "passed": False, "kinds": [k], "plan": {"repeat": 3, "seed": 2, "plan_id": "x"}}
    text = table(card)
    assert "sigkill               1/3" in text and "5.00s [4.00s-9.00s]" in text and "injob x2, job" in text
    assert "sigkill #2" in text
    # a kind's name longer than the column (corrupt-checkpoint #1) widens it: the columns stay apart, aligned
    long = table({**card, "rows": [{**r, "fault": "corrupt-checkpoint"} for r in rows]}).splitlines()
    trials = [ln for ln in long if ln.startswith("  corrupt-checkpoint #")]
    assert len(trials) == 3 and all(re.match(r"  corrupt-checkpoint #\d {2,}\S", ln) for ln in trials), long
    assert len({len(ln) for ln in trials}) == 1, long
    recheck = table({**card, "plan": {**card["plan"], "recheck": "m1"}})
    assert "FAILED (3 trials per kind, seed 2, plan x, a re-check of plan m1)" in recheck, recheck
    assert validate_junit(junit(card))["sigkill #3"] == ["lost 6 steps, expected lost<=4"]


def test_a_card_that_ran_no_trial_fails_every_kind_with_its_reason() -> None:
    from eksft_nb import cost
    from eksft_nb.resilience import scoring

    why = "the job never committed a checkpoint before its last step"
    kinds = scoring.score([], ["sigkill", "exception"], 3, {}, why, cost.Pricing(), 2)
    assert [(k["kind"], k["passed"], k["trials"], k["ok"], k["why"]) for k in kinds] == [
        ("sigkill", 0, 3, False, [why]), ("exception", 0, 3, False, [why])]


def campaign(tmp_path: Path) -> tuple[plan.Plan, dict, Path]:
    from eksft_nb.resilience import manifest

    spec = JobSpec(name="t")
    p = plan.build(spec, reference(), "t", [FaultKind.SIGKILL], repeat=3, seed=2)
    rows = [trial_row(c) for c in p.cases[:2]]   # the third did not run yet
    card = {"job": "t", "expect": ["lost<=4"], "reference": {"job": "t-ref", "digest": "d1"}, "rows": rows,
            "skipped": {}, "problem": "", "passed": False}
    m = manifest.build(card, spec, p.cases, p.seed, p.repeat, p.window, p.kinds, 0.02)
    path = tmp_path / "m.json"
    manifest.write(path, m)
    return p, m, path


def test_a_manifest_holds_the_ground_truth_beside_what_was_observed_and_reproduces_its_plan(
        tmp_path: Path) -> None:
    from eksft_nb.resilience import manifest

    p, m, path = campaign(tmp_path)
    assert (m["format"], m["version"], m["plan"]["seed"]) == ("eksft-campaign", 1, 2)
    assert m["plan"]["window"] == [10, 18]
    first = m["trials"][0]
    assert first["injections"] == [{"fault": "sigkill", "rank": 1, "step": p.cases[0].step}]
    assert first["expected_level"] == "injob" and first["observed"]["level"] == "injob"
    assert first["observed"]["fired_step"] == p.cases[0].step and first["observed"]["passed"] is True
    assert m["trials"][2]["observed"] is None   # planned, not run yet
    back = manifest.read(path)
    assert back.plan_id == m["plan_id"] and back.seed == 2 and back.window == (10, 18)
    # a re-check runs the same injections under new names
    again = manifest.cases(back, "u")
    assert [(c.job, c.step, c.faults[0].fault, c.faults[0].rank, c.expected) for c in again] == \
        [(f"u-sigkill-{c.trial}", c.step, "sigkill", c.faults[0].rank, c.expected) for c in p.cases]
    # and the seed it records draws the same plan again
    redrawn = plan.draw(back.spec, "t", [FaultKind(k) for k in back.kinds], back.window, back.repeat,
                        back.seed)
    assert [manifest.injection(f) for c in redrawn for f in c.faults] == \
        [i for t in m["trials"] for i in t["injections"]]
    # what was observed never changes the plan's id
    assert manifest.plan_id(m["plan"], m["trials"]) == manifest.plan_id(
        m["plan"], [{**t, "observed": None} for t in m["trials"]])


def test_a_recheck_names_what_moved_and_fails_on_a_regression() -> None:
    from eksft_nb.resilience import manifest

    then = {"level": "injob", "passed": True, "downtime_s": 2.0, "detection_s": 0.5, "lost": 3,
            "state_check": "match"}
    assert manifest.differences(then, dict(then)) == [] and manifest.changes(then, dict(then)) == []
    now = {**then, "level": "job", "passed": False, "downtime_s": 9.0, "lost": 5}
    assert manifest.differences(then, now) == ["healed at level job, the manifest's run at injob",
                                               "passed in the manifest's run, fails now"]
    assert manifest.changes(then, now) == ["downtime 9.00s, 2.00s in the manifest's run",
                                           "lost 5 steps, 3 in the manifest's run"]


def _mutate(m: dict, path: tuple, value: object) -> dict:
    import copy

    out = copy.deepcopy(m)
    node = out
    for key in path[:-1]:
        node = node[key]
    if value is KeyError:
        del node[path[-1]]
    else:
        node[path[-1]] = value
    return out


@pytest.mark.parametrize(("path", "value", "said"), [
    (("version",), 2, "not a version-1 eksft-campaign manifest"),
    (("plan", "seed"), "7", "plan.seed '7' is not a whole number"),
    (("plan", "repeat"), 0, "plan.repeat 0 is not a whole number from 1"),
    (("plan", "window"), [18, 10], "plan.window ends before it begins"),
    (("trials", 0, "kind"), "sigkil", "a trial's kind 'sigkil' is not a fault kind"),
    (("trials", 0, "injections", 0, "rank"), 9, "rank 9"),
    (("trials", 0, "injections", 0, "step"), KeyError, "has no step"),
    (("trials", 0, "injections", 0, "fault"), "hang", "does not inject sigkill first"),
    (("trials", 0, "expected_level"), "warm", "expected_level 'warm' is not one of"),
    (("trials", 0, "observed", "downtime_s"), "fast", "observed downtime_s 'fast' is not a number"),
    (("trials", 1, "trial"), 1, "a trial is listed twice"),
    (("trials", 0, "surprise"), 1, "a trial has unknown field(s) 'surprise'"),
    (("spec", "nnodes"), -1, "nnodes"),
    (("trials",), [], "it holds no trial")])
def test_a_bad_manifest_is_refused_in_one_line(tmp_path: Path, path: tuple, value: object, said: str) -> None:
    from eksft_nb.resilience import manifest

    _, m, _ = campaign(tmp_path)
    with pytest.raises(EksftError) as e:
        manifest.parse(json.dumps(_mutate(m, path, value)), "m.json")
    line = str(e.value)
    assert said in line and "\n" not in line and line.startswith("m.json"), line
    for raw in (b"\xff\xfe", b"[]", b'{"version": NaN}', b"1" * 10):
        with pytest.raises(EksftError):
            manifest.parse(raw)
    big = tmp_path / "big.json"
    big.write_bytes(b" " * (manifest.MAX_BYTES + 1))
    with pytest.raises(EksftError, match="over 8 MiB"):
        manifest.read(big)


JSON_VALUES = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False)
                           | st.text(max_size=10), lambda inner: st.lists(inner, max_size=3)
                           | st.dictionaries(st.text(max_size=8), inner, max_size=3), max_leaves=8)


@given(st.binary(max_size=200) | JSON_VALUES.map(lambda v: json.dumps(v).encode()))
def test_any_bytes_are_a_manifest_or_one_line(raw: bytes) -> None:
    from eksft_nb.resilience import manifest

    try:
        manifest.parse(raw)
    except EksftError as e:
        assert "\n" not in str(e)


@given(st.data())
def test_any_edit_of_a_manifest_is_read_whole_or_refused_in_one_line(tmp_path_factory: pytest.TempPathFactory,
                                                                     data: st.DataObject) -> None:
    from eksft_nb.resilience import manifest

    _, m, _ = campaign(tmp_path_factory.mktemp("m"))
    paths = [("version",), ("job",), ("plan", "seed"), ("plan", "repeat"), ("plan", "window"),
             ("plan", "kinds"),
             ("trials", 0, "injections", 0, "rank"), ("trials", 0, "injections", 0, "step"),
             ("trials", 1, "observed", "level"), ("trials", 1, "observed", "lost"), ("trials", 2, "trial"),
             ("spec", "steps"), ("reference",), ("trials", 0, "injections")]
    edited = _mutate(m, data.draw(st.sampled_from(paths)), data.draw(JSON_VALUES | st.just(KeyError)))
    try:
        back = manifest.parse(json.dumps(edited))
    except EksftError as e:
        assert "\n" not in str(e)
    else:
        assert back.trials and all(t.injections[0].fault == t.kind for t in back.trials)
