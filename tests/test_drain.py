"""SIGTERM to every rank, as a node drain or a preemption delivers it: the ranks agree on one step,
save and commit it, and the job stops (not fails); a resume from that save ends bit-identical to a
fault-free run."""

from __future__ import annotations

import json
import os
import signal

import pytest

from eksft_nb.checkpoint_folders import list_checkpoints, verify
from eksft_nb.engines.torchft.hold import HOLD_ENV, step_point
from jobs import BASE, cli, events, job_dir, story, wait_for

pytestmark = pytest.mark.slow


# warm ranks fork their checkpoint writer (it keeps the drain's handler); a cold rank's writer is spawned
# and dies of the SIGTERM to the rank's process group, so that drain saves without it. Both ranks are held
# before step 14 (engines/torchft/hold.py) while the signals land: the step that agrees counts exactly the
# ranks signalled (both: a node drained; rank 0 alone: a peer's node drained, this one's ranks follow)
@pytest.mark.parametrize("extra, signalled", [((), (0, 1)), (("--no-warm-ranks",), (0,))],
                         ids=["warm-both", "cold-one"])
def test_a_drain_saves_commits_and_stops_then_resumes_bit_identical(
        reference_digest: str, extra: tuple, signalled: tuple, tmp_path, monkeypatch) -> None:
    name = "drained" + "-cold" * bool(extra)
    holds = tmp_path / "holds"
    holds.mkdir()
    for rank in (0, 1):
        (holds / step_point(rank, 14)).touch()
    monkeypatch.setenv(HOLD_ENV, str(holds))
    proc = cli("run", "--name", name, *BASE, *extra, "--detach")
    assert proc.returncode == 0, proc.stderr
    # mid checkpoint interval: after the save of step 10 is committed, a few steps into the next interval;
    # rank 0's step 13 is reported after the step's all-reduce, so neither rank has a say in step 14's yet
    wait_for("step 13", lambda: any(e["step"] >= 13 for e in events(name, "step")), timeout=300)
    ranks = {e.rank: e["pid"] for e in events(name, "rank_start")}
    assert sorted(ranks) == [0, 1]
    # to each rank's process group, as ft_launcher (and a warm rank's shim) sends it
    for rank in signalled:
        os.killpg(os.getpgid(ranks[rank]), signal.SIGTERM)
    for rank in (0, 1):
        (holds / step_point(rank, 14)).unlink()
    status = wait_for("the job to end",
                      lambda: (s := json.loads(cli("status", name, "--json").stdout))["state"]
                      not in ("starting", "running", "recovering") and s, timeout=300)
    assert status["state"] == "stopped", story(name)
    [drain] = events(name, "drain")
    step = drain["step"]
    assert drain["committed"] and step == 14, drain
    assert drain["ranks_asked"] == len(signalled), drain
    # the step it drained at is committed on disk, intact, and nothing after it was trained
    committed = {i.step: i for i in list_checkpoints(job_dir(name) / "ckpt") if i.state == "committed"}
    assert step in committed and verify(committed[step]) is None, committed
    assert max(e["step"] for e in events(name, "step")) == step
    summary = json.loads(cli("summary", name, "--json").stdout)
    assert summary["state"] == "stopped", summary
    assert f"drained on SIGTERM at step {step}" in summary["reason"], summary
    assert summary["restarts"] == {"inprocess": 0, "injob": 0, "job": 0}   # a drain is no failure
    # resume from the save it made: the same parameters as the run that never stopped
    resumed = cli("resume", name, "--as", f"{name}-resumed")
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    [start] = events(f"{name}-resumed", "resume")
    assert start["step"] == step
    after = json.loads(cli("summary", f"{name}-resumed", "--json").stdout)
    assert after["state"] == "succeeded" and after["digest"] == reference_digest, after


def test_the_dashboard_says_the_warning_and_the_drain() -> None:
    from eksft_nb.dashboard import Dashboard
    from test_dashboard import FakeJob, said

    job = FakeJob("warned-drained")
    job.steps(1, 12)
    job.emit("warning", rank=0, what="slow-save", message="the save before step 12 is still being written")
    dash = Dashboard(job.handle(), live=False)
    assert said(dash) == "warning: the save before step 12 is still being written"
    job.emit("drain", rank=0, step=12, committed=True)
    job.emit("job_end", dt=0.1, state="stopped", reason="drained on SIGTERM at step 12 (saved and committed)",
             final_step=12)
    dash.update()
    assert said(dash) == "warned-drained stopped: drained on SIGTERM at step 12 (saved and committed)"


