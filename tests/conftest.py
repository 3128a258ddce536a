"""Shared fixtures. Every test session gets its own EKSFT_HOME, so jobs never collide with a user's."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import pytest
from hypothesis import settings

REPO = Path(__file__).resolve().parents[1]

# CI draws the same generated inputs on every run, so a red CI always means a change broke something;
# elsewhere each run explores new ones (and Hypothesis's database replays what once failed)
settings.register_profile("ci", derandomize=True, database=None)
if os.environ.get("CI"):
    settings.load_profile("ci")


@pytest.fixture(scope="session", autouse=True)
def eksft_home() -> Path:
    home = Path(tempfile.mkdtemp(prefix="eksft-test-"))
    os.environ["EKSFT_HOME"] = str(home)
    yield home
    from eksft_nb.backends.local import LocalBackend

    backend = LocalBackend()
    for job in backend.jobs():  # nothing a test launched may outlive the session
        if job.state in ("starting", "running"):
            backend.stop(job.name)
    shutil.rmtree(home, ignore_errors=True)


@pytest.fixture(scope="session")
def finished_job(eksft_home: Path) -> str:
    """A short job that ran to completion (12 steps, checkpoints every 5)."""
    from jobs import run_job

    summary = run_job("finished", "--steps", "12", "--ckpt-every", "5")
    assert summary["state"] == "succeeded", summary
    return "finished"


@pytest.fixture
def ip(monkeypatch: pytest.MonkeyPatch) -> Any:
    """A real IPython shell with the magics loaded; what a cell displays goes to ``shell.shown``."""
    from IPython.testing.globalipapp import get_ipython

    from eksft_nb import magics

    shell = get_ipython()
    shell.run_line_magic("load_ext", "eksft_nb")
    shell.shown = []
    monkeypatch.setattr(magics, "display", shell.shown.append)
    yield shell
    shell.magics_manager.registry["FtrainMagics"].job = None
