"""Warm ranks: ranks forked from a per-node zygote that has already imported torch, behind a shim that
ft_launcher takes for the rank itself (see eksft_nb.runtime.zygote and eksft_nb.runtime.warm_shim)."""

from __future__ import annotations

import errno
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from eksft_nb import procs
from eksft_nb.backends.eks.render import INPOD
from eksft_nb.backends.local.launchers import Node
from eksft_nb.backends.local.supervisor import Supervisor
from eksft_nb.events import EventWriter, make, read_all
from eksft_nb.jobdir import JobDir
from eksft_nb.launcher import TRAINER_MODULE, WARM_SHIM, ZYGOTE_MODULE
from eksft_nb.runtime.warm_shim import SOCKET_ENV, ZYGOTE_ENV, at_path
from eksft_nb.spec import JobSpec, ModelConfig
from jobs import BASE, events, job_dir, run_job, story, wait_for

PROBE = """
import os, sys, time
print("rank", os.getpid(), os.getppid(), "torch" in sys.modules, os.getcwd(), os.environ.get("PROBE"),
      sys.argv[1:], flush=True)
what = sys.argv[1]
if what == "sleep":
    time.sleep(600)
if what == "abort":
    os.abort()
sys.exit(int(what))
"""


@pytest.fixture(scope="module")
def zygote(tmp_path_factory: pytest.TempPathFactory):
    """A zygote serving ranks for this module's shims: (its socket's path, its pid, the folder of probe.py).
    The socket lies deeper than a socket address holds (as under a deep EKSFT_HOME)."""
    folder = tmp_path_factory.mktemp("warm")
    (folder / "probe.py").write_text(PROBE)
    deep = folder.joinpath(*["d" * 30] * 4)
    deep.mkdir(parents=True, mode=0o700)
    name = str(deep / "zygote.sock")
    assert len(name) > 108
    log = folder / "zygote.log"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", ZYGOTE_MODULE, name], stdout=out,
                                stderr=subprocess.STDOUT,
                                env=env, start_new_session=True)
    wait_for("the zygote to import torch", lambda: "ready" in log.read_text() or proc.poll() is not None)
    assert proc.poll() is None, log.read_text()
    yield name, proc.pid, folder
    proc.kill()
    proc.wait()


def shim(zygote: tuple[str, int, Path], *args: str, **env: str) -> subprocess.Popen:
    """A worker as ft_launcher starts it: its own session, ``python -S warm_shim.py -m probe ARGS``."""
    name, pid, folder = zygote
    return subprocess.Popen([sys.executable, "-S", WARM_SHIM, "-m", "probe", *args], cwd=folder,
                            env={**os.environ, SOCKET_ENV: name, ZYGOTE_ENV: str(pid), "PROBE": "here",
                                 **env},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)


def rank_line(p: subprocess.Popen) -> list[str]:
    line = p.stdout.readline().split()
    assert line and line[0] == "rank", (line, p.stderr.read() if p.poll() is not None else "")
    return line


def test_a_warm_rank_is_a_forked_child_that_runs_the_module_as_python_would(zygote) -> None:
    _, zygote_pid, folder = zygote
    p = shim(zygote, "7")
    _, pid, parent, torch_loaded, cwd, probe, *_ = rank_line(p)
    out, err = p.communicate(timeout=60)
    assert p.returncode == 7, err
    assert int(parent) == zygote_pid and int(pid) != p.pid  # forked by the zygote, torch already imported
    assert torch_loaded == "True" and cwd == str(folder) and probe == "here"
    assert "no warm rank" not in err


def test_a_rank_that_dies_of_a_signal_takes_its_shim_with_it(zygote) -> None:
    p = shim(zygote, "abort")
    p.communicate(timeout=60)
    assert p.returncode == -signal.SIGABRT  # as ft_launcher saw it from a cold rank
    p = shim(zygote, "sleep")
    pid = int(rank_line(p)[1])
    os.kill(pid, signal.SIGKILL)  # a rank monitor kills the rank itself
    p.communicate(timeout=60)
    assert p.returncode == -signal.SIGKILL


def test_signals_reach_the_rank_and_a_killed_shim_leaves_no_orphan(zygote) -> None:
    p = shim(zygote, "sleep")
    pid = int(rank_line(p)[1])
    os.killpg(p.pid, signal.SIGTERM)  # how torch's SubprocessHandler stops a worker
    p.communicate(timeout=60)
    assert p.returncode == -signal.SIGTERM and not procs.alive(pid)
    p = shim(zygote, "sleep")
    pid = int(rank_line(p)[1])
    os.killpg(p.pid, signal.SIGKILL)  # and then kills it: the zygote sees the connection close
    p.wait(timeout=60)
    wait_for("the orphaned rank to be killed", lambda: not procs.alive(pid), timeout=30)


