"""The tutorial notebooks, each run once a session (nbclient, a real kernel, real jobs), for every test that
reads a run: test_notebooks checks what each teaches; test_bench checks bench part 8 on notebook 07's run
(its three-engine plan is the part's smoke plan: one run serves both)."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import nbformat
from nbclient import NotebookClient

from conftest import REPO

NOTEBOOKS = sorted((REPO / "notebooks").glob("[0-9][0-9]_*.ipynb"))
ENGINES = REPO / "notebooks" / "07_engines.ipynb"
_RUNS: dict[str, tuple[Any, Path]] = {}


def executed(path: Path, tmp_root: Path) -> tuple[Any, Path]:
    """Run a notebook once per session (its jobs land in the session's EKSFT_HOME) and save it; return the
    executed notebook and where it was saved (its working folder holds what it wrote)."""
    if path.stem not in _RUNS:
        nb = nbformat.read(path, as_version=4)
        with kernel_env(path, tmp_root) as env:
            NotebookClient(nb, timeout=900, kernel_name="python3",
                           resources={"metadata": {"path": str(tmp_root)}}).execute(env=env)
        out = tmp_root / path.name
        nbformat.write(nb, out)
        _RUNS[path.stem] = (nb, out)
    return _RUNS[path.stem]


def saved(stem: str) -> Path:
    """Where this session's run of notebook ``stem`` was saved."""
    return _RUNS[stem][1]


def engines_result(tmp_root: Path) -> dict[str, Any]:
    """The comparison notebook 07 ran and kept (``engines.json``), running it if this session has not."""
    _, saved = executed(ENGINES, tmp_root)
    return json.loads((saved.parent / "engines.json").read_text())


@contextmanager
def kernel_env(path: Path, tmp_root: Path) -> Iterator[dict[str, str]]:
    """The kernel's environment: 06_slurm's has a real two-node Slurm (skipped where slurm-wlm is absent),
    its shared folder and a free rendezvous port; the cluster stops when the notebook has run."""
    if path.stem != "06_slurm":
        yield dict(os.environ)
        return
    from slurm_cluster import free_base, slurm_cluster

    with slurm_cluster(tmp_root / "slurm") as cluster:
        yield {**cluster.env, "EKSFT_SHARED_DIR": str(cluster.shared), "EKSFT_SLURM_PORT": str(free_base())}
