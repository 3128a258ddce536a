"""Warm ranks: ranks forked from a per-node zygote that has already imported torch, behind a shim that
ft_launcher takes for the rank itself (see eksft_nb.runtime.zygote and eksft_nb.runtime.warm_shim)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from eksft_nb.backends import procs
from eksft_nb.backends.eks.render import INPOD
from eksft_nb.backends.local.supervisor import Node, Supervisor
from eksft_nb.events import EventWriter, make, read_all
from eksft_nb.jobdir import JobDir
from eksft_nb.launcher import TRAINER_MODULE, WARM_SHIM, ZYGOTE_MODULE
from eksft_nb.spec import JobSpec, ModelConfig
from jobs import events, job_dir, run_job, wait_for

PROBE = """
import os, sys, time
print("rank", os.getpid(), os.getppid(), "torch" in sys.modules, os.getcwd(), os.environ.get("PROBE"), sys.argv[1:],
      flush=True)
what = sys.argv[1]
if what == "sleep":
    time.sleep(600)
if what == "abort":
    os.abort()
sys.exit(int(what))
"""


@pytest.fixture(scope="module")
def zygote(tmp_path_factory: pytest.TempPathFactory):
    """A zygote serving ranks for this module's shims: (its socket name, its pid, the folder of probe.py)."""
    folder = tmp_path_factory.mktemp("warm")
    (folder / "probe.py").write_text(PROBE)
    name = f"eksft-test-{uuid.uuid4().hex[:8]}"
    log = folder / "zygote.log"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", ZYGOTE_MODULE, name], stdout=out, stderr=subprocess.STDOUT,
                                env=env, start_new_session=True)
    wait_for("the zygote to import torch", lambda: "ready" in log.read_text() or proc.poll() is not None)
    assert proc.poll() is None, log.read_text()
    yield name, proc.pid, folder
    proc.kill()
    proc.wait()


def shim(zygote_name: str, folder: Path, *args: str, **env: str) -> subprocess.Popen:
    """A worker as ft_launcher starts it: its own session, ``python -S warm_shim.py -m probe ARGS``."""
    return subprocess.Popen([sys.executable, "-S", WARM_SHIM, "-m", "probe", *args], cwd=folder,
                            env={**os.environ, "EKSFT_WARM_SOCKET": zygote_name, "PROBE": "here", **env},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)


def rank_line(p: subprocess.Popen) -> list[str]:
    line = p.stdout.readline().split()
    assert line and line[0] == "rank", (line, p.stderr.read() if p.poll() is not None else "")
    return line


def test_a_warm_rank_is_a_forked_child_that_runs_the_module_as_python_would(zygote) -> None:
    name, zygote_pid, folder = zygote
    p = shim(name, folder, "7")
    _, pid, parent, torch_loaded, cwd, probe, *_ = rank_line(p)
    out, err = p.communicate(timeout=60)
    assert p.returncode == 7, err
    assert int(parent) == zygote_pid and int(pid) != p.pid  # forked by the zygote, torch already imported
    assert torch_loaded == "True" and cwd == str(folder) and probe == "here"
    assert "no warm rank" not in err


def test_a_rank_that_dies_of_a_signal_takes_its_shim_with_it(zygote) -> None:
    name, _, folder = zygote
    p = shim(name, folder, "abort")
    p.communicate(timeout=60)
    assert p.returncode == -signal.SIGABRT  # as ft_launcher saw it from a cold rank
    p = shim(name, folder, "sleep")
    pid = int(rank_line(p)[1])
    os.kill(pid, signal.SIGKILL)  # a rank monitor kills the rank itself
    p.communicate(timeout=60)
    assert p.returncode == -signal.SIGKILL


def test_signals_reach_the_rank_and_a_killed_shim_leaves_no_orphan(zygote) -> None:
    name, _, folder = zygote
    p = shim(name, folder, "sleep")
    pid = int(rank_line(p)[1])
    os.killpg(p.pid, signal.SIGTERM)  # how torch's SubprocessHandler stops a worker
    p.communicate(timeout=60)
    assert p.returncode == -signal.SIGTERM and not procs.alive(pid)
    p = shim(name, folder, "sleep")
    pid = int(rank_line(p)[1])
    os.killpg(p.pid, signal.SIGKILL)  # and then kills it: the zygote sees the connection close
    p.wait(timeout=60)
    wait_for("the orphaned rank to be killed", lambda: not procs.alive(pid), timeout=30)


