"""What a real GPU cluster does to a job's pods (issue 24): 4 x p5.48xlarge rendered as `run --dry-run`
renders it, each point checked, and every manifest valid against the real schemas; the instance
types that differ (g5 without RDMA read, HyperPod's ml. names), Kubernetes 1.28, the memory floor,
a script's /dev/shm, and `prepare` on an image without EFA."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
from pathlib import Path

import pytest
import yaml
from eks_pods import LocalPod
from jobs import cli

from eksft_nb import commands
from eksft_nb.backends.eks import EksBackend, efa, names, schemas, sizing
from eksft_nb.backends.eks.failures import CONFIG_ERROR
from eksft_nb.runtime.drain import DRAIN_EXIT
from eksft_nb.errors import SpecError
from eksft_nb.spec import JobSpec

IMAGE = "123456789012.dkr.ecr.us-west-2.amazonaws.com/eksft-nb:0.1.0"
P5 = ["--nnodes", "4", "--nproc-per-node", "8", "--gpus-per-node", "8", "--efa-per-node", "32",
      "--instance-type", "p5.48xlarge"]


def gpu_spec(instance: str = "p5.48xlarge", efa: int = 32, kind: str = "job", **changes: object) -> JobSpec:
    spec = JobSpec(name="llm", backend="eks", nnodes=4, nproc_per_node=8)
    return spec.replace(**{"eks.image": IMAGE, "eks.kind": kind, "eks.gpus_per_node": 8,
                           "eks.efa_per_node": efa, "eks.instance_type": instance, "model.preset": "gpt-8b",
                           **changes})


def pod_of(workload: dict) -> dict:
    if workload["kind"] == "JobSet":
        return workload["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]
    return workload["spec"]["template"]


def env_of(container: dict) -> dict:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container["env"]}


def test_four_p5_nodes_render_for_a_real_gpu_cluster() -> None:
    done = cli("run", "--backend", "eks", "--dry-run", "--name", "llm", "--image", IMAGE, "--model", "gpt-8b",
               *P5, timeout=120)
    assert done.returncode == 0, done.stderr
    docs = [d for d in yaml.safe_load_all(done.stdout) if d]
    for doc in docs:
        schemas.validate(doc, "1.33")
    job = docs[-1]
    pod = pod_of(job)["spec"]
    trainer, prepare = pod["containers"][0], pod["initContainers"][0]
    env = env_of(trainer)
    # EFA: device RDMA (p5's EFA has RDMA read); NCCL says which network it took, so a TCP fallback shows;
    # AWS's current libfabric settings: huge pages off (forks fail without), no RDMAV_FORK_SAFE
    assert env["FI_PROVIDER"] == "efa" and env["FI_EFA_USE_DEVICE_RDMA"] == "1"
    assert env["FI_EFA_USE_HUGE_PAGE"] == "0" and "RDMAV_FORK_SAFE" not in env
    assert env["NCCL_DEBUG"] == "INFO" and env["NCCL_DEBUG_SUBSYS"] == "INIT,NET"
    # `prepare` sees the EFA devices to check them (the trainer reuses an init container's devices)
    assert prepare["resources"]["limits"] == {"vpc.amazonaws.com/efa": "32"}
    assert env_of(prepare)["FI_PROVIDER"] == "efa"
    assert prepare["terminationMessagePolicy"] == "FallbackToLogsOnError"
    # resources: the node less the kubelet's and the DaemonSets' share; memory limited to the request,
    # no CPU limit
    requests, limits = trainer["resources"]["requests"], trainer["resources"]["limits"]
    assert requests == {"nvidia.com/gpu": "8", "vpc.amazonaws.com/efa": "32", "cpu": "180",
                        "memory": "1792Gi"}
    assert limits == {"nvidia.com/gpu": "8", "vpc.amazonaws.com/efa": "32", "memory": "1792Gi"}
    shm = next(v for v in pod["volumes"] if v["name"] == "shm")["emptyDir"]["sizeLimit"]
    assert sizing.quantity(shm, "") + 8 * 8 * sizing.GiB <= sizing.quantity(requests["memory"], "")
    # what Pod Security "restricted" asks: no capability, no privilege escalation, RuntimeDefault seccomp, not
    # root (UID and group 1000 by default, the job folder's group too)
    assert "IPC_LOCK" not in done.stdout
    for container in (trainer, prepare, pod["initContainers"][1]):
        assert container["securityContext"] == {"allowPrivilegeEscalation": False,
                                                "capabilities": {"drop": ["ALL"]}}
    assert pod["securityContext"] == {"runAsNonRoot": True, "runAsUser": 1000, "runAsGroup": 1000,
                                      "fsGroup": 1000, "fsGroupChangePolicy": "OnRootMismatch",
                                      "seccompProfile": {"type": "RuntimeDefault"}}
    # node failures: a drain and a disruption are not charged, a configuration error fails the job at once
    assert job["spec"]["backoffLimitPerIndex"] == 2 and job["spec"]["podReplacementPolicy"] == "Failed"
    assert job["spec"]["podFailurePolicy"]["rules"] == [
        {"action": "FailJob", "onExitCodes": {"operator": "In", "values": [CONFIG_ERROR]}},
        {"action": "Ignore",
         "onExitCodes": {"containerName": "trainer", "operator": "In", "values": [DRAIN_EXIT]}},
        {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]}]
    # voluntary disruption takes no node the job needs: Karpenter leaves the nodes alone, evictions wait
    assert pod_of(job)["metadata"]["annotations"]["karpenter.sh/do-not-disrupt"] == "true"
    pdb = next(d for d in docs if d["kind"] == "PodDisruptionBudget")
    assert pdb["spec"] == {"minAvailable": 4, "selector": {"matchLabels": {names.JOB_LABEL: "llm"}},
                           "unhealthyPodEvictionPolicy": "AlwaysAllow"}
    # a pod recreated after a drain counts the drains and disruptions of its index (it restarts, not starts)
    assert env["EKSFT_IGNORED_FAILURES"] == {"fieldRef": {
        "fieldPath": "metadata.annotations['batch.kubernetes.io/job-index-ignored-failure-count']"}}
    # a lost node's pods are evicted in a minute, not five
    fast = {t["key"]: t["tolerationSeconds"] for t in pod["tolerations"] if t["effect"] == "NoExecute"}
    assert fast == {"node.kubernetes.io/unreachable": 60, "node.kubernetes.io/not-ready": 60}
    # one availability zone for all the job's pods
    zone = pod["affinity"]["podAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert zone == [{"labelSelector": {"matchLabels": {names.JOB_LABEL: "llm"}},
                     "topologyKey": "topology.kubernetes.io/zone"}]
    assert pod["nodeSelector"] == {"node.kubernetes.io/instance-type": "p5.48xlarge"}
    # a JobSet: the same pod, the same child policy, and a configuration error fails the set
    jobset = EksBackend().manifests(gpu_spec(kind="jobset")).workload()
    child = jobset["spec"]["replicatedJobs"][0]["template"]["spec"]
    assert child["podFailurePolicy"] == job["spec"]["podFailurePolicy"] and child["backoffLimit"] == 0
    assert jobset["spec"]["failurePolicy"] == {"maxRestarts": 2, "rules": [
        {"name": "configurationError", "action": "FailJobSet", "onJobFailureReasons": ["PodFailurePolicy"]}]}
    assert pod_of(jobset)["spec"]["affinity"] == pod["affinity"]


def test_g5_efa_has_no_rdma_read() -> None:
    m = EksBackend().manifests(gpu_spec("g5.48xlarge", efa=1))
    trainer = pod_of(m.workload())["spec"]["containers"][0]
    env = env_of(trainer)
    assert env["FI_PROVIDER"] == "efa" and "FI_EFA_USE_DEVICE_RDMA" not in env
    assert trainer["resources"]["requests"]["memory"] == "672Gi"
    assert trainer["resources"]["requests"]["cpu"] == "180"
    with pytest.raises(SpecError, match="2 EFA devices per node: g5.48xlarge has at most 1"):
        commands.prepare(gpu_spec("g5.48xlarge", efa=2))


def test_hyperpod_instance_names_are_understood() -> None:
    m = EksBackend().manifests(gpu_spec("ml.p5.48xlarge"))
    pod = pod_of(m.workload())["spec"]
    # the node label, as given
    assert pod["nodeSelector"] == {"node.kubernetes.io/instance-type": "ml.p5.48xlarge"}
    # only on nodes HyperPod's health checks report Schedulable (ml. names, or --hyperpod with another)
    health = {"key": "sagemaker.amazonaws.com/node-health-status", "operator": "In",
              "values": ["Schedulable"]}
    healthy = {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
        {"matchExpressions": [health]}]}}
    assert pod["affinity"]["nodeAffinity"] == healthy
    flagged = pod_of(EksBackend().manifests(gpu_spec(None, efa=0, **{"eks.hyperpod": True})).workload())
    assert flagged["spec"]["affinity"]["nodeAffinity"] == healthy
    assert "nodeAffinity" not in pod_of(EksBackend().manifests(gpu_spec()).workload())["spec"]["affinity"]
    assert env_of(pod["containers"][0])["FI_EFA_USE_DEVICE_RDMA"] == "1"
    assert pod["containers"][0]["resources"]["requests"]["memory"] == "1792Gi"
    with pytest.raises(SpecError, match="32 EFA devices per node: ml.p4d.24xlarge has at most 4"):
        commands.prepare(gpu_spec("ml.p4d.24xlarge"))
    g6 = pod_of(EksBackend().manifests(gpu_spec("ml.g6.48xlarge", efa=1)).workload())["spec"]
    assert "FI_EFA_USE_DEVICE_RDMA" not in env_of(g6["containers"][0])


@pytest.mark.parametrize("kind", ["job", "jobset"])
def test_kubernetes_1_28_gets_what_it_runs(kind: str) -> None:
    """1.28 drops backoffLimitPerIndex and podReplacementPolicy (alpha there): one retry budget for the
    job instead; the pod failure policy (beta from 1.26) stays, in the form 1.28's schema requires."""
    spec = gpu_spec(kind=kind, **{"eks.k8s_version": "1.28"})
    m = EksBackend().manifests(spec)   # validated against 1.28's schemas
    workload = m.workload()
    job = workload["spec"] if kind == "job" else workload["spec"]["replicatedJobs"][0]["template"]["spec"]
    assert not {"backoffLimitPerIndex", "podReplacementPolicy", "maxFailedIndexes"} & set(job)
    assert job["backoffLimit"] == (2 if kind == "job" else 0)
    assert job["podFailurePolicy"]["rules"][0] == {
        "action": "FailJob", "onPodConditions": [],
        "onExitCodes": {"operator": "In", "values": [CONFIG_ERROR]}}
    old = EksBackend().manifests(gpu_spec(kind=kind, **{"eks.k8s_version": "1.25"})).workload()
    old_job = old["spec"] if kind == "job" else old["spec"]["replicatedJobs"][0]["template"]["spec"]
    assert "podFailurePolicy" not in old_job   # alpha in 1.25: off


