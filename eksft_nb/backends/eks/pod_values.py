"""What a pod sees of a job spec, and how a value is written for the kubelet: shared by the NVRx
renderer and the torchft one (:mod:`.render`, :mod:`.torchft`)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from ...spec import JobSpec
from ...timeouts import resolved
from . import names


def pod_view(spec: JobSpec) -> JobSpec:
    """The spec as the ranks read it: the timeouts filled in for the pods (GPU-scale where they have
    GPUs, see :mod:`eksft_nb.timeouts`); a user script points at its copy in the ConfigMap."""
    spec = resolved(spec)
    if not spec.script:
        return spec
    return spec.replace(script=f"{names.CONFIG_MOUNT}/{script_key(spec)}")


def script_key(spec: JobSpec) -> str:
    """The script's file name, as a ConfigMap key (and so its file name in the pods)."""
    key = re.sub(r"[^-._a-zA-Z0-9]", "_", Path(str(spec.script)).name)
    return key if key not in (names.POD_SPEC, names.SUBMITTED_SPEC, names.FAULTS,
                              names.JOB_UID) else f"script-{key}"


def literal(text: str) -> str:
    """``text`` as the container must see it: the kubelet expands ``$(VAR)`` in command, args and
    env values and turns ``$$`` into ``$``, so every ``$`` is doubled."""
    return text.replace("$", "$$")


def field_env(name: str, path: str) -> dict[str, Any]:
    """An env var the kubelet fills from the pod's own fields (``fieldRef``)."""
    return {"name": name, "valueFrom": {"fieldRef": {"fieldPath": path}}}
