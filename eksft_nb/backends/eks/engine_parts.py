"""What an EKS job is for each engine (the engine contract leaves it to the backend): what an EKS job of
it may not be, its workload, the objects it runs beside the workload and the control Role's rules for them."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ...engines.base import per_engine
from ...engines.registry import engine_of
from ...spec import JobSpec
from ...states import EngineName
from . import torchft
from .names import Kind

Manifest = dict[str, Any]


@dataclass(frozen=True)
class EksEngine:
    check: Callable[[JobSpec], None]   # raise SpecError for what an EKS job of the engine may not be
    # its workload, from the job's pod template and the workload's metadata; None: --kind's own
    workload: Callable[[JobSpec, Manifest, Manifest], Manifest] | None
    objects: Callable[[JobSpec], list[Manifest]]   # what it runs beside the workload, created with it
    # those objects by kind and name from the job's name, in the order ``stop`` and ``remove`` delete them (a
    # NetworkPolicy once the job's pods are gone)
    beside: Callable[[str], list[tuple[Kind, str]]]
    rules: tuple[tuple[str, str, list[str]], ...]   # the control Role's for them: API group, resource, verbs


def _nothing(spec: JobSpec) -> None:
    """NVRx on EKS: every --kind, queued or not."""


PARTS = per_engine({
    EngineName.NVRX: EksEngine(_nothing, None, lambda spec: [], lambda job: [], ()),
    # the replica groups as a JobSet; the Lighthouse as a Deployment behind a Service, with its NetworkPolicy
    EngineName.TORCHFT: EksEngine(torchft.check, torchft.jobset, torchft.lighthouse_objects,
                                  torchft.lighthouse_kinds, torchft.RULES),
})


def of(spec: JobSpec) -> EksEngine:
    """``spec``'s engine's parts on EKS."""
    return PARTS[engine_of(spec).name]
