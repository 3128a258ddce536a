"""Local replay: the pods of a job submitted through the EKS backend, run here as local processes
with their rendered command, args and environment (rank 0's DNS name mapped to 127.0.0.1), under the
Job controller's failure handling (:mod:`eks_controllers`).

It proves the manifest's launch line trains (2 pods x 1 rank), survives a SIGKILL of a rank through
ft_launcher with the restarted rank forked warm by its pod's zygote, survives a drain (the kubelet's
SIGTERM to one pod: every pod drains and exits 138, the Job is not Complete, its pods are recreated and
resume from the drain's save), and resumes from a checkpoint as a new job, bit-identical, with the
dashboard's monitor fed by the streamed pod logs all along."""

from __future__ import annotations

import contextlib
import re
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
from eks_kube import Controllers, Kube, replay_cluster

import nvrx_releases as releases

from eksft_nb import commands
from eksft_nb.backends.eks import EksBackend, names
from eksft_nb.control import FaultCommand, parse_fault
from eksft_nb.runtime.drain import DRAIN_EXIT
from eksft_nb.events import decode_lines
from eksft_nb.job import Job
from jobs import free_port
from eksft_nb.spec import JobSpec

pytestmark = pytest.mark.slow


def free_port_base() -> int:
    """A port with the next two free as well (the rendezvous, store and in-process ports)."""
    return free_port(3)


def pods_processes(root: Path, job: str) -> list[str]:
    """The live processes of a replayed job's pods (they carry its job folder under ``root``)."""
    out = []
    for proc in psutil.process_iter(["pid", "cmdline"]):
        with contextlib.suppress(psutil.Error):
            env = proc.environ()
            if env.get("EKSFT_JOB") == job and env.get("EKSFT_JOB_DIR", "").startswith(str(root)):
                out.append(f"{proc.pid} {' '.join(proc.info['cmdline'] or [])[:120]}")
    return out


@pytest.fixture
def cluster(tmp_path: Path,
            monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Kube, EksBackend, Controllers]]:
    releases.use(releases.NEWEST, monkeypatch)   # the pods' image has the newest NVRx (nvrx_releases)
    monkeypatch.setenv("NVRX_ENABLE_MULTI_LAUNCHERS_PER_NODE", "1")
    with replay_cluster(tmp_path, monkeypatch, mount_checkpoints=True) as made:
        yield made


