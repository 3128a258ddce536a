"""How a local job ends when what it runs on fails under it: the job folder's disk fills up (a real
filesystem, a small tmpfs, filled for real), its supervisor is stopped (SIGSTOP), or the checkpoint it
resumes from is deleted. Each ends (or is adopted) with its reason, and leaves nothing torn or stray:
no half line in the events file, no step folder of a save never committed, no temporary file, no
warm-rank socket."""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import psutil
import pytest

from eksft_nb import procs
from eksft_nb.backends.local import LocalBackend
from eksft_nb.backends.local import ending
from eksft_nb.backends.local.beat import SILENCE_S
from eksft_nb.checkpoint_folders import list_checkpoints
from eksft_nb.control import FaultCommand, submit
from eksft_nb.events import EventWriter, decode, read_all
from eksft_nb.jobdir import JobDir, atomic_write
from eksft_nb.spec import JobSpec
from eksft_nb.states import ACTIVE, JobState
from jobs import cli, events, job_dir, story, wait_for

FULL = "the job folder's disk is full"


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Callable[[str], Path]]:
    """Mount a tmpfs of the given size (a real filesystem that fills up for real); unmounted after."""
    if os.geteuid() != 0:
        pytest.skip("mounting a filesystem needs root")
    mounted: list[Path] = []

    def mount(size: str) -> Path:
        where = tmp_path / f"disk-{len(mounted)}"
        where.mkdir(mode=0o700)
        subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(where)],
                       check=True)
        mounted.append(where)
        return where

    yield mount
    for where in mounted:
        subprocess.run(["umount", "-l", str(where)], check=False)


def fill(disk: Path) -> Path:
    """Write a file until the filesystem refuses another byte (ENOSPC), as a full disk does."""
    filler = disk / "filler"
    with open(filler, "wb", buffering=0) as f:
        for chunk in (1 << 20, 4096, 1):
            try:
                while True:
                    f.write(b"\0" * chunk)
            except OSError as e:
                assert e.errno == errno.ENOSPC, e
    return filler


def assert_nothing_torn_or_stray(jd: JobDir) -> None:
    """Every line of the events file is a whole event; no temporary file, uncommitted step folder or
    warm-rank socket is left."""
    raw = jd.events_path.read_bytes()
    assert raw.endswith(b"\n"), raw[-300:]
    torn = [line for line in raw.decode().splitlines() if decode(line) is None]
    assert not torn, torn
    stray = [str(p) for p in jd.path.rglob("*.tmp")] + [str(p) for p in jd.path.rglob("*.sock")]
    assert not stray and not jd.warm.exists(), stray
    folders = list_checkpoints(jd.path / "ckpt")
    assert {i.state for i in folders} <= {"committed"}, folders


def test_on_a_full_disk_the_end_is_recorded_and_no_event_is_torn(small_disk: Callable[[str], Path]) -> None:
    """A job folder on a 1 MiB filesystem that fills up: appends fail whole (none is left half-written,
    with its readers none the wiser), a state record fails without leaving its temporary file, and the
    end of the job is recorded anyway, in the room reserved for it when the job was made."""
    root = small_disk("1m") / "jobs"
    jd = JobDir.for_name("full", root)
    jd.create(JobSpec(name="full"))
    writer = EventWriter(jd.events_path, "full", rank=None)
    writer.emit("job_start", spec_digest="d", world_size=1, steps=10, backend="local", host="h", pid=1)
    fill(root.parent)
    written = 1
    while not writer.lost:   # until the disk refuses one: the last page's room takes some first
        writer.emit("step", step=written, loss=1.0, tokens=8, step_time=0.1)
        written += 1
    assert jd.events_path.read_bytes().endswith(b"\n")
    assert [e.kind for e in read_all(jd.events_path)] == ["job_start"] + ["step"] * (written - 2)
    with pytest.raises(OSError):
        atomic_write(jd.supervisor_path, "{}" * 4096)
    assert ending.record(jd, JobState.FAILED, f"{FULL}: a test", final_step=written - 2, events=writer)
    status = LocalBackend(root).state("full")
    assert (status.state, status.detail) == ("failed", f"{FULL}: a test")
    ends = [e for e in read_all(jd.events_path) if e.kind == "job_end"]
    assert [(e["state"], e["reason"]) for e in ends] == [("failed", f"{FULL}: a test")]
    [lost] = [e for e in read_all(jd.events_path) if e.kind == "events_lost"]   # what the full disk cost
    assert lost["count"] == 1 and "No space left" in lost["error"]
    assert_nothing_torn_or_stray(jd)


