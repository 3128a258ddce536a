"""Real 2-rank jobs on CPU/gloo that break and heal: NVRx restarts at each level, checkpoints on
disk, and final parameters bit-identical to a fault-free run with the same seed."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from eksft_nb import nvrx
from eksft_nb import procs
from eksft_nb.checkpoint_folders import list_checkpoints
from eksft_nb.texts import format_summary
from eksft_nb.jobdir import JobDir
from eksft_nb.monitor import JobMonitor
from eksft_nb.spec import JobSpec
from eksft_nb.timeouts import resolved
import nvrx_releases as releases
from jobs import cli, events, job_dir, run_job

pytestmark = pytest.mark.slow


@pytest.fixture(params=[releases.NEWEST], ids=lambda v: f"nvrx-{v}")
def nvrx_release(request: pytest.FixtureRequest) -> tuple[str, Path | None]:
    """(the NVRx version a job must run with, the folder to put first on PYTHONPATH for it): the full
    matrix's release (see nvrx_releases)."""
    return releases.version(request.param), releases.folder(request.param)


@pytest.fixture(params=[*releases.SMOKE, releases.NEWEST], ids=lambda v: f"nvrx-{v}")
def any_nvrx_release(request: pytest.FixtureRequest) -> tuple[str, Path | None]:
    """As :func:`nvrx_release`, for the smoke set: every release the tests have."""
    return releases.version(request.param), releases.folder(request.param)


def ran_with(name: str, version: str) -> None:
    """The job ran with NVRx ``version``: the supervisor reported it, and the launchers imported it."""
    [start] = events(name, "job_start")
    assert start["nvrx"] == version, start.data
    log = (job_dir(name) / "logs" / "launcher-0-0.log").read_text()
    assert ("[workload:" in log) == (nvrx.parse_version(version) >= (0, 6, 0)), log[:2000]


