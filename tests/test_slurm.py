"""--backend slurm on a real two-node Slurm (slurmctld and two slurmd on this machine, see
slurm_cluster.py): run, status, list, a pending job's reason, a stop, a scancel from outside, a rank
killed mid-run healed in-job with a bit-identical result, and what a cluster does on day one. The
script alone, without a cluster: test_slurm_script.py."""

from __future__ import annotations

import contextlib
import json
import re
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import psutil
import pytest
from jobs import wait_for
from slurm_cluster import (GPU_NODE, GPU_PARTITION, SECOND_PARTITION, SlurmCluster, free_base,
                           slurm_cluster)

import nvrx_releases as releases

from eksft_nb import commands
from pathlib import Path

from eksft_nb.backends.slurm.backend import SlurmBackend
from eksft_nb.events import read_all
from eksft_nb.spec import JobSpec
from eksft_nb.states import JobState

# a small job: 2 nodes of 1 rank, tiny model, 30 steps, checkpoints every 10
BASE = ["--nnodes", "2", "--nproc-per-node", "1", "--model", "tiny", "--steps", "30", "--ckpt-every", "10",
        "--seed", "0"]


# ---- a real two-node Slurm ----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmCluster]:
    with slurm_cluster(tmp_path_factory.mktemp("slurm")) as c:
        # the Slurm matrix runs on the newest NVRx (nvrx_releases): the jobs' environment (sbatch passes the
        # submitter's on) imports it; two "nodes" on one machine share an address, which NVRx 0.7 allows only
        # when told it is a simulation
        c.env.update(releases.env(releases.NEWEST, {"PYTHONPATH": c.env.get("PYTHONPATH", "")}))
        c.env["NVRX_ENABLE_MULTI_LAUNCHERS_PER_NODE"] = "1"
        yield c


