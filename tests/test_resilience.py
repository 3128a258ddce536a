"""The resilience test: expectations parsed strictly, the plan drawn from the reference run, the card
in its three forms, and real jobs tested through the CLI (a built-in trainer killed twice, a job that
never checkpoints, a user script)."""

from __future__ import annotations

import json
import os
import threading
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
from IPython.core.error import UsageError

from eksft_nb.engines.torchft.checks import FAULTS as TORCHFT_FAULTS
from eksft_nb.engines.torchft.hold import restart_point
from eksft_nb.errors import EksftError
from eksft_nb.events import make
from eksft_nb.goodput import missing_batches
from eksft_nb.monitor import JobMonitor
from eksft_nb.resilience import expect, plan
from eksft_nb.resilience.card import Row, inprocess_note, junit, state_check, table
from eksft_nb.spec import JobSpec
from eksft_nb.states import FaultKind
import nvrx_releases as releases
from jobs import cli, events, job_dir, wait_for
from junit_xml import validate_junit
from reference_run import T0, reference

REPO = Path(__file__).resolve().parents[1]

# a group killed at step 30 (--at-step: a torchft job's first async save committed only at step 128 of 200 in
# its reference, 14 s in, which would leave the faults little room) comes back and heals well before the end
# (2.5 s, 50 steps, on a quiet machine)
TORCHFT_STEPS = 200


# ---- expectations ------------------------------------------------------------------------------

def test_expectations_parse_and_check() -> None:
    checks = expect.parse("level<=injob, downtime<5s, detection<=500ms, lost<=10, state=reference")
    assert [c.text for c in checks] == ["level<=injob", "downtime<5s", "detection<=0.5s", "lost<=10",
                                        "state=reference"]
    row = {"level": "job", "downtime_s": 6.5, "detection_s": 0.2, "lost": 12, "state_check": "match",
           "state_detail": "same digest"}
    assert [c.check(row) for c in checks] == [
        "healed at level job, expected level<=injob", "downtime 6.50s, expected downtime<5s", "",
        "lost 12 steps, expected lost<=10", ""]
    assert expect.parse("level<=in-process")[0].check({**row, "level": "none"}) == ""   # the label works too
    assert [c.text for c in expect.parse(None)] == ["state=reference"]


@pytest.mark.parametrize(("text", "problem"), [
    ("levle<=injob", "unknown expectation 'levle'"), ("level<=warm", "unknown level 'warm'"),
    ("downtime<5 s", "cannot read expectation"), ("downtime<fast", "not a duration"),
    ("lost<=1.5", "whole number"),
    ("state=same", "state=reference"), ("lost<=3,,level<=job", "empty clause"), ("lost~3", "cannot read")])
def test_bad_expectations_are_one_line(text: str, problem: str) -> None:
    with pytest.raises(EksftError) as e:
        expect.parse(text)
    assert problem in str(e.value) and "\n" not in str(e.value), str(e.value)


# ---- the plan ----------------------------------------------------------------------------------

def test_faults_fire_after_the_first_committed_checkpoint() -> None:
    # the save at 5 commits at 7.5 s: step 9 is the first to start after it, and one step of margin
    assert plan.fault_step(reference()) == 10
    assert plan.fault_step(reference(commit_s=0.0)) == 7
    assert plan.fault_step(reference(ckpt_at=None)) is None
    assert plan.fault_step(reference(ckpt_at=20, commit_s=0.0)) is None   # the last step's save protects none


def test_the_plan_has_one_case_per_kind_that_applies() -> None:
    spec = JobSpec(name="t")
    p = plan.build(spec, reference(), "t", refused={"kill-supervisor"})
    assert [c.kind for c in p.cases] == [k for k in FaultKind if k != FaultKind.KILL_SUPERVISOR]
    assert p.skipped == {"kill-supervisor": "the local backend cannot deliver it"}
    sigkill = next(c for c in p.cases if c.kind == FaultKind.SIGKILL)
    assert (sigkill.job, sigkill.step, sigkill.target, sigkill.faults[0].rank) == \
        ("t-sigkill", 10, "rank 1", 1)
    corrupt = next(c for c in p.cases if c.kind == FaultKind.CORRUPT_CHECKPOINT)
    assert [(f.fault, f.step) for f in corrupt.faults] == [("corrupt-checkpoint", 10), ("sigkill", 11)]
    assert next(c for c in p.cases if c.kind == FaultKind.KILL_LAUNCHER).target == "node 0"
    # a script whose saves eksft never saw: no storage faults, and --at-step places the others
    script = JobSpec(name="t", script="train.py")
    p = plan.build(script, reference(ckpt_at=None), "t", at_step=4)
    assert set(p.skipped) == {k.value for k in plan.STORAGE_KINDS} and p.fault_step == 4 and not p.problem
    assert p.expected_s(10.0, script) == pytest.approx(len(p.cases) * (10.0 + plan.RESTART_ALLOWANCE_S))


