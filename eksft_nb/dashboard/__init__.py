"""The live notebook dashboard of a job: ``Dashboard(job)`` (or ``job.dashboard()``)."""

from .dashboard import Dashboard

__all__ = ["Dashboard"]