def test_faults_at_every_level_heal_and_lose_nothing(reference_digest: str, nvrx_release) -> None:
    version, folder = nvrx_release
    name = f"four-faults-{version.replace('.', '-')}"
    # the exception one step after a save: no step boundary has committed it yet (the restart must still
    # resume from it)
    summary = run_job(name, "--fault", "exception:0@11", "--fault", "sigkill:1@30",
                      "--fault", "hang:0@45", "--fault", "kill-launcher@60", nvrx=folder)
    assert summary["state"] == "succeeded", summary
    ran_with(name, version)
    assert summary["steps_done"] == 80
    restarts = summary["restart_events"]
    assert [r["level"] for r in restarts] == ["inprocess", "injob", "inprocess", "job"]
    assert [r["blame_rank"] for r in restarts[:3]] == [0, 1, 0]
    assert all(r["downtime_s"] > 0 and r["rolled_back_steps"] >= 0 for r in restarts)
    # an in-process restart resumes from the newest save, committed or not (the processes wrote it)
    assert [restarts[0]["resumed_step"], restarts[2]["resumed_step"]] == [10, 40], restarts
    # every restart is split into its phases, which add up to its downtime
    for r in restarts:
        assert r["restored_from"] in ("memory", "storage"), r    # and say where the checkpoint came from
        assert list(r["phases"]) == ["detection", "teardown", "reformation", "restore", "first_step"], r
        assert sum(r["phases"].values()) == pytest.approx(r["downtime_s"], abs=0.01), r
    assert format_summary(summary).count("    phases: detection ") == 4   # `summary` says them
    # the exception's rank told its peer at once: the peer did not wait out the collective timeout
    assert restarts[0]["detection_s"] < resolved(JobSpec(), gpu=False).ft.collective_timeout, restarts[0]
    assert summary["digest"] == reference_digest  # bit-identical to the fault-free run, whichever NVRx
    # the restarts loaded the newest checkpoint from the ranks' in-memory copies, unless a newer save was
    # being staged over them when the fault hit (then from storage, saying so): the in-job one did
    resumes = events(name, "resume")
    assert all(e["source"] == "memory"
               or "there is none" in e["memory"] for e in resumes), [e.data for e in resumes]
    [injob] = [r for r in events(name, "restart") if r["level"] == "injob"]
    # from memory, unless the next save was already replacing the copies when rank 1 died (a starved
    # machine commits a save several steps after staging it): then storage, and its resume says so
    said = [e["memory"] for e in resumes if injob["fault_time"] <= e.t <= injob.t and e.get("memory")]
    assert injob["restored_from"] == "memory" or (said and all("there is none" in m for m in said)), \
        (injob.data, said)
    uid = JobDir(job_dir(name)).supervisor()["job_uid"]
    assert not list(Path("/dev/shm").glob(f"*eksft-{uid}-*")), "the copies end with the job"
    fired = [(f["fault"], f["at_step"]) for f in events(name, "fault")]
    assert fired == [("exception", 11), ("sigkill", 30), ("hang", 45), ("kill-launcher", 60)]
    # the job restart ran on the launcher the supervisor had kept warm, not on a cold start
    log = (job_dir(name) / "logs" / "supervisor.log").read_text()
    assert "attempt 1: started ft_launcher on 1 node(s)" in log and "(warm standby)" in log
    if nvrx.NVRx(version).cycle_records:  # NVRx's own record of each worker-group cycle is in the events
        cycles = {(c["attempt"], c["cycle"]): c for c in events(name, "nvrx_cycle")}  # the last word on each
        assert sorted(cycles) == [(0, 0), (0, 1), (1, 0)], cycles  # the in-job restart, then the job restart
        [injob] = [r for r in events(name, "restart") if r["level"] == "injob"]
        assert cycles[(0, 0)]["end"] is not None
        assert injob["fault_time"] <= cycles[(0, 1)]["start"] <= injob.t
        mon = JobMonitor()
        mon.update(events(name))  # the restart timeline names the cycle NVRx began for each group restart
        assert [r.get("nvrx_cycle") for r in mon.restarts] == [None, 1, None, 0]
    if nvrx.NVRx(version).inprocess == "deprecated":
        assert "deprecates in-process restart" in log  # said once, in the job's narrative


def test_a_hang_without_inprocess_is_an_injob_restart_blamed_on_the_hung_rank(reference_digest: str,
                                                                              any_nvrx_release) -> None:
    """The smoke set of every release: a hang found by ft_launcher's heartbeats, the group restarted in-job,
    the right rank blamed, nothing lost."""
    version, folder = any_nvrx_release
    name = f"hang-injob-{version.replace('.', '-')}"
    summary = run_job(name, "--no-inprocess", "--heartbeat-timeout", "6", "--fault", "hang:1@20", nvrx=folder)
    assert summary["state"] == "succeeded", summary
    ran_with(name, version)
    [restart] = summary["restart_events"]
    assert restart["level"] == "injob"
    assert restart["blame_rank"] == 1, restart  # ft_launcher itself blames local rank 0
    assert "hang" in restart["cause"]
    assert summary["digest"] == reference_digest


