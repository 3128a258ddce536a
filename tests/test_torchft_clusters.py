"""The torchft engine on clusters: on EKS the Lighthouse as a Deployment behind a Service and the replica
groups as a JobSet, validated against the schemas, and the rendered pods' commands really training here
against their Lighthouse (kmock as the API server, see test_eks_replay.py); on a real two-node Slurm
(slurm_cluster.py) the Lighthouse on the allocation's first node and a job step per group. On both, a
group killed at a step is replaced and heals from its peer, and the job's events say so as a local job's
(engines/torchft/losses.py). Everywhere the groups' servers listen on the one address their peers use
(engines/torchft/hosts.py), IPv4 or IPv6, never on every interface."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import psutil
import pytest
from eks_kube import Controllers, Kube, replay_cluster
from eks_pods import LocalPod
from jobs import free_port, wait_for
from slurm_cluster import SlurmCluster, free_base, slurm_cluster
from test_eks_replay import free_port_base
from test_torchft import Holds, pace

from eksft_nb import commands
from eksft_nb.backends.eks import EksBackend, names
from eksft_nb.backends.eks.torchft import LIGHTHOUSE_LABEL, lighthouse_name
from eksft_nb.backends.slurm import SlurmBackend
from eksft_nb.engines.torchft import lighthouse as lh
from eksft_nb.engines.torchft import secret
from eksft_nb.engines.torchft.hold import HOLD_ENV, restart_point, step_point
from eksft_nb.engines.torchft.hosts import HOST_ENV, endpoint
from eksft_nb.errors import EksftError
from eksft_nb.control import FaultCommand
from eksft_nb.events import decode_lines, read_all
from eksft_nb.goodput import missing_batches
from eksft_nb.job import Job
from eksft_nb.monitor import JobMonitor
from eksft_nb.spec import JobSpec

pytest.importorskip("torchft")

JOBSET = ("jobset.x-k8s.io", "v1alpha2", "jobsets")
STEPS = 60   # a cluster job that loses group 1 at step 3: paced (2 s a step) until it healed, then fast


def eks_spec(name: str, **changes: object) -> JobSpec:
    return JobSpec(name=name, backend="eks", engine="torchft", nnodes=3, nproc_per_node=1).replace(**{
        "eks.image": "img", "eks.kind": "jobset", "eks.namespace": "train", **changes})


def env_of(container: dict) -> dict[str, object]:
    return {v["name"]: v.get("value", v.get("valueFrom")) for v in container["env"]}


def test_an_eks_torchft_job_is_a_lighthouse_deployment_and_a_jobset_of_replica_groups() -> None:
    spec, _ = commands.prepare(eks_spec("tft"), launching=False)
    m = EksBackend().manifests(spec)   # every manifest validated against its schema (a CRD's, or Kubernetes')
    kinds = [(o["kind"], o["metadata"]["name"]) for o in m.job]
    assert kinds[-4:] == [("NetworkPolicy", "tft-lighthouse"), ("Service", "tft-lighthouse"),
                          ("Deployment", "tft-lighthouse"), ("JobSet", "tft")], kinds
    policy, service, deployment, jobset = m.job[-4:]
    # the Lighthouse: one pod, bound to its own IP on --rdzv-port, reached through its Service by the job's
    # pods alone; its pod is not one of the job's (those are the groups)
    pod = deployment["spec"]["template"]
    [lighthouse] = pod["spec"]["containers"]
    assert lighthouse["command"] + lighthouse["args"] == ["python", "-m", lh.MODULE, "29500"]
    assert env_of(lighthouse)["POD_IP"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    assert env_of(lighthouse)[HOST_ENV] == "$(POD_IP)"   # its entry brackets an IPv6 one for --bind
    assert names.JOB_LABEL not in pod["metadata"]["labels"]
    selector = {LIGHTHOUSE_LABEL: "tft"}
    assert service["spec"]["selector"] == selector == policy["spec"]["podSelector"]["matchLabels"]
    assert service["spec"]["ports"] == [{"name": "lighthouse", "port": 29500, "targetPort": 29500}]
    groups_pods = {"podSelector": {"matchLabels": {names.JOB_LABEL: "tft"}}}
    port = [{"protocol": "TCP", "port": 29500}]
    assert policy["spec"]["ingress"] == [{"from": [groups_pods], "ports": port}]
    # the groups: one replicated job of a one-pod child Job per group (JobSet numbers them 0..2, torchft's
    # replica ids), retried alone, never the set restarted
    [groups] = jobset["spec"]["replicatedJobs"]
    child = groups["template"]["spec"]
    assert (groups["replicas"], child["completions"]) == (3, 1)
    assert child["backoffLimitPerIndex"] == spec.ft.max_job_restarts
    assert jobset["spec"]["failurePolicy"]["maxRestarts"] == 0
    [trainer] = child["template"]["spec"]["containers"]
    env = env_of(trainer)
    assert trainer["command"] == ["python", "-m", "eksft_nb.engines.torchft.trainer"]
    assert "ports" not in trainer   # ephemeral (hosts.py)
    assert env["TORCHFT_LIGHTHOUSE"] == "http://tft-lighthouse.train.svc.cluster.local:29500"
    index = "metadata.annotations['jobset.sigs.k8s.io/job-index']"
    assert env["REPLICA_GROUP_ID"] == {"fieldRef": {"fieldPath": index}}
    assert env[HOST_ENV] == env["MASTER_ADDR"] == "$(POD_IP)" and env["NUM_REPLICA_GROUPS"] == "3"
    order = [v["name"] for v in trainer["env"]]
    assert order.index("POD_IP") < order.index(HOST_ENV)   # the kubelet expands only what comes before
    assert "0.0.0.0" not in json.dumps([lighthouse, trainer])
    # the job's secret: a Secret of the job made before any pod, mounted read-only into the Lighthouse's pod
    # and every group's, its path (never its value) in their environment; a dry run does not show it
    [secret] = [o for o in m.job if o["kind"] == "Secret"]
    assert kinds.index(("Secret", "tft-torchft")) < kinds.index(("NetworkPolicy", "tft-lighthouse"))
    key = secret["stringData"]["secret"]
    assert len(bytes.fromhex(key)) == 32 and secret["metadata"]["labels"][names.JOB_LABEL] == "tft"
    for pod_spec, container in ((pod["spec"], lighthouse), (child["template"]["spec"], trainer)):
        [volume] = [v for v in pod_spec["volumes"] if v.get("secret")]
        assert volume["secret"] == {"secretName": "tft-torchft", "defaultMode": 0o440}
        mount = next(v for v in container["volumeMounts"] if v["name"] == volume["name"])
        path = env_of(container)["EKSFT_TORCHFT_SECRET"]
        assert mount["readOnly"] and path == f"{mount['mountPath']}/secret"
        assert key not in json.dumps(container)
    shown = EksBackend().render(spec)
    assert "secret: <32 random bytes, hex, made at launch>" in shown and not re.search(r"[0-9a-f]{64}", shown)
    rules = next(o for o in m.admin if o["kind"] == "Role")["rules"]
    assert {"apiGroups": ["apps"], "resources": ["deployments"],
            "verbs": ["get", "create", "delete"]} in rules
    assert {"apiGroups": [""], "resources": ["secrets"], "verbs": ["get", "create", "delete"]} in rules


def test_the_eks_lighthouse_binds_an_ipv6_pod_ip_alone(tmp_path: Path) -> None:
    """The rendered Lighthouse pod, run here with ``::1`` as its pod IP (the kubelet's part: eks_pods.py),
    listens on it alone: its entry put the address in the brackets ``--bind`` needs."""
    port = free_port()
    spec, _ = commands.prepare(eks_spec("tft6", **{"eks.port": port}), launching=False)
    objects = {o["kind"]: o for o in EksBackend().manifests(spec).job}
    pod = LocalPod(objects["Deployment"]["spec"]["template"], "tft6-lighthouse", tmp_path, {}, ip="::1",
                   secrets={objects["Secret"]["metadata"]["name"]: objects["Secret"]["stringData"]})
    proc = pod.start("lighthouse", tmp_path / "lighthouse.log")
    try:
        bound = wait_for("the Lighthouse to listen", lambda: {
            (c.laddr.ip, c.laddr.port) for c in psutil.Process(proc.pid).net_connections("inet")
            if c.status == psutil.CONN_LISTEN} or proc.poll() is not None, timeout=60)
        assert bound == {("::1", port)}, (tmp_path / "lighthouse.log").read_text()[-2000:]
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.parametrize("changes, words", [
    ({"eks.kind": "job"}, "runs its replica groups as a JobSet"),
    ({"eks.queue": "q"}, "cannot be queued yet"),
])
def test_what_eks_cannot_run_of_a_torchft_job_is_refused_in_one_line(changes: dict, words: str) -> None:
    with pytest.raises(EksftError) as refused:
        commands.prepare(eks_spec("tft", **changes), launching=False)
    assert words in str(refused.value) and "\n" not in str(refused.value)


# ---- EKS: the rendered pods, run here ---------------------------------------------------------------------

@pytest.fixture
def cluster(tmp_path: Path,
            monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Kube, EksBackend, Controllers]]:
    with replay_cluster(tmp_path, monkeypatch) as made:
        yield made


def listening(pid: int) -> set[str]:
    """The addresses a process tree listens on (none once it ended)."""
    out: set[str] = set()
    try:
        tree = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
    except psutil.Error:
        return out
    for p in tree:
        try:
            out |= {c.laddr.ip for c in p.net_connections(kind="inet") if c.status == psutil.CONN_LISTEN}
        except psutil.Error:
            continue
    return out


def losses(mon: JobMonitor, heals: list, alone: bool) -> tuple[dict, dict, dict]:
    """A job whose group 1 was lost once (killed entering step 3, once step 2 was reported) and healed: the
    failure, the restart and the heal its events say, checked as the local supervisor's are
    (test_torchft.py). ``alone``: group 1's new process was held until group 0 committed a step alone;
    else group 0 was held before step 3 until group 1 was back."""
    assert len(mon.failures) == len(mon.restarts) == 1, (mon.failures, mon.restarts)
    [failure], [restart], [heal] = mon.failures, mon.restarts, [e for e in heals if e.rank == 1]
    kill = next(f for f in mon.faults if f["fault"] == "sigkill")
    assert (failure["level"], failure["blame_rank"], failure["fault_time"]) == ("job", 1, kill["t"]), failure
    assert "replica group 1" in failure["cause"] and failure["detected_at"] >= kill["t"], failure
    assert (restart["level"], restart["blame_rank"], restart["replica_group"], restart["restored_from"]) == (
        "job", 1, 1, "peer") and restart["fault_time"] == kill["t"], restart
    assert heal["skipped_batches"] == heal["step"] - heal["from_step"], heal
    assert restart["resumed_step"] == heal["step"] and restart["skipped_batches"] == heal["skipped_batches"]
    # the steps committed while group 1 was away lacked its batch: the one count of skipped batches agrees
    # with the heal's (a replaced EKS pod reads its step from a beacon written once a second: one more)
    assert 0 <= heal["skipped_batches"] - missing_batches(mon) <= 1, (heal, missing_batches(mon))
    if alone:   # group 0 committed steps alone (the batches group 1 skipped), its first one stalled
        assert heal["step"] > heal["from_step"] >= 1 and missing_batches(mon) > 0, heal
        assert 0 < restart["downtime_s"] < restart["group_downtime_s"], restart
    else:   # group 1 healed at step 2, the last both committed, and skipped nothing; no step came between
        assert (heal["from_step"], heal["step"], heal["skipped_batches"]) == (2, 2, 0), heal
        assert missing_batches(mon) == 0
        assert restart["downtime_s"] == pytest.approx(restart["group_downtime_s"]), restart
        assert restart["downtime_s"] > 0, restart
    return failure, restart, heal


@pytest.mark.slow
def test_a_rendered_torchft_job_trains_against_its_lighthouse_and_a_lost_group_heals(
        cluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Group 1's process is killed at step 3 (the registry's sigkill): its pod fails, its child Job replaces
    it, the new pod heals from group 0, and the job's events say so as a local job's do. Both groups wait
    before step 3 until step 2 is reported, group 1 goes first (and is killed), and its new pod waits before
    it sets up until group 0 committed a step alone (the Slurm job below has the other outcome). Group 0 is
    a straggler (slow-rank) until then, so the job outlasts the replacement however slowly it starts."""
    kube, backend, ctl = cluster
    spec = eks_spec("tftreplay", nnodes=2, steps=STEPS).replace(**{
        "eks.namespace": "default", "eks.gpus_per_node": 0, "eks.port": free_port_base(),
        "model.preset": "tiny"})
    holds = Holds(tmp_path / "holds")
    holds.add(step_point(0, 3), step_point(1, 3), restart_point(1, 1))
    monkeypatch.setenv(HOLD_ENV, str(holds.folder))   # the pods, started and replaced below, wait at them
    backend.launch(spec, faults=[pace(0, step=1), FaultCommand("sigkill", rank=1, step=3)])
    hosts = {f"{lighthouse_name('tftreplay')}.default.svc.{names.CLUSTER_DOMAIN}": "127.0.0.1"}
    lighthouse = ctl.start_deployment(lighthouse_name("tftreplay"), hosts)
    ctl.start_job("tftreplay", hosts, workload=JOBSET, retries=spec.ft.max_job_restarts)
    job = Job("tftreplay", backend)
    seen: set[str] = set()
    deadline = time.time() + 600

    def until(what: str, done: Callable[[], object]) -> None:
        while not (job.refresh() and done()) and not job.monitor.finished and time.time() < deadline:
            seen.update(ip for p in ctl.procs for ip in listening(p.pid))
            time.sleep(0.5)
        assert done(), f"{what}: {backend.logs('tftreplay', debug=True)[-3000:]}"

    try:
        until("step 2", lambda: (job.monitor.last_step or 0) >= 2)
        holds.release(step_point(1, 3))   # group 1 goes on, and is killed entering step 3
        until("the sigkill", lambda: job.monitor.faults)
        holds.release(step_point(0, 3))
        until("group 0 to commit a step alone", lambda: 1 in job.monitor.steps.batches)
        holds.release(restart_point(1, 1))   # group 1's new pod sets up, and heals
        until("group 1 to heal", lambda: job.monitor.restarts)
    finally:
        holds.release()
    if job.monitor.restarts:
        job.inject("slow-rank", rank=0, delay=0.01, duration=1)   # healed: group 0 at full speed again
    while not (state := job.state).ended and time.time() < deadline:
        seen |= {ip for p in ctl.procs for ip in listening(p.pid)}
        time.sleep(0.5)
    assert state == "succeeded", backend.logs("tftreplay", debug=True)[-4000:]
    # every step committed once, and both groups (group 1's replacement pod) ended at the last step with
    # the same weights (read from the pods' logs: the stream behind the monitor once delivered 3 of pod 0's
    # 20 steps, under a load of 15)
    pods = sorted(ctl.root.glob("tftreplay-[0-9]-*.log"))
    events = [e for p in pods for e in decode_lines(p.read_text().splitlines())]
    assert sorted(e["step"] for e in events if e.kind == "step") == list(range(1, STEPS + 1))
    ends = [e for e in events if e.kind == "rank_end"]
    assert sorted(e["replica_group"] for e in ends) == [0, 1] and {e["final_step"] for e in ends} == {STEPS}
    assert len({e["digest"] for e in ends}) == 1, ends
    assert len(pods) == 3   # group 1's pod was replaced once
    failure, _, heal = losses(job.monitor, [e for e in events if e.kind == "heal"], alone=True)
    assert "pod tftreplay-1-" in failure["cause"] and "trainer" in failure["cause"], failure
    assert job.monitor.restarts_by_level()["job"] == 1
    # the pods' servers (the Lighthouse's, the groups' stores, managers and checkpoint servers) listened on
    # the pod's IP, here 127.0.0.1, and nowhere else
    assert lighthouse.poll() is None and seen == {"127.0.0.1"}, seen


# ---- Slurm ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def slurm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmCluster]:
    with slurm_cluster(tmp_path_factory.mktemp("slurm")) as c:
        yield c


def test_a_slurm_torchft_script_starts_the_lighthouse_on_the_first_node_and_a_step_per_group() -> None:
    spec = JobSpec(name="tft", backend="slurm", engine="torchft", nnodes=2, nproc_per_node=1).replace(**{
        "slurm.shared_dir": "/fsx/eksft", "slurm.port": 31000})
    script = commands.dry_run(spec)
    lines = script.splitlines()
    assert "#SBATCH --nodes=2" in lines and "#SBATCH --no-requeue" in lines
    assert 'FIRST_NODE=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1)' in lines
    assert 'export TORCHFT_LIGHTHOUSE="http://$FIRST_NODE:31000"' in lines
    assert "eksft_nb.backends.slurm.torchft /fsx/eksft/tft" in script and "0.0.0.0" not in script
    assert subprocess.run(["bash", "-n"], input=script, text=True).returncode == 0


@pytest.mark.slow
def test_a_torchft_job_on_slurm_runs_every_group_as_a_step_and_a_lost_group_heals(
        slurm: SlurmCluster, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Group 1's process is killed at step 3 (the registry's sigkill): its job step ends, the runner starts
    it again alone, it heals from group 0, and the job's events say so as a local job's do. Both groups wait
    before step 3 until step 2 is reported, group 1 goes first (and is killed), and group 0, and group 1's
    new process before its first step, wait until that process is up: group 1 is back before group 0
    committed a step alone (the EKS job above has the other outcome)."""
    for key in ("SLURM_CONF", "PATH"):
        monkeypatch.setenv(key, slurm.env[key])
    spec = JobSpec(name="tft-slurm", backend="slurm", engine="torchft", nnodes=2, nproc_per_node=1,
                   steps=STEPS).replace(**{"slurm.shared_dir": str(slurm.shared), "slurm.port": free_base(),
                                           "model.preset": "tiny"})
    holds = Holds(tmp_path / "holds")
    holds.add(step_point(0, 3), step_point(1, 3))
    with holds.env():   # sbatch hands the job the submitting environment
        commands.launch(spec, [FaultCommand("sigkill", rank=1, step=3)])
    job = Job("tft-slurm", SlurmBackend(shared_dir=slurm.shared))
    folder = slurm.shared / "tft-slurm"

    def of(kind: str, rank: int, after: float = 0.0) -> list:
        return [e for e in read_all(folder / "events.jsonl")
                if e.kind == kind and e.rank == rank and e.t > after]

    def until(probe: Callable[[], object]) -> Callable[[], object]:
        return lambda: probe() or job.refresh().finished

    try:
        wait_for("step 1", until(lambda: (job.refresh().last_step or 0) >= 1), timeout=600)
        holds.add(step_point(1, 1))   # group 1's next process waits before its first step
        wait_for("step 2", until(lambda: (job.refresh().last_step or 0) >= 2), timeout=300)
        holds.release(step_point(1, 3))   # group 1 goes on, and is killed entering step 3
        kill = wait_for("the sigkill", until(lambda: of("fault", 1)), timeout=120)[0]
        wait_for("group 1's new process", until(lambda: of("rank_start", 1, kill.t)), timeout=600)
    finally:
        holds.release()   # both groups go: one quorum
    state = job.wait(timeout=600)
    logs = "\n".join(f"== {p.name}\n{p.read_text()[-2000:]}" for p in sorted((folder / "logs").glob("*")))
    assert state == "succeeded" and job.monitor.last_step == STEPS, logs
    events = read_all(folder / "events.jsonl")
    ends = [e for e in events if e.kind == "rank_end"]
    assert sorted(e["replica_group"] for e in ends) == [0, 1] and len({e["digest"] for e in ends}) == 1
    job_events = [e.kind for e in events if e.rank is None]
    assert (job_events[0], job_events[-1]) == ("job_start", "job_end"), job_events
    losses(job.monitor, [e for e in events if e.kind == "heal"], alone=False)
    assert job.monitor.restarts_by_level()["job"] == 1
    # the Lighthouse ran on the first node, each group in a job step of its own, group 1's twice
    assert sorted(p.name for p in (folder / "logs").glob("group-*.log")) == [
        "group-0-0.log", "group-1-0.log", "group-1-1.log"]
    job_id = json.loads((folder / "slurm.json").read_text())["job_id"]
    wait_for("Slurm to record the job's end (its batch script exits after the job_end event)", lambda: (
        "JobState=COMPLETED" in slurm.run("scontrol", "show", "job", job_id).stdout), timeout=120)


# ---- the port rule, across a real network path ------------------------------------------------------------

GROUP = """
import datetime, json, os, sys, psutil
from eksft_nb.engines.torchft.listen import install
from eksft_nb.engines.torchft.hosts import group_host
install()   # as the trainer does: the store, manager and checkpoint servers on EKSFT_TORCHFT_HOST, the secret
from torch.distributed import TCPStore
from torchft import Manager, ProcessGroupGloo
host, t = group_host(), datetime.timedelta(seconds=30)
store = TCPStore(host, 0, is_master=True, wait_for_workers=False)
manager = Manager(pg=ProcessGroupGloo(timeout=t), min_replica_size=1, load_state_dict=lambda s: None,
                  state_dict=lambda: {}, replica_id="group0", rank=0, world_size=1, store_addr=host,
                  store_port=store.port, timeout=t, connect_timeout=t)
print(json.dumps(sorted({(c.laddr.ip, c.laddr.port) for c in psutil.Process().net_connections(kind="inet")
                         if c.status == psutil.CONN_LISTEN})), flush=True)
sys.stdin.read()   # until the test is done
"""
HOST_SIDE, PEER_SIDE = "10.213.7.1", "10.213.7.2"   # a private /24 used only inside this test's namespace
HOST_SIDE6, PEER_SIDE6 = "fd00:213:7::1", "fd00:213:7::2"   # and a private IPv6 /64 likewise (an IPv6 pod IP)


def ip(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)


@pytest.fixture(scope="module")
def peer() -> Iterator[str]:
    """Another host: a network namespace reached through a veth pair (../shared/notes/network-namespaces.md);
    yields its name."""
    name = f"eksft-peer-{os.getpid()}"
    if ip("netns", "add", name).returncode != 0:
        pytest.skip("needs root and iproute2 (ip netns) to make a second host")
    try:
        host_if, peer_if = f"vh{name[-8:]}", f"vp{name[-8:]}"
        for step in (["link", "add", host_if, "type", "veth", "peer", "name", peer_if],
                     ["link", "set", peer_if, "netns", name],
                     ["addr", "add", f"{HOST_SIDE}/24", "dev", host_if],
                     ["-6", "addr", "add", f"{HOST_SIDE6}/64", "dev", host_if, "nodad"],
                     ["link", "set", host_if, "up"],
                     ["-n", name, "addr", "add", f"{PEER_SIDE}/24", "dev", peer_if],
                     ["-n", name, "-6", "addr", "add", f"{PEER_SIDE6}/64", "dev", peer_if, "nodad"],
                     ["-n", name, "link", "set", peer_if, "up"], ["-n", name, "link", "set", "lo", "up"]):
            done = ip(*step)
            assert done.returncode == 0, (step, done.stderr)
        yield name
    finally:
        ip("netns", "del", name)
        ip("link", "del", f"vh{name[-8:]}")


def reach_from(peer: str, address: str, ports: list[int]) -> list[bool]:
    """Whether each port at ``address`` accepts a connection from the peer host (3 s each at most)."""
    probe = ("import socket, sys\nfor p in sys.argv[2:]:\n    try:\n        socket.create_connection("
             "(sys.argv[1], int(p)), timeout=3).close(); print(1)\n    except OSError:\n        print(0)\n")
    done = subprocess.run(["ip", "netns", "exec", peer, sys.executable, "-c", probe, address,
                           *map(str, ports)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return [line == "1" for line in done.stdout.split()]


@pytest.mark.slow
@pytest.mark.parametrize("host", ["127.0.0.1", HOST_SIDE, HOST_SIDE6],
                         ids=["local", "cluster", "cluster-ipv6"])
def test_a_groups_servers_are_reached_only_at_the_address_the_rule_gives(peer: str, host: str,
                                                                         tmp_path: Path) -> None:
    """A local group's store, manager and checkpoint servers (and its Lighthouse's gateway) cannot be reached
    from another host; a cluster group's, bound to the address its peers use (an IPv6 one too), can, there
    and nowhere else."""
    port = free_port()
    secret.ensure(tmp_path / "secret")   # the job's, which the gateway and the group's servers require
    env = {**os.environ, secret.ENV: str(tmp_path / "secret")}
    lighthouse = subprocess.Popen(lh.argv(port, host), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                  env=env)
    group = subprocess.Popen([sys.executable, "-c", GROUP], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True,
                             env={**env, HOST_ENV: host,
                                  "TORCHFT_LIGHTHOUSE": f"http://{endpoint(host, port)}"})
    try:
        line = group.stdout.readline()
        assert line, group.communicate(timeout=60)[1][-3000:]
        listens = [tuple(x) for x in json.loads(line)]
        listens += wait_for("the Lighthouse to listen", lambda: [
            (a.laddr.ip, a.laddr.port) for a in psutil.Process(lighthouse.pid).net_connections("inet")
            if a.status == psutil.CONN_LISTEN], timeout=60)
        ports = sorted({p for _, p in listens})
        assert len(ports) >= 4 and {a for a, _ in listens} == {host}, listens   # store, manager, ckpt, LH
        remote = host != "127.0.0.1"
        assert reach_from(peer, host if remote else HOST_SIDE, ports) == [remote] * len(ports)
        if remote:   # not every interface: not through this host's loopback, nor its other family's address
            other = HOST_SIDE6 if host == HOST_SIDE else HOST_SIDE
            for p in ports:
                for address in ("127.0.0.1", "::1", other):
                    with pytest.raises(ConnectionRefusedError):
                        socket.create_connection((address, p), timeout=3).close()
    finally:
        group.kill()
        lighthouse.kill()
        group.communicate()
        lighthouse.wait()
