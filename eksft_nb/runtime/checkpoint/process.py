"""What a rank process keeps across its checkpoint managers (a new one at every in-process restart)."""

from __future__ import annotations

from dataclasses import dataclass, field

from .staging import Stager
from .writer import AsyncWriter


@dataclass
class CheckpointProcess:
    """The rank process's NVRx writer and its staging buffers, which after a commit are the newest
    in-memory copy of the checkpoint. Whoever owns the rank process makes one and hands it to every
    manager it makes (the session does, see :meth:`~eksft_nb.runtime.session.Session.checkpointing`);
    a manager made without one makes its own."""

    writer: AsyncWriter = field(default_factory=AsyncWriter)
    stager: Stager = field(default_factory=Stager)