def cli(c: SlurmCluster, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    """The CLI on the "login node": it finds the jobs it launched without $EKSFT_SHARED_DIR."""
    env = {k: v for k, v in c.env.items() if k != "EKSFT_SHARED_DIR"}
    return subprocess.run([sys.executable, "-m", "eksft_nb", *args], capture_output=True, text=True,
                          timeout=timeout,
                          env=env)


def run(c: SlurmCluster, name: str, *args: str, detach: bool = False) -> dict:
    """``run --backend slurm``: followed to its end, its JSON summary (detached: submitted, {})."""
    proc = cli(c, "run", "--backend", "slurm", "--shared-dir", str(c.shared), "--name", name, *BASE, *args,
               "--slurm-port", str(free_base()), *(["--detach"] if detach else ["--json"]))
    if detach:
        assert proc.returncode == 0 and f"launched {name}" in proc.stdout, proc.stderr[-3000:]
        return {}
    assert proc.returncode in (0, 1) and "{" in proc.stdout, proc.stderr[-3000:]
    return json.loads(proc.stdout[proc.stdout.index("{"):])


def status(c: SlurmCluster, name: str) -> dict:
    proc = cli(c, "status", name, "--backend", "slurm", "--json")
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def story(c: SlurmCluster, name: str) -> str:
    """The job's logs and what its watcher decided (its failures, restarts, drains and end): put in an
    assertion's message, a failure says why the job ended as it did."""
    events = c.shared / name / "events.jsonl"
    decided = [f"{e.kind} {json.dumps(e.data)}" for e in (read_all(events) if events.exists() else [])
               if e.kind in ("failure", "restart", "drain", "job_end")]
    logs = cli(c, "logs", name, "--backend", "slurm", "--debug", "-n", "80").stdout
    return "\n".join([logs, "--- the watcher's events", *decided])


@pytest.fixture(scope="module")
def reference(cluster: SlurmCluster) -> dict:
    summary = run(cluster, "reference")
    assert summary["state"] == "succeeded", story(cluster, "reference")
    return summary


@pytest.mark.slow
def test_a_job_runs_on_two_slurm_nodes_and_reads_as_a_local_one(cluster: SlurmCluster,
                                                                reference: dict) -> None:
    assert reference["backend"] == "slurm" and reference["steps_done"] == 30
    assert reference["checkpoints_committed"] == 3 and reference["restarts"] == {
        "inprocess": 0, "injob": 0, "job": 0}
    folder = cluster.shared / "reference"
    # one ft_launcher per node, each with its own log on the shared disk, the ranks' events beside them
    assert sorted(p.name
                  for p in (folder
                            / "logs").glob("launcher-*.log")) == ["launcher-0-0.log", "launcher-0-1.log"]
    events = read_all(folder / "events.jsonl")
    starts = [e for e in events if e.kind == "rank_start"]
    assert sorted(e.rank for e in starts) == [0, 1]
    # the watcher's own events: the job's start and end, and NVRx's record of its one worker-group cycle
    assert [e.kind for e in events if e.rank is None and e.kind not in ("warning", "nvrx_cycle")] == \
        ["job_start", "job_end"]
    assert {e["cycle"] for e in events if e.kind == "nvrx_cycle"} == {0}
    # the one warning: the test cluster's KillWait (5 s) is shorter than a drain's save may take
    assert [e["what"] for e in events if e.kind == "warning"] == ["slurm-killwait"]
    row = status(cluster, "reference")
    assert (row["state"], row["step"], row["last_checkpoint"]) == ("succeeded", 30, 30)
    listed = json.loads(cli(cluster, "list", "--backend", "slurm", "--json").stdout)
    assert {"reference": "succeeded"}.items() <= {r["name"]: r["state"] for r in listed}.items()
    ckpts = json.loads(cli(cluster, "ckpts", "reference", "--backend", "slurm", "--json").stdout)
    assert [c["step"] for c in ckpts if c["state"] == "committed"] == [10, 20, 30]
    # every checkpoint was committed under this launch's id (its part and the Slurm job id)
    record = json.loads((folder / "slurm.json").read_text())
    assert record["job_uid"].endswith(f"-{record['job_id']}")
    assert {c.job_uid for c in SlurmBackend(shared_dir=cluster.shared).checkpoints("reference")} \
        == {record["job_uid"]}
    # the job's own narrative and the launchers' lines, without the launchers' noise
    text = cli(cluster, "logs", "reference", "--backend", "slurm").stdout
    assert "[launcher-0-0]" in text and "Rendezvous info" not in text


def _kernel_sees(cluster: SlurmCluster, monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernel (this process) talks to the test's cluster: its slurm.conf and commands; the jobs it
    submits run on the cluster's NVRx."""
    for key in ("SLURM_CONF", "PATH", "PYTHONPATH", "NVRX_ENABLE_MULTI_LAUNCHERS_PER_NODE"):
        monkeypatch.setenv(key, cluster.env[key])


@pytest.mark.slow
def test_the_magic_lists_and_shows_a_slurm_job(cluster: SlurmCluster, reference: dict, ip: Any,
                                                capsys: pytest.CaptureFixture[str],
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    _kernel_sees(cluster, monkeypatch)
    monkeypatch.setenv("EKSFT_SHARED_DIR", str(cluster.shared))
    ip.run_cell("%ftrain list --backend slurm")
    out = capsys.readouterr().out
    assert "reference" in out and "succeeded" in out, out
    ip.run_cell("%ftrain status reference --backend slurm")
    out = capsys.readouterr().out
    assert "reference" in out and "succeeded" in out and "30/30" in out, out


@pytest.mark.slow
def test_the_lab_panel_lists_slurm_jobs(cluster: SlurmCluster, reference: dict,
                                        tmp_path_factory: pytest.TempPathFactory) -> None:
    """What the panel renders: the server extension's job list and its stream, with the Slurm jobs this
    machine launched (no $EKSFT_SHARED_DIR, no kubeconfig), and a Slurm job's dashboard figure."""
    from test_lab_server import Stream, jupyter_server

    def slurm_row(data: dict) -> dict | None:   # a local job of this name may be listed too (other tests')
        return next((r for r in data["jobs"] if (r["name"], r["backend"]) == ("reference", "slurm")), None)

    tmp = tmp_path_factory.mktemp("lab")
    env = {**{k: v for k, v in cluster.env.items() if k != "EKSFT_SHARED_DIR"},
           "KUBECONFIG": str(tmp / "none")}
    with jupyter_server(tmp, env) as server:
        code, body = server.request("GET", "jobs")
        assert code == 200 and body["backends"]["slurm"] == {"ok": True, "error": None}, body
        assert "eks" not in body["backends"]
        listed = slurm_row(body)
        assert listed and (listed["backend"], listed["state"],
                           listed["step"]) == ("slurm", "succeeded", 30), body
        stream = Stream(server)
        try:
            _, data = stream.wait("the Slurm job", lambda k, d: k == "jobs" and slurm_row(d) is not None, 120)
            assert data["backends"]["slurm"]["ok"]
        finally:
            stream.close()
        code, figure = server.request("GET", "jobs/reference/figure?backend=slurm")
        assert code == 200 and figure["data"], figure


@pytest.mark.slow
def test_rm_refuses_a_running_slurm_job_and_removes_an_ended_one(cluster: SlurmCluster,
                                                                 reference: dict) -> None:
    run(cluster, "to-remove", detach=True)
    refused = cli(cluster, "rm", "to-remove", "--backend", "slurm")
    assert refused.returncode != 0 and "stop it first" in refused.stderr and "Traceback" not in refused.stderr
    assert cli(cluster, "stop", "to-remove", "--backend", "slurm").returncode == 0
    assert cli(cluster, "rm", "to-remove", "--backend", "slurm").returncode == 0
    assert not (cluster.shared / "to-remove").exists()


@pytest.mark.slow
def test_a_rank_killed_on_slurm_heals_in_job_bit_identically(cluster: SlurmCluster, reference: dict) -> None:
    summary = run(cluster, "killed", "--fault", "sigkill:1@15")
    assert summary["state"] == "succeeded", story(cluster, "killed")
    assert [r["level"] for r in summary["restart_events"]] == ["injob"], summary["restart_events"]
    assert summary["restart_events"][0]["blame_rank"] == 1
    assert summary["digest"] == reference["digest"]   # bit-identical to the fault-free run


@pytest.mark.slow
def test_an_exception_and_a_hang_injected_from_the_cli_heal_in_process_and_resume_continues(
        cluster: SlurmCluster, reference: dict) -> None:
    """The engine's in-process faults on Slurm, one scheduled at launch, one injected into the running
    job from the CLI; `watch` follows it to its end; `ckpts` and `resume` read and continue it."""
    run(cluster, "in-process", "--fault", "exception:0@11", detach=True)
    injected = cli(cluster, "inject", "in-process", "hang", "--rank", "1", "--step", "22", "--backend",
                   "slurm")
    assert injected.returncode == 0, injected.stderr
    assert "queued hang for rank 1 of in-process" in injected.stdout, injected.stderr
    watched = cli(cluster, "watch", "in-process", "--backend", "slurm")
    assert watched.returncode == 0, story(cluster, "in-process")
    assert watched.stdout.count("recovered (inprocess)") == 2, watched.stdout[-3000:]
    summary = json.loads(cli(cluster, "summary", "in-process", "--backend", "slurm", "--json").stdout)
    assert [(r["level"],
             r["blame_rank"]) for r in summary["restart_events"]] == [("inprocess", 0), ("inprocess", 1)]
    fired = [(e["fault"], e["at_step"]) for e in read_all(cluster.shared / "in-process" / "events.jsonl")
             if e.kind == "fault"]
    assert fired == [("exception", 11), ("hang", 22)], fired
    assert summary["digest"] == reference["digest"]   # the same recovery levels as locally, bit-identical
    ckpts = json.loads(cli(cluster, "ckpts", "in-process", "--backend", "slurm", "--json").stdout)
    assert [c["step"] for c in ckpts if c["state"] == "committed"] == [10, 20, 30]
    resumed = cli(cluster, "resume", "in-process", "--steps", "40", "--as", "in-process-more", "--backend",
                  "slurm")
    assert resumed.returncode == 0 and "launched in-process-more" in resumed.stdout, resumed.stderr
    assert cli(cluster, "watch", "in-process-more", "--backend",
               "slurm").returncode == 0, story(cluster, "in-process-more")
    events = read_all(cluster.shared / "in-process-more" / "events.jsonl")
    assert {e["step"] for e in events if e.kind == "resume"} == {30}   # it loaded step 30
    assert max(e["step"] for e in events if e.kind == "step") == 40


@pytest.mark.slow
def test_the_magic_injects_into_resumes_and_stops_a_slurm_job(cluster: SlurmCluster, reference: dict, ip: Any,
                                                              capsys: pytest.CaptureFixture[str],
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    _kernel_sees(cluster, monkeypatch)
    ip.run_cell(f"%%ftrain --backend slurm --shared-dir {cluster.shared} --name magic {' '.join(BASE)} "
                f"--slurm-port {free_base()}\n")
    job = ip.magics_manager.registry["FtrainMagics"].job
    assert job is not None and job.name == "magic" and job.backend.name == "slurm"
    try:
        ip.run_cell("%ftrain inject magic sigkill --rank 1 --step 15 --backend slurm")
        assert "queued sigkill for rank 1 of magic" in capsys.readouterr().out
        assert job.wait(timeout=600) == JobState.SUCCEEDED, story(cluster, "magic")
        summary = job.summary()
        assert [(r["level"], r["blame_rank"]) for r in summary["restart_events"]] == [("injob", 1)]
        assert summary["digest"] == reference["digest"]
        ip.run_cell("%ftrain ckpts --json")
        assert [c["step"] for c in json.loads(capsys.readouterr().out) if c["state"] == "committed"] == [
            10, 20, 30]
        ip.run_cell("%ftrain resume --steps 300")   # the notebook's job: the resumed one from now on
        assert "launched magic-from-30" in capsys.readouterr().out
        resumed = ip.magics_manager.registry["FtrainMagics"].job
        events = cluster.shared / "magic-from-30" / "events.jsonl"
        wait_for("a step after the resume", lambda: events.exists() and any(
            e.kind == "step" and e["step"] > 30 for e in read_all(events)), timeout=300)
        # a live setting on the real Slurm (issue 32): both ranks take it at one step, and the saves follow it
        ip.run_cell("%ftrain set ckpt-every=7 --wait 300 --json")
        changed = json.loads(capsys.readouterr().out)
        assert changed["applied"] and changed["changes"] == {"ckpt-every": [10, 7]}, changed
        taken = {e.rank: e["step"] for e in read_all(events) if e.kind == "setting"}
        assert set(taken) == {0, 1} and set(taken.values()) == {changed["step"]}, taken

        def saved() -> list[int]:
            return [e["step"] for e in read_all(events)
                    if e.kind == "checkpoint" and e["phase"] == "committed"
                    and e["step"] > changed["step"]]

        wait_for("a save at the new interval", saved, timeout=300)
        assert all(step % 7 == 0 for step in saved()), saved()
        ip.run_cell("%ftrain stop")
        assert "stopped magic-from-30" in capsys.readouterr().out
        row = status(cluster, "magic-from-30")
        assert row["state"] == "stopped" and row["detail"].startswith("stopped by the user"), row
        assert resumed.name == "magic-from-30"
    finally:
        for shown in ip.shown:
            getattr(shown, "close", lambda: None)()


@pytest.mark.slow
def test_a_pending_job_says_why_and_a_stop_or_a_scancel_ends_it(cluster: SlurmCluster) -> None:
    blocker = cluster.run("sbatch", "--parsable", "-N2", "--exclusive", "--output=/dev/null", "--wrap",
                          "sleep 600").stdout.strip()
    try:
        wait_for("the blocker to run",
                 lambda: "R" in cluster.run("squeue", "-h", "-j", blocker, "-o", "%t").stdout)
        run(cluster, "waits", "--exclusive", detach=True)
        row = wait_for("the pending reason", lambda: (r := status(cluster, "waits"))["detail"].startswith(
            "waiting: Resources") and r)
        assert (row["state"], row["detail"]) == ("starting", "waiting: Resources in partition gpu")
        assert cli(cluster, "stop", "waits", "--backend", "slurm").returncode == 0
        row = status(cluster, "waits")
        assert row["state"] == "stopped" and row["detail"].startswith("stopped by the user"), row
    finally:
        cluster.run("scancel", blocker)
    run(cluster, "cancelled", detach=True)
    wait_for("a step", lambda: status(cluster, "cancelled")["step"] >= 1, timeout=300)
    job_id = json.loads((cluster.shared / "cancelled" / "slurm.json").read_text())["job_id"]
    cluster.run("scancel", job_id)   # from outside eksft
    row = wait_for("the cancel", lambda: (r := status(cluster, "cancelled"))["ended"] and r)
    assert row["state"] == "stopped" and "outside eksft" in row["detail"], row


@pytest.mark.slow
def test_a_lost_node_is_a_job_restart_that_resumes_from_the_newest_checkpoint(cluster: SlurmCluster,
                                                                              reference: dict) -> None:
    node = cluster.run("sinfo", "-h", "-N", "-p", "gpu", "-o", "%N").stdout.split()[-1]
    run(cluster, "node-lost", detach=True)
    events = cluster.shared / "node-lost" / "events.jsonl"
    wait_for("checkpoint 10", lambda: events.exists() and any(
        e.kind == "checkpoint" and e["phase"] == "committed" for e in read_all(events)), timeout=300,
             every=0.05)
    # the node is lost
    cluster.run("scontrol", "update", f"nodename={node}", "state=down", "reason=eksft-test")
    wait_for("the failure",
             lambda: any(e.kind == "failure" and e["level"] == "job" for e in read_all(events)))
    # Slurm requeues the job (--requeue); the node's slurmd answers, so it returns to service
    # (ReturnToService=2)
    row = wait_for("the end", lambda: (r := status(cluster, "node-lost"))["ended"] and r, timeout=300)
    assert row["state"] == "succeeded", story(cluster, "node-lost")
    summary = json.loads(cli(cluster, "summary", "node-lost", "--backend", "slurm", "--json").stdout)
    assert [r["level"] for r in summary["restart_events"]] == ["job"], summary["restart_events"]
    assert summary["restart_events"][0]["resumed_step"] >= 10
    assert summary["digest"] == reference["digest"]


@pytest.mark.slow
def test_a_lost_first_node_is_a_job_restart_recorded_by_the_requeued_run(cluster: SlurmCluster,
                                                                       reference: dict) -> None:
    """The allocation's first node runs the watcher: lost with it, nothing records the failure, so the
    requeued run does, and resumes from the newest committed checkpoint."""
    run(cluster, "first-lost", detach=True)
    events = cluster.shared / "first-lost" / "events.jsonl"
    wait_for("checkpoint 10", lambda: events.exists() and any(
        e.kind == "checkpoint" and e["phase"] == "committed" for e in read_all(events)), timeout=300,
             every=0.05)
    job_id = json.loads((cluster.shared / "first-lost" / "slurm.json").read_text())["job_id"]
    job = cluster.run("scontrol", "show", "job", "-o", job_id).stdout
    [first] = re.findall(r"BatchHost=(\S+)", job)
    gone = cluster.job_processes(job_id, first)
    assert any("allocation" in " ".join(p.cmdline()) for p in gone), [p.cmdline() for p in gone]
    for p in gone:   # the node stops at once: nothing on it records anything more
        with contextlib.suppress(psutil.NoSuchProcess):
            p.suspend()
    cluster.run("scontrol", "update", f"nodename={first}", "state=down", "reason=eksft-test")
    for p in gone:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.kill()
    row = wait_for("the end", lambda: (r := status(cluster, "first-lost"))["ended"] and r, timeout=600)
    assert row["state"] == "succeeded", story(cluster, "first-lost")
    summary = json.loads(cli(cluster, "summary", "first-lost", "--backend", "slurm", "--json").stdout)
    [restart] = summary["restart_events"]
    assert restart["level"] == "job" and "first node was lost" in restart["cause"], restart
    assert restart["resumed_step"] >= 10
    assert summary["digest"] == reference["digest"]


@pytest.mark.slow
def test_a_killed_launcher_ends_the_step_and_the_job_is_requeued_from_its_checkpoint(cluster: SlurmCluster,
                                                                                   reference: dict) -> None:
    summary = run(cluster, "launcher-lost", "--fault", "kill-launcher@25")
    assert summary["state"] == "succeeded", story(cluster, "launcher-lost")
    [restart] = summary["restart_events"]
    assert restart["level"] == "job" and "injected kill-launcher on node 0" in restart["cause"], restart
    events = read_all(cluster.shared / "launcher-lost" / "events.jsonl")
    # one failure: the peers' ranks that Slurm terminated with the step are no in-job failure of their own
    [failure] = [e for e in events if e.kind == "failure"]
    committed = [e["step"] for e in events if e.kind == "checkpoint" and e["phase"] == "committed"
                 and e.t < failure.t]
    assert committed and restart["resumed_step"] == committed[-1]   # the newest committed checkpoint
    assert summary["digest"] == reference["digest"]
    logs = cluster.shared / "launcher-lost" / "logs"   # the requeued run is attempt 1, with its own logs
    assert (logs / "launcher-1-0.log").is_file() and (logs / "launcher-1-1.log").is_file()
    # the node whose launcher died is kept off the requeued run only where the partition has nodes enough
    [batch_log] = logs.glob("slurm-*.out")
    assert re.search(r"eksft: node \S+ failed; not kept off the requeued run: partition gpu has no 2 nodes "
                     "without it", batch_log.read_text()), batch_log.read_text()[-3000:]


# ---- what a cluster does on day one: drains, GPUs, failures said where users look ----------------------

def slurm_events(folder: Path, kind: str | None = None) -> list:
    path = folder / "events.jsonl"
    return [e for e in (read_all(path) if path.exists() else []) if kind is None or e.kind == kind]


@pytest.mark.slow
def test_a_drain_and_the_time_limit_requeue_the_job_which_resumes_from_each_drains_save(
        cluster: SlurmCluster, reference: dict) -> None:
    """SIGTERM to the job's steps (``scancel --signal=TERM``, as a preemption's grace period sends it), then
    Slurm's warning before the time limit (``--signal=B:USR1``, the limit shortened with KillWait at 5 s):
    each time the ranks save and commit a step, the job is requeued and resumes from that save, and it is
    never said to have succeeded short of its last step. The job's folder is a path with spaces, quotes, a
    ``$`` and a ``%`` (every script value goes through one quoting helper)."""
    shared = cluster.shared / "odd dir's \"$HOME\" %j"
    shared.mkdir()
    name, folder = "drained", shared / "drained"
    # a straggler paces steps 3-22 (half a second each), so that the drain lands mid-run; the timeouts fit
    # steps of seconds (the requeued run's are slowed to 3 s below)
    proc = cli(cluster, "run", "--backend", "slurm", "--shared-dir", str(shared), "--name", name, *BASE,
               "--slurm-port", str(free_base()), "--fault", "slow-rank:1@3", "--soft-timeout", "8",
               "--hard-timeout", "16", "--heartbeat-timeout", "40", "--collective-timeout", "12", "--detach")
    assert proc.returncode == 0, proc.stderr[-3000:]
    job_id = json.loads((folder / "slurm.json").read_text())["job_id"]

    def stepped(n: int, run: int) -> bool:   # step n reached by the run that attempt ``run`` started
        starts = [e.t for e in slurm_events(folder, "rank_start") if e["job_attempt"] == run]
        steps = slurm_events(folder, "step")
        return bool(starts) and any(e["step"] >= n and e.t > min(starts) for e in steps)

    wait_for("step 4", lambda: stepped(4, 0), timeout=300, every=0.1)
    cluster.run("scancel", "--signal=TERM", job_id)
    [first] = wait_for("the drain's requeue", lambda: slurm_events(folder, "failure"), timeout=120)
    [drain] = slurm_events(folder, "drain")
    assert drain["committed"] and 4 <= drain["step"] < 30, drain.data
    said = f"drained at step {drain['step']} (saved and committed) on SIGTERM to the job's steps"
    assert said in first["cause"], first.data
    row = status(cluster, name)
    assert row["state"] in ("starting", "recovering"), row   # requeued: never an end
    # the requeued run, slowed again (3 s a step from two steps after the drain's), has its time limit
    # shortened to come within the grace period the script asked Slurm to warn it at (--signal=B:USR1@GRACE)
    grace = int(re.search(r"#SBATCH --signal=B:USR1@(\d+)", commands.dry_run(
        JobSpec().replace(backend="slurm", **{"slurm.shared_dir": str(shared)}))).group(1))
    for rank in ("0", "1"):
        assert cli(cluster, "inject", name, "slow-rank", "--rank", rank, "--step", str(drain["step"] + 2),
                   "--delay", "3", "--duration", "30", "--backend", "slurm").returncode == 0
    wait_for("the requeued run's slow steps", lambda: stepped(drain["step"] + 3, 1), timeout=300)
    shown = cluster.run("scontrol", "show", "job", job_id).stdout
    m = re.search(r"RunTime=(?:(\d+)-)?(\d+):(\d+):(\d+)", shown)
    run_s = ((int(m.group(1) or 0) * 24 + int(m.group(2))) * 60 + int(m.group(3))) * 60 + int(m.group(4))
    cluster.run("scontrol", "update", f"JobId={job_id}", f"TimeLimit={-(-(run_s + grace + 1) // 60)}")
    wait_for("the time limit's drain", lambda: len(slurm_events(folder, "failure")) == 2, timeout=150)
    cluster.run("scontrol", "update", f"JobId={job_id}", "TimeLimit=UNLIMITED")   # pending: the last run ends
    [warned] = [e for e in slurm_events(folder, "warning") if e["what"] == "slurm-time-limit"]
    second = slurm_events(folder, "drain")[-1]
    assert second["committed"] and second.t - warned.t < grace, (warned.data, second.data)
    row = status(cluster, name)
    assert row["state"] in ("starting", "recovering"), row
    final = wait_for("the end", lambda: (r := status(cluster, name))["ended"] and r, timeout=300)
    assert final["state"] == "succeeded" and final["step"] == 30, story(cluster, name)
    # one end recorded, the last run's: no run that stopped short of the last step said it succeeded
    assert [(e["state"], e["final_step"]) for e in slurm_events(folder, "job_end")] == [("succeeded", 30)]
    summary = json.loads(cli(cluster, "summary", name, "--backend", "slurm", "--json").stdout)
    drains = [e["step"] for e in slurm_events(folder, "drain")]
    assert [(r["level"], r["resumed_step"], r["rolled_back_steps"]) for r in summary["restart_events"]] == [
        ("job", drains[0], 0), ("job", drains[1], 0)], summary["restart_events"]
    assert "Slurm's warning before the time limit" in summary["restart_events"][1]["cause"]
    assert {e["step"] for e in slurm_events(folder, "resume")} == set(drains)
    assert summary["digest"] == reference["digest"]   # bit-identical to the run that was never drained
    assert (folder / "logs" / f"slurm-{job_id}.out").is_file()   # % and $ in the path: the log where asked


@pytest.mark.slow
def test_without_gres_a_dry_runs_script_submitted_by_hand_counts_the_nodes_gpus_where_it_runs(
        cluster: SlurmCluster, tmp_path: Path) -> None:
    """A node with two (fake) GPUs in its gres.conf, a job without --gres: the batch shell counts them there
    and takes the GPU values (timeouts, NCCL environment); the dry run's script runs as submitted by hand
    (after the one command it says to run first), doctor's gate included (``--device cpu``: torch sees none
    of the fake GPUs). Ranks that outnumber the node's GPUs are refused there, in one line, within
    seconds; so is a job that would use them (``--device auto``) where torch sees none (the gate)."""
    env = {**cluster.env, "EKSFT_SHARED_DIR": str(cluster.shared)}
    dry = cli(cluster, "run", "--dry-run", "--backend", "slurm", "--shared-dir", str(cluster.shared),
              "--name", "by-hand", *BASE, "--nnodes", "1", "--partition", GPU_PARTITION, "--slurm-port",
              str(free_base()), "--fault", "slow-rank:0@2", "--device", "cpu")   # the GPUs are fake
    assert dry.returncode == 0, dry.stderr
    script = dry.stdout[dry.stdout.index("#!/bin/bash"):]
    (tmp_path / "by-hand.sbatch").write_text(script)
    [prepare] = re.findall(r"# submitted by hand, it needs the folder of its log first: (.*) && sbatch",
                           script)
    assert subprocess.run(["bash", "-c", prepare], env=env).returncode == 0
    job_id = cluster.run("sbatch", "--parsable", str(tmp_path / "by-hand.sbatch")).stdout.strip()
    folder = cluster.shared / "by-hand"
    wait_for("the ranks", lambda: slurm_events(folder, "rank_start"), timeout=300)
    [start] = slurm_events(folder, "job_start")
    # a whole node (--exclusive, the default) is granted all its GPUs
    assert (start["gpus_per_node"], start["gpus_from"]) == (
        2, f"Slurm's allocation on {GPU_NODE}: SLURM_GPUS_ON_NODE=2"), start.data
    launcher = next(p for p in cluster.job_processes(job_id, GPU_NODE)
                    if "ft_launcher" in " ".join(p.cmdline()))
    assert "--ft-rank-heartbeat-timeout=900" in launcher.cmdline()   # GPU-scale, not the CPU's 15 s
    assert launcher.environ()["NCCL_DEBUG"] == "INFO" and launcher.environ()["EKSFT_NODE_GPUS"] == "2"
    row = wait_for("the end", lambda: (r := json.loads(subprocess.run(
        [sys.executable, "-m", "eksft_nb", "status", "by-hand", "--backend", "slurm", "--json"],
        capture_output=True, text=True, env=env, timeout=120).stdout))["ended"] and r, timeout=300)
    assert (row["state"], row["step"]) == ("succeeded", 30), row
    # more ranks than the node has GPUs; a shared node is granted none, and Slurm's record of it counts
    run(cluster, "too-many", "--nnodes", "1", "--nproc-per-node", "3", "--partition", GPU_PARTITION,
        "--no-exclusive", "--cpus-per-task", "2", detach=True)
    # GPUs on the node that torch does not see, and a job that would use them: doctor's gate stops it
    run(cluster, "no-cuda", "--nnodes", "1", "--partition", GPU_PARTITION, detach=True)
    row = wait_for("the refusal", lambda: (r := status(cluster, "too-many"))["ended"] and r, timeout=120)
    assert row["state"] == "failed" and row["detail"].startswith(
        f"3 ranks per node but the node has 2 GPUs (Slurm's record of node {GPU_NODE} (Gres=gpu:2"), row
    assert "use --nproc-per-node 2" in row["detail"] and not slurm_events(cluster.shared / "too-many",
                                                                          "rank_start")
    row = wait_for("the gate", lambda: (r := status(cluster, "no-cuda"))["ended"] and r, timeout=120)
    assert row["state"] == "failed" and row["detail"].startswith(
        f"doctor on {GPU_NODE}: the spec asks for GPUs but torch sees none here"), row
    assert "--device cpu" in row["detail"] and not slurm_events(cluster.shared / "no-cuda", "rank_start")


@pytest.mark.slow
def test_a_batch_shell_whose_python_has_no_eksft_says_why_and_the_fix(cluster: SlurmCluster,
                                                                      tmp_path: Path) -> None:
    """The nodes' python is not the environment's: the job fails at once, and status and summary say why
    (python's own error, from the batch log) and what to do."""
    bare = Path(sys.base_prefix) / "bin" / "python3"   # this interpreter without this environment
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "python").symlink_to(bare)
    assert subprocess.run([str(tmp_path / "bin" / "python"), "-c", "import eksft_nb"], capture_output=True,
                          env={"PATH": "/usr/bin:/bin"}, cwd=tmp_path).returncode != 0
    # sbatch gives the batch shell this PATH and nothing else of this environment
    env = {**{k: v for k, v in cluster.env.items() if k != "EKSFT_SHARED_DIR"},
           "SBATCH_EXPORT": "SLURM_CONF,HOME,PATH", "PATH": f"{tmp_path / 'bin'}:/usr/bin:/bin"}
    launched = subprocess.run(
        [sys.executable, "-m", "eksft_nb", "run", "--backend", "slurm", "--shared-dir", str(cluster.shared),
         "--name", "no-eksft", *BASE, "--slurm-port", str(free_base()), "--detach"],
        capture_output=True, text=True, timeout=120, env=env)
    assert launched.returncode == 0, launched.stderr
    t0 = time.time()
    row = wait_for("the failure", lambda: (r := status(cluster, "no-eksft"))["ended"] and r, timeout=120)
    assert time.time() - t0 < 60
    assert row["state"] == "failed", row
    assert "ModuleNotFoundError: No module named 'eksft_nb'" in row["detail"], row
    assert row["detail"].endswith("the nodes' python has no eksft_nb: put the shared environment first on "
                                  "PATH"), row
    summary = json.loads(cli(cluster, "summary", "no-eksft", "--backend", "slurm", "--json").stdout)
    assert summary["state"] == "failed" and summary["reason"] == row["detail"], summary


@pytest.mark.slow
def test_a_first_node_whose_name_does_not_resolve_is_said_within_seconds(cluster: SlurmCluster) -> None:
    """The launchers would wait for the rendezvous their whole join timeout: status says what they wait for,
    why and since when, within seconds."""
    node = cluster.run("sinfo", "-h", "-N", "-p", SECOND_PARTITION, "-o", "%N").stdout.split()[0]
    with pytest.raises(OSError):
        socket.getaddrinfo(node, None)   # the test's premise: a host name that does not exist
    run(cluster, "nowhere", "--nnodes", "1", "--partition", SECOND_PARTITION, detach=True)
    t0 = time.time()
    row = wait_for("the wait said", lambda: "does not resolve" in (r := status(cluster, "nowhere"))["detail"]
                   and r, timeout=120)
    assert time.time() - t0 < 60, row
    port = json.loads((cluster.shared / "nowhere" / "spec.json").read_text())["slurm"]["port"]
    assert re.fullmatch(rf"waiting since \d\d:\d\d:\d\d \(\d+ s\) for the rendezvous at {node}:{port}: its "
                        r"name does not resolve on \S+ \(.*\) \(the launchers wait for it until their join "
                        r"timeout: fix the nodes' name resolution, DNS or /etc/hosts\)", row["detail"]), row
    [warning] = [e for e in slurm_events(cluster.shared / "nowhere", "warning") if e["what"] == "rendezvous"]
    assert f"{node}:{port}" in warning["message"]
    assert cli(cluster, "stop", "nowhere", "--backend", "slurm").returncode == 0


def test_container_options_are_refused_in_one_line_where_pyxis_is_absent(cluster: SlurmCluster) -> None:
    proc = cli(cluster, "run", "--backend", "slurm", "--shared-dir", str(cluster.shared), "--name", "pyxis",
               *BASE, "--container-image", "nvcr.io#nvidia/pytorch:25.01-py3", "--detach")
    assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr
    assert "--container-image needs pyxis, which this cluster does not have" in proc.stderr, proc.stderr
    assert not (cluster.shared / "pyxis").exists()
