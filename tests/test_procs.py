"""Processes of local jobs, by identity: a stop never signals a process that merely reuses a
recorded pid; a supervisor that dies (or fails) never leaves the job's processes running
unsupervised; ``rm`` refuses while any process of a job runs; ``logs`` carries no library tracebacks."""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from eksft_nb import procs
from eksft_nb.backends.local import LocalBackend
from eksft_nb.backends.local.supervisor import Supervisor
from eksft_nb.control import FaultCommand, submit
from eksft_nb.errors import JobError
from eksft_nb.events import EventWriter, read_all
from eksft_nb.job import Job, attach
from eksft_nb.jobdir import JobDir, atomic_write
from eksft_nb.spec import JobSpec, ModelConfig
from eksft_nb.states import JobState
from jobs import cli, events, marked_process, wait_for

# what NVRx's rank monitor prints when a stop cancels it (captured from a real stop), and a rank's own error
MONITOR_CANCELLED = """\
handle: <Handle StreamReaderProtocol.connection_made.<locals>.callback(<Task cancell...erver.py:336>>) at \
/usr/lib/python3.11/asyncio/streams.py:248>
Traceback (most recent call last):
  File "/usr/lib/python3.11/asyncio/events.py", line 80, in _run
    self._context.run(self._callback, *self._args)
  File "/venv/lib/python3.11/site-packages/nvidia_resiliency_ext/fault_tolerance/rank_monitor_server.py", \
line 348, in _handle_ipc_connection
    while msg := await read_obj_from_ipc_stream(reader):
                 ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^
  File "/usr/lib/python3.11/asyncio/streams.py", line 540, in _wait_for_data
    await self._waiter
asyncio.exceptions.CancelledError
"""
RANK_ERROR = """\
[rank1]: Traceback (most recent call last):
[rank1]:   File "/home/me/train.py", line 12, in <module>
[rank1]:     step()
[rank1]: ValueError: the batch is empty
"""


def fake_job(tmp_path: Path, record: dict, name: str = "old") -> LocalBackend:
    jd = JobDir.for_name(name, tmp_path)
    jd.create(JobSpec(name=name))
    atomic_write(jd.supervisor_path, json.dumps(record))
    return LocalBackend(tmp_path)


@pytest.fixture
def stranger() -> subprocess.Popen:
    """An unrelated process group (its own session), as a process that reused a job's pid would be."""
    proc = subprocess.Popen(["sleep", "600"], start_new_session=True)
    yield proc
    proc.kill()
    proc.wait()


@pytest.mark.parametrize("state", ["succeeded", "running"])
def test_stop_never_signals_a_process_that_reuses_a_recorded_pid(tmp_path: Path, stranger: subprocess.Popen,
                                                                   state: str) -> None:
    started = psutil.Process(stranger.pid).create_time()
    old = {"pid": stranger.pid, "started": started - 3600}  # that pid, an hour ago: another process
    backend = fake_job(tmp_path, {"pid": stranger.pid, "pgid": stranger.pid, "supervisor": old, "keeper": old,
                                  "job_uid": "0123456789abcdef", "state": state,
                                  "launchers": [{"node": 0, **old, "pgid": stranger.pid, "tag": "0.0",
                                                 "log": str(tmp_path / "old" / "logs"
                                                            / "launcher-0-0.log")}]})
    backend.stop("old", timeout=5)
    assert stranger.poll() is None, "stop signalled a process that is not the job's"
    assert backend.state("old").state in ("succeeded", "stopped")


def test_a_recorded_process_is_known_by_its_start_ticks_when_the_clock_steps(
    stranger: subprocess.Popen) -> None:
    # psutil's wall-clock start moves with the boot time whenever the system clock is stepped (NTP):
    # the job's supervisor must not look gone then, nor another process at its pid look like it
    entry = procs.identity(stranger.pid)
    stepped = {**entry, "started": entry["started"] + 1.0}
    assert procs.recorded(stepped) is not None and procs.recorded(stepped).pid == stranger.pid
    assert procs.recorded({**entry, "ticks": entry["ticks"] - 1}) is None
    # recorded before ticks: the start time decides
    assert procs.recorded({**entry, "ticks": None}) is not None


def test_rm_refuses_while_a_process_of_the_job_runs(tmp_path: Path) -> None:
    uid = "fedcba9876543210"
    backend = fake_job(tmp_path, {"job_uid": uid, "state": "failed", "reason": "gave up"})
    rank = marked_process(uid, start_new_session=True)
    try:
        with pytest.raises(JobError, match=f"processes \\[{rank.pid}\\] of job 'old' still run"):
            backend.remove("old")
        assert (tmp_path / "old" / "spec.json").is_file()
    finally:
        rank.kill()
        rank.wait()
    backend.remove("old")
    assert not (tmp_path / "old").exists()


# a launcher starting its ranks, at its busiest: child after child (300 at most), each living a minute
FORKING = """
import os, time
for _ in range(300):
    if os.fork() == 0:
        time.sleep(60)
        os._exit(0)
time.sleep(60)
"""


