"""The EKS backend's lifecycle through the real ``kubernetes`` client, against kmock's Kubernetes
emulator over loopback HTTP: submit (and its failures), watch, logs, inject, checkpoints, stop,
resume. The tests play the Job controller and the kubelet (``eks_kube.Controllers``); commands
exec'd into a pod really run, with the pod's rendered environment."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from eks_kube import Controllers, Kube, running
from jobs import wait_for

from eksft_nb import commands
from eksft_nb.backends.eks import EksBackend
from eksft_nb.procs import start_ticks
from eksft_nb.backends.eks.backend import CONFIGMAP
from eksft_nb.backends.eks.pods import parse_time
from eksft_nb.backends.eks.render import render
from eksft_nb.checkpoint_folders import COMMIT, sha256_file, step_dir
from eksft_nb.errors import ControlError, JobError, SpecError
from eksft_nb.events import LOG_PREFIX, make
from eksft_nb.job import Job
from eksft_nb.spec import JobSpec

NS = "default"


def eks_spec(name: str = "demo", **changes: object) -> JobSpec:
    spec = JobSpec(name=name, backend="eks", nnodes=2, nproc_per_node=1, steps=10)
    return spec.replace(**{"eks.image": "img:1", "eks.gpus_per_node": 0, "model.preset": "tiny",
                           "checkpoint.every": 4,
                           **changes})


def line(kind: str, rank: int | None, **data: object) -> str:
    """A rank's telemetry line as it appears in its pod's log."""
    return LOG_PREFIX + make(kind, "demo", rank, **data).to_json()


def rank_start(rank: int, pid: int, injob: int = 0, start: int = 0) -> str:
    return line("rank_start", rank, pid=pid, host=f"demo-{rank}", job_attempt=0, injob_restart=injob,
                inprocess_iteration=0, world_size=2, start_step=start)


def steps(first: int, last: int) -> list[str]:
    return [line("step", 0, step=s, loss=5.0 - 0.1 * s, tokens=1024,
                 step_time=0.01) for s in range(first, last + 1)]


@pytest.fixture
def kube() -> Kube:
    with running() as k:
        yield k


@pytest.fixture
def backend(kube: Kube, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> EksBackend:
    """Connected through a kubeconfig context, as a user's notebook is; the FSx claim exists."""
    monkeypatch.setenv("KUBECONFIG", str(kube.kubeconfig(tmp_path / "kubeconfig")))
    monkeypatch.delenv("EKSFT_NAMESPACE", raising=False)
    b = EksBackend(context="kmock", request_timeout=5)
    b._cluster().create({"apiVersion": "v1", "kind": "PersistentVolumeClaim",
                         "metadata": {"name": "fsx-claim", "namespace": NS},
                         "spec": {"accessModes": ["ReadWriteMany"],
                                  "resources": {"requests": {"storage": "1200Gi"}}}})
    return b


@pytest.fixture
def ctl(kube: Kube, tmp_path: Path) -> Controllers:
    return Controllers(kube, NS, tmp_path / "cluster")


def stored(kube: Kube, plural: str) -> list[str]:
    return sorted(name for (res, ns, name), obj in kube.emulator.objects.items()
                  if res.plural == plural and not obj.deleted)


def raw(kube: Kube, plural: str, name: str) -> dict:
    return next(o.raw for (res, _, n),
                o in kube.emulator.objects.items() if res.plural == plural and n == name)