def test_a_job_that_never_checkpoints_has_no_case_and_says_why() -> None:
    p = plan.build(JobSpec(name="t"), reference(ckpt_at=None), "t")
    assert not p.cases and "never committed a checkpoint" in p.problem
    script = plan.build(JobSpec(name="t", script="x.py"), reference(ckpt_at=None), "t")
    assert "--at-step" in script.problem


def test_named_kinds_are_checked() -> None:
    assert plan.parse_kinds("sigkill, hang,sigkill") == [FaultKind.SIGKILL, FaultKind.HANG]
    with pytest.raises(EksftError, match="did you mean sigkill"):
        plan.parse_kinds("sigkil")
    with pytest.raises(EksftError, match="names no fault"):
        plan.parse_kinds(" , ")
    with pytest.raises(EksftError, match="do not apply to this job: disk-full"):
        plan.build(JobSpec(name="t", script="x.py"), reference(ckpt_at=None), "t", [FaultKind.DISK_FULL],
                   at_step=3)


def test_state_is_the_digest_or_else_the_loss_curve() -> None:
    ref, same = reference(), reference()
    assert state_check(same, ref)[0] == "match"
    off = reference()
    off.steps.loss[7] *= 1.05
    check, why = state_check(off, ref)
    assert check == "differs" and "loss at step 8" in why and "tolerance 2 %" in why
    assert state_check(off, ref, tolerance=0.1)[0] == "match"
    ref.digest, same.digest = "abc", "abd"
    assert state_check(same, ref) == ("differs", "final digest abd, the reference's abc")


def test_a_job_that_reports_no_state_must_run_all_the_references_steps() -> None:
    # an unmodified script: no digest, no loss; a case that resumed redoes steps, one that left its
    # loop early (a SIGTERM it caught, exit 0) runs fewer
    ref, redone, early = reference(), reference(steps=26), reference(steps=14)
    for mon in (ref, redone, early):
        mon.steps.loss[:] = [None] * len(mon.steps.loss)
    check, why = state_check(redone, ref)
    assert check == "match" and "ran 26 optimizer steps" in why and "reference's 20" in why, why
    check, why = state_check(early, ref)
    assert check == "differs"
    assert "ran 14 optimizer steps, fewer than the reference's 20: it stopped early" in why


# ---- the card ----------------------------------------------------------------------------------

def test_a_card_that_ran_no_case_fails_in_every_form() -> None:
    card = {"job": "t", "expect": ["state=reference"], "reference": {}, "rows": [], "skipped": {},
            "problem": "the job never committed a checkpoint", "passed": False}
    assert validate_junit(junit(card)) == {"plan": ["the job never committed a checkpoint"]}
    assert "FAILED" in table(card) and "never committed" in table(card)


def test_junit_holds_colour_codes_and_control_characters_as_xml_can() -> None:
    """Issue 34: a failure text with a rank's ANSI colour codes or a NUL made --junit write XML that no
    reader parses. Escape sequences are dropped, other characters XML 1.0 cannot hold are written as
    their codes; the file parses and says the same."""
    why = ["\x1b[1;31mRuntimeError\x1b[0m: loss \x00diverged\x0b at step 3\x1b]0;title\x07",
           "rank 1 said \udcff\ufffe\x1b"]
    row = {"case": "sigkill \x1b[32mrank 1\x1b[0m", "job": "t-\x01sigkill", "why": why, "level": "injob",
           "downtime_s": 1.5, "lost": 2, "state_check": "match"}
    card = {"job": "t\x1b[0m", "expect": [], "reference": {}, "rows": [row], "skipped": {}, "problem": "",
            "passed": False}
    xml = junit(card)
    assert validate_junit(xml) == {"sigkill rank 1": ["RuntimeError: loss \\x00diverged\\x0b at step 3"]}
    suite = ET.fromstring(xml.encode())   # the bytes a file holds, through the strict (expat) parser
    [case] = suite
    assert suite.get("name") == "resilience.t"
    assert case.find("failure").text == ("RuntimeError: loss \\x00diverged\\x0b at step 3\n"
                                         "rank 1 said \\udcff\\ufffe\\x1b")
    out = case.find("system-out").text
    assert out == "job t-\\x01sigkill: level injob, downtime 1.50s, lost 2, state match", out