@pytest.mark.parametrize("why", ["no zygote", "an environment the zygote cannot serve"])
def test_without_a_zygote_that_can_serve_it_the_rank_starts_cold(zygote, why: str) -> None:
    name, pid, folder = zygote
    if why == "no zygote":
        p = shim((f"{name}-gone", pid, folder), "3")
    else:  # torch read its thread count at import: a rank that wants another starts afresh
        p = shim(zygote, "3", OMP_NUM_THREADS="7")
    _, pid, _, torch_loaded, *_ = rank_line(p)
    out, err = p.communicate(timeout=120)
    assert p.returncode == 3
    assert int(pid) == p.pid and torch_loaded == "False"  # the shim exec'd `python -u -m probe 3`
    assert len(re.findall("no warm rank", err)) == 1, err


class Squatter:
    """A process that listens where a zygote's shims look (a socket path, an abstract name) before the
    zygote does: records what each connection sends it, then closes it."""

    def __init__(self, *addresses: str) -> None:
        self.listeners = []
        for address in addresses:
            listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            listener.bind(address)
            listener.listen(16)
            self.listeners.append(listener)
        self.received: list[bytes] = []
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        import selectors

        sel = selectors.DefaultSelector()
        for listener in self.listeners:
            sel.register(listener, selectors.EVENT_READ)
        try:
            while True:
                for key, _ in sel.select():
                    conn, _ = key.fileobj.accept()
                    conn.settimeout(60)
                    try:
                        self.received.append(conn.recv(1 << 20))
                    except OSError:
                        self.received.append(b"")
                    conn.close()
        except (OSError, ValueError):   # closed
            pass

    def close(self) -> None:
        for listener in self.listeners:
            listener.close()


def test_a_squatter_on_the_zygotes_socket_gets_nothing_and_the_rank_starts_cold(zygote,
                                                                                tmp_path: Path) -> None:
    """Whoever listens where the shim was told to look, as the same user (who could replace the socket
    file), or on the abstract name the shim once used, is not the zygote: it receives no byte (no
    environment, no stdio), and the rank starts cold, saying why."""
    _, zygote_pid, folder = zygote
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    path = str(private / "zygote.sock")
    squatter = Squatter(path, "\0" + path)
    try:
        p = shim((path, zygote_pid, folder), "3", SECRET="hunter2")
        _, pid, _, torch_loaded, *_ = rank_line(p)
        out, err = p.communicate(timeout=120)
    finally:
        squatter.close()
    assert not any(squatter.received), squatter.received[0][:200]   # on main: the shim's whole environment
    assert p.returncode == 3 and int(pid) == p.pid and torch_loaded == "False", err
    assert f"not by zygote {zygote_pid}" in err and len(re.findall("no warm rank", err)) == 1, err


@pytest.mark.skipif(os.geteuid() != 0, reason="acting as another user needs root")
def test_another_user_cannot_reach_the_zygote(zygote) -> None:
    """The socket's folder is the user's own (0700): another user cannot even connect to it."""
    name, _, _ = zygote
    r, w = os.pipe()
    child = os.fork()
    if child == 0:   # nobody, trying the zygote's socket as a shim would
        code = 1
        try:
            os.setgid(65534)
            os.setuid(65534)
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                at_path(s, name)
            except OSError as e:
                os.write(w, b"refused %d" % e.errno)
            else:
                s.settimeout(60)
                os.write(w, b"answered " + s.recv(100))
            code = 0
        finally:
            os._exit(code)
    os.close(w)
    got = os.read(r, 200)
    os.close(r)
    assert os.waitpid(child, 0)[1] == 0
    assert got == b"refused %d" % errno.EACCES, got