# a rank SIGTERMed by ft_launcher for an in-job restart may never reach the step boundary a drain needs
# (it hangs, or waits in C on a peer that is gone): it must still die of the signal, after its patience
RANK = """
import ctypes, os, signal, sys, time
from eksft_nb.runtime.drain import Drain
drain = Drain(patience_floor=1.0).install()
how = sys.argv[1]
if how == "fork":   # a forked child (a warm rank's checkpoint writer) gets a SIGTERM of its own
    up, told = os.pipe()
    child = os.fork()
    if child == 0:   # os.fork returns here once the child's fork hooks ran
        os.write(told, b"up")
        time.sleep(60)
        os._exit(0)
    os.read(up, 2)
    os.kill(child, signal.SIGTERM)
    print("ready", flush=True)
    time.sleep(4)   # four times the patience: the child's signal is not this rank's
    os.kill(child, signal.SIGKILL)
    sys.exit(0)
print("ready", flush=True)
if how == "python":   # as the hang fault does
    while True:
        time.sleep(0.05)
if how == "c":   # a main thread stuck in C runs no Python handler (a collective on a gone peer)
    mutex = ctypes.create_string_buffer(64)
    libc = ctypes.CDLL(None)
    libc.pthread_mutex_lock(mutex)
    libc.pthread_mutex_lock(mutex)
if how == "left-loop":   # its training function failed (an in-process restart waits on a lost peer)
    drain.patience_floor = 600.0   # longer than the test waits: only leaving the loop ends it now
    drain.left_loop()
    while True:
        time.sleep(0.05)
if how == "agreed":   # the drain is agreed at the next step boundary: the save may take its time
    while not drain.requested:
        time.sleep(0.01)
    drain.agree()
    time.sleep(4)
    sys.exit(0)
"""


@pytest.mark.parametrize("how, dies", [("python", True), ("c", True), ("left-loop", True), ("agreed", False),
                                       ("fork", False)])
def test_a_sigtermed_rank_dies_of_it_unless_its_drain_is_agreed(how: str, dies: bool) -> None:
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-c", RANK, how], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        if how != "fork":
            proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=120)
    finally:
        proc.kill()
    assert code == (-signal.SIGTERM if dies else 0), code


@pytest.mark.parametrize("code, drained, sigterm, script, exit_code", [
    (0, 2, False, False, 138),    # every rank here drained (a peer pod's SIGTERM): a drain, never 0
    (1, 2, True, False, 138),     # drained, then ft_launcher died of the signal in its exit barrier
    (0, 0, True, False, 0),       # SIGTERM as the last step ended: finished
    (0, 0, True, True, 138),      # a script that stopped on SIGTERM: not known to be done
    (1, 0, True, False, 138),     # stopped before the ranks could drain: the cluster's doing, not a failure
    (1, 0, False, False, 1),      # a launcher that gave up: its own code
    (-9, 0, False, False, 137),   # a launcher killed: as a shell says it
])
def test_the_pods_exit_code_says_a_drain(tmp_path, monkeypatch, code: int, drained: int, sigterm: bool,
                                         script: bool, exit_code: int) -> None:
    """What the process around ft_launcher exits with (eks.pod_entry), from ft_launcher's code, the marks of
    this pod's 2 ranks, a SIGTERM to it and whether the job is a script; a drain is recorded for the next
    incarnation (its attempt counts it) and said in the termination message."""
    from eksft_nb.backends.eks.pod_entry import Drains, _outcome, attempt
    from eksft_nb.runtime.drain import DRAIN_EXIT

    monkeypatch.setenv("EKSFT_TERMINATION_LOG", str(tmp_path / "termination-log"))
    marks = [{"rank": r, "step": 12, "committed": True} for r in range(drained)]
    drains = Drains(str(tmp_path / "job"), "uid1")
    assert _outcome(code, marks, 2, sigterm, script, drains) == exit_code
    message = (tmp_path / "termination-log").read_text() if exit_code == DRAIN_EXIT else ""
    assert message.startswith("drained on SIGTERM at step 12 (saved and committed)" if drained else
                              "stopped by the cluster (SIGTERM)" if exit_code == DRAIN_EXIT else "")
    monkeypatch.setenv("EKSFT_JOB_ATTEMPT", "1")
    assert attempt(Drains(str(tmp_path / "job"), "uid1")) == 1 + (exit_code == DRAIN_EXIT)
    assert attempt(Drains(str(tmp_path / "job"), "another-launch")) == 1