def test_memory_must_hold_shm_and_eight_gib_per_gpu_rank() -> None:
    with pytest.raises(SpecError) as e:
        commands.prepare(gpu_spec(**{"eks.memory": "12Gi", "eks.shm_size": "10Gi"}))
    assert "plus 8Gi for each of the 8 ranks" in e.value.problem and "--memory 74Gi" in e.value.fix
    EksBackend().manifests(gpu_spec(**{"eks.memory": "74Gi", "eks.shm_size": "10Gi"}))
    with pytest.raises(SpecError, match="more than a p5.48xlarge has"):
        commands.prepare(gpu_spec(**{"eks.memory": "3000Gi"}))
    with pytest.raises(SpecError, match="a g5.48xlarge pod cannot hold the 640Gi /dev/shm plus 8Gi for each"):
        commands.prepare(gpu_spec("g5.48xlarge", efa=1, **{"eks.shm_size": "640Gi"}))
    # unknown instance type: the floor plus /dev/shm, requested and limited
    trainer = pod_of(EksBackend().manifests(gpu_spec(None, efa=0)).workload())["spec"]["containers"][0]
    shm = sizing.quantity(sizing.shm_size(gpu_spec(None, efa=0)), "")
    assert sizing.quantity(trainer["resources"]["limits"]["memory"], "") >= shm + 64 * sizing.GiB
    assert trainer["resources"]["requests"]["cpu"] == "9"


