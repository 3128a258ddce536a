"""Which replica group reports a committed step: the group first in the step's quorum, or, where that group
threw the step away, the first of those that committed it, at the next quorum.

torchft decides a step's commit per replica group: a group whose step raised throws it away while the others
commit it. The group first in the step's quorum reports the step when it commits it, at once. Every other
group that commits it holds its report (its own loss, tokens, time, the groups that trained it, and when it
ended) until its next quorum, and there drops it, unless the step went unreported: the quorum's max step is
that step, this group is the first of the groups there (torchft's ``max_replica_rank`` 0: those that
committed it), and a group ranked before it in the step's quorum is in this quorum behind it (it threw the
step away). So a step is reported once, by a group that trained it; a later quorum finds no report held,
and a group that heals held none. Not reported: a step the first group threw away and was then lost before
the next quorum. Reported twice (three groups or more): a step whose first group committed it and was lost
before the next quorum, while another group ranked before the reporter threw it away.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class StepReport:
    step: int
    loss: float | None
    tokens: int | None
    step_time: float
    batches: int    # the ranks whose batches the committed step trained (every rank of its groups)
    t: float        # when the step ended


class QuorumSeen:
    """A Manager's client, seen through: the last quorum it returned (torchft 0.2.0 keeps the replica ids
    and the rank among the groups at the max step only inside its quorum call)."""

    def __init__(self, client: Any) -> None:
        self._client, self.last = client, None

    def _quorum(self, *args: Any, **kwargs: Any) -> Any:
        self.last = self._client._quorum(*args, **kwargs)
        return self.last

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)


class StepReports:
    """One replica group's step reports (see the module's docstring): ``committed`` after each step it
    committed, ``after_quorum`` once each quorum returned."""

    def __init__(self, s: Any, manager: Any, report: bool = True) -> None:
        # every rank of a group decides alike (a late report's save is the group's); ``report``: it emits
        self.s, self.manager, self.emits = s, manager, report
        self.quorum = manager._client = QuorumSeen(manager._client)
        self.held: tuple[StepReport, set[str]] | None = None  # and the groups ranked before this one then

    def committed(self, report: StepReport) -> None:
        """This group committed ``report``'s step: report it if first in its quorum, else hold it."""
        if self.manager.participating_rank() == 0:
            self.held = None
            self.report(report)
            return
        quorum = self.quorum.last   # torchft ranks a quorum's groups by replica id
        self.held = report, set(sorted(quorum.replica_ids)[:quorum.replica_rank]) if quorum else set()

    def after_quorum(self) -> int | None:
        """Report the held step if it went unreported (see the module's docstring), and return it; drop it
        either way."""
        held, self.held, quorum = self.held, None, self.quorum.last
        if held is None or quorum is None:
            return None
        report, before = held
        unreported = before & set(quorum.replica_ids)   # a group ranked before this one then, here behind it
        if quorum.max_step == report.step and quorum.max_replica_rank == 0 and unreported:
            self.report(report)
            return report.step
        return None

    def report(self, r: StepReport) -> None:
        if self.s.instrumented and self.emits:
            self.s.emit("step", step=r.step, loss=r.loss, tokens=r.tokens, step_time=r.step_time,
                        batches=r.batches, t=r.t)