# ---- the front ends (nothing launches on bad input) ---------------------------------------------

def test_bad_input_is_refused_before_any_job_runs(ip: object, tmp_path: Path) -> None:
    before = sorted(p.name for p in (job_dir("x").parent).glob("*")) if job_dir("x").parent.exists() else []
    proc = cli("test", "--name", "bad", "--expect", "lvl<=injob")
    assert proc.returncode == 2 and "unknown expectation 'lvl'" in proc.stderr, proc.stderr
    proc = cli("test", "--name", "bad", "--faults", "sigkil")
    assert proc.returncode == 2 and "did you mean sigkill" in proc.stderr, proc.stderr
    proc = cli("test", "--name", "bad", "--engine", "torchft", "--nnodes", "2", "--nproc-per-node", "1",
               "--faults", "sigkill,segfault")
    assert proc.returncode == 2 and "the torchft engine cannot fire: segfault" in proc.stderr, proc.stderr
    proc = cli("test", "--name", "bad", "--junit", str(tmp_path / "no" / "card.xml"))
    assert proc.returncode == 2 and "does not exist" in proc.stderr, proc.stderr
    proc = cli("test", "--name", "bad", "--repeat", "0", "--manifest", str(tmp_path / "m.json"))
    assert proc.returncode == 2 and "--repeat 0 is not a number of trials" in proc.stderr, proc.stderr
    proc = cli("test", "--name", "bad", "--price", "p9.huge")
    assert proc.returncode == 2 and "neither a price nor an instance type" in proc.stderr, proc.stderr
    (tmp_path / "bad.json").write_text('{"format": "eksft-campaign", "version": 7}')
    proc = cli("test", "--name", "bad", "--recheck", str(tmp_path / "bad.json"))
    assert proc.returncode == 2 and "bad.json: not a version-1 eksft-campaign" in proc.stderr, proc.stderr
    assert not (tmp_path / "m.json").exists()
    with pytest.raises(UsageError, match="unknown expectation"):
        ip.run_line_magic("ftrain", 'test --name bad --expect "lvl<3"')
    with pytest.raises(UsageError, match="--script names a script too"):
        ip.run_cell_magic("ftrain", "test --name bad --script x.py", "print(1)\n")
    with pytest.raises(UsageError, match="did you mean --faults"):
        ip.run_cell_magic("ftrain", "test --fualts sigkill", "print(1)\n")
    after = sorted(p.name for p in (job_dir("x").parent).glob("*")) if job_dir("x").parent.exists() else []
    assert after == before


# ---- real jobs ---------------------------------------------------------------------------------

def run_test(name: str, *args: str, tmp: Path,
             timeout: float = 1500) -> tuple[int, dict, str, dict[str, list[str]]]:
    """``python -m eksft_nb test``: exit code, card, narration, JUnit failures by case."""
    xml = tmp / f"{name}.xml"
    proc = cli("test", "--name", name, "--model", "tiny", "--seed", "0", *args, "--json", "--junit", str(xml),
               timeout=timeout)
    assert proc.stdout.strip().startswith("{"), proc.stderr[-3000:]
    return proc.returncode, json.loads(proc.stdout), proc.stderr, validate_junit(xml.read_text())


