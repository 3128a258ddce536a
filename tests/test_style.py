"""The repository passes ruff with its own configuration (pyproject.toml), line length included, and the
package keeps its shape: no module over :data:`MAX_LINES` lines (one file, one idea), and no arrow from an
engine up into a backend (backends import engines, never the reverse).

It runs the ruff installed beside this Python (``make setup`` installs it with the ``dev`` extra), so CI
on a clean clone checks what a maintainer checks by hand.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

from conftest import REPO


def test_ruff_finds_nothing_with_the_project_config() -> None:
    proc = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "--output-format", "concise",
                           "."], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"ruff check (exit {proc.returncode}):\n{proc.stdout}{proc.stderr}"


MAX_LINES = 600
PACKAGE = REPO / "eksft_nb"


def test_no_module_of_the_package_passes_600_lines() -> None:
    long = {str(p.relative_to(REPO)): n for p in sorted(PACKAGE.rglob("*.py"))
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"over {MAX_LINES} lines (split each by concept): {long}"


def _imported(path: Path) -> list[tuple[int, str]]:
    """The modules ``path`` imports, as absolute dotted names (relative imports resolved), with their line."""
    package = ".".join(path.relative_to(REPO).with_suffix("").parts[:-1])
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package.rsplit(".", node.level - 1)[0] if node.level else ""
            module = ".".join(part for part in (base, node.module or "") if part)
            found += [(node.lineno, f"{module}.{alias.name}") for alias in node.names]
    return found


def test_no_engine_module_imports_from_a_backend() -> None:
    upward = [f"{p.relative_to(REPO)}:{line} imports {name}"
              for p in sorted((PACKAGE / "engines").rglob("*.py"))
              for line, name in _imported(p) if name.startswith("eksft_nb.backends")]
    assert not upward, upward
    # the check reads what it must: the backends' torchft parts import the engine (the allowed direction)
    assert any(name.startswith("eksft_nb.engines.torchft")
               for _, name in _imported(PACKAGE / "backends" / "local" / "torchft.py"))
