"""The live notebook dashboard of a job: ``Dashboard(job)`` (the magics show it for the jobs they launch and
attach)."""

from .dashboard import Dashboard

__all__ = ["Dashboard"]
