"""NVRx sections on real jobs: a hang inside a step is found by the step section's timeout long before the
heartbeat timeout, while a save longer than that runs on inside its own section; and a script whose every
restart dies of its own error (a section ft_launcher has no timeout for) has each restart counted and the
error named, with its fix, in the job's reason."""

from __future__ import annotations

from pathlib import Path

import pytest

import eksft_nb
from eksft_nb import commands
from eksft_nb.control import FaultCommand
from eksft_nb.spec import JobSpec
from jobs import cli, events, job_dir, story

pytestmark = pytest.mark.slow
SCRIPTS = Path(__file__).parent / "scripts"
HEARTBEAT_S = 60.0  # the one timeout a hang had to wait for before sections
STEP_S = 5.0


def test_a_hang_in_a_step_is_found_by_its_section_while_a_longer_save_runs_on() -> None:
    spec = JobSpec(name="step-section").replace(
        **{
            "model.preset": "tiny",
            "steps": 24,
            "checkpoint.every": 5,
            "checkpoint.mode": "sync",
            "ft.inprocess": False,
            "ft.heartbeat_timeout": HEARTBEAT_S,
            "ft.step_timeout": STEP_S,
            "ft.out_of_section_timeout": STEP_S,
            "ft.checkpoint_timeout": 60.0,
            "ft.step_time": 0.9 * STEP_S,   # as a run measured it: the pre-flight warns, and launches
        }
    )
    slow = FaultCommand("slow-storage", rank=0, step=5, params={"delay": 2 * STEP_S, "duration": 1})
    row = commands.launch(spec, [slow, FaultCommand("hang", rank=1, step=13)])
    assert row["warnings"] == ["a step takes ~4.5 s (measured) but the step section is 5 s: less than a "
                               "fifth to spare → raise --step-timeout above 9"]
    job = eksft_nb.attach("step-section")
    assert job.wait(400) == "succeeded", story("step-section")
    saves = {e["step"]: e for e in events("step-section", "checkpoint") if e["phase"] == "committed"}
    assert saves[5]["blocked_s"] >= 2 * STEP_S  # longer than the step and out-of-section timeouts: not killed
    [restart] = job.summary()["restart_events"]
    assert restart["cause"].startswith("hang: rank 1 stayed in its step section"), restart
    assert restart["blame_rank"] == 1 and restart["resumed_step"] == 10
    assert restart["detection_s"] < HEARTBEAT_S / 3, restart  # the section's 5 s, polled every second
    logs = "\n".join(p.read_text() for p in (job_dir("step-section") / "logs").glob("launcher-*.log"))
    assert "Section 'step' has been open for" in logs and "Did not get subsequent heartbeat" not in logs
    # what the run measured sizes a check (and a resume) of the next one
    rows = {r["name"]: r for r in commands.check(JobSpec(name="next"), from_job="step-section")["rows"]}
    assert 0 < rows["a step (measured)"]["seconds"] < STEP_S
    assert rows["a save (measured)"]["seconds"] >= 2 * STEP_S


def test_a_scripts_own_error_in_every_restart_is_named_and_every_restart_counted(tmp_path: Path) -> None:
    # the script opens a "restore" section once it has a save to restore: after the fault, every start
    ckpt = tmp_path / "state.pt"
    # (no job restart, and no giving up before ft_launcher has used its three restarts)
    proc = cli(
        "run",
        "--name",
        "own-error",
        "--script",
        str(SCRIPTS / "unbounded_section.py"),
        "--script-args",
        f"--steps 40 --ckpt {ckpt}",
        "--no-inprocess",
        "--section-timeouts",
        "step:30",
        "--fault",
        "sigkill:1@8",
        "--max-job-restarts",
        "0",
        "--progress-patience",
        "10",
        "--json",
    )
    summary = eksft_nb.attach("own-error").summary()
    assert summary["state"] == "failed", proc.stderr[-2000:]
    # ft_launcher restarted the group three times: each restart is counted, each failed before a step
    assert summary["restarts"]["injob"] == 3, story("own-error")
    assert [r["recovered"] for r in summary["restart_events"]] == [False, False, False]
    assert all("Unknown section: restore" in r["cause"] for r in summary["restart_events"][1:]), (
        [r["cause"] for r in summary["restart_events"]], story("own-error"))
    # the reason names the error and the fix
    assert summary["reason"].startswith("ft_launcher on node 0 gave up"), summary["reason"]
    assert (
        "the ranks' last error: rank" in summary["reason"] and "Unknown section: restore" in summary["reason"]
    )
    assert "--section-timeouts restore:SECONDS" in summary["reason"]
    assert "restarts: inprocess 0, injob 3, job 0" in cli("summary", "own-error").stdout
