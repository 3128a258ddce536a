"""Shared fixtures. Every test session gets its own EKSFT_HOME, so jobs never collide with a user's."""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import settings

from jobs import free_port, stop_server

REPO = Path(__file__).resolve().parents[1]

# CI draws the same generated inputs on every run, so a red CI always means a change broke something;
# elsewhere each run explores new ones (and Hypothesis's database replays what once failed)
settings.register_profile("ci", derandomize=True, database=None)
if os.environ.get("CI"):
    settings.load_profile("ci")

# `make test` runs the tests on two workers (pytest-xdist). The files that use a real Slurm (two at once would
# run jobs of the same ids on the same node names, and a test that ends a node's processes by job id could
# end the other cluster's) or the notebooks' runs (bench part 8 reads notebook 07's, tests/notebook_runs.py)
# run on one worker, one after the other. A file with a module- or class-scoped fixture (a job its tests
# read: test_torchft's fault matrix, test_ports' jobs, test_bench's run) is one unit, so the fixture is set
# up once, not once per worker its tests land on (CI ran test_torchft's 70 s matrix twice). Every other test
# goes to whichever worker is free. xdist's own `--dist loadgroup` cannot do it here: it names an item's
# group by rewriting the item's node id, which pytest 9 no longer reads, so its groups silently fall apart.
ONE_WORKER = ("slurm_cluster", "notebook_runs")
SHARED_FIXTURE = re.compile(r"""@pytest\.fixture\(.*?scope=["'](module|class|package)["']""", re.S)


def work_unit(path: Path) -> str | None:
    """The unit all of a file's tests share ("one-worker", or the file itself), or None: each its own."""
    text = path.read_text()
    if any(f"from {m} import" in text or f"import {m}" in text for m in ONE_WORKER):
        return "one-worker"
    return str(path) if SHARED_FIXTURE.search(text) else None


def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """Work units as ``--dist loadscope`` makes them: the one-worker files' one, one for each file with a
    shared fixture, one for each other test."""
    from xdist.scheduler import LoadScopeScheduling

    units: dict[str, str | None] = {}

    class SharedWorkUnits(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            file = nodeid.split("::", 1)[0]
            if file not in units:
                units[file] = work_unit(config.rootpath / file) if file.endswith(".py") else None
            return units[file] or nodeid

    return SharedWorkUnits(config, log)


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


@pytest.fixture(scope="session")
def reference_digest(eksft_home: Path) -> str:
    """The fault-free run of ``jobs.BASE`` (run once a session): every healed run of that job, in any test
    file, must end with parameters bit-identical to its digest."""
    from jobs import events, run_job

    summary = run_job("reference")
    assert summary["state"] == "succeeded", summary
    assert summary["restarts"] == {"inprocess": 0, "injob": 0, "job": 0}
    losses = [e["loss"] for e in events("reference", "step")]
    assert losses[-1] < losses[0] - 2.0, "the built-in data must be learnable: the loss has to fall"
    return summary["digest"]


@pytest.fixture(scope="session")
def corrupt_job(eksft_home: Path) -> tuple[str, dict]:
    """``jobs.BASE`` with sync saves whose checkpoint 20 (committed when step 20 ends) is corrupted at step
    25, then rank 1 killed at step 27 (run once a session): (its name, its summary). test_engine checks what
    the user is told and that nothing is lost, test_engine_storage which rank found the bad shard."""
    from jobs import run_job

    name = "corrupt"
    return name, run_job(name, "--ckpt-mode", "sync", "--fault", "corrupt-checkpoint@25", "--fault",
                         "sigkill:1@27")


@pytest.fixture(scope="session")
def stopped_job(eksft_home: Path) -> tuple[str, list[int], list[int], int]:
    """An endless job launched detached from the CLI and stopped with ``stop`` once it ran 5 steps (run once a
    session): (its name, the pids of its supervisor, launchers and ranks just before the stop, those of them
    alive then, the stop's exit status). test_engine checks that nothing of it is left, test_procs what its
    logs say."""
    from eksft_nb import procs
    from eksft_nb.jobdir import JobDir
    from jobs import cli, events, wait_for

    name = "to-stop"
    proc = cli("run", "--name", name, "--model", "tiny", "--steps", "100000", "--detach")
    assert proc.returncode == 0, proc.stderr
    wait_for("5 steps", lambda: len(events(name, "step")) >= 5, timeout=120)
    sup = JobDir.for_name(name).supervisor()
    pids = [sup["pid"]] + [launcher["pid"] for launcher in sup["launchers"]] + [
        e["pid"] for e in events(name, "rank_start")]
    alive = [p for p in pids if procs.alive(p)]
    return name, pids, alive, cli("stop", name).returncode


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


@pytest.fixture
def lab(tmp_path: Path) -> Iterator[dict[str, Any]]:
    """A fresh JupyterLab server on the quickstart notebook, with its own EKSFT_HOME."""
    with jupyterlab(tmp_path, Path(sys.executable).parent / "jupyter") as server:
        yield server


@contextlib.contextmanager
def jupyterlab(tmp_path: Path, jupyter: Path, env: dict[str, str] | None = None) -> Iterator[dict[str, Any]]:
    """A JupyterLab server started by ``jupyter`` (that environment's), with ``env`` over os.environ."""
    root, settings = tmp_path / "root", tmp_path / "settings"
    root.mkdir(parents=True)
    shutil.copy(REPO / "notebooks" / "01_quickstart.ipynb", root)
    for name, value in (("@jupyterlab/apputils-extension/notification.jupyterlab-settings",
                         {"fetchNews": "false", "checkForUpdates": False}),
                        ("@jupyterlab/notebook-extension/tracker.jupyterlab-settings",
                         {"windowingMode": "none"})):
        (settings / name).parent.mkdir(parents=True, exist_ok=True)
        (settings / name).write_text(json.dumps(value))
    port, token = free_port(), secrets.token_hex(16)
    env = {**os.environ, "EKSFT_HOME": str(tmp_path / "eksft"), "JUPYTERLAB_SETTINGS_DIR": str(settings),
           "JUPYTERLAB_WORKSPACES_DIR": str(tmp_path / "workspaces"),
           "JUPYTER_RUNTIME_DIR": str(tmp_path / "runtime"),
           "JUPYTER_CONFIG_DIR": str(tmp_path / "config"), **(env or {})}
    log = open(tmp_path / "lab.log", "wb")
    server = subprocess.Popen(
        [str(jupyter), "lab", "--no-browser", "--allow-root", "--ip=127.0.0.1",
         f"--port={port}", "--port-retries=0", f"--IdentityProvider.token={token}",
         f"--ServerApp.root_dir={root}",
         "--LabApp.expose_app_in_browser=True", "--LabApp.news_url=None",
         "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate"],
        env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 60
    while True:
        try:
            urllib.request.urlopen(f"{url}/api/status?token={token}", timeout=2)
            break
        except OSError:
            if server.poll() is not None or time.time() > deadline:
                raise RuntimeError(f"JupyterLab did not start; see {tmp_path / 'lab.log'}") from None
            time.sleep(0.3)
    try:
        yield {"url": url, "token": token, "home": Path(env["EKSFT_HOME"]), "dir": tmp_path,
               "runtime": Path(env["JUPYTER_RUNTIME_DIR"])}
    finally:
        stop_server(server, log)
        from eksft_nb.backends.local import LocalBackend
        from eksft_nb.states import ENDED

        backend = LocalBackend(Path(env["EKSFT_HOME"]) / "jobs")
        for job in backend.jobs():
            if job.state not in ENDED:
                backend.stop(job.name)