@pytest.mark.parametrize("why", ["no zygote", "an environment the zygote cannot serve"])
def test_without_a_zygote_that_can_serve_it_the_rank_starts_cold(zygote, why: str) -> None:
    name, _, folder = zygote
    if why == "no zygote":
        p = shim(f"{name}-gone", folder, "3")
    else:  # torch read its thread count at import: a rank that wants another starts afresh
        p = shim(name, folder, "3", OMP_NUM_THREADS="7")
    _, pid, _, torch_loaded, *_ = rank_line(p)
    out, err = p.communicate(timeout=120)
    assert p.returncode == 3
    assert int(pid) == p.pid and torch_loaded == "False"  # the shim exec'd `python -u -m probe 3`
    assert len(re.findall("no warm rank", err)) == 1, err


FAKE_LAUNCHER = """
import os, subprocess, sys
at = sys.argv.index("--no-python")
worker = sys.argv[at + 1:sys.argv.index("-m", at)]   # python -S SHIM, as the pod's entry resolved them
print("worker", os.environ["EKSFT_WARM_SOCKET"], *worker, flush=True)
sys.exit(subprocess.run([*worker, "-m", "probe", "5"]).returncode)
"""


def test_an_eks_pods_entry_starts_its_zygote_whose_ranks_are_forked_and_which_ends_with_the_launcher(
        tmp_path: Path) -> None:
    """The trainer container's command with warm ranks (``inpod launch``), with a stand-in for ft_launcher
    that runs its worker command on the probe: the shim is this installation's, the rank is forked by
    the zygote the entry started, and the zygote ends when the launcher does (nothing holds the pod)."""
    (tmp_path / "probe.py").write_text(PROBE)
    (tmp_path / "launcher.py").write_text(FAKE_LAUNCHER)
    log = tmp_path / "pod.log"
    with open(log, "wb") as out:
        entry = subprocess.run([sys.executable, *INPOD[1:], "launch", sys.executable, "launcher.py", "--nnodes=1",
                                "-m", TRAINER_MODULE], cwd=tmp_path, stdout=out, stderr=subprocess.STDOUT,
                               env={**os.environ, "PROBE": "here"}, timeout=300)
    text = log.read_text()
    assert entry.returncode == 5, text   # the rank's status, through the shim and the launcher
    worker = re.search(r"^worker (\S+) (.+)$", text, re.M)
    assert worker and worker.group(2).split() == [sys.executable, "-S", WARM_SHIM], text
    zygote = int(re.search(rf"eksft zygote {worker.group(1)}: ready \(pid (\d+)", text).group(1))
    _, pid, parent, torch_loaded, *_ = re.search(r"^rank .*$", text, re.M).group(0).split()
    assert int(parent) == zygote and torch_loaded == "True" and f"forked rank {pid} " in text
    assert "no warm rank" not in text
    wait_for("the zygote to end with its launcher", lambda: not procs.alive(zygote), timeout=30)


@pytest.mark.slow
def test_restarted_ranks_are_forked_warm_at_every_level_and_lose_nothing() -> None:
    cold = run_job("cold-reference", "--steps", "40", "--no-warm-ranks")
    warm = run_job("warm-faults", "--steps", "40", "--no-inprocess", "--fault", "sigkill:1@12",
                   "--fault", "kill-launcher@25")
    assert cold["state"] == warm["state"] == "succeeded", warm
    assert [r["level"] for r in warm["restart_events"]] == ["injob", "job"]
    assert warm["digest"] == cold["digest"]  # bit-identical to a fault-free run of cold ranks
    logs = job_dir("warm-faults") / "logs"
    forked = {int(pid) for log in logs.glob("zygote-*.log") for pid in re.findall(r"forked rank (\d+)", log.read_text())}
    starts = events("warm-faults", "rank_start")
    assert len(starts) == 6 and {e["pid"] for e in starts} <= forked  # every incarnation, the first included
    assert {e["job_attempt"] for e in starts} == {0, 1}
    assert not list((job_dir("cold-reference") / "logs").glob("zygote-*.log"))
    launcher_logs = " ".join(p.read_text() for p in logs.glob("launcher-*.log"))
    assert "no warm rank" not in launcher_logs
    uid = (job_dir("warm-faults") / "supervisor.json").read_text()
    uid = re.search(r'"job_uid": "(\w+)"', uid).group(1)
    deadline = time.time() + 30
    while procs.marked(uid) and time.time() < deadline:
        time.sleep(0.2)
    assert not procs.marked(uid)  # no zygote, standby or rank outlives the job


