"""EKS manifests: rendered for a matrix of jobs, valid against the real schemas, and invalid specs
rejected before anything is rendered or sent, with a message that names the problem and the fix."""

from __future__ import annotations

import copy

import pytest
import yaml
from jobs import cli

from eksft_nb import commands
from eksft_nb.backends.eks import EksBackend, names, schemas, sizing
from eksft_nb.errors import SpecError
from eksft_nb.backends.eks.render import INPOD
from eksft_nb.launcher import WARM_SHIM, Ports, launcher_argv
from eksft_nb.spec import JobSpec
from eksft_nb.timeouts import derive

IMAGE = "123456789012.dkr.ecr.us-west-2.amazonaws.com/eksft-nb:0.1.0"


def eks_spec(name: str = "demo", nnodes: int = 1, gpus: int = 0, efa: int = 0, kind: str = "job",
             mode: str = "async", **changes: object) -> JobSpec:
    spec = JobSpec(name=name, backend="eks", nnodes=nnodes, nproc_per_node=max(gpus, 1))
    return spec.replace(**{"eks.image": IMAGE, "eks.kind": kind, "eks.gpus_per_node": gpus,
                           "eks.efa_per_node": efa,
                           "checkpoint.mode": mode, "model.preset": "gpt-1b" if gpus else "tiny", **changes})


def pod_template(workload: dict) -> dict:
    spec = workload["spec"]
    if workload["kind"] == "Job":
        return spec["template"]
    if workload["kind"] == "JobSet":
        return spec["replicatedJobs"][0]["template"]["spec"]["template"]
    return spec["pytorchReplicaSpecs"]["Master"]["template"]


MATRIX = [(1, 0, 0), (2, 8, 0), (2, 8, 4), (16, 8, 0), (16, 8, 32)]   # (nodes, GPUs per node, EFA per node)


@pytest.mark.parametrize("kind", ["job", "jobset", "pytorchjob"])
@pytest.mark.parametrize("nnodes,gpus,efa", MATRIX)
@pytest.mark.parametrize("mode", ["async", "sync"])
def test_matrix_renders_valid_manifests(kind: str, nnodes: int, gpus: int, efa: int, mode: str) -> None:
    spec = eks_spec(nnodes=nnodes, gpus=gpus, efa=efa, kind=kind, mode=mode)
    text = EksBackend().render(spec)
    docs = [d for d in yaml.safe_load_all(text) if d]
    for doc in docs:  # what `kubectl apply -f` would send, re-validated after the YAML round trip
        schemas.validate(doc, spec.eks.k8s_version)
    kinds = [d["kind"] for d in docs]
    workload = docs[-1]
    assert kinds[:3] == ["ServiceAccount", "Role", "RoleBinding"]
    assert workload["kind"] == {"job": "Job", "jobset": "JobSet", "pytorchjob": "PyTorchJob"}[kind]
    assert ("Service" in kinds) == (kind == "job")

    pod = pod_template(workload)["spec"]
    trainer = pod["containers"][0]
    env = {e["name"]: e.get("value", e.get("valueFrom")) for e in trainer["env"]}
    # the local launch line, with node 0's stable DNS name: no shell, no sleep, no DNS polling
    node_rank = "$(RANK)" if kind == "pytorchjob" else "$(EKSFT_NODE_RANK)"
    # the rendezvous waits for pods that are still being scheduled (--rdzv-join-timeout); a SIGTERMed pod's
    # launcher gives its ranks the grace period to save (a drain), on CPU pods too
    grace = derive(spec).grace.seconds
    line = launcher_argv(spec, node_rank=node_rank, rdzv_host=names.rank0_host(spec),
                         ports=Ports.from_base(29500), rdzv_id="demo", rdzv_conf={"join_timeout": "1800"})
    assert "--rdzv-conf=join_timeout=1800" in line and f"--term-timeout={grace:g}" in line
    # the in-pod entry runs that very line and ends the pod as its ranks did (a drain is no success); with
    # warm ranks (the default) it starts the pod's zygote first and makes the image's shim the launcher's
    # worker: the shim's path is the container's, so this machine's is nowhere
    assert trainer["command"] == INPOD + ["launch"] and trainer["args"] == line and line[0] == "ft_launcher"
    assert WARM_SHIM not in text and "sleep" not in text and "getent" not in text
    cold = pod_template(EksBackend().manifests(spec.replace(**{"ft.warm_ranks": False})).workload())["spec"]
    assert cold["containers"][0]["command"] == INPOD + ["launch"] and cold["containers"][0]["args"] == line
    if kind != "pytorchjob":
        assert names.rank0_host(spec) == f"{names.pod_host(spec, 0)}.demo.default.svc.cluster.local"
        assert env["EKSFT_NODE_RANK"]["fieldRef"]["fieldPath"].endswith(
            "['batch.kubernetes.io/job-completion-index']")
    assert env["EKSFT_EVENTS_STDOUT"] == "1" and env["EKSFT_JOB_DIR"] == "/checkpoints/demo"
    # devices, NCCL/EFA, shared memory and the checkpoint volume
    limits = trainer.get("resources", {}).get("limits", {})
    assert int(limits.get("nvidia.com/gpu", 0)) == gpus and int(limits.get("vpc.amazonaws.com/efa", 0)) == efa
    assert ("NCCL_SOCKET_IFNAME" in env) == bool(gpus) and (env.get("FI_PROVIDER") == "efa") == bool(efa)
    assert "IPC_LOCK" not in text   # Pod Security "baseline" refuses it
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["shm"]["emptyDir"] == {"medium": "Memory", "sizeLimit": sizing.default_shm(spec)}
    assert volumes["checkpoints"]["persistentVolumeClaim"]["claimName"] == "fsx-claim"
    assert pod["automountServiceAccountToken"] is False and pod["shareProcessNamespace"] is True
    assert pod["initContainers"][0]["command"][-1] == "prepare"


