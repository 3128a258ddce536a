"""Kueue's side of a queued job (``--queue``): the admin objects ``--kueue-objects`` prints, and the
topology-aware placement ``--topology`` asks for.

The printed objects admit what the job runs: the ClusterQueue's quota is the sum of the rendered
pods' requests (every pod, hot spares included, counted as the scheduler counts a pod: its containers
plus its sidecars, or its largest init step if that is more), so it stays right whatever the pods
request. The ResourceFlavor's node labels are the pods' own ``nodeSelector`` instance type (p5en,
HyperPod's ``ml.p5.48xlarge``...), and the ClusterQueue preempts lower priorities when the job's
WorkloadPriorityClass says it may. All in ``kueue.x-k8s.io/v1beta2``: served from Kueue 0.15 on, the
only version from 0.20 (the bundled CRDs, Kueue 0.19.2, serve both).
"""

from __future__ import annotations

import math
from fractions import Fraction
from typing import Any

from ...errors import SpecError
from ...spec import JobSpec
from . import names, quantities
from .instances import INSTANCE_TYPES

API = "kueue.x-k8s.io/v1beta2"
INSTANCE_LABEL = "node.kubernetes.io/instance-type"
# the flavors printed for GPU pods with no --instance-type (those whose devices fit a pod), p5 first
CANDIDATES = ("p5.48xlarge", "p4d.24xlarge")
GPU, EFA = "nvidia.com/gpu", "vpc.amazonaws.com/efa"
# topology-aware scheduling: EKS labels each node with its place in the AWS network (layer 1 the
# broadest, 3 the closest); the admin creates a Topology of that name with these levels (README)
TOPOLOGY = "aws-network"
LAYER_LABEL = "topology.k8s.aws/network-node-layer-{}"
PLACEMENT = {"required": "kueue.x-k8s.io/podset-required-topology",
             "preferred": "kueue.x-k8s.io/podset-preferred-topology"}

def quantity(value: Any) -> Fraction:
    """A rendered resource amount, exactly."""
    if (exact := quantities.parse(value)) is None:
        raise SpecError(f"a rendered resource amount {value!r} is not a Kubernetes quantity",
                        "fix the option that sets it (--cpu, --memory, ...)")
    return exact


