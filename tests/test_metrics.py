"""Prometheus export: the metrics a scrape returns come from the job's events."""

from __future__ import annotations

import subprocess
import sys

import pytest
from jobs import free_port, scrape

from eksft_nb.job import attach

pytestmark = pytest.mark.slow


def test_a_scrape_reports_steps_restarts_checkpoints_and_goodput(finished_job: str) -> None:
    port = free_port()
    samples = scrape(port,
                     subprocess.Popen([sys.executable, "-m", "eksft_nb", "metrics", finished_job, "--port",
                                       str(port)],
                                            stdout=subprocess.PIPE, stderr=subprocess.PIPE))
    job = (("job", finished_job),)
    mon = attach(finished_job).refresh()
    assert samples[("eksft_step", job)] == mon.last_step == 12
    assert samples[("eksft_last_checkpoint_step", job)] == 12
    assert samples[("eksft_running", job)] == 0
    assert samples[("eksft_restarts_total", (("job", finished_job), ("level", "injob")))] == 0
    assert 0 < samples[("eksft_goodput_ratio", job)] < 1
    assert samples[("eksft_time_seconds", (("category", "productive"), ("job", finished_job)))] > 0


def test_unknown_jobs_are_refused_before_listening() -> None:
    proc = subprocess.run([sys.executable, "-m", "eksft_nb", "metrics", "nope"], capture_output=True,
                          text=True,
                          timeout=60)
    assert proc.returncode == 2 and "no job named 'nope'" in proc.stderr
