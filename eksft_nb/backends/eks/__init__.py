"""The EKS backend: the same job on Amazon EKS, through the official ``kubernetes`` client.

- ``names``: names, labels, paths and API coordinates shared by everything below
- ``instances``: the GPU instance types (GPUs, EFA devices, RDMA read, vCPUs, memory), HyperPod ``ml.`` names
- ``sizing``: the trainer's CPU and memory requests and its ``/dev/shm``
- ``failures``: node failures and preemption (pod failure policy, tolerations, zone, per Kubernetes version)
- ``efa``: the in-pod check that the image can use EFA (libfabric's provider, aws-ofi-nccl)
- ``checks``: EKS-specific spec checks (before anything is rendered or sent)
- ``render``: the manifests (Indexed Job + headless Service, JobSet or PyTorchJob; ConfigMap; RBAC; FSx)
- ``kueue``: Kueue's objects sized from the rendered pods, and topology-aware placement (``--queue``)
- ``network``: the job's NetworkPolicy (only its own pods, and Prometheus, reach its ports)
- ``schemas``: validation of every manifest against the Kubernetes and CRD schemas
- ``cluster``: the API connection (kubeconfig context or in-cluster) and errors a user can act on
- ``pods``: what a pod's status means for the job (pending, image errors, OOM, eviction, loss)
- ``stream``: the job's events, from the pods' logs and states, for the same JobMonitor as local jobs
- ``inpod``: small commands that run inside the pods (prepare the job folder, inject, list checkpoints)
- ``backend``: :class:`EksBackend`, the lifecycle (submit, watch, logs, inject, stop, resume)
"""

from __future__ import annotations

from typing import Any

__all__ = ["EksBackend"]


def __getattr__(name: str) -> Any:
    # lazily, so the commands that run inside the pods (inpod) do not import the Kubernetes client
    if name == "EksBackend":
        from .backend import EksBackend

        return EksBackend
    raise AttributeError(name)