@pytest.mark.slow
def test_a_full_disk_during_a_save_ends_the_job_with_its_reason_and_leaves_nothing_torn(
        small_disk: Callable[[str], Path]) -> None:
    home = small_disk("40m")
    env = {**os.environ, "EKSFT_HOME": str(home)}
    backend = LocalBackend(home / "jobs")
    name = "disk-fills"
    launched = subprocess.run([sys.executable, "-m", "eksft_nb", "run", "--name", name, "--model", "tiny",
                               "--steps", "100000", "--ckpt-every", "5", "--detach"], env=env,
                              capture_output=True, text=True, timeout=300)
    assert launched.returncode == 0, launched.stderr
    jd = JobDir.for_name(name, home / "jobs")
    try:
        def saves(phase: str) -> list[int]:
            return [e["step"] for e in read_all(jd.events_path)
                    if e.kind == "checkpoint" and e["phase"] == phase]

        first = wait_for("a committed checkpoint", lambda: saves("committed"))[0]
        wait_for("a save in flight", lambda: any(s > first for s in saves("staged")))
        fill(home)
        wait_for("the job to end", lambda: backend.state(name).state not in ACTIVE, timeout=180)
        status = backend.state(name)
        assert status.state == "failed" and status.detail.startswith(FULL), status
        assert f"resume {name}" in status.detail, status
        wait_for("its supervisor and keeper to exit", lambda: backend.settled(name), timeout=60)
    finally:
        if backend.state(name).state in ACTIVE:
            backend.stop(name)
    ends = [e for e in read_all(jd.events_path) if e.kind == "job_end"]
    assert [(e["state"], e["reason"]) for e in ends] == [("failed", status.detail)]
    log = (jd.logs / "supervisor.log").read_text()
    assert "adopt" not in log and f"job failed: {FULL}" in log, log   # one supervisor, ended on purpose
    assert "Traceback" not in (jd.logs / "supervisor.err").read_text()
    assert not procs.marked(jd.supervisor()["job_uid"])
    assert_nothing_torn_or_stray(jd)
    assert any(i.state == "committed" for i in list_checkpoints(jd.path / "ckpt"))  # what it resumes from


def test_a_stopped_supervisor_whose_keeper_is_gone_leaves_its_job_orphaned(tmp_path: Path) -> None:
    """Stopped, it supervises nothing: with its keeper gone, the job counts as orphaned (so the first
    query adopts it), not as running under a supervisor."""
    uid = "5a5a5a5a5a5a5a5a"
    supervisor = subprocess.Popen(["sleep", "600"], env={**os.environ, procs.JOB_UID_ENV: uid},
                                  start_new_session=True)
    try:
        jd = JobDir.for_name("halted", tmp_path)
        jd.create(JobSpec(name="halted"))
        atomic_write(jd.supervisor_path, json.dumps({"job_uid": uid, "state": "running",
                                                     "supervisor": procs.identity(supervisor.pid)}))
        backend = LocalBackend(tmp_path)
        assert (backend.state("halted").state, backend.state("halted").orphaned) == ("running", False)
        os.kill(supervisor.pid, signal.SIGSTOP)
        wait_for("it to stop", lambda: procs.halted(psutil.Process(supervisor.pid)))
        assert (backend.state("halted").state, backend.state("halted").orphaned) == ("running", True)
    finally:
        supervisor.kill()
        supervisor.wait()


