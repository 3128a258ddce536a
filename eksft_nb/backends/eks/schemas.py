"""Validation of rendered manifests against the schemas the API server enforces.

Core kinds use ``kubernetes-validate`` (the Kubernetes OpenAPI schemas, strict: unknown fields are
errors) for the chosen Kubernetes version. JobSet, PyTorchJob, PodMonitor and Kueue's queue kinds use
the ``openAPIV3Schema`` of their CRDs, shipped in ``eksft_nb/backends/schemas/``, closed the same way (an
object with declared properties accepts no others unless it says ``x-kubernetes-preserve-unknown-fields``).
"""

from __future__ import annotations

import copy
from functools import lru_cache
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import yaml

from ...errors import SpecError
from .names import KINDS

SCHEMA_DIR = Path(__file__).resolve().parent.parent / "schemas"
CRDS = {"JobSet": "jobset.x-k8s.io_jobsets.yaml", "PyTorchJob": "kubeflow.org_pytorchjobs.yaml",
        "PodMonitor": "monitoring.coreos.com_podmonitors.yaml",
        **{k: f"kueue.x-k8s.io_{KINDS[k].plural}.yaml"
           for k in ("ClusterQueue", "LocalQueue", "ResourceFlavor", "WorkloadPriorityClass")}}


def validate(manifest: dict[str, Any], k8s_version: str) -> None:
    """Raise :class:`SpecError` naming the field when ``manifest`` does not match its schema."""
    kind, name = manifest.get("kind", "?"), manifest.get("metadata", {}).get("name", "?")
    if kind in CRDS:
        error = jsonschema.exceptions.best_match(crd_validator(kind,
                                                               manifest["apiVersion"]).iter_errors(manifest))
    else:
        try:
            kubernetes_validate.validate(manifest, k8s_version, strict=True)
            return
        except kubernetes_validate.ValidationError as e:
            error = e
    if error is not None:
        where = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in error.absolute_path).lstrip(".")
        raise SpecError(f"the rendered {kind} {name!r} is invalid for Kubernetes {k8s_version}: "
                        f"{where or 'top level'}: {error.message}",
                        "fix the option that sets this field (see --help); if none does, please report it")


def validate_all(manifests: list[dict[str, Any]], k8s_version: str) -> None:
    for m in manifests:
        validate(m, k8s_version)


@lru_cache(maxsize=None)
def crd_validator(kind: str, api_version: str) -> jsonschema.protocols.Validator:
    crd = yaml.load((SCHEMA_DIR / CRDS[kind]).read_text(),
                    Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    group, _, version = api_version.partition("/")
    served = {v["name"]: v for v in crd["spec"]["versions"] if v.get("served")}
    if crd["spec"]["group"] != group or version not in served:
        raise SpecError(f"{kind} {api_version} is not in the bundled CRD (versions: {', '.join(served)})",
                        "this is a bug in eksft-nb: please report it")
    schema = _closed(copy.deepcopy(served[version]["schema"]["openAPIV3Schema"]))
    return jsonschema.Draft202012Validator(schema)


def _closed(schema: dict[str, Any]) -> dict[str, Any]:
    """Forbid undeclared properties, as the API server's strict field validation does."""
    if "properties" in schema and "additionalProperties" not in schema \
            and not schema.get("x-kubernetes-preserve-unknown-fields"):
        schema["additionalProperties"] = False
    children = list(schema.get("properties", {}).values())
    children += [schema[k] for k in ("items", "additionalProperties") if isinstance(schema.get(k), dict)]
    children += [s for k in ("anyOf", "allOf", "oneOf") for s in schema.get(k, [])]
    for child in children:
        _closed(child)
    return schema
