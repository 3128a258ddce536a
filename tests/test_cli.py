"""Bad input: one clear line naming the problem and the fix, a non-zero exit, nothing changed on disk."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from eksft_nb.jobdir import jobs_root
from jobs import cli, events


def snapshot(root: Path | None = None) -> dict[str, float]:
    root = root or jobs_root()
    if not root.exists():
        return {}
    return {str(p): p.stat().st_mtime for p in root.rglob("*")}


def assert_rejected(args: list[str], *expected: str, watch: Path | None = None) -> None:
    """``watch``: the folder that must not change (default: every job folder)."""
    before = snapshot(watch)
    proc = cli(*args)
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("eksft: error: "), proc.stderr
    for text in expected:
        assert text in lines[0], lines[0]
    assert "Traceback" not in proc.stderr
    assert snapshot(watch) == before, "a rejected command changed files on disk"


@pytest.mark.parametrize("args, expected", [
    (["run", "--name", "Not_A_Label"], ["invalid job name", "use e.g. --name not-a-label"]),
    (["run", "--name", "ok", "--nproc-per-node", "0"], ["nproc_per_node must be an integer >= 1, got 0"]),
    (["run", "--name", "ok", "--steps", "-3"], ["steps must be an integer >= 1, got -3"]),
    (["run", "--name", "ok", "--steps", "many"], ["--steps expects int, got 'many'"]),
    (["run", "--name", "ok", "--fault", "explode:0@3"], ["unknown fault 'explode'", "did you mean"]),
    (["run", "--name", "ok", "--fault", "hang:5@3"], ["rank 5 is out of range for a job of 2 ranks"]),
    (["run", "--name", "ok", "--fault", "kill-launcher:3@3"], ["node 3 is out of range"]),
    (["run", "--name", "ok", "--steps", "40", "--fault", "sigkill:1@41"],
     ["step 41 is past the last step of the job (40): sigkill would never fire"]),
    (["run", "--name", "ok", "--fault", "sigkill@x"], ["cannot parse fault", "kind[:rank][@step]"]),
    (["run", "--name", "ok", "--resume", "step:40"], ["no checkpoint in", "ckpts"]),
    (["run", "--name", "ok", "--resume", "/nowhere/step_00000010"], ["no checkpoint at /nowhere"]),
    (["status", "no-such-job"], ["no job named 'no-such-job'"]),
])
def test_bad_run_input(args: list[str], expected: list[str]) -> None:
    assert_rejected(args, *expected)


@pytest.mark.parametrize("args, hint", [
    (["run", "--stepz", "3"], "did you mean --steps?"),          # run's own flags, not inject's --step
    (["inject", "some-job", "sigkill", "--rnak", "1"], "did you mean --rank?"),
    (["list", "--jsn"], "did you mean --json?"),
])
def test_a_mistyped_option_gets_the_closest_flag_of_its_command(args: list[str], hint: str) -> None:
    before = snapshot()
    proc = cli(*args)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert "unrecognized arguments:" in last and last.endswith(f"({hint})"), proc.stderr
    assert snapshot() == before


def test_bad_spec_file(tmp_path: Path) -> None:
    spec = tmp_path / "job.yaml"
    spec.write_text("name: from-file\nstep: 10\n")
    assert_rejected(["run", "--spec", str(spec)], "unknown spec field 'step'", "did you mean steps")


@pytest.mark.slow
def test_bad_commands_for_an_existing_job(finished_job: str) -> None:
    assert_rejected(["run", "--name", finished_job], "already exists", "choose another --name")
    assert_rejected(["inject", finished_job, "hang", "--rank", "1"],
                    "has already ended (succeeded): faults only go to a running job")
    assert_rejected(["resume", finished_job, "--step", "7"], "no committed checkpoint at step 7",
                    "pick one of: ")
    assert_rejected(["inject", finished_job, "nonsense"], "unknown fault 'nonsense'")


@pytest.mark.slow
def test_bad_fault_commands_for_a_running_job() -> None:
    assert cli("run", "--name", "running", "--model", "tiny", "--steps", "100000", "--detach").returncode == 0
    deadline = time.time() + 120
    while time.time() < deadline and len(events("running", "step")) < 3:
        time.sleep(0.5)
    control = jobs_root() / "running" / "control"  # the running job itself keeps writing its events
    try:
        assert_rejected(["inject", "running", "hang", "--rank", "9"], "rank 9 is out of range",
                        "--rank between 0 and 1",
                        watch=control)
        assert_rejected(["inject", "running", "kill-launcher", "--rank", "0"], "does not target a rank",
                        watch=control)
        assert_rejected(["inject", "running", "hang", "--step", "1"], "step 1 has already passed",
                        watch=control)
        assert_rejected(["inject", "running", "hang", "--step", "100001"],
                        "step 100001 is past the last step of the job (100000): hang would never fire",
                        "use a step from 1 to 100000", watch=control)
        assert_rejected(["inject", "running", "slow-rank", "--delay", "-1"],
                        "slow-rank parameter delay is -1.0",
                        "seconds per step, > 0", watch=control)
        pending = control / "pending"
        (pending / "garbage.json").write_text("{not json")  # a malformed command written by hand
        ok = cli("inject", "running", "exception", "--rank", "1")
        assert ok.returncode == 0 and ok.stdout.startswith(("fired exception on rank 1",
                                                            "queued exception for rank 1"))
        while time.time() < deadline and not (control / "rejected" / "garbage.json").exists():
            time.sleep(0.5)   # the ranks set it aside, once, with the reason
        assert (control / "rejected"
                / "garbage.reason").read_text().startswith("a fault command is not valid JSON")
    finally:
        assert cli("stop", "running").returncode == 0
    assert os.path.exists(jobs_root() / "running" / "events.jsonl")