@pytest.mark.slow
def test_a_stopped_supervisor_is_killed_and_its_job_adopted_and_stop_does_not_wait_on_one() -> None:
    name = "sigstop"
    assert cli("run", "--name", name, "--model", "tiny", "--steps", "100000", "--detach").returncode == 0
    jd = JobDir.for_name(name)
    backend = LocalBackend()
    try:
        wait_for("3 steps", lambda: len(events(name, "step")) >= 3)
        stopped = jd.supervisor()["supervisor"]
        os.kill(stopped["pid"], signal.SIGSTOP)
        # a node lost while nobody supervises: the job would stay "running" for good
        submit(jd.pending, FaultCommand("kill-launcher"))
        # the keeper hears no beat: it kills the supervisor (by identity), and a successor adopts the job
        wait_for("a successor", lambda: jd.supervisor()["supervisor"]["pid"] != stopped["pid"],
                 timeout=SILENCE_S + 120)
        assert procs.recorded(stopped) is None
        log = (jd.logs / "supervisor.log").read_text()
        assert f"the supervisor (pid {stopped['pid']}) stopped beating" in log, story(name)
        assert f"supervisor {stopped['pid']} is gone; supervisor " in log and "adopted the job" in log, log
        [restart] = wait_for("the job restart", lambda: events(name, "restart"))
        assert restart["level"] == "job" and "kill-launcher" in restart["cause"], restart
        assert backend.state(name).state == "running"
        # stop never waits on a stopped supervisor: it kills it, and ends the job's processes itself
        successor = jd.supervisor()
        os.kill(successor["supervisor"]["pid"], signal.SIGSTOP)
        t0 = time.monotonic()
        backend.stop(name)
        took = time.monotonic() - t0
    finally:
        if backend.state(name).state in ACTIVE:
            backend.stop(name)
    assert took < SILENCE_S, f"stop took {took:.1f}s"   # it neither waited on it nor for its keeper to notice
    status = backend.state(name)
    assert (status.state, status.detail) == ("stopped", "stopped by the user")
    assert [e["state"] for e in events(name, "job_end")] == ["stopped"]
    assert not procs.marked(successor["job_uid"]), [p.cmdline() for p in procs.marked(successor["job_uid"])]
    assert not jd.warm.exists()


@pytest.mark.slow
def test_rm_refuses_while_a_job_resumes_from_the_folder_and_a_vanished_start_ends_the_job(
        finished_job: str) -> None:
    source = "finished-copy"   # a copy: the session's finished job stays as other tests expect it
    shutil.copytree(job_dir(finished_job), job_dir(source))
    name = "from-copy"
    ckpt = job_dir(source) / "ckpt"
    launched = cli("run", "--name", name, "--model", "tiny", "--steps", "100000", "--ckpt-every", "1000",
                   "--resume", str(ckpt), "--detach")
    assert launched.returncode == 0, launched.stderr
    backend = LocalBackend()
    try:
        refused = cli("rm", source)
        assert refused.returncode != 0 and f"job '{name}' (" in refused.stderr, refused.stderr
        assert f"resumes from {ckpt}" in refused.stderr and f"stop {name}" in refused.stderr, refused.stderr
        assert job_dir(source).is_dir()
        [resumed] = wait_for("the resume", lambda: events(name, "resume"))
        assert resumed["path"].startswith(str(ckpt)), resumed
        shutil.rmtree(ckpt)   # deleted by hand: the next restore cannot succeed
        submit(JobDir.for_name(name).pending, FaultCommand("exception", rank=0))
        wait_for("the job to end", lambda: backend.state(name).state not in ACTIVE, timeout=180)
    finally:
        if backend.state(name).state in ACTIVE:
            backend.stop(name)
    status = backend.state(name)
    assert status.state == "failed", story(name)
    assert "no restart can help" in status.detail, status
    assert f"no checkpoint in {ckpt} can be loaded" in status.detail, status
    # each rank's in-process tier stopped at the first such restore (the launchers had at most their own
    # restarts' worth before the supervisor ended the job), where it restarted endlessly
    fatal = [e for e in events(name, "rank_error") if e.get("fatal")]
    assert fatal and all("NoStartPoint" in e["error"] for e in fatal), fatal
    assert len(fatal) <= 2 * (1 + JobSpec().ft.max_injob_restarts), fatal
    assert [e["state"] for e in events(name, "job_end")] == ["failed"]
    backend.remove(source)   # nothing resumes from it any more
    assert not job_dir(source).exists()