def test_killing_a_jobs_processes_ends_the_children_a_parent_forks_while_they_are_killed() -> None:
    """CI: a stop, right after a job restart, found two of the job's processes alive 10 s after killing
    every marked process it had listed: a process forked after the scan passed its parent is not listed."""
    uid = "0f0f0f0f0f0f0f0f"
    parent = subprocess.Popen([sys.executable, "-c", FORKING], env={**os.environ, procs.JOB_UID_ENV: uid},
                              start_new_session=True)
    try:
        wait_for("its first children", lambda: len(procs.marked(uid)) >= 3, timeout=30, every=0.05)
        procs.kill_marked(uid, timeout=30)
        assert procs.marked(uid) == []
    finally:
        try:
            os.killpg(parent.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        parent.wait()


def test_a_job_reads_ended_only_once_its_supervisor_and_keeper_are_gone(tmp_path: Path) -> None:
    """The supervisor records the end (``job_end``, then its record) a moment before it and its keeper
    exit: until they have, the job is still running, ending, so that "stopped" means nothing runs."""
    uid = "00112233445566aa"
    keeper = subprocess.Popen(["sleep", "600"], env={**os.environ, procs.JOB_UID_ENV: uid},
                              start_new_session=True)
    try:
        backend = fake_job(tmp_path, {"job_uid": uid, "state": "stopped", "reason": "stopped by the user",
                                      "keeper": procs.identity(keeper.pid)})
        EventWriter(JobDir.for_name("old", tmp_path).events_path, "old", rank=None).emit(
            "job_end", state="stopped", reason="stopped by the user", final_step=7)
        job = Job("old", backend)
        state, detail = job.status()
        assert (state, detail) == (JobState.RUNNING, "ending (stopped: stopped by the user)")
        assert not state.ended
    finally:
        keeper.kill()
        keeper.wait()
    assert job.status() == (JobState.STOPPED, "stopped by the user")


def test_logs_drop_library_tracebacks_whole_and_keep_a_rank_s_error(tmp_path: Path) -> None:
    backend = fake_job(tmp_path, {"state": "stopped"})
    (tmp_path / "old" / "logs" / "launcher-0-0.log").write_text(RANK_ERROR + MONITOR_CANCELLED + "training "
                                                                "went on\n")
    shown = backend.logs("old").splitlines()
    assert shown == ["[rank1]: ValueError: the batch is empty", "training went on"], shown
    debug = backend.logs("old", debug=True)
    assert MONITOR_CANCELLED in debug and RANK_ERROR in debug


@pytest.mark.slow
def test_a_full_disk_in_the_supervisor_ends_the_job_with_the_reason_and_nothing_running(
    eksft_home: Path) -> None:
    jd = JobDir.for_name("disk-full")
    jd.create(JobSpec(name="disk-full", steps=100000, model=ModelConfig(preset="tiny")))
    sup = Supervisor(jd)
    read_events = sup._read_events

    def failing() -> None:
        read_events()
        if sup.mon.last_step >= 3:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(jd.events_path))

    sup._read_events = failing
    assert sup.run() == 1
    record = jd.supervisor()
    assert record["state"] == "failed" and "No space left on device" in record["reason"], record
    assert [e["state"] for e in read_all(jd.events_path) if e.kind == "job_end"] == ["failed"]
    assert not procs.marked(sup.job_uid), [p.cmdline() for p in procs.marked(sup.job_uid)]


@pytest.mark.slow
def test_a_job_whose_supervisor_and_keeper_died_is_adopted_not_lost() -> None:
    assert cli("run", "--name", "orphan", "--model", "tiny", "--steps", "60", "--ckpt-every", "10",
               "--detach").returncode == 0
    jd = JobDir.for_name("orphan")
    wait_for("5 steps", lambda: len(events("orphan", "step")) >= 5)
    record = jd.supervisor()
    victims = [record[who]["pid"] for who in ("keeper", "supervisor") if who in record] or [record["pid"]]
    for pid in victims:  # the keeper and the supervisor, as a careless `kill -9` would
        os.kill(pid, signal.SIGKILL)
    wait_for("the supervisor to die", lambda: not any(procs.alive(pid) for pid in victims))
    submit(jd.pending, FaultCommand("sigkill", rank=1))  # an in-job restart while nobody supervises
    wait_for("the restart", lambda: any(e["injob_restart"] == 1 for e in events("orphan", "rank_start")))
    backend = LocalBackend()
    status = backend.state("orphan")   # a query starts nothing: the job is orphaned, not yet adopted
    assert (status.state, status.orphaned) == ("running",
                                               True) and "nothing supervises" in status.detail, status
    assert not any(procs.recorded(jd.supervisor().get(who), record["job_uid"])
                   for who in ("keeper", "supervisor"))
    state, detail = attach("orphan").status()   # looking at the job adopts it
    assert state == "running" and "adopted" in detail, detail
    with pytest.raises(JobError):
        backend.remove("orphan")
    wait_for("the end", lambda: backend.state("orphan").state not in ("starting", "running"), 300)
    assert backend.state("orphan").state == "succeeded"
    assert max(e["step"] for e in events("orphan", "step")) == 60
    [restart] = events("orphan", "restart")  # recorded by the supervisor that adopted the job
    assert restart["level"] == "injob" and restart["blame_rank"] == 1, restart
    assert "sigkill" in restart["cause"], restart
    wait_for("the keeper and supervisor to exit", lambda: not procs.marked(record["job_uid"]), 30)


@pytest.mark.slow
def test_logs_after_a_stop_carry_no_library_traceback(
        stopped_job: tuple[str, list[int], list[int], int]) -> None:
    name, _, _, stopped = stopped_job   # the session's job stopped after 5 steps (test_engine checks its end)
    assert stopped == 0
    logs, debug = cli("logs", name, "--lines", "100000").stdout, cli("logs", name, "--debug", "--lines",
                                                                     "100000").stdout
    for noise in ("Traceback", "CancelledError", "  File "):
        assert noise not in logs, f"{noise!r} leaked:\n{logs[-2000:]}"
    assert "job stopped: stopped by the user" in logs and "failure" not in logs
    assert set(logs.splitlines()) <= set(debug.splitlines()) and len(debug) > len(logs)
