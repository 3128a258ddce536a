"""A resume point the loader refuses (issue 18, finding 8): without --step the new job starts from the
source's next older checkpoint that loads and says so (the CLI's answer, the summary, the dashboard);
with --step it fails with one line. Never a silent start from step 0."""

from __future__ import annotations

import json

import pytest

from ckpt_craft import build_on_class, rewrite
from eksft_nb import attach
from eksft_nb.checkpoint_folders import step_dir
from eksft_nb.dashboard import Dashboard
from jobs import cli, events, job_dir, run_job, story, wait_for


@pytest.mark.slow
def test_a_refused_resume_point_falls_back_and_says_so() -> None:
    assert run_job("fb-src", "--steps", "20", "--ckpt-every", "10")["state"] == "succeeded"
    newest = step_dir(job_dir("fb-src") / "ckpt", 20)
    # the hostile step 20: it BUILDs pathlib.PosixPath, then holds the genuine metadata
    rewrite(newest, ".metadata", build_on_class("pathlib", "PosixPath", "__truediv__",
                                                (newest / ".metadata").read_bytes()))

    named = cli("resume", "fb-src", "--step", "20", "--as", "fb-named", "--detach")
    assert named.returncode != 0 and not named.stdout.strip(), named.stdout
    [line] = named.stderr.strip().splitlines()
    assert "checkpoint at step 20 cannot be used" in line and "BUILD" in line, line
    assert line.endswith("pick another step"), line
    assert not job_dir("fb-named").exists()  # nothing launched

    fallback = cli("resume", "fb-src", "--as", "fb-dst", "--detach")
    assert fallback.returncode == 0, fallback.stderr
    said = fallback.stdout.strip()
    assert said.startswith("launched fb-dst, resuming from fb-src step 10 (step 20 refused: "), said
    assert "BUILD" in said and "\n" not in said, said
    wait_for("fb-dst to end", lambda: json.loads(cli("status", "fb-dst", "--json").stdout)["ended"], 300)
    summary = json.loads(cli("summary", "fb-dst", "--json").stdout)
    assert summary["state"] == "succeeded", story("fb-dst")
    assert summary["resumed_from"].startswith("from fb-src step 10 (step 20 refused: "), summary
    assert "resumed from fb-src step 10 (step 20 refused: " in cli("summary", "fb-dst").stdout
    [first, *_] = events("fb-dst", "resume")
    assert first["step"] == 10 and [s["step"] for s in first["skipped"]] == [20], first.data
    assert min(e["start_step"] for e in events("fb-dst", "rank_start")) == 10  # never from step 0

    dash = Dashboard(attach("fb-dst"), interval=0.3)
    try:
        wait_for("the dashboard to show the fallback", lambda: "step 20 refused" in dash.header.origin, 60)
        origin = dash.header.origin
        assert origin.startswith("resumed from fb-src step 10 (step 20 refused: "), origin
    finally:
        dash.close()
