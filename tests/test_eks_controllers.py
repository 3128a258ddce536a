"""The replay's Job and JobSet controllers decide as Kubernetes and JobSet document it (the examples of
kubernetes.io's "Handling retriable and non-retriable pod failures with Pod failure policy" and of
JobSet's failure policy), and the policies eksft renders decide what a drain, a disruption, a
configuration error and a crash need."""

from __future__ import annotations

from typing import Any

import pytest
from eks_controllers import jobset_action, pod_failure_action

from eksft_nb.backends.eks import EksBackend
from eksft_nb.spec import JobSpec

# kubernetes.io's example: FailJob on container main's exit code 42, Ignore a disruption
DOCS = {"podFailurePolicy": {"rules": [
    {"action": "FailJob", "onExitCodes": {"containerName": "main", "operator": "In", "values": [42]}},
    {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget"}]}]}}


def status(*containers: tuple[str, int], init: tuple[str, int] | None = None,
           conditions: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    def terminated(name: str, code: int) -> dict[str, Any]:
        return {"name": name, "state": {"terminated": {"exitCode": code}}}

    out: dict[str, Any] = {"phase": "Failed", "containerStatuses": [terminated(*c) for c in containers],
                           "conditions": conditions or []}
    if init:
        out["initContainerStatuses"] = [terminated(*init)]
    return out


@pytest.mark.parametrize("pod_status,action", [
    (status(("main", 42)), "FailJob"),
    (status(("main", 1)), "Count"),                  # no rule matches: counted toward the backoff limit
    (status(("sidecar", 42)), "Count"),              # containerName restricts the rule
    (status(("main", 0), conditions=[{"type": "DisruptionTarget", "status": "True"}]), "Ignore"),
    (status(("main", 137), conditions=[{"type": "DisruptionTarget", "status": "False"}]), "Count"),
])
def test_the_documented_pod_failure_policy_example(pod_status: dict, action: str) -> None:
    assert pod_failure_action(DOCS, "ns/p", pod_status)[0] == action


def test_rules_match_in_order_over_every_container_and_name_the_rule() -> None:
    policy = {"podFailurePolicy": {"rules": [
        {"action": "Ignore", "onExitCodes": {"operator": "NotIn", "values": [1, 2, 3]}},
        {"action": "FailJob", "onExitCodes": {"operator": "In", "values": [3]}}]}}
    # NotIn: any non-zero code outside the values; an init container's code counts; exit 0 never does
    assert pod_failure_action(policy, "ns/p", status(("main", 0), init=("prepare", 7)))[0] == "Ignore"
    assert pod_failure_action(policy, "ns/p", status(("main", 0)))[0] == "Count"
    action, message = pod_failure_action(policy, "ns/p", status(("main", 1), ("side", 3)))
    assert (action, message) == ("FailJob", "Container side for pod ns/p failed with exit code 3 matching "
                                            "FailJob rule at index 1")


def rendered(kind: str, **changes: object) -> tuple[dict[str, Any], dict[str, Any]]:
    """The (child) Job's spec and the JobSet's failure policy (empty for a Job) that eksft renders."""
    spec = JobSpec(name="demo", backend="eks", nnodes=2, nproc_per_node=1).replace(**{
        "eks.image": "img:1", "eks.gpus_per_node": 0, "eks.kind": kind, "model.preset": "tiny", **changes})
    workload = EksBackend().manifests(spec).workload()
    if kind == "job":
        return workload["spec"], {}
    return workload["spec"]["replicatedJobs"][0]["template"]["spec"], workload["spec"]["failurePolicy"]


@pytest.mark.parametrize("kind", ["job", "jobset"])
@pytest.mark.parametrize("version", ["1.28", "1.33"])
def test_what_the_rendered_policies_decide(kind: str, version: str) -> None:
    job, jobset = rendered(kind, **{"eks.k8s_version": version})
    drained = status(("trainer", 138), ("metrics", 143))          # every pod of a drained job
    evicted = status(("trainer", 137), conditions=[{"type": "DisruptionTarget", "status": "True"}])
    refused = status(init=("prepare", 78))                         # prepare refused the job folder or image
    crashed = status(("trainer", 1))
    assert pod_failure_action(job, "ns/p", drained)[0] == "Ignore"   # recreated, not charged
    assert pod_failure_action(job, "ns/p", evicted)[0] == "Ignore"
    assert pod_failure_action(job, "ns/p", crashed)[0] == "Count"    # a retry of its index (or set) spent
    action, message = pod_failure_action(job, "ns/p", refused)
    assert action == "FailJob"
    if kind == "jobset":   # the child Job failed by its policy fails the set; any other failure restarts it
        assert jobset_action(jobset, "node", "PodFailurePolicy", message) == "FailJobSet"
        assert jobset_action(jobset, "node", "BackoffLimitExceeded", "") == "RestartJobSet"


def test_jobset_rules_match_reasons_patterns_and_targets_in_order() -> None:
    policy = {"rules": [
        {"name": "drained", "action": "RestartJobSetAndIgnoreMaxRestarts",
         "onJobFailureReasons": ["PodFailurePolicy"], "onJobFailureMessagePatterns": ["exit code 138"]},
        {"name": "workers", "action": "RestartJob", "targetReplicatedJobs": ["workers"]},
        {"name": "config", "action": "FailJobSet", "onJobFailureReasons": ["PodFailurePolicy"]}]}
    drained = "Container trainer for pod ns/p failed with exit code 138 matching FailJob rule at index 1"
    assert jobset_action(policy, "node", "PodFailurePolicy", drained) == "RestartJobSetAndIgnoreMaxRestarts"
    assert jobset_action(policy, "node", "PodFailurePolicy", drained.replace("138", "78")) == "FailJobSet"
    assert jobset_action(policy, "workers", "BackoffLimitExceeded", "") == "RestartJob"
    assert jobset_action(policy, "node", "BackoffLimitExceeded", "") == "RestartJobSet"   # no rule matches
    assert jobset_action(None, "node", "PodFailurePolicy", drained) == "RestartJobSet"