def calls_outside_the_role(kube: Kube, spec: JobSpec) -> list[str]:
    """The backend's API calls (the tests' controllers have no token) that the rendered control Role
    does not grant (the fixture's volume claim is the admin's)."""
    role = next(d for d in render(spec).admin if d["kind"] == "Role")
    grants = {(g, r, v) for rule in role["rules"] for g in rule["apiGroups"] for r in rule["resources"]
              for v in rule["verbs"]}
    outside = []
    for r in kube.emulator.requests:
        if r.headers.get("Authorization") != "Bearer test-token":
            continue
        parts = r.url.path.strip("/").split("/")
        group = "" if parts[0] == "api" else parts[1]
        rest = parts[parts.index("namespaces") + 2:] if "namespaces" in parts else parts[3 if group else 2:]
        resource = rest[0] + (f"/{rest[2]}" if len(rest) > 2 else "")
        method = r.method.value.upper()
        verb = {"POST": "create", "DELETE": "delete", "PATCH": "patch", "PUT": "update"}.get(method) or (
            "watch" if r.params.get("watch") in ("true", "1") else "get" if len(rest) > 1 else "list")
        if (group, resource, verb) not in grants and (resource, verb) != ("persistentvolumeclaims", "create"):
            outside.append(f"{method} {r.url.path} ({verb} {resource})")
    return outside


def posts(kube: Kube) -> list[str]:
    return [r.url.path.rsplit("/", 1)[-1] for r in kube.emulator.requests if r.method.value.upper() == "POST"]


# ---- submit ---------------------------------------------------------------------------------------

def test_submit_creates_the_rendered_objects_and_is_idempotent(kube: Kube, backend: EksBackend) -> None:
    spec = eks_spec()
    backend.launch(spec)
    assert (stored(kube, "configmaps"), stored(kube, "services"),
            stored(kube, "jobs")) == (["demo"], ["demo"], ["demo"])
    job = raw(kube, "jobs", "demo")
    # sent as validated
    assert job["spec"]["template"] == backend.manifests(spec).workload()["spec"]["template"]
    assert posts(kube) == ["persistentvolumeclaims", "configmaps", "networkpolicies", "podmonitors",
                           "poddisruptionbudgets", "services",
                           "jobs"]   # the claim: the fixture's
    assert stored(kube, "networkpolicies") == stored(kube, "poddisruptionbudgets") == ["demo"]
    backend.launch(spec)   # again: every object exists with this spec, nothing changes
    assert posts(kube)[7:] == ["configmaps", "networkpolicies", "podmonitors", "poddisruptionbudgets",
                               "services", "jobs"]
    assert stored(kube, "jobs") == ["demo"] and backend.spec("demo") == spec


def test_a_different_spec_under_the_same_name_is_refused(kube: Kube, backend: EksBackend) -> None:
    backend.launch(eks_spec())
    with pytest.raises(JobError,
                       match="job 'demo' already exists in namespace default with a different spec: choose"):
        backend.launch(eks_spec(steps=20))
    assert backend.spec("demo").steps == 10


def test_a_foreign_object_blocks_the_launch_and_nothing_is_left(kube: Kube, backend: EksBackend) -> None:
    backend._cluster().create({"apiVersion": "v1", "kind": "Service",
                               "metadata": {"name": "demo", "namespace": NS},
                               "spec": {"clusterIP": "None", "ports": [{"port": 80}]}})
    with pytest.raises(JobError,
                       match="a Service named 'demo' already exists .* is not an eksft job: choose another"):
        backend.launch(eks_spec())
    assert stored(kube, "configmaps") == [] and stored(kube, "jobs") == []   # the ConfigMap was rolled back


@pytest.mark.parametrize("status,problem,fix", [
    (403, "cannot create Job demo in namespace default: forbidden (403: injected)", "eksft-control Role"),
    (500, "the API server failed (500: injected)", "retry in a minute"),
    (422, "the API server rejected it (422: injected)", "fix the option"),
])
def test_api_errors_are_explained_and_nothing_is_half_created(kube: Kube, backend: EksBackend, status: int,
                                                              problem: str, fix: str) -> None:
    kube.emulator.inject("POST", "/jobs", status=status)
    with pytest.raises(JobError) as e:
        backend.launch(eks_spec())
    assert problem in e.value.problem and fix in e.value.fix
    assert stored(kube, "configmaps") == stored(kube, "services") == stored(kube, "jobs") == []
    assert stored(kube, "networkpolicies") == []


