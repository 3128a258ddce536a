"""Helpers for tests that run real jobs through the CLI."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any, Callable

from eksft_nb import loopback
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


def story(name: str, lines: int = 40) -> str:
    """What a job's supervisor narrated and the last notable lines of its launchers' logs: put in an
    assertion's message, a CI failure says what the job went through."""
    logs = job_dir(name) / "logs"
    parts = [(logs / "supervisor.log").read_text(errors="replace")
             if (logs / "supervisor.log").exists() else ""]
    notable = ("fail", "error", "heartbeat", "exit", "timeout", "traceback", "signal")
    for log in sorted(logs.glob("launcher-*.log")):
        kept = [ln for ln in log.read_text(errors="replace").splitlines()
                if any(w in ln.lower() for w in notable)]
        parts.append(f"--- {log.name}\n" + "\n".join(kept[-lines:]))
    return "\n".join(parts)


def wait_for(what: str, probe: Callable[[], Any], timeout: float = 300, every: float = 0.3,
             explain: Callable[[], str] | None = None) -> Any:
    """Poll ``probe`` until it returns something true; return that (fail after ``timeout`` seconds, with
    what ``explain`` says then: a job's story, so a CI failure tells what the job went through)."""
    deadline = time.time() + timeout
    while not (value := probe()):
        if time.time() > deadline:
            said = f"\n{explain()}" if explain else ""
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what} (last: {value!r}){said}")
        time.sleep(every)
    return value


def marked_process(job_uid: str, **popen: Any) -> subprocess.Popen:
    """A ``sleep`` carrying a job's mark, returned once its environment shows the mark: Popen returns when
    the child's exec closed its descriptors, a moment before the kernel sets up the new environment (a
    scan in that moment reads none)."""
    from eksft_nb import procs

    proc = subprocess.Popen(["sleep", "600"], env={**os.environ, procs.JOB_UID_ENV: job_uid}, **popen)
    wait_for("its environment", lambda: proc.pid in {p.pid for p in procs.marked(job_uid)}, timeout=30,
             every=0.05)
    return proc


def stop_server(proc: subprocess.Popen, log: Any) -> None:
    """End a server a fixture started (SIGTERM, then SIGKILL after 20 s) and close its log."""
    proc.terminate()
    try:
        proc.wait(20)
    except subprocess.TimeoutExpired:
        proc.kill()
    log.close()


def free_port(count: int = 1) -> int:
    """The first of ``count`` consecutive loopback ports free now, where the product picks its own."""
    return loopback.free_ports(count, consecutive=True)[0]


def scrape(port: int, server: subprocess.Popen, timeout: float = 60) -> dict[tuple[str, tuple], float]:
    """One scrape of the metrics ``server`` starting on ``port`` (once it listens), as
    {(sample name, sorted labels): value}; it is terminated afterwards."""
    from prometheus_client.parser import text_string_to_metric_families

    body, deadline = "", time.time() + timeout
    try:
        while not body and time.time() < deadline and server.poll() is None:
            try:
                body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
            except OSError:
                time.sleep(0.2)
    finally:
        server.terminate()
        _, err = server.communicate(timeout=10)
    assert body, f"no metrics on port {port}: {(err or b'').decode(errors='replace')[-2000:]}"
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(body) for s in family.samples}


def run_ranks(target: Callable[..., None], args: list[tuple], timeout: float = 300) -> list[int | None]:
    """Run ``target(*args[r])`` in one spawned process per rank; their exit codes (a rank still
    running after ``timeout`` seconds is killed)."""
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=target, args=a) for a in args]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=timeout)
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    return [p.exitcode for p in procs]


def fsdp_snapshot(model: Any, optim: Any) -> dict[str, Any]:
    """The full (unsharded) parameters and optimizer state of an FSDP2 model, cloned, by name."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, optim)
    flat = {f"model.{k}": v.full_tensor() for k, v in msd.items()}
    flat |= {f"optim.{p}.{k}": v.full_tensor() if hasattr(v, "full_tensor") else v
             for p, st in osd["state"].items() for k, v in st.items()}
    return {k: v.clone() for k, v in flat.items()}
