"""The pods' security context: what Pod Security "restricted" asks of a pod, where the image allows it.

By default the pods run as UID and GID :data:`DEFAULT_UID` (``--run-as-user``), never root, with every
capability dropped, no privilege escalation and the runtime's default seccomp profile: the
``restricted`` level admits them. An image that must run as root (``--run-as-user 0``) keeps the rest
and runs under the ``baseline`` level. Every pod of a job, and every pod that replaces one, runs as the
same user, which owns the job folder (0700) on the shared volume. FSx for Lustre does not apply
``fsGroup``: a volume whose root only root may write, or a folder an earlier job left as another user,
makes ``prepare`` refuse in one line with the owner, the mode and the fix (see :mod:`.inpod`).
"""

from __future__ import annotations

from typing import Any

from ...spec import JobSpec

DEFAULT_UID = 1000


def pod_security(spec: JobSpec) -> dict[str, Any]:
    uid = spec.eks.run_as_user
    seccomp = {"seccompProfile": {"type": "RuntimeDefault"}}
    if uid == 0:
        return seccomp
    # OnRootMismatch: a volume whose root is the group's already is not walked (an FSx holds millions)
    return {"runAsNonRoot": True, "runAsUser": uid, "runAsGroup": uid, "fsGroup": uid,
            "fsGroupChangePolicy": "OnRootMismatch", **seccomp}


def container_security(spec: JobSpec) -> dict[str, Any]:
    """Every container's: no capability (EFA's memory registration needs none on EKS's GPU AMIs, whose
    containerd has an unlimited memlock limit), no privilege escalation."""
    return {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}
