"""Where a job lives: the backend, built with the settings the job was launched with, that holds a job
of a name, from any process.

A backend is built from settings (an EKS namespace and kubeconfig context, a Slurm shared folder), and only
one built with a job's settings finds it. So a launch records them (``$EKSFT_HOME/whereabouts/BACKEND/
NAME.json``) and every later command rebuilds the job's backend from that record, in any process; a name
given with no backend is looked for on every backend that can hold it (local; Slurm; EKS where a
kubeconfig is set), and two jobs of one name are named both, with the flag that picks one.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence
from pathlib import Path

from ..control import FaultCommand
from ..errors import EksftError, JobError, UnknownJobError, shown
from ..jobdir import atomic_write, eksft_home
from ..spec import JobSpec
from ..spec_checks import BACKENDS, DNS1123_LABEL, valid_name
from . import get_backend
from .base import Backend

RECORDS = "whereabouts"
RECORD_BYTES = 4096
PROBE_TIMEOUT = 5.0   # seconds a cluster has to answer whether it holds a name (one that does not: said)

# each value a record may hold, checked as it is read (a file: untrusted)
_VALID: dict[str, Callable[[str], bool]] = {
    "namespace": lambda v: len(v) <= 63 and DNS1123_LABEL.match(v) is not None,
    "context": lambda v: 0 < len(v) <= 253 and v.isprintable(),
    "shared_dir": lambda v: len(v) <= 4096 and v.isprintable() and os.path.isabs(v),
}


def _path(backend: str, name: str) -> Path:
    return eksft_home() / RECORDS / backend / f"{name}.json"


def of_spec(spec: JobSpec) -> Backend:
    """The backend that launches ``spec`` and finds its job: built with the spec's settings."""
    return get_backend(spec.backend, **get_backend(spec.backend).locator(spec))


def launch(backend: Backend, spec: JobSpec, faults: Sequence[FaultCommand] = ()) -> None:
    """Start the job (a spec the command layer checked) on ``backend``, then record where it lives."""
    backend.launch(spec, list(faults))
    settings = backend.locator(spec)
    path = _path(backend.name, spec.name)
    if settings:
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        atomic_write(path, json.dumps(settings))
    else:
        path.unlink(missing_ok=True)


def forget(backend: str, name: str) -> None:
    """Drop the record of a job that was removed."""
    if backend in BACKENDS and valid_name(name):
        _path(backend, name).unlink(missing_ok=True)


def recorded(backend: Backend, name: str) -> dict[str, str]:
    """The settings a job of ``name`` was launched with on ``backend``'s kind of backend ({}: none recorded).
    A record that is not one eksft wrote is refused in one line, and changes nothing."""
    path = _path(backend.name, name)
    if not valid_name(name) or not path.is_file():
        return {}
    try:
        with path.open("rb") as f:
            raw = f.read(RECORD_BYTES + 1)
        record = json.loads(raw) if len(raw) <= RECORD_BYTES else None
    except (OSError, ValueError):
        record = None
    if not (isinstance(record, dict)
            and all(k in backend.locator_keys and isinstance(v, str) and _VALID.get(k, bool)(v)
                    for k, v in record.items())):
        raise JobError(f"the record of where {backend.name} job {name!r} runs ({path}) is not one eksft "
                       "wrote", f"delete it (the {backend.name} backend's defaults are then used)")
    return record


def rebuilt(backend: str, name: str, **options: float) -> Backend:
    """The ``backend`` that finds job ``name``: built with the settings recorded at its launch."""
    default = get_backend(backend)
    settings = recorded(default, name)
    return get_backend(backend, **settings, **options) if settings or options else default


def find(name: str, backend: str | None = None) -> Backend:
    """The backend that holds job ``name``: ``backend``'s, else the one of every backend that holds a job
    of that name. None: an :class:`UnknownJobError` that says where it looked (and which cluster did not
    answer); two or more: refused, naming each, with the ``--backend`` that picks one."""
    if backend is not None:
        return rebuilt(backend, name)
    found: list[Backend] = []
    searched: list[str] = []
    unanswered: list[str] = []
    missing: UnknownJobError | None = None
    for kind in BACKENDS:
        if kind == "eks" and not (_path(kind, name).is_file() or _kubeconfig_here()):
            continue   # not even imported: the Kubernetes client takes seconds to import
        probe = rebuilt(kind, name, **({"request_timeout": PROBE_TIMEOUT} if kind == "eks" else {}))
        if kind != "local" and not (probe.configured() or recorded(probe, name)):
            continue
        searched.append(kind)
        try:
            probe.spec(name)
        except UnknownJobError as e:
            missing = missing or e   # the first backend's (local: it names the jobs there)
            continue
        except EksftError as e:   # a cluster that does not answer hides no job found elsewhere
            if kind == "local":   # its folder is there and does not read: said as it is
                raise
            unanswered.append(f"{kind} did not answer ({e.problem})")
            continue
        found.append(rebuilt(kind, name) if kind == "eks" else probe)
    if len(found) > 1:
        kinds = [b.name for b in found]
        raise JobError(f"{shown(name)} names a job on {len(kinds)} backends: {_listed(kinds, 'and')}",
                       f"pick one with {_listed([f'--backend {k}' for k in kinds], 'or')}")
    if found:
        return found[0]
    assert missing is not None   # local is always searched, and answers
    elsewhere = f", nor on {_listed(searched[1:], 'or')}" if searched[1:] else ""
    raise UnknownJobError(f"{missing.problem}{elsewhere}" + "".join(f"; {u}" for u in unanswered),
                          missing.fix)


def _kubeconfig_here() -> bool:
    """Whether this machine may reach a cluster: a kubeconfig, a context named, or a pod's service account
    (:meth:`EksBackend.configured` says it exactly, once the client is imported)."""
    files = (os.environ.get("KUBECONFIG") or "~/.kube/config").split(os.pathsep)
    return (any(f and Path(f).expanduser().is_file() for f in files)
            or any(os.environ.get(v) for v in ("EKSFT_CONTEXT", "KUBERNETES_SERVICE_HOST")))


def _listed(words: list[str], last: str) -> str:
    """``a, b and c``."""
    return f"{', '.join(words[:-1])} {last} {words[-1]}" if len(words) > 1 else words[0]
