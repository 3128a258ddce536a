"""EKS: the job's NetworkPolicy, read as the cluster's network plugin reads it. The job's own pods reach
every TCP port of each other (rendezvous, stores, gloo and NCCL's ephemeral ports); the Prometheus
namespace reaches the metrics port only; any other pod, in the namespace or not, reaches nothing."""

from __future__ import annotations

import pytest
from test_eks_kueue import template
from test_eks_lifecycle import NS, eks_spec

from eksft_nb import commands
from eksft_nb.backends.eks import EksBackend, names, schemas
from eksft_nb.errors import SpecError

EPHEMERAL = 45123   # a port gloo or NCCL might pick


def selects(selector: dict, labels: dict) -> bool:
    return selector.get("matchLabels", {}).items() <= labels.items() and not selector.get("matchExpressions")


def admits(policy: dict, source_ns: dict, source_pod: dict, port: int) -> bool:
    """Whether ``policy`` lets a pod (labels ``source_pod``, in a namespace labelled ``source_ns``)
    connect over TCP to ``port`` of a pod it selects (the NetworkPolicy semantics of networking.k8s.io/v1)."""
    spec = policy["spec"]
    assert spec["policyTypes"] == ["Ingress"]
    same_ns = source_ns.get("kubernetes.io/metadata.name") == policy["metadata"]["namespace"]
    for rule in spec.get("ingress", []):
        ports = rule.get("ports") or [{}]
        if not any(p.get("protocol", "TCP") == "TCP" and p.get("port") in (None, port) for p in ports):
            continue
        for peer in rule.get("from") or [{}]:
            ns_ok = selects(peer["namespaceSelector"], source_ns) if "namespaceSelector" in peer else same_ns
            pod_ok = selects(peer["podSelector"], source_pod) if "podSelector" in peer else True
            if ns_ok and pod_ok:
                return True
    return False


@pytest.mark.parametrize("kind", ["job", "jobset", "pytorchjob"])
@pytest.mark.parametrize("prometheus", [None, "prom"])
def test_only_the_jobs_pods_reach_its_ports_and_prometheus_its_metrics(kind: str,
                                                                       prometheus: str | None) -> None:
    changes = {"eks.kind": kind, **({"eks.prometheus_namespace": prometheus} if prometheus else {})}
    m = EksBackend().manifests(eks_spec(**changes))   # each manifest validated against its schema
    policy = next(d for d in m.job if d["kind"] == "NetworkPolicy")
    schemas.validate(policy, "1.33")
    assert [d["kind"] for d in m.job].index("NetworkPolicy") < len(m.job) - 1   # in force before any pod runs
    pod = template(m.workload())
    assert selects(policy["spec"]["podSelector"], pod["metadata"]["labels"])
    listening = [p["containerPort"] for c in pod["spec"]["containers"] + pod["spec"]["initContainers"]
                 for p in c.get("ports", [])]
    assert names.METRICS_PORT in listening and 29500 in listening
    here = {"kubernetes.io/metadata.name": NS}
    ours = pod["metadata"]["labels"]
    for port in listening + [EPHEMERAL]:
        assert admits(policy, here, ours, port), port
        assert not admits(policy, here, {**ours, names.JOB_LABEL: "other"}, port), port   # another job's pod
        assert not admits(policy, {"kubernetes.io/metadata.name": "elsewhere"}, ours, port), port
    scraper = {"kubernetes.io/metadata.name": prometheus or "monitoring"}
    assert admits(policy, scraper, {"app": "prometheus"}, names.METRICS_PORT)
    assert not any(admits(policy, scraper, {"app": "prometheus"},
                          p) for p in [29500, 29501, 29502, EPHEMERAL])


def test_without_the_metrics_sidecar_nothing_outside_the_job_is_admitted() -> None:
    m = EksBackend().manifests(eks_spec(**{"eks.k8s_version": "1.28"}))
    policy = next(d for d in m.job if d["kind"] == "NetworkPolicy")
    assert not admits(policy, {"kubernetes.io/metadata.name": "monitoring"}, {}, names.METRICS_PORT)
    assert admits(policy, {"kubernetes.io/metadata.name": NS}, {names.JOB_LABEL: "demo"}, EPHEMERAL)


def test_a_bad_prometheus_namespace_fails_with_problem_and_fix() -> None:
    with pytest.raises(SpecError) as e:
        commands.dry_run(eks_spec(**{"eks.prometheus_namespace": "Monitoring NS"}))
    assert "--prometheus-namespace 'Monitoring NS'" in e.value.problem and "monitoring-ns" in e.value.fix