def amount(resource: str, value: Fraction) -> str:
    """``value`` as a quota, rounded up: cpu in whole cores or millicores, byte sizes in the largest
    binary unit that divides them, counts as integers."""
    if resource == "cpu":
        milli = math.ceil(value * 1000)
        return str(milli // 1000) if milli % 1000 == 0 else f"{milli}m"
    whole = math.ceil(value)
    if resource in ("memory", "ephemeral-storage") or resource.startswith("hugepages-"):
        for unit, size in reversed(quantities.BINARY.items()):
            if whole and whole % size == 0:
                return f"{whole // size}{unit}"
    return str(whole)


def _add(total: dict[str, Fraction], more: dict[str, Fraction]) -> dict[str, Fraction]:
    return {k: total.get(k, Fraction(0)) + more.get(k, Fraction(0)) for k in {*total, *more}}


def _max(a: dict[str, Fraction], b: dict[str, Fraction]) -> dict[str, Fraction]:
    return {k: max(a.get(k, Fraction(0)), b.get(k, Fraction(0))) for k in {*a, *b}}


def container_requests(container: dict[str, Any]) -> dict[str, Fraction]:
    """What a container requests; a limit with no request is its request (the API server's default)."""
    res = container.get("resources") or {}
    return {k: quantity(v) for k, v in {**(res.get("limits") or {}), **(res.get("requests") or {})}.items()}


def pod_requests(pod: dict[str, Any]) -> dict[str, Fraction]:
    """A pod's effective request, as the scheduler and Kueue compute it: its containers plus its native
    sidecars (init containers with ``restartPolicy: Always``), or, if more, the largest init step (an
    init container plus the sidecars started before it); plus the pod's overhead."""
    total: dict[str, Fraction] = {}
    for c in pod.get("containers") or []:
        total = _add(total, container_requests(c))
    sidecars: dict[str, Fraction] = {}
    init: dict[str, Fraction] = {}
    for c in pod.get("initContainers") or []:
        own = container_requests(c)
        if c.get("restartPolicy") == "Always":
            total = _add(total, own)
            sidecars = _add(sidecars, own)
            init = _max(init, sidecars)
        else:
            init = _max(init, _add(own, sidecars))
    total = _max(total, init)
    return _add(total, {k: quantity(v) for k, v in (pod.get("overhead") or {}).items()})


def pod_sets(workload: dict[str, Any]) -> list[tuple[int, dict[str, Any]]]:
    """Kueue's pod sets of a rendered workload: (how many pods, their template)."""
    spec = workload["spec"]
    if workload["kind"] == "Job":
        return [(spec.get("parallelism", 1), spec["template"])]
    if workload["kind"] == "JobSet":
        return [(r.get("replicas", 1) * r["template"]["spec"].get("parallelism", 1),
                 r["template"]["spec"]["template"])
                for r in spec["replicatedJobs"]]
    return [(r.get("replicas", 1), r["template"]) for r in spec["pytorchReplicaSpecs"].values()]


def job_requests(workload: dict[str, Any]) -> dict[str, Fraction]:
    """What all the workload's pods request together: the quota it needs to be admitted."""
    total: dict[str, Fraction] = {}
    for count, template in pod_sets(workload):
        total = _add(total, {k: v * count for k, v in pod_requests(template["spec"]).items()})
    return total


def placement(spec: JobSpec) -> tuple[str, str] | None:
    """``--topology MODE[:LAYER]`` as (pod-set annotation, node label), or None."""
    if not spec.eks.topology:
        return None
    mode, _, layer = spec.eks.topology.partition(":")
    return PLACEMENT[mode], LAYER_LABEL.format(layer or 3)


def place(workload: dict[str, Any], spec: JobSpec) -> None:
    """With ``--topology``: annotate every pod set so that Kueue admits it only (required) or
    preferably (preferred) under one network node of the chosen layer."""
    if (wanted := placement(spec)) is None:
        return
    for _, template in pod_sets(workload):
        template.setdefault("metadata", {}).setdefault("annotations", {})[wanted[0]] = wanted[1]


def _flavor_name(instance_type: str | None) -> str:
    return instance_type.replace(".", "-") if instance_type else "default-flavor"


def _fits(instance_type: str, per_pod: dict[str, Fraction]) -> bool:
    node = INSTANCE_TYPES[instance_type]
    return per_pod.get(GPU, 0) <= node.gpus and per_pod.get(EFA, 0) <= node.efa


def objects(spec: JobSpec, workload: dict[str, Any]) -> list[dict[str, Any]]:
    """ResourceFlavor(s), a ClusterQueue named ``--queue`` with quota for exactly this workload's pods, its
    LocalQueue in the job's namespace, and the ``--priority`` WorkloadPriorityClass."""
    e = spec.eks
    labels = {names.MANAGED_BY: names.MANAGER}
    need = job_requests(workload)
    templates = [t["spec"] for _, t in pod_sets(workload)]
    per_pod: dict[str, Fraction] = {}
    for pod in templates:
        per_pod = _max(per_pod, pod_requests(pod))
    selected = {(pod.get("nodeSelector") or {}).get(INSTANCE_LABEL) for pod in templates}
    if len(selected) != 1:
        raise SpecError("the pods of the workload select different instance types",
                        "please report it: a bug in eksft-nb")
    chosen = selected.pop()
    if chosen:   # Kueue admits a flavor whose node labels agree with the pods' own selector
        types: list[str | None] = [chosen]
    else:        # Kueue picks the first flavor with quota and adds its labels to the pods' selector
        types = [t for t in CANDIDATES if per_pod.get(GPU) and _fits(t, per_pod)] or [None]
    flavors = []
    for t in types:
        body: dict[str, Any] = {"nodeLabels": {INSTANCE_LABEL: t}} if t else {}
        if e.topology:
            body["topologyName"] = TOPOLOGY
        flavors.append({"apiVersion": API, "kind": "ResourceFlavor",
                        "metadata": {"name": _flavor_name(t), "labels": labels}, "spec": body})
    covered = ["cpu", "memory"] + [r for r in (GPU, EFA) if need.get(r)]
    covered += sorted(r for r in need if need[r] and r not in covered)
    queue_spec: dict[str, Any] = {"namespaceSelector": {}, "queueingStrategy": "BestEffortFIFO"}
    if e.priority:   # the priority class promises it: a higher-priority job evicts lower ones
        queue_spec["preemption"] = {"withinClusterQueue": "LowerPriority"}
    queue_spec["resourceGroups"] = [{"coveredResources": covered, "flavors": [
        {"name": _flavor_name(t),
         "resources": [{"name": r, "nominalQuota": amount(r, need.get(r, Fraction(0)))}
                                                for r in covered]} for t in types]}]
    out = [*flavors,
           {"apiVersion": API, "kind": "ClusterQueue", "metadata": {"name": e.queue, "labels": labels},
            "spec": queue_spec},
           {"apiVersion": API, "kind": "LocalQueue",
            "metadata": {"name": e.queue, "namespace": e.namespace, "labels": labels},
            "spec": {"clusterQueue": e.queue}}]
    if e.priority:
        out.append({"apiVersion": API, "kind": "WorkloadPriorityClass",
                    "metadata": {"name": e.priority, "labels": labels},
                    "value": 1000,
                    "description": "eksft-nb training jobs: admitted first, and may preempt lower "
                                                  "priorities in their ClusterQueue"})
    return out