def test_a_scripts_shm_follows_the_pod_memory(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text("pass\n")
    sized = {spec_changes: sizing.shm_size(gpu_spec(**{"script": str(script), **dict(spec_changes)}))
             for spec_changes in ((), (("eks.instance_type", None), ("eks.efa_per_node", 0)),
                                  (("eks.memory", "400Gi"),))}
    assert list(sized.values()) == ["448Gi", "64Gi", "100Gi"]
    EksBackend().manifests(gpu_spec(script=str(script)))   # and the pod holds it


def _efa_pod(tmp_path: Path) -> LocalPod:
    return _pod(tmp_path, gpu_spec("p4d.24xlarge", efa=4, nnodes=1))


def _pod(tmp_path: Path, spec: JobSpec) -> LocalPod:
    m = EksBackend().manifests(spec)
    config = m.job[0]["data"]
    return LocalPod(pod_of(m.workload()), "llm-0", tmp_path, config, {names.COMPLETION_INDEX: "0",
                                                                      names.INDEX_FAILURES: "0"})


def test_prepare_refuses_an_efa_pod_without_the_provider_or_the_plugin(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The rendered `prepare` of a p4d pod, run with its environment on this machine (no EFA here):
    one line and the configuration-error exit code, which the pod failure policy turns into a failed job.
    The EFA check comes before doctor's gate (it needs no torch): an image without EFA is said first."""
    pod = _efa_pod(tmp_path)
    assert pod.env("prepare")["FI_PROVIDER"] == "efa"
    done = pod.run("prepare", timeout=120)
    assert done.returncode == CONFIG_ERROR, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "libfabric (the EFA provider) is not installed" in lines[0]
    assert "--efa-per-node 0" in lines[0]
    # libfabric there, but a provider that does not answer: fi_info's own words
    bin_dir, lib_dir = tmp_path / "bin", tmp_path / "lib"
    bin_dir.mkdir()
    lib_dir.mkdir()
    fi_info = bin_dir / "fi_info"
    fi_info.write_text("#!/bin/sh\necho 'fi_getinfo: -61 (No data available)' >&2\nexit 1\n")
    fi_info.chmod(fi_info.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")   # the image's PATH
    done = pod.run("prepare", timeout=120)
    assert done.returncode == CONFIG_ERROR and "fi_getinfo: -61 (No data available)" in done.stderr
    # the provider answers, aws-ofi-nccl is missing: NCCL would use TCP
    fi_info.write_text("#!/bin/sh\necho 'provider: efa'\n")
    done = pod.run("prepare", timeout=120)
    assert done.returncode == CONFIG_ERROR and "aws-ofi-nccl (libnccl-net*.so" in done.stderr
    (lib_dir / "libnccl-net-ofi.so").write_bytes(b"")
    monkeypatch.setenv("LD_LIBRARY_PATH", str(lib_dir))
    # EFA is ready: what stops this pod now is the next gate, doctor's (this machine has no GPU, as a p4d
    # pod's image with a CPU build of torch would not), in its own one line and nothing about EFA
    done = pod.run("prepare", timeout=120)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == CONFIG_ERROR and len(lines) == 1, done.stderr
    assert lines[0].startswith("eksft: error: the spec asks for GPUs but torch sees none here"), lines
    assert "EFA" not in lines[0] and "ready" not in done.stdout


def _plugin(folder: Path, name: str, symbol: str | None = "ncclNetPlugin_v8") -> None:
    """A shared library named ``name`` in ``folder`` exporting ``symbol`` (an NCCL net plugin's entry)."""
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        pytest.skip("needs a C compiler to build a stand-in NCCL plugin (apt-get install gcc)")
    folder.mkdir(parents=True, exist_ok=True)
    source = folder / "plugin.c"
    source.write_text(f"const int {symbol or 'somethingElse'} = 1;\n")
    subprocess.run([compiler, "-shared", "-fPIC", "-o", str(folder / name), str(source)], check=True)


def test_the_trainer_checks_what_nccl_loads_not_a_file(tmp_path: Path) -> None:
    """On an EFA pod the trainer's entry asks, in the trainer container, what NCCL would dlopen as its network
    plugin (NCCL_NET_PLUGIN's name, else libnccl-net.so, through the loader's own search): none fails the pod
    in one line (its termination message) before ft_launcher starts; an aws-ofi-nccl that installs only
    libnccl-net-ofi.so gets NCCL_NET_PLUGIN=ofi."""
    pod = _efa_pod(tmp_path)
    done = pod.run("trainer", timeout=120)
    assert done.returncode == CONFIG_ERROR, done.stderr[-2000:]
    message = pod.termination_log("trainer").read_text()
    assert message.startswith("this pod has EFA devices, but NCCL would load no network plugin "
                              "(libnccl-net.so")
    assert "LD_LIBRARY_PATH" in message and "\n" not in message and "ft_launcher" not in done.stderr
    env = {"PATH": os.environ["PATH"], **{k: os.environ[k] for k in ("PYTHONPATH",) if k in os.environ}}
    _plugin(tmp_path / "ofi", "libnccl-net-ofi.so")
    ofi = {**env, "LD_LIBRARY_PATH": str(tmp_path / "ofi")}
    assert efa.check_in_child(ofi) == ({"NCCL_NET_PLUGIN": "ofi"}, None)
    _plugin(tmp_path / "both", "libnccl-net.so")
    assert efa.check_in_child({**env, "LD_LIBRARY_PATH": str(tmp_path / "both")}) == ({}, None)
    _plugin(tmp_path / "fake", "libnccl-net.so", symbol=None)
    fix, problem = efa.check_in_child({**env, "LD_LIBRARY_PATH": str(tmp_path / "fake")})
    assert fix == {} and "libnccl-net.so exports no ncclNetPlugin_vN: it is not an NCCL net plugin" in problem
    assert efa.check_in_child({**env, "NCCL_NET_PLUGIN": "none"})[1].startswith("NCCL_NET_PLUGIN=none")


def test_efa_is_on_by_default_where_the_instance_has_it() -> None:
    """--instance-type p5.48xlarge alone renders its 32 EFA devices (a socket fallback is then the stream's
    warning); --efa-per-node N asks for EFA (NCCL may use aws-ofi-nccl only: a fallback fails); 0 is none."""
    def trainer(**changes: object) -> dict:
        spec = gpu_spec(**{"eks.efa_per_node": None, **changes})
        return pod_of(EksBackend().manifests(spec).workload())["spec"]["containers"][0]

    default = trainer()
    assert default["resources"]["limits"]["vpc.amazonaws.com/efa"] == "32"
    assert env_of(default)["FI_PROVIDER"] == "efa" and "NCCL_NET" not in env_of(default)
    assert env_of(trainer(**{"eks.efa_per_node": 32}))["NCCL_NET"] == "AWS Libfabric"
    off = trainer(**{"eks.efa_per_node": 0})
    assert "vpc.amazonaws.com/efa" not in off["resources"]["limits"] and "FI_PROVIDER" not in env_of(off)
    assert env_of(trainer(**{"eks.instance_type": "g6e.48xlarge"}))["FI_PROVIDER"] == "efa"
    assert "FI_PROVIDER" not in env_of(trainer(**{"eks.instance_type": None}))   # unknown: no guess
    assert "FI_PROVIDER" not in env_of(trainer(**{"eks.gpus_per_node": 0, "nproc_per_node": 1,
                                                  "model.preset": "tiny"}))   # CPU pods talk TCP


def test_newer_instance_types_the_pods_root_choice_and_the_release_label() -> None:
    for instance, gpus, efa_devices, rdma in (("g6e.48xlarge", 8, 4, False), ("p6-b200.48xlarge", 8, 8, True),
                                              ("p6e-gb200.36xlarge", 4, 8, True)):
        spec = gpu_spec(instance, efa=None, nproc_per_node=gpus, **{"eks.gpus_per_node": gpus})
        trainer = pod_of(EksBackend().manifests(spec).workload())["spec"]["containers"][0]
        assert trainer["resources"]["limits"]["vpc.amazonaws.com/efa"] == str(efa_devices)
        assert ("FI_EFA_USE_DEVICE_RDMA" in env_of(trainer)) == rdma
    # an image that must run as root: its choice, said (Pod Security "baseline" then, not "restricted")
    root = pod_of(EksBackend().manifests(gpu_spec(**{"eks.run_as_user": 0})).workload())["spec"]
    assert root["securityContext"] == {"seccompProfile": {"type": "RuntimeDefault"}}
    docs = EksBackend().manifests(gpu_spec(**{"eks.prometheus_release": "prom"})).job
    assert next(d for d in docs if d["kind"] == "PodMonitor")["metadata"]["labels"]["release"] == "prom"


def test_prepare_refuses_a_job_folder_it_cannot_write_in_one_line(tmp_path: Path) -> None:
    """A shared volume the pods' user cannot write (root squash, a root-only volume root, a folder an earlier
    job left): one line with the owner, the mode and the fix, as the termination message, not a traceback.
    (Tests run as root, whom permissions do not stop: a file where the folder goes fails the same way.)
    A CPU pod: a GPU pod on this GPU-less machine stops at doctor's gate first (see the EFA test)."""
    pod = _pod(tmp_path, JobSpec(name="llm", backend="eks", nnodes=1, nproc_per_node=2).replace(
        **{"eks.image": IMAGE, "eks.gpus_per_node": 0}))
    volume = pod.mounts["/checkpoints"]
    (volume / "llm").write_text("not a folder")
    done = pod.run("prepare", timeout=120)
    assert done.returncode == CONFIG_ERROR and "Traceback" not in done.stderr, done.stderr
    message = pod.termination_log("prepare").read_text()
    assert message.startswith(f"this pod (uid {os.getuid()} gid {os.getgid()}) cannot write the job folder "
                              "(File exists: "), message
    assert f"{volume / 'llm'} belongs to uid {os.getuid()}" in message and "--run-as-user" in message