def test_missing_crd_is_explained(kube: Kube, backend: EksBackend) -> None:
    kube.emulator.inject("POST", "/jobsets", status=404,
                         message="the server could not find the requested resource")
    with pytest.raises(JobError,
                       match=r"the JobSet API is not installed on this cluster \(404\): install JobSet"):
        backend.launch(eks_spec(**{"eks.kind": "jobset"}))
    assert stored(kube, "configmaps") == []


def test_invalid_spec_or_missing_volume_sends_nothing(kube: Kube, backend: EksBackend) -> None:
    before = len(kube.emulator.requests)
    with pytest.raises(SpecError, match="16 GPUs per node"):
        commands.prepare(eks_spec(**{"eks.gpus_per_node": 16}))   # the one check, before the backend
    assert len(kube.emulator.requests) == before
    with pytest.raises(JobError, match="claim 'scratch' does not exist in namespace default: create it"):
        backend.launch(eks_spec(**{"eks.checkpoint_pvc": "scratch"}))
    assert posts(kube) == ["persistentvolumeclaims"]   # only the fixture's


def test_unreachable_or_slow_api_server(kube: Kube, backend: EksBackend, tmp_path: Path,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    backend.launch(eks_spec())
    kube.emulator.inject("GET", "/configmaps/demo", delay=3)
    with pytest.raises(JobError, match=r"did not answer within 1s"):
        EksBackend(context="kmock", request_timeout=1).state("demo")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    closed = Kube(kube.emulator, f"http://127.0.0.1:{port}", kube.loop)
    monkeypatch.setenv("KUBECONFIG", str(closed.kubeconfig(tmp_path / "closed")))
    with pytest.raises(JobError,
                       match=rf"cannot connect to the Kubernetes API at http://127.0.0.1:{port} .*refused"):
        EksBackend(context="kmock").launch(eks_spec(name="other"))


def test_kubeconfig_contexts_and_in_cluster_config(kube: Kube, backend: EksBackend, tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(JobError, match="has no context 'prod': use --context with one of: kmock"):
        EksBackend(context="prod").jobs()
    from kubernetes.config import incluster_config
    from eksft_nb.backends.eks import cluster

    secrets = tmp_path / "sa"
    secrets.mkdir()
    (secrets / "token").write_text("sa-token")
    (secrets / "ca.crt").write_text("-----BEGIN CERTIFICATE-----\n")
    (secrets / "namespace").write_text("training")
    monkeypatch.delenv("KUBECONFIG")
    monkeypatch.setenv("HOME", str(tmp_path))   # no ~/.kube/config either
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.100.0.1")
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", "443")
    monkeypatch.setattr(incluster_config, "SERVICE_TOKEN_FILENAME", str(secrets / "token"))
    monkeypatch.setattr(incluster_config, "SERVICE_CERT_FILENAME", str(secrets / "ca.crt"))
    monkeypatch.setattr(cluster, "IN_CLUSTER_NAMESPACE", secrets / "namespace")
    c = cluster.Cluster.connect()
    assert (c.server, c.namespace) == ("https://10.100.0.1:443", "training")
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST")
    with pytest.raises(JobError, match="no Kubernetes configuration.*aws eks update-kubeconfig"):
        cluster.Cluster.connect()


# ---- watch, logs, monitor ---------------------------------------------------------------------------

def test_streamed_logs_feed_the_job_monitor(kube: Kube, backend: EksBackend, ctl: Controllers) -> None:
    backend.launch(eks_spec())
    job = Job("demo", backend)
    assert job.state == "starting" and "0 of 2 pods" in backend.state("demo").detail
    pods = ctl.create_pods("demo")
    waiting_since = time.time() - 125
    ctl.status(pods[1], "Pending",
               conditions=[{"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                            "lastTransitionTime": time.strftime("%Y-%m-%dT%H:%M:%SZ",
                                                                time.gmtime(waiting_since)),
                            "message": "0/3 nodes are available: 3 Insufficient nvidia.com/gpu."}])
    since = time.strftime("%H:%M:%S", time.localtime(int(waiting_since)))
    # issue 35: what it waits for, and since when
    assert re.fullmatch(re.escape(f"pod {pods[1]} (node 1): not scheduled: 0/3 nodes are available: 3 "
                                  f"Insufficient nvidia.com/gpu. (since {since}, ") + r"2m0[4-9]s\)",
                        backend.state("demo").detail), backend.state("demo").detail
    # the stream says it too, once, with what it holds up
    [warning] = wait_for("the pending pod's warning", lambda: job.refresh().warnings)
    assert warning["what"] == "pod-pending" and warning["message"] == (
        f"pod {pods[1]} (node 1) is not scheduled: 0/3 nodes are available: 3 Insufficient nvidia.com/gpu. "
        f"(since {since}); the other pods wait for it in the rendezvous for up to 1800 s "
        "(--rdzv-join-timeout), then fail")
    for p in pods:
        ctl.run(p)
    assert job.state == "running"
    ctl.log(pods[0], "[2026-01-01 00:00:00,000] [INFO] [ft_launcher7@demo-0] Starting elastic_operator",
            rank_start(0, 40),
            "[rank0]: tokenizer ready")
    ctl.log(pods[1], rank_start(1, 41))
    ctl.log(pods[0], *steps(1, 4),
            line("checkpoint", 0, phase="committed", step=4, path="/checkpoints/demo/ckpt/step_00000004"),
            *steps(5, 5))
    wait_for("step 5", lambda: job.refresh().last_step == 5)
    assert job.monitor.state == "running" and job.monitor.checkpoints[4].state == "committed"
    # rank 1 is SIGKILLed: its fault event, ft_launcher's line, then the new worker group resumes from 4
    ctl.log(pods[1], line("fault", 1, fault="sigkill", id="f1", target_rank=1, at_step=6),
            "[2026-01-01 00:00:10,000] [ERROR] [ft_launcher8@demo-1] failed (exitcode: -9) local_rank: 0 "
            "(pid: 41) of binary: python")
    wait_for("the failure", lambda: job.refresh().state == "recovering")
    assert job.monitor.failures[-1]["cause"] == "injected sigkill on rank 1" and job.monitor.failures[-1][
        "level"] == "injob"
    ctl.log(pods[1], rank_start(1, 52, injob=1, start=4))
    ctl.log(pods[0], rank_start(0, 51, injob=1, start=4), *steps(5, 10),
            line("rank_end", 0, final_step=10, digest="abc123"))
    for p in pods:
        ctl.exit(p, 0)
    ctl.finish("demo")
    assert job.wait(timeout=20, poll=0.1) == "succeeded"
    restart = job.monitor.restarts[0]
    assert (restart["level"], restart["cause"], restart["blame_rank"], restart["resumed_step"],
            restart["rolled_back_steps"]) == ("injob", "injected sigkill on rank 1", 1, 4, 1)
    assert job.monitor.max_step == 10 and job.monitor.digest == "abc123" and job.monitor.backend == "eks"
    summary = job.summary()
    assert summary["restarts"] == {"inprocess": 0, "injob": 1, "job": 0} and summary["goodput"]["wall_s"] > 0
    # the log: what the ranks print, without telemetry and launcher noise (unless debug), per node
    assert backend.logs("demo").splitlines() == ["[node 0] [rank0]: tokenizer ready"]
    debug = backend.logs("demo", debug=True).splitlines()
    assert debug[
        0] == "[node 0] [2026-01-01 00:00:00,000] [INFO] [ft_launcher7@demo-0] Starting elastic_operator"
    assert sum(LOG_PREFIX in x for x in debug) == 18 and debug[-1].startswith("[node 1] @@eksft ")


def test_pod_failures_become_failure_and_restart_events(kube: Kube, backend: EksBackend,
                                                        ctl: Controllers) -> None:
    backend.launch(eks_spec())
    job = Job("demo", backend)
    pods = ctl.create_pods("demo")
    for p in pods:
        ctl.run(p)
    ctl.log(pods[0], rank_start(0, 40), *steps(1, 3))
    wait_for("step 3", lambda: job.refresh().last_step == 3)
    ctl.exit(pods[1], 137, "OOMKilled")
    failure = wait_for("the OOM failure", lambda: job.refresh().failures and job.monitor.failures[-1])
    assert failure["level"] == "job" and failure["cause"] == (
        f"pod {pods[1]} (node 1): ft_launcher was OOM-killed (the pod reached its memory limit: "
        "raise --memory)")
    assert backend.state("demo").detail.startswith(f"recovering: pod {pods[1]} (node 1): ft_launcher "
                                                   "was OOM-killed")
    # the Job controller replaces the pod; the new worker group resumes from its checkpoint
    replacement = ctl.create_pods("demo", failures=1)[1]
    ctl.run(replacement)
    ctl.log(pods[0], rank_start(0, 41, injob=1, start=2), *steps(3, 4))
    restart = wait_for("the restart", lambda: job.refresh().restarts and job.monitor.restarts[-1])
    assert (restart["level"], restart["resumed_step"], restart["rolled_back_steps"]) == ("job", 2, 1)
    # an eviction, then a lost node: the pod is marked with the fault and deleted at once
    ctl.status(replacement, "Failed", reason="Evicted", message="The node was low on resource: memory.")
    evicted = f"pod {replacement} (node 1): evicted: The node was low on resource: memory."
    assert wait_for("the eviction", lambda: job.refresh().failures[-1]["cause"] == evicted)
    deleted = backend.lose_node("demo", 0)
    assert deleted == pods[0] and pods[0] not in stored(kube, "pods")
    wait_for("the node loss", lambda: len(job.refresh().failures) == 3)
    assert job.monitor.faults[-1]["fault"] == "node-loss" and job.monitor.faults[-1]["node"] == 0
    assert job.monitor.failures[-1][
        "cause"] == f"injected node-loss on node 0: pod {pods[0]} (node 0) was deleted: its node is lost"
    assert calls_outside_the_role(kube, eks_spec()) == []   # no pod was modified, only deleted


def test_a_pod_that_cannot_start_says_why(kube: Kube, backend: EksBackend, ctl: Controllers) -> None:
    backend.launch(eks_spec())
    pods = ctl.create_pods("demo")
    ctl.status(pods[0], "Pending", {"waiting": {"reason": "ErrImagePull", "message": "pull access denied"}})
    assert backend.state("demo").state == "starting"
    ctl.status(pods[0], "Pending",
               {"waiting": {"reason": "ImagePullBackOff", "message": "Back-off pulling image img:1"}})
    status = backend.state("demo")
    assert status.state == "failed" and status.detail.startswith(
        f"pod {pods[0]} (node 0): image img cannot be pulled (ImagePullBackOff: Back-off pulling image "
        "img:1)")
    ctl.status(pods[0], "Pending", {"waiting": {"reason": "ContainerCreating"}})
    ctl.core.create_namespaced_event(NS, {"metadata": {"name": "e1"},
                                          "involvedObject": {"kind": "Pod", "name": pods[0]},
                                          "type": "Warning", "reason": "FailedMount",
                                          "lastTimestamp": "2026-01-01T00:00:00Z",
                                          "message": "MountVolume.SetUp failed for volume \"checkpoints\""})
    # since when it waits: the pod's creation (the server's clock, to the second)
    detail = backend.state("demo").detail
    created = parse_time(raw(kube, "pods", pods[0])["metadata"]["creationTimestamp"])
    assert detail == (f"pod {pods[0]} (node 0): FailedMount: MountVolume.SetUp failed for volume "
                      f"\"checkpoints\" (since {time.strftime('%H:%M:%S', time.localtime(created))}, "
                      f"{detail.rsplit(', ', 1)[1]}"), detail
    assert re.fullmatch(r"\d+m\d\ds\)", detail.rsplit(", ", 1)[1]), detail


def test_a_pod_that_fails_in_prepare_says_why_and_fails_the_job(kube: Kube, backend: EksBackend,
                                                                 ctl: Controllers) -> None:
    """Issue 35: the pods' ``prepare`` refuses the job folder another job left on the volume; its one line is
    the init container's termination message, the pod failure policy fails the Job at once, and `status`
    and the stream name the reason."""
    spec = eks_spec(**{"eks.port": 29900})
    other = ctl.root / "volumes" / "fsx-claim" / "demo"
    other.mkdir(parents=True)
    (other / "spec.json").write_text(eks_spec(steps=99).to_json())
    backend.launch(spec)
    job = Job("demo", backend)
    ctl.start_job("demo", hosts={}).join(120)
    outcome = ctl.outcomes["demo"]
    assert (outcome.condition, outcome.reason) == ("Failed", "PodFailurePolicy")
    assert "failed with exit code 78 matching FailJob rule at index 0" in outcome.message
    why = "/checkpoints/demo holds a different job named demo: remove that folder from the volume"
    status = backend.state("demo")
    assert status.state == "failed" and why in status.detail, status.detail
    assert job.wait(timeout=30, poll=0.1) == "failed"
    wait_for("the stream's end", lambda: job.refresh().finished)   # the workload is polled every 2 s
    assert why in job.monitor.reason and "PodFailurePolicy" in job.monitor.reason, job.monitor.reason
    pod = next(p for p in ctl.exit_codes)
    assert ctl.pod_status(pod)["initContainerStatuses"][0]["state"]["terminated"]["message"].startswith(
        "/checkpoints/demo holds a different job named demo")


# ---- inside the pods: inject, signal, checkpoints; stop and resume ------------------------------------

def committed_checkpoint(root: Path, step: int) -> None:
    folder = step_dir(root, step)
    folder.mkdir(parents=True)
    (folder / "__0_0.distcp").write_bytes(os.urandom(256))
    files = {"__0_0.distcp": {"size": 256, "sha256": sha256_file(folder / "__0_0.distcp")}}
    (folder / COMMIT).write_text(json.dumps({"step": step, "world_size": 2, "bytes": 256, "time": time.time(),
                                             "files": files}))


def test_inject_signal_checkpoints_stop_and_resume(kube: Kube, backend: EksBackend, ctl: Controllers) -> None:
    from eksft_nb.control import parse_fault

    backend.launch(eks_spec(), faults=[parse_fault("exception:0@3")])
    job = Job("demo", backend)
    pods = ctl.create_pods("demo")
    for p in pods:
        assert ctl.pods[p].run("prepare").returncode == 0   # the init container, for real
        ctl.run(p)
    job_dir = ctl.root / "volumes" / "fsx-claim" / "demo"
    assert json.loads((job_dir / "spec.json").read_text())["name"] == "demo"
    pending = (job_dir / "control" / "pending").glob("*.json")
    assert [json.loads(f.read_text())["fault"] for f in pending] == ["exception"]

    command = job.inject("sigkill", rank=1, step=7)
    assert json.loads((job_dir / "control" / "pending" / f"{command.id}.json").read_text())["step"] == 7
    assert kube.emulator.exec_calls[-1][2][:4] == ["python", "-m", "eksft_nb.backends.eks.inpod", "inject"]
    with pytest.raises(ControlError,
                       match="rank 5 is out of range for a job of 2 ranks: use --rank between 0 and 1"):
        job.inject("sigkill", rank=5)

    # a rank process in pod 1, with its progress beacon: signalled where it runs
    env = ctl.pods[pods[1]].process_env("trainer")   # a warm rank's environ has no RANK (the zygote's)
    rank = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], env=env)
    beacon = {"rank": 1, "pid": rank.pid, "host": socket.gethostname(), "start_ticks": start_ticks(rank.pid)}
    # a beacon written in another pod, or by a process that had the pid before: not this rank
    for other in ({"host": "another-pod"}, {"start_ticks": beacon["start_ticks"] - 1}, {"start_ticks": None}):
        (job_dir / "progress" / "rank-1.json").write_text(json.dumps({**beacon, **other}))
        with pytest.raises(JobError, match="rank 1 of job demo is not running in any pod"):
            backend.signal("demo", 1, "SIGKILL")
    (job_dir / "progress" / "rank-1.json").write_text(json.dumps(beacon))
    assert backend.signal("demo", 1, "SIGKILL") in pods and rank.wait(10) == -9
    with pytest.raises(JobError, match="rank 0 of job demo is not running in any pod"):
        backend.signal("demo", 0)

    committed_checkpoint(job_dir / "ckpt", 4)
    (job_dir / "ckpt" / "step_00000008").mkdir()
    infos = job.checkpoints()
    assert [(i.step, str(i.path), i.state) for i in infos] == [
        (4, "/checkpoints/demo/ckpt/step_00000004", "committed"),
        (8, "/checkpoints/demo/ckpt/step_00000008", "incomplete")]
    mounted = EksBackend(context="kmock",
                         checkpoints_mount=str(ctl.root / "volumes" / "fsx-claim")).checkpoints("demo")
    assert [(i.step, str(i.path)) for i in mounted] == [(i.step, str(i.path)) for i in infos]

    backend.stop("demo", timeout=5)
    deletes = [r for r in kube.emulator.requests if r.method.value.upper() == "DELETE"]
    assert deletes[0].url.path.endswith("/jobs/demo") and deletes[0].data["propagationPolicy"] == "Foreground"
    assert stored(kube, "jobs") == stored(kube, "pods") == stored(kube, "services") == []
    order = [r.url.path.rsplit("/", 2)[-2] for r in deletes]
    # pods gone
    assert stored(kube, "networkpolicies") == [] and order.index("networkpolicies") > order.index("jobs")
    assert stored(kube, "configmaps") == ["demo"] and backend.state("demo").state == "stopped"
    assert job.wait(timeout=10, poll=0.1) == "stopped"
    with pytest.raises(JobError, match="no running pod to list its checkpoints.*EKSFT_CHECKPOINTS_MOUNT"):
        job.checkpoints()

    # resume: a new job from step 4, its spec pointing at the checkpoint on the shared volume
    resumed = Job("demo",
                  EksBackend(context="kmock",
                             checkpoints_mount=str(ctl.root / "volumes" / "fsx-claim"))).resume(step=4)
    assert resumed.name == "demo-from-4" and stored(kube, "jobs") == ["demo-from-4"]
    pod_spec = JobSpec.from_json(raw(kube, "configmaps", "demo-from-4")["data"]["spec.json"])
    assert pod_spec.resume == "/checkpoints/demo/ckpt/step_00000004" and pod_spec.checkpoint.dir is None
    assert [j.name for j in backend.jobs()] == ["demo", "demo-from-4"]
    backend.remove("demo")
    with pytest.raises(JobError, match="no EKS job named 'demo' in namespace default"):
        backend.spec("demo")
    assert calls_outside_the_role(kube, eks_spec()) == []