def test_job_pods_find_node_0_through_the_headless_service() -> None:
    docs = EksBackend().manifests(eks_spec(nnodes=4, gpus=8, efa=4)).job
    service, job = next(d for d in docs if d["kind"] == "Service"), docs[-1]
    pod = job["spec"]["template"]
    assert service["spec"]["clusterIP"] == "None" and service["spec"]["publishNotReadyAddresses"] is True
    assert service["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    assert pod["spec"]["subdomain"] == service["metadata"]["name"] == "demo"
    assert job["spec"]["completionMode"] == "Indexed" and job["spec"]["completions"] == job["spec"][
        "parallelism"] == 4
    assert job["spec"]["backoffLimitPerIndex"] == 2 and job["spec"]["maxFailedIndexes"] == 0


def test_shm_is_sized_for_checkpoint_staging() -> None:
    big, small = eks_spec(nnodes=2, gpus=8), eks_spec(nnodes=16, gpus=8)
    # gpt-1b: 12 bytes per parameter of model + AdamW state, split over the nodes, 50% headroom, +1 GiB
    assert sizing.quantity(sizing.default_shm(big), "") >= 1.5 * 12 * big.model.n_params() / 2
    assert sizing.quantity(sizing.default_shm(big), "") > sizing.quantity(sizing.default_shm(small), "")
    assert sizing.default_shm(eks_spec()) == "1Gi"
    assert sizing.shm_size(eks_spec(**{"eks.shm_size": "64Gi"})) == "64Gi"


def test_control_plane_role_grants_only_what_it_calls() -> None:
    def grants_for(spec: JobSpec) -> dict[tuple[str, str], set[str]]:
        role = next(d for d in EksBackend().manifests(spec).admin if d["kind"] == "Role")
        return {(g, r): set(rule["verbs"]) for rule in role["rules"]
                for g in rule["apiGroups"] for r in rule["resources"]}

    grants = grants_for(eks_spec(kind="jobset"))
    assert grants == {
        ("jobset.x-k8s.io", "jobsets"): {"get", "create", "delete"},
        ("", "configmaps"): {"get", "list", "create", "delete"},
        ("", "services"): {"get", "create", "delete"},
        ("", "pods"): {"list", "watch", "delete"},
        ("", "pods/log"): {"get"},
        ("", "pods/exec"): {"get", "create"},
        ("", "events"): {"list"},
        ("", "persistentvolumeclaims"): {"get"},
        ("monitoring.coreos.com", "podmonitors"): {"get", "create", "delete"},
        ("networking.k8s.io", "networkpolicies"): {"get", "create", "delete"},
        ("policy", "poddisruptionbudgets"): {"get", "create", "delete"},
    }
    # a queued job's state reads Kueue's Workloads
    assert grants_for(eks_spec(kind="jobset", **{"eks.queue": "gpus"})) == {
        **grants, ("kueue.x-k8s.io", "workloads"): {"list"}}


def test_fsx_storage_class_and_claim() -> None:
    spec = eks_spec(**{"eks.create_pvc": True, "eks.fsx_subnet": "subnet-0abc",
                       "eks.fsx_security_groups": "sg-1",
                       "eks.storage_size": "2400Gi"})
    m = EksBackend().manifests(spec)
    sc = next(d for d in m.admin if d["kind"] == "StorageClass")
    pvc = m.job[0]
    assert sc["provisioner"] == "fsx.csi.aws.com" and sc["parameters"]["subnetId"] == "subnet-0abc"
    # the throughput the timeouts assume (--storage-mbps 300): the least tier that delivers it at the size
    assert sc["parameters"]["perUnitStorageThroughput"] == "125"   # 2.4 TiB x 125 = 300 MB/s
    tier = {(size, mbps): next(d for d in EksBackend().manifests(spec.replace(**{
        "eks.storage_size": size, "checkpoint.storage_mbps": mbps})).admin
        if d["kind"] == "StorageClass")["parameters"]["perUnitStorageThroughput"]
        for size, mbps in (("1200Gi", 300.0), ("1200Gi", 301.0), ("1200Gi", 1200.0), ("4800Gi", 1200.0))}
    assert tier == {("1200Gi", 300.0): "250", ("1200Gi", 301.0): "500", ("1200Gi", 1200.0): "1000",
                    ("4800Gi", 1200.0): "250"}
    chosen = EksBackend().manifests(spec.replace(**{"eks.fsx_throughput": 1000})).admin
    assert next(d for d in chosen if d["kind"] == "StorageClass")["parameters"][
        "perUnitStorageThroughput"] == "1000"
    assert pvc["kind"] == "PersistentVolumeClaim" and pvc["spec"]["accessModes"] == ["ReadWriteMany"]
    assert pvc["spec"]["storageClassName"] == "fsx-sc" and pvc["spec"]["resources"]["requests"][
        "storage"] == "2400Gi"


def test_a_cell_script_travels_in_the_config_map(tmp_path) -> None:
    script = tmp_path / "cell 1.py"
    script.write_text("print('hello from the cell')\n")
    spec = eks_spec(script=str(script), script_args=["--lr", "0.1"])
    config, job = EksBackend().manifests(spec).job[0], EksBackend().manifests(spec).job[-1]
    assert config["data"]["cell_1.py"] == script.read_text()
    assert JobSpec.from_json(config["data"]["spec.json"]).script == "/etc/eksft/cell_1.py"
    assert JobSpec.from_json(config["data"]["submitted-spec.json"]) == spec
    assert job["spec"]["template"]["spec"]["containers"][0]["args"][-4:] == ["eksft_nb.runtime.script",
                                                                             "/etc/eksft/cell_1.py", "--lr",
                                                                             "0.1"]


def test_schemas_reject_what_the_api_server_would() -> None:
    m = EksBackend().manifests(eks_spec(kind="jobset", nnodes=2, gpus=8))
    jobset = copy.deepcopy(m.workload())
    jobset["spec"]["replicatedJobs"][0]["replcas"] = 1  # a typo: the CRD declares no such field
    with pytest.raises(SpecError, match=r"JobSet 'demo'.*replicatedJobs\[0\].*replcas"):
        schemas.validate(jobset, "1.33")
    pytorch = EksBackend().manifests(eks_spec(kind="pytorchjob")).workload()
    pytorch["spec"]["runPolicy"]["backoffLimit"] = "two"
    with pytest.raises(SpecError, match=r"runPolicy\.backoffLimit.*'two'"):
        schemas.validate(pytorch, "1.33")
    job = copy.deepcopy(m.job[0])
    job["data"]["x"] = 3  # ConfigMap data must be strings
    with pytest.raises(SpecError, match=r"ConfigMap 'demo'.*data\.x"):
        schemas.validate(job, "1.33")


def test_kubernetes_version_is_selectable() -> None:
    spec = eks_spec()
    EksBackend().render(spec.replace(**{"eks.k8s_version": "1.37"}))
    # what a version lacks is not rendered (tests/test_eks_gpu_cluster.py); the schemas still refuse it:
    # Job.spec.backoffLimitPerIndex does not exist before 1.28
    job = EksBackend().manifests(spec.replace(**{"eks.k8s_version": "1.27"})).workload()
    job["spec"]["backoffLimitPerIndex"] = 2
    with pytest.raises(SpecError, match=r"invalid for Kubernetes 1\.27: spec: Additional properties"):
        schemas.validate(job, "1.27")


LONG = "a" * 55
INVALID = [
    ({"eks.gpus_per_node": 16, "nproc_per_node": 16}, "16 GPUs per node: an EC2 instance has at most 8",
     "--gpus-per-node 8"),
    ({"eks.gpus_per_node": 8, "nproc_per_node": 8, "eks.efa_per_node": 32,
      "eks.instance_type": "p4d.24xlarge"},
     "32 EFA devices per node: p4d.24xlarge has at most 4", "--efa-per-node 4"),
    ({"eks.gpus_per_node": 4, "nproc_per_node": 8}, "8 ranks per node but only 4 GPUs", "--nproc-per-node 4"),
    ({"eks.efa_per_node": 2}, "EFA devices are only used by NCCL", "--efa-per-node 0"),
    ({"name": LONG, "eks.kind": "jobset", "nnodes": 16}, "too long for --kind jobset",
     "at most 53 characters"),
    ({"eks.checkpoint_pvc": ""}, "no checkpoint PVC name", "--pvc NAME"),
    ({"eks.image": ""}, "container image '' is missing", "--image REGISTRY/REPO:TAG"),
    ({"eks.memory": "2Gi", "eks.shm_size": "8Gi"}, "does not cover the 8Gi memory-backed /dev/shm",
     "--memory 9Gi"),
    ({"eks.cpu": "lots"}, "--cpu 'lots' is not a Kubernetes quantity", "--cpu 4 (or 500m)"),
    ({"eks.create_pvc": True}, "needs a subnet and security groups", "--fsx-subnet"),
    ({"eks.create_pvc": True, "eks.storage_size": "1000Gi", "eks.fsx_subnet": "s",
      "eks.fsx_security_groups": "g"},
     "FSx for Lustre cannot be 1000Gi", "--storage-size 1200Gi"),
    ({"checkpoint.dir": "/tmp/ckpt"}, "not on the shared volume", "under /checkpoints"),
    ({"resume": "/home/me/ckpt/step_00000010"}, "not on the shared volume the pods mount",
     "under /checkpoints"),
    ({"script": "/nonexistent/train.py"}, "does not exist", "--script"),
    ({"eks.k8s_version": "2.0"}, "cannot validate for Kubernetes '2.0'", "--k8s-version 1.25 to 1.37"),
    ({"eks.namespace": "Team_A"}, "namespace 'Team_A' is not a DNS-1123 label", "--namespace"),
    ({"eks.port": 70000}, "out of range", "--rdzv-port"),
    ({"name": "x" * 64}, "invalid job name", "--name"),
    ({"eks.kind": "deployment"}, "unknown EKS workload kind", "--kind job"),
    ({"eks.instance_type": "trn1.32xlarge", "eks.gpus_per_node": 8, "nproc_per_node": 8},
     "trn1.32xlarge has no NVIDIA GPUs", "p5.48xlarge"),
    ({"eks.instance_type": "ml.trn2.48xlarge"}, "ml.trn2.48xlarge has no NVIDIA GPUs", "NVIDIA GPU instance"),
    ({"eks.image": "repo/eksft:latest"}, "is tagged :latest", "--allow-latest-image"),
    ({"eks.run_as_user": -1}, "--run-as-user -1 is not a user id", "--run-as-user 1000"),
    ({"eks.join_timeout": 5}, "too short for a pod to be scheduled", "--rdzv-join-timeout 60"),
    ({"eks.prometheus_release": "kube prometheus"}, "is not a label value", "--prometheus-release"),
    ({"eks.create_pvc": True, "eks.fsx_subnet": "s", "eks.fsx_security_groups": "g",
      "eks.fsx_throughput": 300},
     "--fsx-throughput 300 is not an FSx for Lustre tier", "125 / 250 / 500 / 1000"),
    ({"eks.create_pvc": True, "eks.fsx_subnet": "s", "eks.fsx_security_groups": "g",
      "eks.fsx_throughput": 125},
     "at 125 MB/s per TiB delivers 150 MB/s, less than the 300 MB/s", "--fsx-throughput 250"),
    ({"eks.create_pvc": True, "eks.fsx_subnet": "s", "eks.fsx_security_groups": "g",
      "checkpoint.storage_mbps": 5000.0}, "delivers at most 1200 MB/s", "--storage-size 7200Gi"),
]


@pytest.mark.parametrize("changes,problem,fix", INVALID, ids=[p for _, p, _ in INVALID])
def test_invalid_specs_fail_with_problem_and_fix(changes: dict, problem: str, fix: str) -> None:
    with pytest.raises(SpecError) as e:
        commands.dry_run(eks_spec(**changes))   # the command layer checks, once; the backend asserts
    message = str(e.value)
    assert problem in message and fix in e.value.fix and "\n" not in message


def test_cli_dry_run_prints_the_manifests() -> None:
    done = cli("run", "--backend", "eks", "--dry-run", "--name", "llm", "--image", IMAGE, "--kind", "jobset",
                   "--nnodes", "2", "--nproc-per-node", "8", "--gpus-per-node", "8", "--efa-per-node", "4",
                   "--model", "gpt-1b", "--namespace", "training", timeout=120)
    assert done.returncode == 0, done.stderr
    docs = [d for d in yaml.safe_load_all(done.stdout) if d]
    assert [d["kind"] for d in docs] == ["ServiceAccount", "Role", "RoleBinding", "ConfigMap",
                                         "NetworkPolicy", "PodMonitor", "PodDisruptionBudget",
                                        "JobSet"]
    assert all(d["metadata"]["namespace"] == "training" for d in docs)
    assert "# warning: image" not in done.stdout   # tagged
    untagged = cli("run", "--backend", "eks", "--dry-run", "--name", "llm", "--image", "repo/eksft",
                   "--gpus-per-node", "0", "--nproc-per-node", "1", timeout=120)
    warned = "# warning: image repo/eksft has no tag, so the nodes pull :latest"
    assert untagged.returncode == 0 and warned in untagged.stdout
    bad = cli("run", "--backend", "eks", "--dry-run", "--image", IMAGE, "--gpus-per-node", "12", timeout=120)
    assert bad.returncode == 2 and bad.stderr.startswith(
        "eksft: error: 12 GPUs per node") and bad.stdout == ""


@pytest.mark.parametrize("kind", ["job", "jobset", "pytorchjob"])
def test_script_args_reach_the_pod_literally(kind: str, tmp_path) -> None:
    """The kubelet expands $(VAR) in args (tests/eks_pods.py does it as the kubelet does), then the
    launcher substitutes ${local_rank} in its workers' args (string.Template, as torch's launcher
    does): user text survives both, and only the launcher's own node-rank reference is expanded."""
    from string import Template

    from eks_pods import LocalPod

    script = tmp_path / "train.py"
    script.write_text("pass\n")
    tricky = ["$(HOME)", "$$", "a$b$", "$(EKSFT_JOB)", "--x=$(EKSFT_NODE_RANK)", "$$(X)", "$",
              "${local_rank}"]
    spec = eks_spec(kind=kind, nnodes=2, script=str(script), script_args=tricky)
    m = EksBackend().manifests(spec)
    template = pod_template(m.workload())
    config = m.job[0]["data"]
    pod = LocalPod(template, "demo-1", tmp_path, config,
                   {names.COMPLETION_INDEX: "1", names.INDEX_FAILURES: "0",
                                                         names.JOBSET_RESTARTS: "0"})
    argv = pod.argv(names.container(spec))
    assert [Template(a).safe_substitute(local_rank="0") for a in argv[-len(tricky):]] == tricky
    node_rank = next(a for a in argv if a.startswith("--node-rank="))
    # RANK: the operator's
    assert node_rank == ("--node-rank=$(RANK)" if kind == "pytorchjob" else "--node-rank=1")


@pytest.mark.parametrize("kind", ["job", "jobset", "pytorchjob"])
def test_pods_carry_the_jobs_lineage_id(kind: str) -> None:
    """Every pod of one workload (and of its restarts) names the same run in its commits: the launch's
    id, kept in the job's record (its ConfigMap), new for every launch, even of the same name and spec
    (issue 18, finding 6): a relaunch then never takes an earlier launch's checkpoints for its own."""
    def run_of(spec: JobSpec) -> str:
        docs = [d for d in yaml.safe_load_all(EksBackend().render(spec)) if d]
        record = next(d for d in docs if d["kind"] == "ConfigMap")
        template = pod_template(docs[-1])["spec"]
        for c in template["containers"] + template["initContainers"][:1]:
            ref = next(e["valueFrom"]["configMapKeyRef"] for e in c["env"] if e["name"] == "EKSFT_JOB_UID")
            assert ref["name"] == record["metadata"]["name"]
        return record["data"][ref["key"]]

    first = run_of(eks_spec(kind=kind))
    assert len(first) == 16 and first != run_of(eks_spec(kind=kind))
