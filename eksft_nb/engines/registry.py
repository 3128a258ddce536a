"""The one registry of engines: an :class:`~eksft_nb.states.EngineName` to its :class:`~.base.Engine`."""

from __future__ import annotations

from collections.abc import Mapping

from ..errors import SpecError, shown
from ..spec import JobSpec
from ..states import EngineName
from .base import Engine, per_engine
from .nvrx import NVRX
from .torchft.engine import TORCHFT

ENGINES: Mapping[EngineName, Engine] = per_engine({e.name: e for e in (NVRX, TORCHFT)})


def engine_of(spec: JobSpec) -> Engine:
    """The engine ``spec``'s job runs on (a spec read back from a job's record is not validated: an engine
    this version does not know is refused in one line)."""
    try:
        return ENGINES[EngineName(spec.engine)]
    except (ValueError, TypeError):
        raise SpecError(f"unknown engine {shown(spec.engine)}",
                        f"use {' or '.join(f'--engine {e}' for e in EngineName)}") from None