def test_jobset_and_pytorchjob_go_through_the_custom_objects_api(kube: Kube, backend: EksBackend,
                                                                   ctl: Controllers) -> None:
    jobset = ("jobset.x-k8s.io", "v1alpha2", "jobsets")
    backend.launch(eks_spec(**{"eks.kind": "jobset"}))
    assert stored(kube, "jobsets") == ["demo"] and stored(kube, "services") == []   # JobSet makes its own
    job = Job("demo", backend)
    pods = ctl.create_pods("demo", workload=jobset)
    for p in pods:
        ctl.run(p)
    ctl.log(pods[0], rank_start(0, 40), *steps(1, 10), line("rank_end", 0, final_step=10, digest="d1"))
    for p in pods:
        ctl.exit(p, 0)
    ctl.finish("demo", "Completed", workload=jobset)
    assert job.wait(timeout=20, poll=0.1) == "succeeded" and job.monitor.digest == "d1"
    backend.stop("demo", timeout=5)
    assert stored(kube, "jobsets") == stored(kube, "pods") == []

    backend.launch(eks_spec(name="torch", **{"eks.kind": "pytorchjob"}))
    created = raw(kube, "pytorchjobs", "torch")
    assert set(created["spec"]["pytorchReplicaSpecs"]) == {"Master", "Worker"}
    assert backend.state("torch").state == "starting"
    backend.stop("torch", timeout=5)
    assert stored(kube, "pytorchjobs") == [] and backend.state("torch").state == "stopped"


