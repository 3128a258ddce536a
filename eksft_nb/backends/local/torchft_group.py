"""A local replica group's processes, one per rank (``--nproc-per-node``), as the supervisor watches them.

Its rank 0 leads a process group of its own, and its other ranks join it: the registry's
kill-launcher kills the whole group, and the supervisor's mark (``procs.NODE_MARK``) ends every rank of
it. The group is lost when any of its ranks ends other than 0 (its peers in the group cannot go on
without that rank's shards), and done when every rank ended 0.
"""

from __future__ import annotations

import subprocess
from dataclasses import dataclass, field

from .launchers import Node


@dataclass
class Group(Node):
    """``popen``: the group's rank 0; ``others``: its ranks 1..N-1, in order."""

    others: list[subprocess.Popen] = field(default_factory=list)

    @property
    def processes(self) -> list[subprocess.Popen]:
        return [p for p in (self.popen, *self.others) if p is not None]

    @property
    def pids(self) -> set[int]:
        return {p.pid for p in self.processes}

    def ranks(self, size: int) -> range:
        """The group's ranks in the job (``size``: ranks per group)."""
        return range(self.index * size, (self.index + 1) * size)

    def poll(self) -> int | None:
        """The exit status of the first rank that ended other than 0; else 0 once every rank ended 0,
        None while any runs."""
        codes = [p.poll() for p in self.processes]
        lost = [c for c in codes if c not in (None, 0)]
        if lost:
            return lost[0]
        return 0 if all(c == 0 for c in codes) else None

    def lost_rank(self, size: int) -> int | None:
        """The rank in the job of the first of the group's processes that ended other than 0."""
        return next((rank for rank, p in zip(self.ranks(size), self.processes) if p.poll() not in (None, 0)),
                    None)

    def wait(self) -> None:
        for p in self.processes:
            p.wait()
