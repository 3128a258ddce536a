"""Voluntary disruption: what keeps the cluster from taking a training pod for its own convenience.

- ``karpenter.sh/do-not-disrupt: "true"`` on every pod: Karpenter neither consolidates nor expires the
  node under it while it runs (a drain it needs anyway, for a Spot interruption or node repair, still
  comes: the job drains, see :mod:`.pod_entry`).
- A PodDisruptionBudget of ``minAvailable: --nnodes``: an eviction (``kubectl drain``, a managed node
  group update, any tool that uses the Eviction API) may take a hot spare, never a node the job needs,
  until the job ends; ``unhealthyPodEvictionPolicy: AlwaysAllow`` lets a pod that is not running
  (stuck pending an image, say) be evicted still, so it never blocks a drain for nothing.
  Involuntary disruptions (a lost node, a Spot interruption, a forced drain) are not blocked: a pod
  they stop drains and is recreated.
"""

from __future__ import annotations

from typing import Any

from ...spec import JobSpec
from . import names

DO_NOT_DISRUPT = "karpenter.sh/do-not-disrupt"


def pod_annotations(spec: JobSpec) -> dict[str, str]:
    return {DO_NOT_DISRUPT: "true"}


def minor(spec: JobSpec) -> int:
    return int(spec.eks.k8s_version.split(".")[1])


def pod_disruption_budget(spec: JobSpec) -> dict[str, Any]:
    body: dict[str, Any] = {"minAvailable": spec.nnodes,
                            "selector": {"matchLabels": {names.JOB_LABEL: spec.name}}}
    if minor(spec) >= 27:   # beta (on by default) from 1.27
        body["unhealthyPodEvictionPolicy"] = "AlwaysAllow"
    return {"apiVersion": "policy/v1", "kind": "PodDisruptionBudget",
            "metadata": {"name": spec.name, "namespace": spec.eks.namespace, "labels": names.labels(spec),
                         "annotations": {names.DIGEST: spec.digest()}},
            "spec": body}