def test_the_cli_submits_to_the_kubeconfig_context(kube: Kube, backend: EksBackend) -> None:
    from jobs import cli

    done = cli("run", "--backend", "eks", "--detach", "--name", "from-cli", "--image", "img:1",
               "--gpus-per-node", "0",
               "--nnodes", "2", "--nproc-per-node", "1", "--model", "tiny", "--context", "kmock", timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("launched from-cli: 2 ranks (2x1)")
    assert stored(kube, "jobs") == ["from-cli"] and backend.spec("from-cli").eks.context == "kmock"
    listed = cli("list", "--backend", "eks", timeout=60)
    assert listed.returncode == 0 and "from-cli" in listed.stdout, listed.stderr
    stopped = cli("stop", "from-cli", "--backend", "eks", timeout=120)
    assert stopped.returncode == 0, stopped.stderr
    assert stored(kube, "jobs") == []
    missing = cli("status", "nope", "--backend", "eks", timeout=60)
    assert missing.returncode == 2 and "nope" in missing.stderr


def test_kill_supervisor_is_refused_on_eks_before_anything_is_sent() -> None:
    from eksft_nb.backends.eks import EksBackend
    from eksft_nb.control import FaultCommand

    with pytest.raises(ControlError, match="kill-supervisor is a local fault") as refused:
        commands.check_fault(FaultCommand("kill-supervisor"), eks_spec(), EksBackend())
    assert "\n" not in str(refused.value.args[0])


def test_a_claim_other_nodes_cannot_mount_is_refused(kube: Kube, backend: EksBackend) -> None:
    backend._cluster().create({"apiVersion": "v1", "kind": "PersistentVolumeClaim",
                               "metadata": {"name": "ebs", "namespace": NS},
                               "spec": {"accessModes": ["ReadWriteOnce"],
                                        "resources": {"requests": {"storage": "1Gi"}}}})
    with pytest.raises(JobError) as e:
        backend.launch(eks_spec(**{"eks.checkpoint_pvc": "ebs"}))
    assert "claim 'ebs' is ReadWriteOnce, not ReadWriteMany" in e.value.problem and "\n" not in str(e.value)
    assert "accessModes [ReadWriteMany]" in e.value.fix
    assert posts(kube) == ["persistentvolumeclaims"] * 2   # the two claims: nothing of the job was sent


def test_every_launch_has_its_own_job_uid_in_the_record(kube: Kube, backend: EksBackend,
                                                        ctl: Controllers) -> None:
    """Issue 18, finding 6: a relaunch under the same name and spec (after `rm`, which keeps the job's
    folder and checkpoints) commits under another job uid, so it never takes the earlier launch's newer
    checkpoints for its own, nor prunes its own saves for theirs. The pods read the id from the record."""
    def job_uid() -> str:
        return backend._cluster().get(CONFIGMAP, "demo")["data"]["job-uid"]

    backend.launch(eks_spec())
    first = job_uid()
    pods = ctl.create_pods("demo")
    assert {ctl.pods[p].env(c)["EKSFT_JOB_UID"] for p in pods for c in ("prepare", "trainer")} == {first}
    assert ctl.pods[pods[0]].run("prepare").returncode == 0   # the job's folder, on the shared volume
    backend.launch(eks_spec())   # submitted again while it exists: the same launch, the same id
    assert job_uid() == first
    backend.stop("demo", timeout=5)
    backend.remove("demo")
    backend.launch(eks_spec())
    second = job_uid()
    assert len(second) == 16 and second != first
    pods = ctl.create_pods("demo")
    assert ctl.pods[pods[0]].run("prepare").returncode == 0   # the same job's folder: taken over
    assert ctl.pods[pods[0]].env("trainer")["EKSFT_JOB_UID"] == second
