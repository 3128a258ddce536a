"""Backends: where a job's ranks run. ``get_backend("local" | "eks" | "slurm")``."""

from __future__ import annotations

from ..errors import SpecError, shown
from .base import Backend, EventSource, JobSummary

__all__ = ["Backend", "EventSource", "JobSummary", "get_backend"]


def get_backend(name: str, **kwargs: object) -> Backend:
    if name == "local":
        from .local import LocalBackend

        return LocalBackend(**kwargs)  # type: ignore[arg-type]
    if name == "eks":
        from .eks import EksBackend

        return EksBackend(**kwargs)  # type: ignore[arg-type]
    if name == "slurm":
        from .slurm import SlurmBackend

        return SlurmBackend(**kwargs)  # type: ignore[arg-type]
    raise SpecError(f"unknown backend {shown(name)}", "use --backend local, eks or slurm")
