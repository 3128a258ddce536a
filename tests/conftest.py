"""Shared fixtures. Every test session gets its own EKSFT_HOME, so jobs never collide with a user's."""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


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


def run_cli(*args: str, timeout: float = 300) -> "subprocess.CompletedProcess[str]":
    """Run ``python -m eksft_nb ARGS`` as a user would; returns the completed process."""
    import subprocess

    return subprocess.run([sys.executable, "-m", "eksft_nb", *args], capture_output=True, text=True,
                           timeout=timeout, env=dict(os.environ))
