"""A resume point the loader refuses (issue 18, finding 8; issue 34, item 3): without --step the new job
starts from the source's next older checkpoint that loads and says so (the CLI's answer, the summary,
the dashboard); with --step it fails with one line. Never a silent start from step 0, never a stall."""

from __future__ import annotations

import json
import time

import pytest

from ckpt_craft import build_on_class, flooded_metadata, rewrite
from eksft_nb import attach
from eksft_nb.checkpoint_folders import step_dir
from eksft_nb.dashboard import Dashboard
from jobs import cli, events, job_dir, run_job, story, wait_for


@pytest.mark.slow
def test_a_refused_resume_point_falls_back_and_says_so() -> None:
    assert run_job("fb-src", "--steps", "30", "--ckpt-every", "10")["state"] == "succeeded"
    # issue 34's step 30: one dict of 100,000 int keys in one hash bucket (1.3 MB; refused after 111 s
    # by every reader, each restore of the job cut by the timeouts until it failed)
    flooded = step_dir(job_dir("fb-src") / "ckpt", 30)
    rewrite(flooded, ".metadata", flooded_metadata(100_000, "int"))
    # issue 18's step 20: it BUILDs pathlib.PosixPath, then holds the genuine metadata
    built = step_dir(job_dir("fb-src") / "ckpt", 20)
    rewrite(built, ".metadata", build_on_class("pathlib", "PosixPath", "__truediv__",
                                               (built / ".metadata").read_bytes()))

    named = cli("resume", "fb-src", "--step", "20", "--as", "fb-named", "--detach")
    assert named.returncode != 0 and not named.stdout.strip(), named.stdout
    [line] = named.stderr.strip().splitlines()
    assert "checkpoint at step 20 cannot be used" in line and "BUILD" in line, line
    assert line.endswith("pick another step"), line
    assert not job_dir("fb-named").exists()  # nothing launched

    t0 = time.monotonic()
    fallback = cli("resume", "fb-src", "--as", "fb-dst", "--detach")
    assert fallback.returncode == 0, fallback.stderr
    assert time.monotonic() - t0 < 60  # the flooded step is refused, not worked through (bench/ times it)
    said = fallback.stdout.strip()
    assert said.startswith("launched fb-dst, resuming from fb-src step 10 (step 30 refused: "), said
    assert "a dict key of type int" in said and "step 20 refused: " in said and "BUILD" in said, said
    assert "\n" not in said, said
    wait_for("fb-dst to end", lambda: json.loads(cli("status", "fb-dst", "--json").stdout)["ended"], 300)
    summary = json.loads(cli("summary", "fb-dst", "--json").stdout)
    assert summary["state"] == "succeeded", story("fb-dst")
    assert summary["restarts"] == {"inprocess": 0, "injob": 0, "job": 0}, story("fb-dst")  # no restore cut
    assert summary["resumed_from"].startswith("from fb-src step 10 (step 30 refused: "), summary
    assert "resumed from fb-src step 10 (step 30 refused: " in cli("summary", "fb-dst").stdout
    [first, *_] = events("fb-dst", "resume")
    assert first["step"] == 10 and [s["step"] for s in first["skipped"]] == [30, 20], first.data
    assert "a dict key of type int" in first["skipped"][0]["reason"], first.data
    assert min(e["start_step"] for e in events("fb-dst", "rank_start")) == 10  # never from step 0

    dash = Dashboard(attach("fb-dst"), interval=0.3)
    try:
        wait_for("the dashboard to show the fallback", lambda: "step 20 refused" in dash.header.origin, 60)
        origin = dash.header.origin
        assert origin.startswith("resumed from fb-src step 10 (step 30 refused: "), origin
        assert "a dict key of type int" in origin and "BUILD" in origin, origin
    finally:
        dash.close()
