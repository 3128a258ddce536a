"""EKS: the Prometheus PodMonitor and the pods' metrics sidecar, and Kueue (``--queue``/``--priority``):
the rendered contract, validated against the CRDs, and the queued/admitted lifecycle read from the
Workload's conditions, through the real client against kmock's emulator (tests play Kueue)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from eks_kube import Controllers, Kube
from eks_pods import LocalPod
from jobs import free_port, scrape, wait_for
from kubernetes.client.rest import ApiException
from test_eks_lifecycle import NS, backend, ctl, eks_spec, kube  # noqa: F401 (the fixtures)
from test_eks_lifecycle import line, rank_start, steps

from eksft_nb import cli, commands
from eksft_nb.backends.eks import EksBackend, names
from eksft_nb.backends.eks.render import render
from eksft_nb.errors import SpecError
from eksft_nb.events import make
from eksft_nb.job import Job
from eksft_nb.runtime.drain import DRAIN_EXIT

KUEUE = ("kueue.x-k8s.io", "v1beta1")
GPU = {"eks.gpus_per_node": 8, "nproc_per_node": 8, "eks.efa_per_node": 32, "model.preset": "gpt-1b"}


def template(workload: dict) -> dict:
    spec = workload["spec"]
    return spec["template"] if "template" in spec else (
        spec["replicatedJobs"][0]["template"]["spec"]["template"] if "replicatedJobs" in spec
        else spec["pytorchReplicaSpecs"]["Master"]["template"])


# ---- Prometheus ----------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["job", "jobset", "pytorchjob"])
def test_the_pod_monitor_selects_the_pods_on_the_port_they_serve(kind: str) -> None:
    m = EksBackend().manifests(eks_spec(**{"eks.kind": kind}))   # validated, the PodMonitor against its CRD
    monitor = next(d for d in m.job if d["kind"] == "PodMonitor")
    pod = template(m.workload())
    assert monitor["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    assert monitor["spec"]["namespaceSelector"] == {"matchNames": [NS]}
    endpoint, = monitor["spec"]["podMetricsEndpoints"]
    assert endpoint["honorLabels"] is True   # the exporter's job label is the job's name
    # each series names its pod's node as dcgm-exporter does: the dashboard joins the GPUs of the job's nodes
    assert endpoint["relabelings"] == [{"sourceLabels": ["__meta_kubernetes_pod_node_name"],
                                        "targetLabel": "Hostname",
                                        "action": "replace"}]
    sidecar = next(c for c in pod["spec"]["initContainers"] if c["name"] == names.METRICS)
    assert sidecar["restartPolicy"] == "Always"   # a native sidecar: it ends with the trainer
    assert [p["name"] for p in sidecar["ports"]] == [endpoint["port"]]
    # before native sidecars (Kubernetes 1.29) nothing is added that could hold the pod in its init phase
    old = EksBackend().manifests(eks_spec(**{"eks.kind": kind, "eks.k8s_version": "1.28"}) if kind != "job"
                                 else eks_spec(**{"eks.k8s_version": "1.28"}))
    assert "PodMonitor" not in [d["kind"] for d in old.job]
    assert [c["name"] for c in template(old.workload())["spec"]["initContainers"]] == ["prepare"]


def test_the_metrics_sidecar_serves_the_jobs_folder(tmp_path: Path) -> None:
    """The sidecar's rendered command, run as the kubelet would after the pod's `prepare`, serves what
    the ranks wrote to the job folder on the shared volume."""
    spec = eks_spec()
    m = render(spec)
    pod = LocalPod(template(m.workload()), "demo-0", tmp_path, m.job[0]["data"],
                   {names.COMPLETION_INDEX: "0", names.INDEX_FAILURES: "0"})
    assert pod.run("prepare", timeout=60).returncode == 0
    events = pod.mounts[names.CKPT_MOUNT] / spec.name / "events.jsonl"
    lines = [make("rank_start", "demo", 0, pid=1, host="demo-0", job_attempt=0, injob_restart=0,
                  inprocess_iteration=0,
                  world_size=2, start_step=0)]
    lines += [make("step", "demo", 0, step=s, loss=5.0 - 0.1 * s, tokens=1024,
                   step_time=0.5) for s in range(1, 9)]
    lines += [make("checkpoint", "demo", 0, phase="committed", step=8, blocked_s=0.1)]
    events.write_text("".join(e.to_json() + "\n" for e in lines))
    argv = pod.argv(names.METRICS)
    assert argv[argv.index("--port") + 1] == str(names.METRICS_PORT)
    port = free_port()   # the pod has a network of its own; here the port must be a free one
    argv[argv.index("--port") + 1] = str(port)
    samples = scrape(port,
                     subprocess.Popen(pod._argv(names.METRICS, argv), env=pod.process_env(names.METRICS),
                                            cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE))
    assert samples[("eksft_step", (("job", "demo"),))] == 8
    assert samples[("eksft_last_checkpoint_step", (("job", "demo"),))] == 8
    assert samples[("eksft_steps_per_second", (("job", "demo"),))] == 2.0


# ---- Kueue: the rendered contract ------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["job", "jobset", "pytorchjob"])
def test_a_queued_workload_carries_kueues_contract(kind: str) -> None:
    spec = eks_spec(**{"eks.kind": kind, "eks.queue": "gpus", "eks.priority": "high"})
    workload = EksBackend().manifests(spec).workload()   # validated against the Job schema or the CRD
    labels = workload["metadata"]["labels"]
    assert labels[names.QUEUE_LABEL] == "gpus" and labels[names.PRIORITY_LABEL] == "high"
    suspend = workload["spec"]["runPolicy"]["suspend"] if kind == "pytorchjob" else workload["spec"][
        "suspend"]
    assert suspend is True
    # only the workload is queued, and without --queue nothing of Kueue is rendered
    others = EksBackend().manifests(spec).job[:-1]
    assert all(names.QUEUE_LABEL not in d["metadata"]["labels"] for d in others)
    plain = EksBackend().manifests(eks_spec(**{"eks.kind": kind})).workload()
    assert names.QUEUE_LABEL not in plain["metadata"]["labels"] and "suspend" not in str(plain["spec"])


@pytest.mark.parametrize("instance,flavors",
                         [("p5.48xlarge", ["p5-48xlarge"]), ("p4d.24xlarge", ["p4d-24xlarge"]),
                                              (None, ["p5-48xlarge", "p4d-24xlarge"])])
def test_the_dry_run_prints_matching_queue_objects(instance: str | None, flavors: list[str],
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    import yaml

    args = ["run", "--backend", "eks", "--dry-run", "--kueue-objects", "--name", "llm", "--image", "img:1",
            "--nnodes", "2", "--nproc-per-node", "8", "--gpus-per-node", "8", "--efa-per-node", "4",
            "--model",
            "gpt-1b", "--namespace", "training", "--queue", "gpus", "--priority", "high"]
    assert cli.main(args + (["--instance-type", instance] if instance else [])) == 0
    docs = {(d["kind"], d["metadata"]["name"]): d for d in yaml.safe_load_all(capsys.readouterr().out) if d}
    assert [n for k, n in docs if k == "ResourceFlavor"] == flavors   # each validated against its CRD
    local, cluster = docs[("LocalQueue", "gpus")], docs[("ClusterQueue", "gpus")]
    assert local["metadata"]["namespace"] == "training" and local["spec"]["clusterQueue"] == "gpus"
    assert docs[("WorkloadPriorityClass", "high")]["value"] > 0
    group, = cluster["spec"]["resourceGroups"]
    assert group["coveredResources"] == ["cpu", "memory", "nvidia.com/gpu", "vpc.amazonaws.com/efa"]
    quota = {f["name"]: {r["name"]: r["nominalQuota"] for r in f["resources"]} for f in group["flavors"]}
    assert [f["name"] for f in group["flavors"]] == flavors
    assert all(q["nvidia.com/gpu"] == "16" for q in quota.values())   # the job's 2 nodes of 8 GPUs fit
    assert all(q["vpc.amazonaws.com/efa"] == "8" for q in quota.values())   # and their 2 x 4 EFA devices
    workload = docs[("JobSet", "llm")] if ("JobSet", "llm") in docs else docs[("Job", "llm")]
    assert workload["metadata"]["labels"][names.QUEUE_LABEL] == "gpus"


@pytest.mark.parametrize("changes,problem,fix", [
    ({"eks.queue": "GPU_Queue"}, "--queue 'GPU_Queue' is not a Kubernetes name", "--queue gpu-queue"),
    ({"eks.queue": "q", "eks.priority": "x" * 64}, "--priority 'xxxx", "--priority"),
    ({"eks.priority": "high"}, "--priority needs --queue", "add --queue NAME"),
])
def test_bad_queue_options_fail_with_problem_and_fix(changes: dict, problem: str, fix: str) -> None:
    with pytest.raises(SpecError) as e:
        commands.dry_run(eks_spec(**changes))   # the command layer's one check
    assert problem in e.value.problem and fix in e.value.fix


# ---- Kueue: the lifecycle ------------------------------------------------------------------------

def kueue_workload(controllers: Controllers, job: dict, conditions: list[dict],
                   version: str = "v1beta1") -> None:
    """What Kueue does for a queued Job: a Workload it owns, with the conditions of its admission."""
    custom = controllers.custom
    api = (KUEUE[0], version)
    name = f"job-{job['metadata']['name']}-1a2b3"
    body = {"apiVersion": f"kueue.x-k8s.io/{version}", "kind": "Workload",
            "metadata": {"name": name, "namespace": NS,
                         "labels": {"kueue.x-k8s.io/job-uid": job["metadata"]["uid"]},
                         "ownerReferences": [{"apiVersion": "batch/v1", "kind": "Job",
                                              "name": job["metadata"]["name"],
                                              "uid": job["metadata"]["uid"], "controller": True}]},
            "spec": {"queueName": "gpus", "priorityClassName": "high",
                     "priorityClassSource": "kueue.x-k8s.io/workloadpriorityclass",
                     "podSets": [{"name": "main", "count": 2, "template": template(job)}]}}
    try:
        custom.get_namespaced_custom_object(*api, NS, "workloads", name)
    except ApiException:
        custom.create_namespaced_custom_object(*api, NS, "workloads", body)
    custom.patch_namespaced_custom_object_status(*api, NS, "workloads", name, {"status": {"conditions": [
        {"lastTransitionTime": "2026-01-01T00:00:00Z", "observedGeneration": 1, **c} for c in conditions]}})


def test_queued_then_admitted_in_the_cli_and_the_dashboard(kube: Kube, backend: EksBackend, ctl: Controllers,  # noqa: F811
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    from eksft_nb.dashboard import Dashboard

    backend.launch(eks_spec(**{"eks.queue": "gpus", "eks.priority": "high"}))
    job = ctl.custom.get_namespaced_custom_object("batch", "v1", NS, "jobs", "demo")
    assert job["spec"]["suspend"] is True and job["metadata"]["labels"][names.QUEUE_LABEL] == "gpus"
    # a cluster without Kueue: the job would wait forever, and says so
    status = backend.state("demo")
    assert status.state == "starting" and "this cluster has no Kueue (no Workload API)" in status.detail
    kube.emulator.resources["kueue.x-k8s.io/v1beta1/workloads"] = {
        "kind": "Workload", "namespaced": True, "verbs": ["list", "get", "create", "patch"]}
    assert backend.state(
        "demo").detail == "queued: waiting for quota in gpus (Kueue has not taken the workload yet)"
    waiting = ("couldn't assign flavors to pod set main: insufficient quota for nvidia.com/gpu in flavor "
               "p5-48xlarge")
    kueue_workload(ctl, job,
                   [{"type": "QuotaReserved", "status": "False", "reason": "Pending", "message": waiting}])
    queued = f"queued: waiting for quota in gpus ({waiting})"
    assert backend.state("demo") == type(status)("demo", "eks", "starting", queued)

    assert cli.main(["status", "demo", "--backend", "eks"]) == 0
    assert "demo: starting  step 0/" in (out := capsys.readouterr().out) and f"({queued})" in out
    handle = Job("demo", backend)
    dash = Dashboard(handle, live=False)
    assert dash.header.state == "starting" and dash.header.detail == queued
    title = dash.header._title.value
    assert "eksft-detail" in title and "queued: waiting for quota in gpus" in title

    # Kueue admits it (and unsuspends the Job): the Job controller then creates the pods
    kueue_workload(ctl, job,
                   [{"type": "QuotaReserved", "status": "True", "reason": "QuotaReserved", "message": "ok"},
                              {"type": "Admitted", "status": "True", "reason": "Admitted", "message": "ok"}])
    assert backend.state("demo").detail == "admitted"
    ctl.custom.patch_namespaced_custom_object("batch", "v1", NS, "jobs", "demo", {"spec": {"suspend": False}})
    assert backend.state("demo").detail == "admitted; 0 of 2 pods created"
    dash.update()
    assert dash.header.detail == "admitted; 0 of 2 pods created"
    assert cli.main(["status", "demo", "--backend", "eks"]) == 0
    assert "(admitted; 0 of 2 pods created)" in capsys.readouterr().out
    pods = ctl.create_pods("demo")
    for p in pods:
        ctl.run(p)
    assert backend.state("demo").state == "running"
    dash.update()
    assert dash.header.detail == ""
    # preempted: Kueue suspends the Job again (its pods go) and says why on the Workload
    preempted = "Preempted to accommodate a workload (UID: 1) due to prioritization in the ClusterQueue"
    kueue_workload(ctl, job,
                   [{"type": "QuotaReserved", "status": "False", "reason": "Pending", "message": "pending"},
                              {"type": "Admitted", "status": "False", "reason": "NoReservation",
                               "message": "no"},
                              {"type": "Evicted", "status": "True", "reason": "Preempted",
                               "message": preempted}])
    ctl.custom.patch_namespaced_custom_object("batch", "v1", NS, "jobs", "demo", {"spec": {"suspend": True}})
    assert backend.state("demo").detail == f"queued: waiting for quota in gpus ({preempted})"
    # its pods got SIGTERM: the ranks drained at step 3 and every pod exited 138, which is no failure to
    # charge, and no end: the job waits in the queue, and resumes from that save once admitted again
    ctl.log(pods[0], rank_start(0, 40), *steps(1, 3), line("drain", 0, step=3, committed=True))
    ctl.log(pods[1], rank_start(1, 41))
    wait_for("the drain event", lambda: handle.refresh().drain)   # written before the pods exit
    for p in pods:
        ctl.exit(p, DRAIN_EXIT, "Error", "drained on SIGTERM at step 3 (saved and committed)")
    failure = wait_for("the drain", lambda: handle.refresh().failures and handle.monitor.failures[-1])
    assert failure["level"] == "job" and failure["cause"].startswith(
        "drained on SIGTERM at step 3 (saved and committed): pod demo-")
    assert not handle.monitor.finished and handle.state == "starting"
    assert backend.state("demo").detail == f"queued: waiting for quota in gpus ({preempted})"
    kueue_workload(ctl, job,
                   [{"type": "QuotaReserved", "status": "True", "reason": "QuotaReserved", "message": "ok"},
                    {"type": "Admitted", "status": "True", "reason": "Admitted", "message": "ok"}])
    ctl.custom.patch_namespaced_custom_object("batch", "v1", NS, "jobs", "demo", {"spec": {"suspend": False}})
    again = ctl.create_pods("demo", annotations={"batch.kubernetes.io/job-index-ignored-failure-count": "1"})
    for p in again:
        ctl.run(p)
    for rank, pod in ((1, again[1]), (0, again[0])):   # they count the drain: they restart, from its save
        ctl.log(pod, line("rank_start", rank, pid=50 + rank, host=f"demo-{rank}", job_attempt=2,
                          injob_restart=0, inprocess_iteration=0, world_size=2, start_step=3))
    ctl.log(again[0], *steps(4, 5))
    restart = wait_for("the resume", lambda: handle.refresh().restarts and handle.monitor.restarts[-1])
    assert (restart["level"], restart["resumed_step"], restart["rolled_back_steps"]) == ("job", 3, 0)
    assert handle.state == "running" and handle.monitor.last_step == 5
    backend.stop("demo", timeout=5)
    assert [r for r in kube.emulator.requests if r.method.value.upper() == "DELETE"
            and "podmonitors" in str(r.url.path)]


# ---- Kueue: objects that admit what they print -----------------------------------------------------

P5 = ["run", "--backend", "eks", "--dry-run", "--kueue-objects", "--name", "llm", "--image", "img:1",
      "--nnodes", "4",
      "--nproc-per-node", "8", "--gpus-per-node", "8", "--model", "gpt-1b", "--namespace", "training",
      "--queue", "gpus"]


def printed(args: list[str], capsys: pytest.CaptureFixture[str]) -> dict[tuple[str, str], dict]:
    import yaml

    assert cli.main(args) == 0   # every object validated against its schema before it is printed
    return {(d["kind"], d["metadata"]["name"]): d for d in yaml.safe_load_all(capsys.readouterr().out) if d}


def summed_requests(workload: dict) -> dict[str, float]:
    """Every pod of the workload (its parallelism), each as the scheduler counts it: containers plus
    native sidecars, or its largest init container if that is more."""
    from eksft_nb.backends.eks.checks import quantity

    def requests(c: dict) -> dict[str, float]:
        res = c.get("resources") or {}
        return {k: quantity(v, k) for k, v in {**res.get("limits", {}), **res.get("requests", {})}.items()}

    pod = template(workload)["spec"]
    steady: dict[str, float] = {}
    for c in pod["containers"] + [c for c in pod.get("initContainers",
                                                     []) if c.get("restartPolicy") == "Always"]:
        for k, v in requests(c).items():
            steady[k] = steady.get(k, 0.0) + v
    for c in pod.get("initContainers", []):
        for k, v in requests(c).items():
            steady[k] = max(steady.get(k, 0.0), v)
    count = workload["spec"]["parallelism"] if workload["kind"] == "Job" else \
        workload["spec"]["replicatedJobs"][0]["template"]["spec"]["parallelism"]
    return {k: v * count for k, v in steady.items()}


@pytest.mark.parametrize("extra", [[], ["--cpu", "96", "--memory", "1000Gi"], ["--kind", "jobset"]])
def test_the_printed_quota_covers_every_pod_spares_included(extra: list[str],
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    """4 x p5.48xlarge and a hot spare: five pods of 8 GPUs and 32 EFA devices each, all of which must be
    admitted for the rendezvous to hold its spare: the ClusterQueue's quota covers what they request."""
    from eksft_nb.backends.eks.checks import quantity

    docs = printed(P5 + ["--efa-per-node", "32", "--instance-type", "p5.48xlarge", "--spare-nodes",
                         "1"] + extra,
                   capsys)
    workload = docs.get(("Job", "llm")) or docs[("JobSet", "llm")]
    need = summed_requests(workload)
    assert need["nvidia.com/gpu"] == 40 and need["vpc.amazonaws.com/efa"] == 160
    group, = docs[("ClusterQueue", "gpus")]["spec"]["resourceGroups"]
    flavor, = group["flavors"]
    quota = {r["name"]: quantity(r["nominalQuota"], r["name"]) for r in flavor["resources"]}
    # a resource not covered is never admitted
    assert set(need) <= set(group["coveredResources"]) == set(quota)
    for resource, amount in need.items():
        assert quota[resource] >= amount > 0, resource
    assert quota["nvidia.com/gpu"] == 40 and quota["vpc.amazonaws.com/efa"] == 160
    if extra[:1] == ["--cpu"]:   # the trainer's own requests are in it, not only the sidecar's
        assert quota["cpu"] >= 5 * 96 and quota["memory"] >= 5 * 1000 * 2**30


