"""eksft-nb: a Jupyter-native control plane for fault-tolerant FSDP training with NVIDIA NVRx.

``%load_ext eksft_nb`` registers the ``%%ftrain`` / ``%ftrain`` magics; ``launch()`` and ``attach()``
are the same reach from plain Python, ``Dashboard(job)`` shows a job's live dashboard.
"""

from .errors import EksftError, JobError, SpecError
from .job import Job, attach, launch
from .spec import JobSpec

__all__ = ["Dashboard", "EksftError", "Job", "JobError", "JobSpec", "SpecError", "attach", "launch",
           "load_ipython_extension"]


def load_ipython_extension(ipython):
    from .magics import register

    register(ipython)


def __getattr__(name: str):
    if name == "Dashboard":  # widgets and plotly load only for a notebook that shows one
        from .dashboard import Dashboard

        return Dashboard
    if name == "__version__":  # one source, nbext/package.json, which the build writes into the metadata
        from importlib.metadata import version

        return version("eksft-nb")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
