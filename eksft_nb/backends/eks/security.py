"""The pods' security context: what Pod Security "restricted" asks of a pod, where the image allows it.

By default the pods run as UID and GID :data:`DEFAULT_UID` (``--run-as-user``), never root, with every
capability dropped, no privilege escalation and the runtime's default seccomp profile: the
``restricted`` level admits them. An image that must run as root (``--run-as-user 0``) keeps the rest
and runs under the ``baseline`` level. The group is also the pods' ``fsGroup`` and the job folder's
group, and the pods' ``umask`` leaves what they write group-writable (see :mod:`.pod_entry`), so every
pod of the job, and its replacements, can write the job folder on a shared volume whose root squash
maps root to nobody.
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
