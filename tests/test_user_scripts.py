"""User scripts under the same launcher: one that uses the runtime helpers, one that knows nothing of eksft-nb."""

from __future__ import annotations

from pathlib import Path

import pytest

from jobs import cli, events, run_job

pytestmark = pytest.mark.slow
SCRIPTS = Path(__file__).parent / "scripts"


def test_a_script_with_the_helpers_gets_telemetry_faults_and_checkpoints() -> None:
    summary = run_job("aware", "--script", str(SCRIPTS / "aware.py"), "--steps", "40", "--ckpt-mode", "sync",
                      "--no-inprocess", "--fault", "sigkill:1@25")
    assert summary["state"] == "succeeded", summary
    assert summary["steps_done"] == 40
    [restart] = summary["restart_events"]
    assert restart["level"] == "injob" and restart["blame_rank"] == 1 and restart["resumed_step"] == 20
    committed = [e["step"] for e in events("aware", "checkpoint") if e["phase"] == "committed"]
    assert {10, 20, 30, 40} <= set(committed)
    losses = [e["loss"] for e in events("aware", "step")]
    assert losses[-1] < losses[0]


def test_a_script_that_knows_nothing_of_eksft_still_shows_restarts_exit_codes_and_logs() -> None:
    summary = run_job("unaware", "--script", str(SCRIPTS / "unaware.py"), "--no-inprocess")
    assert summary["state"] == "succeeded", summary
    [restart] = summary["restart_events"]
    assert restart["level"] == "injob" and restart["blame_rank"] == 1
    assert restart["cause"] == "rank 1 failed: exit code 3"
    starts = events("unaware", "rank_start")
    assert {(e.rank, e["injob_restart"]) for e in starts} == {(0, 0), (1, 0), (0, 1), (1, 1)}
    logs = cli("logs", "unaware").stdout
    assert "rank 1: giving up with exit code 3" in logs and "attempt 1 done, x=" in logs
