"""How the workload meets node failures and preemption, as Kubernetes intends, per Kubernetes version.

- A pod the cluster disrupts (node drain, preemption, taint eviction of a lost node: the pod carries
  the ``DisruptionTarget`` condition) is replaced without charging its index's retries
  (``podFailurePolicy``: Ignore). Kubernetes 1.26 on (the policy and the condition are beta there).
- A configuration error (``prepare`` refuses the job folder, the EFA provider or aws-ofi-nccl is
  missing, the image lacks ft_launcher) exits with :data:`CONFIG_ERROR` and fails the job at once:
  a retry on the same image and volume fails the same way.
- A lost node's pods are evicted 60 s after it turns unreachable or not ready, not the default 300 s.
- All pods of a job run in one availability zone (EFA does not cross zones): the first pod picks it.
- ``backoffLimitPerIndex`` and ``podReplacementPolicy`` are beta (on by default) from 1.29; 1.28 drops
  them (alpha), so there the Job has one ``backoffLimit`` for all its pods.
"""

from __future__ import annotations

from typing import Any

from ...spec import JobSpec
from . import names

CONFIG_ERROR = 78        # sysexits' EX_CONFIG: the exit code of a pod that cannot run as configured
EVICT_AFTER_S = 60       # tolerationSeconds for node.kubernetes.io/unreachable and not-ready
ZONE = "topology.kubernetes.io/zone"


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
    return {"podFailurePolicy": {"rules": [
        {"action": "FailJob", "onExitCodes": {"operator": "In", "values": [CONFIG_ERROR]}, **exit_only},
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
    taints += ["vpc.amazonaws.com/efa"] if e.efa_per_node else []
    return [{"key": t, "operator": "Exists", "effect": "NoSchedule"} for t in taints] + [
        {"key": f"node.kubernetes.io/{t}", "operator": "Exists", "effect": "NoExecute",
         "tolerationSeconds": EVICT_AFTER_S} for t in ("unreachable", "not-ready")]


def zone_affinity(spec: JobSpec) -> dict[str, Any]:
    """Every pod in the zone of the job's other pods (the first one is free to pick)."""
    return {"podAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [
        {"labelSelector": {"matchLabels": {names.JOB_LABEL: spec.name}}, "topologyKey": ZONE}]}}