STUCK_LAUNCHER = """
import signal, subprocess, sys, time
if sys.argv[1] == "ignores":   # as ft_launcher in its exit barrier: the store's wait outlasts the signal
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
monitor = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])   # its rank monitor
print(monitor.pid, flush=True)
time.sleep(300)
"""


@pytest.mark.parametrize("on_sigterm, code", [("ignores", -signal.SIGKILL), ("ends", -signal.SIGTERM)])
def test_a_launcher_left_waiting_after_its_ranks_drained_is_ended(tmp_path, monkeypatch, on_sigterm: str,
                                                                  code: int) -> None:
    """A pod whose peer was drained: its ranks drained too, but its ft_launcher waits in torchelastic's exit
    barrier for the peer that left (300 s), and SIGTERM does not end that wait. The pod's entry sends it
    SIGTERM, then SIGKILL (to the processes under it as well), and the pod ends as a drain."""
    import contextlib
    import subprocess
    import sys
    import time

    import psutil

    from eksft_nb.backends.eks import pod_entry

    monkeypatch.setattr(pod_entry, "EXIT_GRACE_S", 0.5)
    monkeypatch.setattr(pod_entry, "KILL_GRACE_S", 1.0)
    launcher = subprocess.Popen([sys.executable, "-c", STUCK_LAUNCHER, on_sigterm],
                                stdout=subprocess.PIPE, text=True)
    monitor = psutil.Process(int(launcher.stdout.readline()))
    try:
        t0 = time.monotonic()
        (tmp_path / "rank-0.json").write_text(json.dumps({"rank": 0, "step": 12, "committed": True}))
        assert pod_entry._wait(launcher, str(tmp_path), 1, []) == code
        assert time.monotonic() - t0 < 60
        if code == -signal.SIGKILL:   # nothing of the pod outlives its launcher
            gone, alive = psutil.wait_procs([monitor], timeout=10)
            assert not [p for p in alive if p.status() != psutil.STATUS_ZOMBIE], alive
    finally:
        launcher.kill()
        with contextlib.suppress(psutil.Error):
            monitor.kill()


def test_a_pod_after_a_drain_waits_for_every_pod_before_it_to_end(tmp_path) -> None:
    """After a drain the workload replaces each pod as soon as that pod is gone; a replacement started while
    another drained pod still waits in its exit barrier would join the old rendezvous and lose its store
    (the replay found it). So each pod leaves a mark as it exits, and a pod of the next incarnation waits for
    all of them, at most the pods' grace period, and not once it is stopped itself."""
    import threading

    from eksft_nb.backends.eks.pod_entry import Drains

    job = str(tmp_path / "job")
    old0, old1 = Drains(job, "uid1"), Drains(job, "uid1")
    assert old0.wait_for_previous(2, 60.0, []) == []   # the first incarnation waits for nobody
    old1.record({"step": 12, "committed": True, "t": 0.0, "sigterm": True})
    old1.gone("1")
    new1 = Drains(job, "uid1")
    assert new1.before == 1 and new1.wait_for_previous(2, 0.2, []) == ["0"]   # pod 0 still in its barrier
    ended = threading.Timer(0.3, old0.gone, args=("0",))
    ended.start()
    assert new1.wait_for_previous(2, 60.0, []) == []   # returns as pod 0 ends
    ended.join()
    assert Drains(job, "another-launch").wait_for_previous(2, 60.0, []) == []   # another launch's drains
    new1.record({"step": 14, "committed": True, "t": 0.0, "sigterm": True})   # a second drain ...
    assert Drains(job, "uid1").wait_for_previous(2, 60.0, [1.0]) == []   # ... and the pod is stopped itself
