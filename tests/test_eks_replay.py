"""Local replay: the pods of a job submitted through the EKS backend, run here as local processes
with their rendered command, args and environment (rank 0's DNS name mapped to 127.0.0.1).

It proves the manifest's launch line trains (2 pods x 1 rank), survives a SIGKILL of a rank through
ft_launcher with the restarted rank forked warm by its pod's zygote, and resumes from a checkpoint as a new
job, with the dashboard's monitor fed by the streamed pod logs all along."""

from __future__ import annotations

import contextlib
import re
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
from eks_kube import Controllers, Kube, replay_cluster

from eksft_nb import commands
from eksft_nb.backends.eks import EksBackend, names
from eksft_nb.control import parse_fault
from eksft_nb.events import decode_lines
from eksft_nb.job import Job
from eksft_nb.spec import JobSpec

pytestmark = pytest.mark.slow


def free_port_base() -> int:
    """A port with the next two free as well (the rendezvous, store and in-process ports)."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        try:
            for port in (base + 1, base + 2):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue


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
    with replay_cluster(tmp_path, monkeypatch, mount_checkpoints=True) as made:
        yield made


def test_rendered_pods_train_survive_a_sigkill_and_resume(
    cluster: tuple[Kube, EksBackend, Controllers]) -> None:
    kube, backend, ctl = cluster
    # in-job restart only (in-process restart has its own tests), and checkpoints committed before the
    # next step (async ones commit a little later), so the step it resumes from is known
    spec = JobSpec(name="replay", backend="eks", nnodes=2, nproc_per_node=1, steps=16).replace(**{
        "eks.image": "local", "eks.gpus_per_node": 0, "eks.port": free_port_base(), "model.preset": "tiny",
        "checkpoint.every": 4, "checkpoint.mode": "sync", "ft.inprocess": False})
    backend.launch(spec, faults=[parse_fault("sigkill:1@10")])
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

    assert job.wait(timeout=300, poll=0.5) == "succeeded", backend.logs("replay", debug=True)
    mon = job.monitor
    assert mon.max_step == 16 and mon.digest and mon.state == "succeeded"
    assert {f["fault"] for f in mon.faults} == {"sigkill",
                                                "slow-rank"} and injected.id in {f["id"] for f in mon.faults}
    assert len(mon.restarts) == 1, mon.restarts
    [restart] = mon.restarts
    assert (restart["level"], restart["cause"], restart["blame_rank"], restart["resumed_step"]) == (
        "injob", "injected sigkill on rank 1", 1, 8)
    assert mon.resumes[-1]["path"] == "/checkpoints/replay/ckpt/step_00000008"   # as the pods see it
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
    assert len(rank1) == 2   # its first incarnation and the one ft_launcher restarted in its pod
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
                   script_args=typed).replace(**{"eks.image": "local", "eks.gpus_per_node": 0,
                                                 "eks.port": free_port_base(), "ft.inprocess": False})
    backend.launch(spec)
    ctl.start_job("literal", hosts={names.rank0_host(spec): "127.0.0.1"})
    job = Job("literal", backend)
    assert job.wait(timeout=240, poll=0.5) == "succeeded", backend.logs("literal", debug=True)
    printed = [line.split("ARGS ", 1)[1] for line in backend.logs("literal").splitlines() if "ARGS " in line]
    assert [json.loads(p) for p in printed] == [typed]
