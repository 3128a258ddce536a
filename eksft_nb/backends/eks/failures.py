"""How the workload meets node failures and preemption, as Kubernetes intends, per Kubernetes version.

- A pod whose ranks drained on SIGTERM (a node drain, Karpenter's consolidation, a node group update or
  auto-repair, a HyperPod node replacement, a Kueue suspend: they saved and committed a step) exits
  :data:`~eksft_nb.runtime.drain.DRAIN_EXIT` (see :mod:`.pod_entry`), and every pod of the job does,
  since the ranks agree to drain together. It is replaced without charging its index's retries
  (``podFailurePolicy``: Ignore on that exit code of the trainer), and resumes from the drain's save; a
  JobSet's child Job does the same. A PyTorchJob's replicas restart on it under ``restartPolicy:
  ExitCode``, which retries 138 as the user's own retryable code.
- A pod the cluster disrupts (node drain, preemption, taint eviction of a lost node: the pod carries
  the ``DisruptionTarget`` condition) is replaced without charging its index's retries
  (``podFailurePolicy``: Ignore). Kubernetes 1.26 on (the policy and the condition are beta there).
- A configuration error (``prepare`` refuses the job folder, the EFA provider or aws-ofi-nccl is
  missing, the image lacks ft_launcher) exits with :data:`CONFIG_ERROR` and fails the job at once:
  a retry on the same image and volume fails the same way.
- A lost node's pods are evicted 60 s after it turns unreachable or not ready, not the default 300 s.
- All pods of a job run in one availability zone (EFA does not cross zones): the first pod picks it.
- On SageMaker HyperPod (``--hyperpod``, or an ``ml.`` instance type) only on nodes HyperPod's health
  checks report ``Schedulable``: a node it found faulty (or is replacing) takes no replacement pod.
- A recreated pod does not land on the node a drain came from: a drained node is cordoned
  (``node.kubernetes.io/unschedulable``) and Karpenter taints a node it disrupts
  (``karpenter.sh/disrupted``), neither of which the pods tolerate.
- ``backoffLimitPerIndex`` and ``podReplacementPolicy`` are beta (on by default) from 1.29; 1.28 drops
  them (alpha), so there the Job has one ``backoffLimit`` for all its pods.
"""

from __future__ import annotations

from typing import Any

from ...runtime.drain import DRAIN_EXIT
from ...spec import JobSpec
from ...timeouts import derive
from . import names
from .instances import efa_per_node, hyperpod

CONFIG_ERROR = 78        # sysexits' EX_CONFIG: the exit code of a pod that cannot run as configured
EVICT_AFTER_S = 60       # tolerationSeconds for node.kubernetes.io/unreachable and not-ready
ZONE = "topology.kubernetes.io/zone"
HYPERPOD_HEALTH = "sagemaker.amazonaws.com/node-health-status"   # HyperPod's health agent labels its nodes


def termination_grace_s(spec: JobSpec) -> int:
    """The pod's grace period from the kubelet's SIGTERM to its SIGKILL: a drain saves and commits before
    the ranks exit, and ft_launcher waits for its ranks (``--term-timeout``, the same grace), with 30 s to
    spare."""
    return int(derive(spec).grace.seconds) + 30


def minor(spec: JobSpec) -> int:
    return int(spec.eks.k8s_version.split(".")[1])


def per_index(spec: JobSpec) -> bool:
    """Whether the cluster keeps per-index retries (``backoffLimitPerIndex``) and waits for a failed pod
    to be gone before replacing it (``podReplacementPolicy: Failed``)."""
    return minor(spec) >= 29


def pod_failure_policy(spec: JobSpec) -> dict[str, Any]:
    """The Job's (or JobSet child Job's) ``podFailurePolicy``; empty before Kubernetes 1.26."""
    if minor(spec) < 26:
        return {}
    # before 1.29 the schema requires onPodConditions on every rule (an empty list: exit codes only)
    exit_only = {"onPodConditions": []} if minor(spec) < 29 else {}
    drained = {"containerName": names.container(spec), "operator": "In", "values": [DRAIN_EXIT]}
    return {"podFailurePolicy": {"rules": [
        {"action": "FailJob", "onExitCodes": {"operator": "In", "values": [CONFIG_ERROR]}, **exit_only},
        {"action": "Ignore", "onExitCodes": drained, **exit_only},
        {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]},
    ]}}


def job_retries(spec: JobSpec) -> dict[str, Any]:
    """An Indexed Job's retry fields: per index where the version has them, else one budget for the job."""
    if per_index(spec):
        return {"backoffLimitPerIndex": spec.ft.max_job_restarts, "maxFailedIndexes": 0,
                "podReplacementPolicy": "Failed"}
    return {"backoffLimit": spec.ft.max_job_restarts}


def jobset_failure_policy(spec: JobSpec) -> dict[str, Any]:
    """A child Job that failed through its pod failure policy (a configuration error) fails the set;
    any other failure restarts it, up to ``max_job_restarts``."""
    rules = [{"name": "configurationError", "action": "FailJobSet",
              "onJobFailureReasons": ["PodFailurePolicy"]}]
    return {"maxRestarts": spec.ft.max_job_restarts, **({"rules": rules} if minor(spec) >= 26 else {})}


def tolerations(spec: JobSpec) -> list[dict[str, Any]]:
    e = spec.eks
    taints = ["nvidia.com/gpu"] if e.gpus_per_node else []
    taints += ["vpc.amazonaws.com/efa"] if efa_per_node(spec) else []
    return [{"key": t, "operator": "Exists", "effect": "NoSchedule"} for t in taints] + [
        {"key": f"node.kubernetes.io/{t}", "operator": "Exists", "effect": "NoExecute",
         "tolerationSeconds": EVICT_AFTER_S} for t in ("unreachable", "not-ready")]


def affinity(spec: JobSpec) -> dict[str, Any]:
    """Every pod in the zone of the job's other pods (the first one is free to pick); on HyperPod, only
    on nodes it reports healthy."""
    out: dict[str, Any] = {"podAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [
        {"labelSelector": {"matchLabels": {names.JOB_LABEL: spec.name}}, "topologyKey": ZONE}]}}
    if spec.eks.hyperpod or hyperpod(spec.eks.instance_type):
        out["nodeAffinity"] = {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
            {"matchExpressions": [{"key": HYPERPOD_HEALTH, "operator": "In", "values": ["Schedulable"]}]}]}}
    return out