@pytest.mark.parametrize("how", ["absent", "broken"])
def test_without_nvrx_s_wrapper_an_exception_restarts_in_job_and_the_job_says_so(
        reference_digest: str, how: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """In-process restart is deprecated since NVRx 0.6: where a release has no Wrapper (absent: the
    supervisor finds out; broken: found, but the ranks cannot import it, as in a pod whose NVRx the render
    could not know), the job asked for it trains without it, says so once, and an exception restarts the
    group in-job; nothing is lost. NVRx's module is hidden by tests/data/no_inprocess/sitecustomize.py."""
    monkeypatch.setenv("EKSFT_TEST_NO_INPROCESS", how)
    name = f"no-wrapper-{how}"
    summary = run_job(name, "--fault", "exception:0@15", nvrx=Path(__file__).parent / "data" / "no_inprocess")
    assert summary["state"] == "succeeded", summary
    [restart] = summary["restart_events"]
    assert (restart["level"], restart["blame_rank"]) == ("injob", 0), restart
    assert summary["digest"] == reference_digest
    [said] = [w for w in summary["warnings"] if "in-process" in w]
    if how == "absent":
        assert ("has no in-process restart (inprocess.Wrapper): exceptions and hangs restart the worker "
                "group in-job instead") in said, said
    else:
        assert said.startswith("in-process restart is off: this NVRx has no inprocess.Wrapper that imports "
                               "(ImportError: nvidia_resiliency_ext.inprocess is broken here"), said
        assert said.endswith("restart the worker group in-job instead"), said
    assert not events(name, "inprocess_wrapper")   # no rank ran under the Wrapper


def test_resume_skips_a_corrupt_checkpoint_and_says_why(reference_digest: str,
                                                        corrupt_job: tuple[str, dict]) -> None:
    # sync saves: checkpoint 20 is committed when step 20 ends, so it is the one corrupted at step 25
    _, summary = corrupt_job
    assert summary["state"] == "succeeded", summary
    [fault] = [e for e in events("corrupt", "fault") if e["fault"] == "corrupt-checkpoint"]
    assert fault["checkpoint_step"] == 20
    rejected = [e for e in events("corrupt", "checkpoint") if e["phase"] == "rejected"]
    assert rejected and rejected[0]["step"] == 20 and "checksum mismatch" in rejected[0]["reason"]
    resume = events("corrupt", "resume")[0]
    assert resume["step"] == 10 and resume["skipped"][0]["step"] == 20
    assert summary["digest"] == reference_digest
    assert "checksum mismatch" in cli("logs", "corrupt").stdout + json.dumps(summary)  # the user is told


def test_a_rank_killed_mid_save_never_leaves_a_checkpoint_that_is_loaded(reference_digest: str) -> None:
    # the save of step 10 is staged at the end of step 10 and committed at a later step boundary;
    # rank 1 dies at the start of step 11, before every rank's write was confirmed
    summary = run_job("mid-save", "--no-inprocess", "--fault", "sigkill:1@11")
    assert summary["state"] == "succeeded", summary
    begun = [e["step"] for e in events("mid-save", "checkpoint") if e["phase"] == "begin"]
    assert begun[0] == 10
    first_commit = next(e for e in events("mid-save", "checkpoint") if e["phase"] == "committed")
    kill_t = events("mid-save", "fault")[0].t
    assert first_commit.t > kill_t, "the interrupted save must not have been committed"
    assert not events("mid-save", "resume") or events("mid-save", "resume")[0]["step"] != 10
    starts = [e for e in events("mid-save", "rank_start") if e["injob_restart"] == 1]
    assert starts and all(e["start_step"] == 0 for e in starts)
    assert summary["digest"] == reference_digest


def test_save_failure_is_visible_and_the_next_save_is_retried() -> None:
    summary = run_job("save-fail", "--steps", "40", "--fault", "save-failure:1@21")
    assert summary["state"] == "succeeded"
    ckpt = events("save-fail", "checkpoint")
    [failed] = [e for e in ckpt if e["phase"] == "failed"]
    assert failed["step"] > 21 and "rank 1" in failed["error"] and "injected save failure" in failed["error"]
    begun = [e["step"] for e in ckpt if e["phase"] == "begin"]
    retry = begun[begun.index(failed["step"]) + 1]
    assert retry <= min(failed["step"] + 10, 40), begun  # retried at a following step boundary
    committed = [e["step"] for e in ckpt if e["phase"] == "committed"]
    assert retry in committed and committed[-1] == 40, committed
    assert summary["restarts"] == {"inprocess": 0, "injob": 0, "job": 0}  # training went on


def test_signals_and_segfaults_restart_the_group_blaming_the_right_rank() -> None:
    summary = run_job("signals", "--steps", "40", "--no-inprocess", "--fault", "sigterm:0@12",
                      "--fault", "segfault:1@25")
    assert summary["state"] == "succeeded", summary
    assert [(r["level"], r["blame_rank"]) for r in summary["restart_events"]] == [("injob", 0), ("injob", 1)]


def test_restarts_that_make_no_progress_end_the_job_with_the_reason() -> None:
    args = ["--steps", "40", "--no-inprocess", "--max-injob-restarts", "5", "--ckpt-mode", "sync"]
    for _ in range(3):  # the same failure, three times in a row, before any new checkpoint
        args += ["--fault", "exception:0@13"]
    summary = run_job("no-progress", *args)
    assert summary["state"] == "failed"
    assert "no progress" in summary["reason"] and "checkpoint step 10" in summary["reason"]
    assert_nothing_left("no-progress")


def test_stop_leaves_no_process_of_the_job_alive(stopped_job: tuple[str, list[int], list[int], int]) -> None:
    name, pids, alive, stopped = stopped_job   # the session's job stopped after 5 steps (test_procs reads it)
    assert alive == pids   # its supervisor, launchers and ranks all ran until the stop
    assert stopped == 0
    assert_nothing_left(name, pids)
    assert cli("status", name, "--json").stdout.count('"stopped"') >= 1


def test_jobs_outlive_their_launcher_and_any_process_can_attach() -> None:
    proc = cli("run", "--name", "detached", "--model", "tiny", "--steps", "30", "--detach")
    assert proc.returncode == 0 and "watch detached" in proc.stdout  # the launching process is gone now
    watched = cli("watch", "detached", timeout=300)
    assert watched.returncode == 0, watched.stderr
    assert "job detached: succeeded" in watched.stdout
    listed = cli("list").stdout
    assert "detached" in listed and "succeeded" in listed


def test_job_folders_are_private(reference_digest: str) -> None:
    path = job_dir("reference")
    for p in [path, path / "control", path / "ckpt", path / "logs"]:
        assert (p.stat().st_mode & 0o777) == 0o700, p
    assert (path / "events.jsonl").stat().st_mode & 0o077 == 0
    assert (path / "spec.json").stat().st_mode & 0o077 == 0
    assert list_checkpoints(path / "ckpt")


def test_what_users_read_carries_no_library_noise() -> None:
    out = cli("run", "--name", "quiet", "--model", "tiny", "--steps", "20", "--fault", "sigkill:1@8")
    logs = cli("logs", "quiet").stdout
    for text in (out.stdout + out.stderr, logs):
        for noise in ("pynvml", "NVML", "waitForInput", "socket.cpp", "FutureWarning", "Traceback"):
            assert noise not in text, f"{noise!r} leaked:\n{text[-2000:]}"
    assert "sigkill" in logs and "recovered" in logs
    assert "NVML" in cli("logs", "quiet", "--debug").stdout  # still there for those who ask


def assert_nothing_left(name: str, pids: list[int] | None = None) -> None:
    jd = JobDir.for_name(name)
    sup = jd.supervisor()
    pids = list(pids or []) + [sup["pid"]] + [e["pid"] for e in events(name, "rank_start")]
    pids += [sup["keeper"]["pid"]] if sup.get("keeper") else []  # it exits just after the supervisor
    deadline = time.time() + 30
    while time.time() < deadline and any(procs.alive(p) for p in pids):
        time.sleep(0.2)
    assert not [p for p in pids if procs.alive(p)]
    for launcher in sup["launchers"]:
        assert not procs.group_alive(launcher["pgid"])
    assert not procs.marked(sup["job_uid"]), [p.cmdline() for p in procs.marked(sup["job_uid"])]


def test_a_killed_supervisor_is_replaced_by_one_that_adopts_the_job(reference_digest: str) -> None:
    # the supervisor dies at step 30; its successor adopts the running launcher, then has to restart
    # the job when that launcher (not its child: no exit status) is killed at step 50
    summary = run_job("kill-sup", "--fault", "kill-supervisor@30", "--fault", "kill-launcher@50")
    assert summary["state"] == "succeeded", summary
    assert summary["steps_done"] == 80
    fired = {f["fault"]: f for f in events("kill-sup", "fault")}
    assert fired["kill-supervisor"]["at_step"] == 30 and fired["kill-supervisor"]["supervisor_pid"] > 0
    assert [r["level"] for r in summary["restart_events"]] == ["job"]
    assert "kill-launcher" in summary["restart_events"][0]["cause"]
    assert summary["digest"] == reference_digest
    log = (job_dir("kill-sup") / "logs" / "supervisor.log").read_text()
    assert f"supervisor {fired['kill-supervisor']['supervisor_pid']} is gone" in log
    assert "adopted the job" in log
    assert len(events("kill-sup", "job_start")) == len(events("kill-sup", "job_end")) == 1
    assert_nothing_left("kill-sup")


@pytest.mark.parametrize("release", ["installed", releases.NEWEST], ids=lambda v: f"nvrx-{v}")
def test_a_hot_spare_takes_a_lost_nodes_place_without_a_job_restart(reference_digest: str,
                                                                    release: str) -> None:
    """Three launchers of one rank each, two active and one spare in the rendezvous: losing an active
    node (its launcher and ranks) is an in-job restart with the spare, and loses nothing. On NVRx 0.4 the
    supervisor hands the lost node's place over in the legacy rendezvous it hosts; on 0.6+ the spare is
    NVRx's own standby node (--nnodes 2:3), the store host NVRx's nvrx-control, and NVRx's cycle records
    show the node it trained on."""
    version = releases.version(release)
    name = f"spare-{version.replace('.', '-')}"
    summary = run_job(name, "--nnodes", "2", "--nproc-per-node", "1", "--spare-nodes", "1",
                      "--fault", "kill-launcher:1@40", nvrx=releases.folder(release))
    assert summary["state"] == "succeeded", summary
    assert summary["steps_done"] == 80
    (restart,) = summary["restart_events"]
    assert restart["level"] == "injob" and restart["cause"].startswith("injected kill-launcher on node 1: ")
    assert restart["cause"].endswith("a hot spare took its place")
    assert summary["digest"] == reference_digest  # the same as the fault-free 2-rank run
    log = (job_dir(name) / "logs" / "supervisor.log").read_text()
    assert "started ft_launcher on 3 node(s)" in log and "attempt 1" not in log
    if nvrx.NVRx(version).spares == "handover":
        # the supervisor handed the lost node's place over at once, not after NVRx's keep-alive expiry
        assert "handed the spare over: expired launcher " in log, log
    else:
        assert "handed the spare over" not in log   # nothing of NVRx's state was touched
        control = (job_dir(name) / "logs" / "nvrx-control-0.log").read_text(errors="replace")
        assert "nnodes=2:3" in control, control[-2000:]
        cycles = {c["cycle"]: c for c in events(name, "nvrx_cycle")}   # the last word on each
        assert sorted(cycles) == [0, 1] and cycles[0]["end"] is not None, cycles
        [recovered] = events(name, "restart")   # NVRx began cycle 1 for the spare between fault and recovery
        assert recovered["fault_time"] <= cycles[1]["start"] <= recovered.t, (cycles, recovered.data)
        mon = JobMonitor()
        mon.update(events(name))
        assert [r.get("nvrx_cycle") for r in mon.restarts] == [1]
    # it resumed from a checkpoint committed before the fault, and its downtime is split into phases
    [fault] = events(name, "fault")
    committed = {e["step"] for e in events(name, "checkpoint") if e["phase"] == "committed"
                 and e.t < fault.t}
    assert restart["resumed_step"] == max(committed), (restart, committed)
    assert list(restart["phases"]) == ["detection", "teardown", "reformation", "restore",
                                       "first_step"], restart
    assert sum(restart["phases"].values()) == pytest.approx(restart["downtime_s"], abs=0.01), restart