def test_the_hung_ranks_death_read_after_its_warm_recovery_is_no_second_incident() -> None:
    """A warm in-job restart can run from ft_launcher's line about the killed, hung rank to the new ranks'
    first step within one supervisor poll, which reads the ranks' events before the launcher's log. The
    supervisor is fed what it saw in CI, in that order: the hang was one incident, not a second
    "rank 0 died (SIGKILL)"; a rank of the new incarnation killed later still is one."""
    jd = JobDir.for_name("warm-race")
    jd.create(JobSpec(name="warm-race", steps=1000, model=ModelConfig(preset="tiny")))
    sup = Supervisor(jd)
    log = jd.logs / "launcher-0-0.log"
    sup.nodes = [Node(0, log, "0.0", {"pid": os.getpid(), "started": 0.0})]
    t0 = time.time() - 60
    ranks = [EventWriter(jd.events_path, "warm-race", rank=r) for r in (0, 1)]

    def rank(r: int, t: float, kind: str, **data: object) -> None:
        ranks[r].write(make(kind, "warm-race", r, t=t0 + t, **data))

    def start(t: float, injob: int) -> None:
        for r in (0, 1):
            rank(r, t + r / 20, "rank_start", pid=1000 + 10 * injob + r, host="vm", job_attempt=0,
                 injob_restart=injob, inprocess_iteration=0, world_size=2, start_step=0)

    def launcher(t: float, who: str, text: str) -> None:
        at = t0 + t
        stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(at)) + f",{int(at % 1 * 1000):03d}"
        with open(log, "a") as f:
            f.write(f"[{stamp}] [WARNING] [{who}@vm] {text}\n")

    def incidents() -> list[tuple[str, str]]:
        sup._pump()
        return [(e.kind, e["cause"]) for e in read_all(jd.events_path) if e.kind in ("failure", "restart")]

    start(1, 0)
    for step in range(1, 6):
        rank(0, 1 + step, "step", step=step, loss=None, tokens=None, step_time=0.1)
    rank(0, 6.5, "fault", fault="hang", id="f1", target_rank=0, at_step=6)
    assert incidents() == []
    launcher(15, "RankMonServer77@vm:0", "Did not get subsequent heartbeat. Waited 8.00 seconds.")
    launcher(15, "RankMonServer77@vm:0", "FT timeout elapsed.")
    [hang] = incidents()
    assert hang[0] == "failure" and hang[1].startswith("hang: no heartbeat from rank 0 "), hang
    # before the next poll: rank 1's monitor times out too (it waited on rank 0), the launcher reaps the
    # killed rank and restarts the group, the new ranks step
    launcher(15.01, "RankMonServer78@vm:1", "FT timeout elapsed.")
    launcher(15.3, "ft_launcher70", "failed (exitcode: -9) local_rank: 0 (pid: 71) of binary: /usr/bin/python")
    launcher(15.3, "ft_launcher70", "[default] Worker group FAILED. 2/3 attempts left; will restart worker group")
    start(15.5, 1)
    rank(0, 15.7, "step", step=1, loss=None, tokens=None, step_time=0.1)
    assert incidents() == [hang, ("restart", hang[1])]
    # a rank of the new incarnation killed afterwards is a new incident
    launcher(20, "ft_launcher70", "failed (exitcode: -9) local_rank: 1 (pid: 82) of binary: /usr/bin/python")
    assert incidents()[2:] == [("failure", "rank 1 died (SIGKILL)")]
    start(20.5, 2)
    rank(0, 20.7, "step", step=1, loss=None, tokens=None, step_time=0.1)
    assert incidents()[3] == ("restart", "rank 1 died (SIGKILL)")
    # a hang whose launcher lines, replacement ranks and their first step all land within one poll:
    # the launcher's line, logged first, opens the incident with its cause
    rank(0, 25, "fault", fault="hang", id="f2", target_rank=0, at_step=2)
    launcher(30, "RankMonServer77@vm:0", "Did not get subsequent heartbeat. Waited 8.00 seconds.")
    launcher(30.3, "ft_launcher70", "failed (exitcode: -9) local_rank: 0 (pid: 91) of binary: /usr/bin/python")
    start(30.5, 3)
    rank(0, 30.7, "step", step=1, loss=None, tokens=None, step_time=0.1)
    failure, restart = incidents()[4:]
    assert failure[0] == "failure" and failure[1].startswith("hang: no heartbeat from rank 0 "), failure
    assert restart == ("restart", failure[1])
    sup.log.close()
