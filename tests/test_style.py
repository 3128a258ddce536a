"""The repository passes ruff with its own configuration (pyproject.toml), line length included.

It runs the ruff installed beside this Python (``make setup`` installs it with the ``dev`` extra), so CI
on a clean clone checks what a maintainer checks by hand.
"""

from __future__ import annotations

import subprocess
import sys

from conftest import REPO


def test_ruff_finds_nothing_with_the_project_config() -> None:
    proc = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "--output-format", "concise",
                           "."], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"ruff check (exit {proc.returncode}):\n{proc.stdout}{proc.stderr}"
