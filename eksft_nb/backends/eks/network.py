"""The job's NetworkPolicy: its pods accept connections only from each other, and the metrics port
also from the Prometheus namespace.

A job's pods open the rendezvous (``--rdzv-port``), the TCPStore (the next port) and the in-process
Wrapper's store (the one after) on node 0, and gloo and NCCL's bootstrap and TCP transport on ephemeral
ports of every pod (EFA traffic does not go through the pod network). An ephemeral port cannot be
named, so the job's own pods may reach any TCP port; nobody else may reach any, but for the metrics
sidecar's port from ``--prometheus-namespace``. Egress is left open (DNS, the image registry, S3).
"""

from __future__ import annotations

from typing import Any

from ...spec import JobSpec
from . import names

NAMESPACE_LABEL = "kubernetes.io/metadata.name"   # set by the API server on every namespace


def network_policy(spec: JobSpec, metrics: bool) -> dict[str, Any]:
    """``metrics``: the pods run the metrics sidecar (so Prometheus may reach its port)."""
    pods = {"podSelector": {"matchLabels": {names.JOB_LABEL: spec.name}}}
    ingress: list[dict[str, Any]] = [{"from": [pods], "ports": [{"protocol": "TCP"}]}]
    if metrics:
        prometheus = {"namespaceSelector": {"matchLabels": {NAMESPACE_LABEL: spec.eks.prometheus_namespace}}}
        ingress.append({"from": [prometheus], "ports": [{"protocol": "TCP", "port": names.METRICS_PORT}]})
    return {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
            "metadata": {"name": spec.name, "namespace": spec.eks.namespace, "labels": names.labels(spec),
                         "annotations": {names.DIGEST: spec.digest()}},
            "spec": {**pods, "policyTypes": ["Ingress"], "ingress": ingress}}