@pytest.mark.parametrize("instance", ["p5.48xlarge", "p5e.48xlarge", "p5en.48xlarge", "ml.p5.48xlarge"])
def test_the_flavor_selects_the_nodes_the_pods_select(instance: str,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    docs = printed(P5 + ["--efa-per-node", "16", "--instance-type", instance], capsys)
    pod = template(docs[("Job", "llm")])["spec"]
    flavor, = [d for (kind, _), d in docs.items() if kind == "ResourceFlavor"]
    assert flavor["spec"]["nodeLabels"] == pod["nodeSelector"] == {
        "node.kubernetes.io/instance-type": instance}
    group, = docs[("ClusterQueue", "gpus")]["spec"]["resourceGroups"]
    assert [f["name"] for f in group["flavors"]] == [flavor["metadata"]["name"]]


def test_preemption_where_the_priority_class_promises_it_and_v1beta2(
    capsys: pytest.CaptureFixture[str]) -> None:
    from eksft_nb.backends.eks.schemas import CRDS, SCHEMA_DIR

    docs = printed(P5 + ["--priority", "high"], capsys)
    assert docs[("WorkloadPriorityClass", "high")]["value"] > 0
    assert docs[("ClusterQueue", "gpus")]["spec"]["preemption"] == {"withinClusterQueue": "LowerPriority"}
    kueue = [d for d in docs.values() if d["apiVersion"].startswith("kueue.x-k8s.io/")]
    assert len(kueue) == 5 and {d["apiVersion"] for d in kueue} == {"kueue.x-k8s.io/v1beta2"}
    assert "v1beta2" in (SCHEMA_DIR / CRDS["ClusterQueue"]).read_text()   # the bundled CRD serves it
    plain = printed(P5, capsys)   # no priority class, nothing promised
    assert "preemption" not in plain[("ClusterQueue", "gpus")]["spec"]


@pytest.mark.parametrize("kind", ["job", "jobset"])
@pytest.mark.parametrize("topology,annotation,level", [
    ("required", "kueue.x-k8s.io/podset-required-topology", "topology.k8s.aws/network-node-layer-3"),
    ("preferred:2", "kueue.x-k8s.io/podset-preferred-topology", "topology.k8s.aws/network-node-layer-2"),
])
def test_topology_aware_scheduling_is_opt_in(kind: str, topology: str, annotation: str, level: str,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    docs = printed(P5 + ["--efa-per-node", "32", "--instance-type", "p5.48xlarge", "--kind", kind,
                         "--topology", topology], capsys)
    workload = docs[("Job" if kind == "job" else "JobSet", "llm")]
    assert template(workload)["metadata"]["annotations"][annotation] == level
    assert docs[("ResourceFlavor", "p5-48xlarge")]["spec"]["topologyName"] == "aws-network"
    plain = printed(P5 + ["--kind", kind], capsys)
    assert not any("topology" in k for k in template(plain[("Job" if kind == "job" else "JobSet", "llm")])
                   ["metadata"]["annotations"])
    assert all("topologyName" not in d["spec"] for (k, _), d in plain.items() if k == "ResourceFlavor")


@pytest.mark.parametrize("changes,problem,fix", [
    ({"eks.queue": "q", "eks.topology": "rack"}, "--topology 'rack' is not a placement",
     "--topology required"),
    ({"eks.queue": "q", "eks.topology": "required:4"}, "--topology 'required:4'", "required:2"),
    ({"eks.topology": "required"}, "--topology needs --queue", "add --queue NAME"),
    ({"eks.queue": "q", "eks.topology": "required", "eks.kind": "pytorchjob"},
     "a PyTorchJob's master and workers",
     "--kind job or jobset"),
])
def test_bad_topology_fails_with_problem_and_fix(changes: dict, problem: str, fix: str) -> None:
    with pytest.raises(SpecError) as e:
        commands.dry_run(eks_spec(**changes))   # the command layer's one check
    assert problem in e.value.problem and fix in e.value.fix


def test_a_kueue_that_serves_only_v1beta2_is_read(kube: Kube, backend: EksBackend, ctl: Controllers) -> None:  # noqa: F811
    """Kueue 0.20 no longer serves v1beta1: the job's state still comes from its Workload."""
    backend.launch(eks_spec(**{"eks.queue": "gpus"}))
    job = ctl.custom.get_namespaced_custom_object("batch", "v1", NS, "jobs", "demo")
    kube.emulator.resources["kueue.x-k8s.io/v1beta2/workloads"] = {
        "kind": "Workload", "namespaced": True, "verbs": ["list", "get", "create", "patch"]}
    waiting = "couldn't assign flavors to pod set main: insufficient quota for nvidia.com/gpu"
    kueue_workload(ctl, job,
                   [{"type": "QuotaReserved", "status": "False", "reason": "Pending", "message": waiting}],
                   version="v1beta2")
    assert backend.state("demo").detail == f"queued: waiting for quota in gpus ({waiting})"