def test_rendered_pods_train_survive_a_sigkill_and_a_drain_and_resume(
    cluster: tuple[Kube, EksBackend, Controllers]) -> None:
    kube, backend, ctl = cluster
    # in-job restart only (in-process restart has its own tests), and checkpoints committed before the
    # next step (async ones commit a little later), so the step it resumes from is known
    spec = JobSpec(name="replay", backend="eks", nnodes=2, nproc_per_node=1, steps=16).replace(**{
        "eks.image": "local:test", "eks.gpus_per_node": 0, "eks.port": free_port_base(),
        "model.preset": "tiny", "checkpoint.every": 4, "checkpoint.mode": "sync", "ft.inprocess": False})
    # rank 0 a straggler from step 11 (1 s a step), so the drain below lands before the last step
    pace = FaultCommand("slow-rank", rank=0, step=11, params={"delay": 1.0, "duration": 5})
    backend.launch(spec, faults=[parse_fault("sigkill:1@10"), pace])
    ctl.start_job("replay", hosts={names.rank0_host(spec): "127.0.0.1"})
    job = Job("replay", backend)
    deadline = time.time() + 240
    while job.refresh().last_step < 1 and time.time() < deadline:
        time.sleep(0.2)
    injected = job.inject("slow-rank", rank=0, delay=0.01, duration=1)   # at run time, exec'd into a pod
    # a live setting, through the command layer as the CLI's `set --backend eks`: exec'd into a pod, taken by
    # both ranks at one step, and in force after the in-job restart and in the resumed job
    changed = commands.set_settings("replay", ["keep-last=5"], backend="eks", wait=120)
    assert changed["applied"] and changed["changes"] == {"keep-last": [3, 5]}, changed

    # a node drain: the kubelet's SIGTERM to pod 1's container, once the in-job restart has recovered
    first = sorted(ctl.pods)
    while not (job.refresh().restarts and job.monitor.last_step >= 11) and time.time() < deadline:
        time.sleep(0.2)
    drained = next(p for p in first if p.startswith("replay-1-"))
    ctl.terminate(drained)
    # every pod drained: its own exit code, so the Job is not Complete; the Job controller ignored the
    # failures (podFailurePolicy) and recreated both pods, which resume from the drain's save
    while not (job.refresh().drain and len(ctl.pods) == 4) and not job.monitor.finished \
            and time.time() < deadline:
        time.sleep(0.2)
    assert {ctl.exit_codes.get(p) for p in first} == {DRAIN_EXIT}, (ctl.exit_codes,
                                                                     backend.logs("replay", debug=True))
    assert "replay" not in ctl.outcomes and len(ctl.pods) == 4   # not ended: replaced
    step = job.monitor.drain["step"]
    assert job.monitor.drain["committed"] and 11 < step < 16, job.monitor.drain

    assert job.wait(timeout=300, poll=0.5) == "succeeded", backend.logs("replay", debug=True)
    assert ctl.outcomes["replay"].condition == "Complete"
    # each index replaced once, charged nothing: the replacement started while the other drained pod was
    # still in its exit barrier waited for it to end, rather than join the old rendezvous and lose its store
    later = sorted(set(ctl.pods) - set(first))
    ended = [(p, ctl.exit_codes.get(p), (ctl.root / f"{p}.log").read_text(errors="replace")[-2000:])
             for p in later]
    replacements = [ctl.pods[p].annotations for p in later]
    assert [a.get("batch.kubernetes.io/job-index-ignored-failure-count") for a in replacements] == ["1",
                                                                                                   "1"], ended
    assert [a["batch.kubernetes.io/job-index-failure-count"] for a in replacements] == ["0", "0"]
    mon = job.monitor
    assert mon.max_step == 16 and mon.digest and mon.state == "succeeded"
    assert {f["fault"] for f in mon.faults} == {"sigkill",
                                                "slow-rank"} and injected.id in {f["id"] for f in mon.faults}
    assert len(mon.restarts) == 2, mon.restarts
    restart, drain = mon.restarts
    assert (restart["level"], restart["cause"], restart["blame_rank"], restart["resumed_step"]) == (
        "injob", "injected sigkill on rank 1", 1, 8)
    # the drain: one job-level restart for both pods, nothing rolled back
    assert (drain["level"], drain["resumed_step"], drain["rolled_back_steps"]) == ("job", step, 0), drain
    assert drain["cause"].startswith(f"drained on SIGTERM at step {step} (saved and committed): pod "), drain
    assert [r["path"] for r in mon.resumes[-2:]] == [   # as the pods see them
        "/checkpoints/replay/ckpt/step_00000008", f"/checkpoints/replay/ckpt/step_{step:08d}"]
    # the pods' NVRx wrote its cycle records into the job folder (the flags their image's NVRx takes, added
    # in the pod), one folder per incarnation, and rank 0 relayed them through its log: the restart names
    # the cycle NVRx began; the drain's pods began their own cycle 0, under their attempt (2: the drain and
    # its index's ignored failure, as their ranks count it below)
    assert sorted(mon.nvrx_cycles) == [(0, 0), (0, 1), (2, 0)] and restart["nvrx_cycle"] == 1, mon.nvrx_cycles
    records = ctl.root / "volumes" / "fsx-claim" / "replay" / "logs" / "nvrx"   # the job folder's, here
    assert sorted(p.name for p in records.iterdir()) == ["attempt-0", "attempt-2"]
    # warm ranks: each pod's entry started its zygote, and every rank it ran, the in-job restart's
    # included, was forked by that pod's zygote (pods are told apart by their log files)
    for pod in sorted(ctl.root.glob("replay-[0-9]-*.log")):
        text = pod.read_text()
        forked = {int(pid) for pid in re.findall(r"forked rank (\d+) for worker", text)}
        starts = [e for e in decode_lines(text.splitlines()) if e.kind == "rank_start"]
        assert starts and {e["pid"] for e in starts} <= forked, (pod.name, text[-3000:])
        assert "no warm rank" not in text
    rank1 = [e for p in ctl.root.glob("replay-[0-9]-*.log") for e in decode_lines(p.read_text().splitlines())
             if e.kind == "rank_start" and e.rank == 1]
    # its first incarnation, the one ft_launcher restarted in its pod, and its replacement pod's, which
    # counts the drain (and its index's ignored failure) into its attempt: it restarts, it does not start
    assert [(e["job_attempt"], e["injob_restart"]) for e in sorted(rank1, key=lambda e: e.t)] == [
        (0, 0), (0, 1), (2, 0)]
    # and the pods' zygotes ended with their ft_launchers: nothing of the job outlives its pods
    deadline = time.time() + 30
    while (left := pods_processes(ctl.root, "replay")) and time.time() < deadline:
        time.sleep(0.2)
    assert not left, left

    resumed = job.resume(step=8)
    ctl.start_job(resumed.name, hosts={names.rank0_host(resumed.spec): "127.0.0.1"})
    assert resumed.wait(timeout=300, poll=0.5) == "succeeded", backend.logs(resumed.name, debug=True)
    assert resumed.name == "replay-from-8" and resumed.monitor.resumes[0]["step"] == 8
    assert resumed.monitor.steps.step[0] == 9 and resumed.monitor.max_step == 16
    assert resumed.monitor.digest == mon.digest   # the same parameters, bit for bit
    taken = mon.settings[changed["seq"]]
    assert set(taken["ranks"]) == {0, 1} and len(set(taken["ranks"].values())) == 1, taken
    assert resumed.spec.checkpoint.keep_last == 5


def test_script_args_reach_the_ranks_literally(cluster: tuple[Kube, EksBackend, Controllers],
                                               tmp_path: Path) -> None:
    """The kubelet expands $(VAR) (for variables the container defines) and $$ in args, and the
    launcher ${local_rank} and $$ in its workers' args: what the user typed reaches the script."""
    import json

    kube, backend, ctl = cluster
    script = tmp_path / "echo_args.py"
    script.write_text("import json, sys\nprint('ARGS ' + json.dumps(sys.argv[1:]), flush=True)\n")
    typed = ["$(EKSFT_JOB)", "$$", "cost$5", "$(EKSFT_NODE_RANK)", "$$(EKSFT_JOB)", "${local_rank}"]
    spec = JobSpec(name="literal", backend="eks", nnodes=1, nproc_per_node=1, script=str(script),
                   script_args=typed).replace(**{"eks.image": "local:test", "eks.gpus_per_node": 0,
                                                 "eks.port": free_port_base(), "ft.inprocess": False})
    backend.launch(spec)
    ctl.start_job("literal", hosts={names.rank0_host(spec): "127.0.0.1"})
    job = Job("literal", backend)
    assert job.wait(timeout=240, poll=0.5) == "succeeded", backend.logs("literal", debug=True)
    printed = [line.split("ARGS ", 1)[1] for line in backend.logs("literal").splitlines() if "ARGS " in line]
    assert [json.loads(p) for p in printed] == [typed]