def test_the_built_in_trainer_heals_every_trial_of_each_fault_and_the_card_scores_them(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The one real campaign of the suite (CI time): 2 kinds x 2 seeded trials, a manifest and a price."""
    from eksft_nb.resilience import manifest

    releases.use(releases.NEWEST, monkeypatch)   # the card's jobs run on the newest NVRx (nvrx_releases)
    kept = tmp_path / "campaign.json"
    # sync saves: each save is committed before the next step begins, so the save before a trial's fault
    # is always committed when it fires and the rollback is at most ckpt-every steps. An async save
    # commits at the first step boundary after its writer is done: on loaded cores a writer 6 steps
    # late defers the next save too, and a fault then rolls back two saves (11 steps), a real cost the
    # card reports, but no bound this test could hold (test_whatif.py measures that commit lag)
    rc, card, narration, failures = run_test(
        "rt", "--steps", "40", "--ckpt-every", "5", "--ckpt-mode", "sync", "--faults", "sigkill,exception",
        "--repeat", "2",
        "--plan-seed", "3", "--manifest", str(kept), "--price", "p5.48xlarge",
        "--expect", "level<=inprocess, lost<=10, state=reference", tmp=tmp_path)
    trials = {(r["case"], r["trial"]): r for r in card["rows"]}
    assert set(trials) == {(k, n) for k in ("sigkill", "exception") for n in (1, 2)}, narration[-3000:]
    # the expected total is said before the first trial runs
    assert narration.index("expect about") < narration.index("case sigkill #1"), narration
    assert card["reference"]["state"] == "succeeded" and card["reference"]["digest"]
    for r in trials.values():
        assert r["fired"] and r["state_check"] == "match", r   # the final digest is the reference's
        assert r["at_step"] > 5 and r["lost"] <= 10 and r["downtime_s"] > 0
        # each trial is a real job in its own folder: its events hold the fault it fired, where planned
        fired = events(r["job"], "fault")
        assert [(e["fault"], e["at_step"]) for e in fired] == [(r["fault"], r["at_step"])]
        assert r["fired_step"] == r["at_step"] and r["fired_t"] == fired[0].t
        # its cost: downtime and recomputed steps on both ranks, at p5.48xlarge's price per GPU-hour
        assert r["lost_gpu_s"] >= 2 * r["downtime_s"] > 0
        assert r["cost"]["usd"] == pytest.approx(r["lost_gpu_s"] / 3600 * 55.04 / 8, abs=1e-4)
    for kind in ("sigkill", "exception"):   # a kind's two trials at two steps
        assert trials[(kind, 1)]["at_step"] != trials[(kind, 2)]["at_step"]
    for n in (1, 2):
        x, s = trials[("exception", n)], trials[("sigkill", n)]
        assert x["level"] == "inprocess" and x["passed"], x
        # a lost rank process is healed in-job: not what this card asked for, so every sigkill trial fails
        assert s["level"] == "injob" and not s["passed"]
        assert s["why"] == ["healed at level injob, expected level<=inprocess"]
        assert sum(s["phases"].values()) == pytest.approx(s["downtime_s"], abs=0.01)
    kinds = {k["kind"]: k for k in card["kinds"]}
    assert (kinds["exception"]["passed"], kinds["exception"]["ok"]) == (2, True)
    assert (kinds["sigkill"]["passed"], kinds["sigkill"]["ok"], kinds["sigkill"]["levels"]) == (0, False,
                                                                                                {"injob": 2})
    assert all(k["trials"] == 2 and k["downtime_s"]["n"] == 2 and k["cost"]["usd"] > 0
               for k in kinds.values())
    assert rc == 1 and not card["passed"]
    why = ["healed at level injob, expected level<=inprocess"]
    assert failures == {"sigkill #1": why, "sigkill #2": why, "exception #1": [], "exception #2": []}
    # the campaign's manifest: read back whole, the ground truth of each trial beside what it showed
    m = manifest.read(kept)
    assert m.plan_id == card["plan"]["plan_id"] and m.seed == 3 and m.repeat == 2
    for t in m.trials:
        r = trials[(t.kind, t.trial)]
        assert (t.injections[0].step, t.injections[0].rank, t.job) == \
            (r["at_step"], int(r["target"][5:]), r["job"])
        assert t.observed["level"] == r["level"] and t.observed["fired_t"] == r["fired_t"]
        assert t.expected_level == {"sigkill": "injob", "exception": "inprocess"}[t.kind]
    redrawn = plan.draw(m.spec, "rt", [FaultKind(k) for k in m.kinds], m.window, m.repeat, m.seed)
    assert [(c.kind.value, c.step, c.faults[0].rank) for c in redrawn] == \
        [(t.kind, t.injections[0].step, t.injections[0].rank) for t in m.trials]
    # in-process restart on an NVRx that deprecates it: what in-job restart, its way forward, cost here
    mean = {k: sum(trials[(k, n)]["downtime_s"] for n in (1, 2)) / 2 for k in ("sigkill", "exception")}
    assert card["note"] == (f"NVRx {releases.NEWEST} deprecates in-process restart (inprocess.Wrapper): an "
                            f"in-job restart took {mean['sigkill']:.2f}s here, an in-process one "
                            f"{mean['exception']:.2f}s (--no-inprocess: every recovery in-job)")
    assert card["note"] in narration


def test_a_job_that_never_checkpoints_fails_the_card_with_the_reason(tmp_path: Path) -> None:
    rc, card, _, failures = run_test("nockpt", "--steps", "12", "--ckpt-every", "0", tmp=tmp_path)
    assert rc == 1 and not card["passed"] and card["rows"] == []
    assert "never committed a checkpoint" in card["problem"], card
    # no manifest asked for, yet the card names its plan (what a --manifest run of it would record)
    assert len(card["plan"]["plan_id"]) == 16 and int(card["plan"]["plan_id"], 16) >= 0, card["plan"]
    assert list(failures) == ["plan"] and "never committed a checkpoint" in failures["plan"][0]
    assert job_dir("nockpt-ref").is_dir() and not job_dir("nockpt-sigkill").exists()   # no case ran
    # every kind that applies fails its row with the reason (the storage kinds too: it saved its last step)
    assert [k["kind"] for k in card["kinds"]] == [k.value for k in FaultKind]
    assert all((k["passed"], k["ok"], k["why"]) == (0, False, [card["problem"]]) for k in card["kinds"])


def test_a_users_script_is_checked_by_its_loss_curve(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    script = str(REPO / "tests" / "scripts" / "aware.py")
    monkeypatch.chdir(tmp_path)   # each of the test's jobs runs the script in a folder of its own, made here
    rc, card, _, failures = run_test("scr", "--script", script, "--steps", "30", "--ckpt-every", "5",
                                     "--faults", "sigkill", "--expect", "level<=injob, state=reference",
                                     tmp=tmp_path)
    [row] = card["rows"]
    assert card["reference"]["digest"] is None   # a script reports no digest: its losses are compared
    assert row["state_check"] == "match" and "loss curve within 2 %" in row["state_detail"], row
    assert row["level"] == "injob" and row["passed"] and rc == 0, card
    assert failures == {"sigkill": []}
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_dir()) == ["scr-ref", "scr-sigkill"]


def test_a_scripts_working_folders_must_be_new(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "old-sigkill").mkdir()
    proc = cli("test", "--name", "old", "--script", str(REPO / "tests" / "scripts" / "aware.py"))
    assert proc.returncode == 2, proc.stderr
    assert f"working folders {tmp_path / 'old-sigkill'} exist already" in proc.stderr, proc.stderr
    assert not job_dir("old-ref").exists() and not (tmp_path / "old-ref").exists()   # nothing ran


NVRX_EXAMPLES = os.environ.get("EKSFT_NVRX_EXAMPLES")


@pytest.mark.slow
@pytest.mark.timeout(3600)   # nine real jobs, each about a minute on 2 busy cores
@pytest.mark.skipif(not NVRX_EXAMPLES, reason="set EKSFT_NVRX_EXAMPLES to the examples/ folder of NVRx "
                    "0.7.0's repository (not in its wheel, not shipped here; see docs/nvrx-versions.md)")
def test_nvrx_heartbeats_example_unmodified_passes_every_applicable_fault(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    releases.use(releases.NEWEST, monkeypatch)
    # NVRx's own example, as its release ships it: it saves checkpoint.pt into --output_dir at each epoch's
    # end (100 steps of 2 ranks x batch 8) and resumes from it, and reports neither loss nor digest
    script = Path(str(NVRX_EXAMPLES)) / "fault_tolerance" / "train_ddp_heartbeats_api.py"
    monkeypatch.chdir(tmp_path)
    args = "--device cpu --hidden 64 --train_dataset_size 1600 --val_dataset_size 200 --epochs 2 --batch 8 " \
           "--output_dir out"
    rc, card, narration, failures = run_test(
        "nvhb", "--script", str(script), "--script-args", args, "--no-inprocess", "--heartbeat-timeout", "8",
        "--at-step", "110", tmp=tmp_path, timeout=3300)
    applicable = [k.value for k in FaultKind if k not in plan.STORAGE_KINDS]   # local refuses none
    assert [r["case"] for r in card["rows"]] == applicable, narration[-3000:]
    why = "it acts on checkpoints eksft writes, and the reference run showed none"
    assert card["skipped"] == {k.value: why for k in FaultKind if k in plan.STORAGE_KINDS}
    for r in card["rows"]:
        assert set(r) == set(Row.__annotations__) and r["fired"] and r["at_step"] == 110, r
        assert r["passed"] and r["why"] == [] and r["state_check"] == "match", (r, narration[-3000:])
        assert "optimizer steps" in r["state_detail"] and "at least the reference's" in r["state_detail"], r
        # each job ran in a working folder of its own: the script's checkpoint there is its own
        assert (tmp_path / r["job"] / "out" / "checkpoint.pt").is_file()
    rows = {r["case"]: r for r in card["rows"]}
    for kind in ("exception", "hang", "sigkill", "segfault"):   # a rank lost: ft_launcher restarts the ranks
        assert rows[kind]["level"] == "injob" and rows[kind]["downtime_s"] > 0, rows[kind]
    assert rows["kill-launcher"]["level"] == "job", rows["kill-launcher"]
    assert rc == 0 and card["passed"] and card["problem"] == ""
    assert failures == {k: [] for k in applicable}   # the JUnit XML: every case a testcase, none failed
    assert (tmp_path / "nvhb-ref" / "out" / "checkpoint.pt").is_file()


def test_the_card_says_what_in_job_restart_costs_where_nvrx_deprecates_in_process() -> None:
    def row(case: str, level: str, downtime: float) -> dict:
        return {"case": case, "level": level, "downtime_s": downtime}

    both = [row("exception", "inprocess", 1.0), row("sigkill", "injob", 6.0), row("hang", "injob", 8.0)]
    assert inprocess_note("0.4.1", True, both) == "" and inprocess_note(None, True, both) == ""
    assert inprocess_note("0.7.0", False, both) == ""   # in-process restart was off: nothing to say
    assert inprocess_note("0.6.0", True, both) == (
        "NVRx 0.6.0 deprecates in-process restart (inprocess.Wrapper): an in-job restart took 7.00s here, an "
        "in-process one 1.00s (--no-inprocess: every recovery in-job)")
    assert inprocess_note("0.7.0", True, both[:1]).endswith(
        "what an in-job restart costs instead was not measured here (a sigkill case measures it)")
    card = {"job": "j", "expect": [], "reference": {}, "rows": [], "skipped": {}, "problem": "",
            "passed": False, "note": inprocess_note("0.7.0", True, both)}
    assert table(card).splitlines()[-1] == f"  note: {card['note']}"


def test_the_cards_figure_stacks_each_cases_downtime_by_phase() -> None:
    import plotly.graph_objects as go

    from eksft_nb.resilience.figures import card_figure

    phases = {"detection": 0.5, "teardown": 1.0, "reformation": 1.5, "restore": 2.0, "first_step": 0.25}
    rows = [{"case": "sigkill", "passed": True, "level": "injob", "phases": phases},
            {"case": "slow-rank", "passed": False, "level": "none", "phases": {}}]
    card = {"job": "t", "passed": False, "rows": rows}
    live = go.FigureWidget()
    card_figure(card, live)
    assert [t.name for t in live.data] == ["detection", "teardown", "reformation", "restore", "first step"]
    assert [t.x[0] for t in live.data] == list(phases.values()) and [t.x[1] for t in live.data] == [0.0] * 5
    assert list(live.data[0].y) == ["sigkill (pass, injob)", "slow-rank (FAIL, none)"]


def test_a_row_reads_the_cases_events() -> None:
    from eksft_nb.resilience.card import row

    [case] = plan.build(JobSpec(name="t"), reference(), "t", [FaultKind.SIGKILL]).cases
    ref = reference()
    ref.digest = "d1"

    def case_job(fired: bool, digest: str = "d1", state: str = "succeeded") -> JobMonitor:
        mon = reference()
        evs = [make("fault", "t", rank=1, t=T0 + 9.5, fault="sigkill", id=case.faults[0].id, target_rank=1,
                    at_step=10)] if fired else []
        evs += [make("restart", "t", t=T0 + 14, level="injob", cause="injected sigkill on rank 1",
                     blame_rank=1, fault_time=T0 + 9.5, detection_s=0.5, downtime_s=4.0, rolled_back_steps=4,
                     resumed_step=5,
                     phases={"detection": 0.5, "teardown": 1.0, "reformation": 1.0, "restore": 1.5,
                             "first_step": 0.0})] if fired else []
        evs.append(make("job_end", "t", t=T0 + 30, state=state, reason="", final_step=20, digest=digest))
        mon.update(evs)
        return mon

    checks = expect.parse("level<=injob, downtime<5s, lost<=4, state=reference")
    r = row(case, case_job(True), ref, checks, "")
    assert (r["level"], r["detection_s"], r["downtime_s"], r["lost"]) == ("injob", 0.5, 4.0, 4)
    assert r["passed"]
    assert r["phases"]["restore"] == 1.5 and r["state_check"] == "match"
    r = row(case, case_job(True, digest="d2"), ref, checks, "")
    assert not r["passed"] and r["why"] == ["state: final digest d2, the reference's d1"]
    r = row(case, case_job(False), ref, checks, "")
    assert not r["passed"] and r["why"][0].startswith("the fault never fired (scheduled at step 10")
    r = row(case, case_job(True, state="failed"), ref, checks, "")
    assert r["level"] is None and r["why"] == ["the job did not heal: it ended failed"]


# ---- torchft ------------------------------------------------------------------------------------

TORCHFT = JobSpec(name="t", engine="torchft", nnodes=2, nproc_per_node=1)


def test_a_torchft_plan_takes_the_kinds_its_engine_fires() -> None:
    p = plan.build(TORCHFT, reference(), "t")
    assert [c.kind.value for c in p.cases] == [k.value for k in FaultKind if k.value in TORCHFT_FAULTS]
    assert set(p.skipped) == {k.value for k in FaultKind} - set(TORCHFT_FAULTS)
    fires = ", ".join(TORCHFT_FAULTS)
    assert p.skipped["segfault"] == f"the torchft engine cannot fire it (it fires {fires})"


def torchft_case(case: plan.Case, digests: tuple[str, ...], healed: bool = True) -> tuple[JobMonitor, list]:
    """A torchft case job over the reference's 20 steps: group 1's rank killed at step 10, restarted by the
    supervisor, healed from group 0 at step 12 (steps 10-12 trained without its batch); each rank's digest."""
    cause = "replica group 1's rank was killed (SIGKILL)"
    evs = [make("fault", "t", rank=1, t=T0 + 9.5, fault="sigkill", id=case.faults[0].id, target_rank=1,
                at_step=10),
           make("failure", "t", t=T0 + 9.7, level="job", cause=cause, blame_rank=1, fault_time=T0 + 9.5,
                detected_at=T0 + 9.7)]
    if healed:
        evs += [make("rank_start", "t", rank=1, t=T0 + 11.0, pid=7, host="h", job_attempt=0, injob_restart=0,
                     inprocess_iteration=0, world_size=2, start_step=0, t_enter=T0 + 10.2),
                make("heal", "t", rank=1, t=T0 + 12.6, from_step=9, step=12, skipped_batches=3, heal_s=0.4),
                make("restart", "t", t=T0 + 12.6, level="job", cause=cause, blame_rank=1, fault_time=T0 + 9.5,
                     detection_s=0.2, downtime_s=0.8, rolled_back_steps=0, resumed_step=12,
                     restored_from="peer", group_downtime_s=3.1, skipped_batches=3, replica_group=1)]
    evs += [make("rank_end", "t", rank=r, t=T0 + 20.5, final_step=20, digest=d, replica_group=r)
            for r, d in enumerate(digests)]
    evs.append(make("job_end", "t", t=T0 + 21, state="succeeded", reason="all 20 steps done", final_step=20,
                    digest=digests[-1]))
    mon = reference()
    mon.steps.batches[9:12] = [1, 1, 1]   # group 0 alone
    mon.update(evs)
    return mon, evs


def test_a_torchft_row_reads_the_groups_recovery_and_fails_where_they_diverged() -> None:
    from eksft_nb.resilience.card import row

    [case] = plan.build(TORCHFT, reference(), "t", [FaultKind.SIGKILL]).cases
    ref = reference()
    ref.digest = "d1"
    checks = expect.parse("level<=job, lost<=0, state=reference")
    mon, evs = torchft_case(case, ("d2", "d2"))
    r = healthy = row(case, mon, ref, checks, "", events=evs)
    assert (r["level"], r["restored_from"], r["lost"], r["skipped_batches"]) == ("job", "peer", 0, 3)
    assert (r["detection_s"], r["downtime_s"]) == (0.2, 0.8) and r["passed"], r
    assert r["state_check"] == "consistent"   # healed from a peer: never the reference's digest, said why
    assert r["state_detail"].startswith("every replica group ended with digest d2 (not the reference's d1")
    mon, evs = torchft_case(case, ("d2", "d3"))
    r = row(case, mon, ref, checks, "", events=evs)
    assert r["state_check"] == "differs" and not r["passed"], r
    assert r["why"] == ["state: the replica groups ended with different weights (group 0 d2, group 1 d3)"]
    # group 1 never came back before the job ended: not healed, and its rank reported no digest
    mon, evs = torchft_case(case, ("d2",), healed=False)
    r = row(case, mon, ref, checks, "", events=evs)
    assert r["level"] is None and r["state_check"] == "differs" and not r["passed"], r
    assert r["why"][0].startswith("the replica group of rank 1 was lost and had not healed from a peer"), r
    text = table({"job": "t", "expect": [], "reference": {}, "rows": [healthy], "skipped": {}, "problem": "",
                  "passed": True})
    assert "restored from peer; 3 batches skipped" in text and "consistent" in text, text


def alone_steps(name: str) -> list:
    """The steps job ``name`` committed with one replica group's batch (none before it exists)."""
    try:
        return [e for e in events(name, "step") if e["batches"] == 1]
    except OSError:
        return []


@pytest.mark.slow
def test_torchft_groups_heal_each_fault_and_the_card_reads_how(tmp_path: Path) -> None:
    pytest.importorskip("torchft")
    from test_torchft import Holds

    # the sigkill case's killed group (group 1) is held before it sets up again until its peer committed a
    # step alone: the card's row then reads a heal with batches skipped, whichever process starts faster
    holds = Holds(tmp_path / "holds")
    holds.add(restart_point(1, 1))
    release = threading.Thread(target=lambda: (wait_for("the sigkill case's peer to train alone", lambda: (
        alone_steps("rtft-sigkill") or not holds.held()), timeout=1500), holds.release()), daemon=True)
    release.start()
    try:
        with holds.env():
            rc, card, narration, failures = run_test(
                "rtft", "--engine", "torchft", "--nnodes", "2", "--nproc-per-node", "1", "--steps",
                str(TORCHFT_STEPS), "--ckpt-every", "5", "--at-step", "30", "--faults", "sigkill,exception",
                "--expect", "level<=job, lost<=0, state=reference", tmp=tmp_path)
    finally:
        holds.release()
        release.join(30)
    rows = {r["case"]: r for r in card["rows"]}
    assert list(rows) == ["sigkill", "exception"] and card["skipped"] == {}, narration[-3000:]
    ref_digest = card["reference"]["digest"]
    for r in rows.values():
        evs = events(r["job"])
        mon = JobMonitor()
        mon.update(evs)
        assert r["fired"] and [e["fault"] for e in events(r["job"], "fault")] == [r["fault"]], r
        assert r["passed"] and r["why"] == [] and r["lost"] == 0, (r, narration[-3000:])
        assert r["skipped_batches"] == missing_batches(mon), r
        assert r["restored_from"] == "peer" and [e["step"] for e in events(r["job"], "heal")], r
        # every group's final digest the same: the reference's, or (a group healed from a peer after
        # training steps without it) consistent with it
        ends = {e["digest"] for e in events(r["job"], "rank_end")}
        assert len(ends) == 1, ends
        assert r["state_check"] == ("match" if ends == {ref_digest} else "consistent"), r
    # a step thrown away inside backward: healed from a peer without a restart, nothing skipped
    x = rows["exception"]
    assert x["level"] == "none" and x["downtime_s"] == 0.0 and x["skipped_batches"] == 0, x
    assert events(x["job"], "step_discarded") and not events(x["job"], "restart"), x
    # a rank killed: its group restarted by the supervisor and healed from its peer, which trained on
    s = rows["sigkill"]
    [restart] = events(s["job"], "restart")
    assert s["level"] == "job" and restart["restored_from"] == "peer" and restart["replica_group"] == 1, s
    assert s["downtime_s"] == pytest.approx(restart["downtime_s"], abs=1e-3) and s["skipped_batches"] > 0, s
    [digest] = {e["digest"] for e in events(s["job"], "rank_end")}
    assert s["state_check"] == "consistent" and digest != ref_digest, s
    assert s["state_detail"].startswith(f"every replica group ended with digest {digest} (not the "), s
    assert rc == 0 and card["passed"] and failures == {"exception": [], "sigkill": []}