@pytest.mark.slow
def test_a_squatter_on_the_next_zygotes_names_gets_nothing_and_the_restart_is_still_warm() -> None:
    """Before a job's second attempt (after a kill-launcher), another process binds the names its
    zygotes would take: the abstract names the shims once used and the socket paths themselves. No
    rank connects to it, and every rank of both attempts is still forked warm."""
    run = subprocess.Popen([sys.executable, "-m", "eksft_nb", "run", "--name", "warm-squatted", *BASE,
                            "--steps", "40", "--no-inprocess", "--fault", "kill-launcher@20", "--json"],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    jd = JobDir.for_name("warm-squatted")
    uid = wait_for("the job's uid", lambda: jd.supervisor().get("job_uid"), timeout=120)
    first = jd.logs / "zygote-0.0.log"
    wait_for("the first zygote", lambda: first.exists() and "ready" in first.read_text(), timeout=300)
    (jd.path / "warm").mkdir(mode=0o700, exist_ok=True)
    squatter = Squatter(str(jd.path / "warm" / "1.0.sock"), f"\0eksft-{uid}-1.0")
    try:
        out, err = run.communicate(timeout=600)
    finally:
        squatter.close()
    summary = json.loads(out[out.index("{"):])
    assert summary["state"] == "succeeded", (summary, err[-2000:])
    assert [r["level"] for r in summary["restart_events"]] == ["job"]
    assert squatter.received == [], [r[:200] for r in squatter.received]
    forked = {int(pid) for log in (jd.logs).glob("zygote-*.log")
              for pid in re.findall(r"forked rank (\d+)", log.read_text())}
    starts = events("warm-squatted", "rank_start")
    assert {e["job_attempt"] for e in starts} == {0, 1}, story("warm-squatted")
    assert {e["pid"] for e in starts} <= forked, story("warm-squatted")
    assert "no warm rank" not in " ".join(p.read_text() for p in jd.logs.glob("launcher-*.log"))


def test_a_ranks_group_is_killed_before_its_pid_is_freed(tmp_path: Path) -> None:
    """The zygote ends what a rank left in its group (its checkpoint writer) when the rank ends; by
    then the rank must not have been reaped, or its pid (the group's id) could be another's."""
    script = tmp_path / "reap.py"
    script.write_text(REAP)
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    states, helper_alive, sent = out.stdout.split()
    assert sent == "exit" and helper_alive == "False"
    assert states == "Z", f"the rank was {states!r} when its group was killed (not a zombie: reaped)"


REAP = """
import os, select, selectors, signal, socket
from eksft_nb.runtime import zygote

seen = []   # the rank's state (as /proc shows it) each time a group is killed
real_killpg = os.killpg
def killpg(pgid, sig):
    try:
        with open(f"/proc/{pgid}/stat") as f:
            seen.append(f.read().rsplit(")", 1)[1].split()[0])
    except FileNotFoundError:
        seen.append("gone")
    real_killpg(pgid, sig)
os.killpg = killpg

r, w = os.pipe()
rank = os.fork()
if rank == 0:          # the rank: its own group with a helper in it (a checkpoint writer), then it ends
    os.setsid()
    helper = os.fork()
    if helper == 0:    # until killed (it reads nothing from the pipe: the rank's pid is for the test)
        os.close(w)
        signal.pause()
        os._exit(0)
    os.write(w, b"%d" % helper)
    os._exit(0)
os.close(w)
helper = int(os.read(r, 20))
watch = os.pidfd_open(helper)
os.waitid(os.P_PID, rank, os.WEXITED | os.WNOWAIT)   # it has ended, not yet reaped
mine, theirs = socket.socketpair()
sel = selectors.DefaultSelector()
sel.register(mine, selectors.EVENT_READ, rank)
zygote._reap({rank: mine}, sel)
ended = select.select([watch], [], [], 60)[0]
print(seen[0] if seen else "none", not ended, theirs.recv(100).split()[0].decode())
"""


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
        entry = subprocess.run([sys.executable, *INPOD[1:], "launch", sys.executable, "launcher.py",
                                "--nnodes=1",
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
    forked = {int(pid) for log in logs.glob("zygote-*.log")
              for pid in re.findall(r"forked rank (\d+)", log.read_text())}
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
    assert not (job_dir("warm-faults") / "warm").exists()  # nor a zygote's socket, of any attempt


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
    launcher(15.3, "ft_launcher70",
             "failed (exitcode: -9) local_rank: 0 (pid: 71) of binary: /usr/bin/python")
    launcher(15.3, "ft_launcher70",
             "[default] Worker group FAILED. 2/3 attempts left; will restart worker group")
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
    launcher(30.3, "ft_launcher70",
             "failed (exitcode: -9) local_rank: 0 (pid: 91) of binary: /usr/bin/python")
    start(30.5, 3)
    rank(0, 30.7, "step", step=1, loss=None, tokens=None, step_time=0.1)
    failure, restart = incidents()[4:]
    assert failure[0] == "failure" and failure[1].startswith("hang: no heartbeat from rank 0 "), failure
    assert restart == ("restart", failure[1])
    sup.log.close()
