"""Helpers for tests that run real jobs through the CLI."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

from eksft_nb.events import Event, read_all
from eksft_nb.jobdir import JobDir

# a small job: 2 ranks, tiny model, 80 steps, checkpoints every 10 (about 20 s fault-free on 2 cores)
BASE = ["--model", "tiny", "--steps", "80", "--ckpt-every", "10", "--seed", "0"]


def cli(*args: str, timeout: float = 600, nvrx: Path | None = None) -> subprocess.CompletedProcess:
    """``python -m eksft_nb ARGS``; with ``nvrx``, that folder's NVRx (a ``pip --target`` install) is
    imported ahead of the environment's, by the CLI and by the supervisor, launchers and ranks it starts."""
    env = dict(os.environ)
    if nvrx is not None:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(nvrx), env.get("PYTHONPATH")) if p)
    return subprocess.run([sys.executable, "-m", "eksft_nb", *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


def run_job(name: str, *args: str, timeout: float = 600, nvrx: Path | None = None) -> dict:
    """Launch and follow a job to its end; return its JSON summary."""
    proc = cli("run", "--name", name, *BASE, *args, "--json", timeout=timeout, nvrx=nvrx)
    assert proc.stdout.strip(), f"no summary; stderr:\n{proc.stderr[-3000:]}"
    return json.loads(proc.stdout[proc.stdout.index("{"):])


def events(name: str, kind: str | None = None) -> list[Event]:
    evs = read_all(JobDir.for_name(name).events_path)
    return [e for e in evs if kind is None or e.kind == kind]


def job_dir(name: str) -> Path:
    return JobDir.for_name(name).path


def wait_for(what: str, probe: Callable[[], Any], timeout: float = 300) -> Any:
    """Poll ``probe`` until it returns something true; return that (fail after ``timeout`` seconds)."""
    deadline = time.time() + timeout
    while not (value := probe()):
        if time.time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.3)
    return value
