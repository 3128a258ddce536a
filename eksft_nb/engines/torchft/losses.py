"""A replica group lost, then healed: the ``failure`` and ``restart`` events of a torchft job, one
implementation for every backend (the local supervisor, the EKS event stream, the Slurm runner).

The backend says when it saw a group lost (:meth:`LostGroups.lost`: its process ended or hung, its pod
failed, its job step ended) and feeds every event of the job's ranks (:meth:`LostGroups.observe`); the
group's ``heal`` closes its incident. Both events are level ``job`` (the backend recovered the group);
the restart says what the job lost: ``downtime_s`` is the survivors' stall (they wait until the Lighthouse
drops the lost group: how much longer than a typical step the first step committed after the fault took),
``group_downtime_s`` the time until the restarted group healed, and ``skipped_batches`` the batches it
did not train.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass
from typing import Any

from ...states import RestartLevel

TYPICAL_STEPS = 20  # a step's typical time: the median of this many before a fault


@dataclass
class Loss:
    cause: str
    fault_time: float
    detected: float
    last_step: int           # the job's last step when the group was seen lost
    typical_step_s: float
    stall: float | None = None   # the survivors' stall, once a step committed after the fault


def fault_time(faults: Iterable[dict[str, Any]], group: int, started: float, detected: float,
               since: float | None = None, ranks: Collection[int] | None = None) -> float:
    """When group ``group`` was lost: an injected fault on it (one of its ``ranks``, by default the one
    numbered as the group; or the group as a node) between its start and ``detected``; else when it last
    made progress (``since``: a hang); else ``detected``."""
    ranks = (group,) if ranks is None else ranks
    return max((f["t"] for f in faults
                if (f["rank"] in ranks or f.get("node") == group) and started <= f["t"] <= detected),
               default=detected if since is None else since)


class LostGroups:
    """The groups lost and not yet healed, and the job's recent step times. ``emit(kind, **fields)``
    publishes an event; ``say(text)`` narrates (the supervisor's log, a runner's output); a group of
    ``ranks_per_group`` ranks reports its heal from its rank 0."""

    def __init__(self, emit: Callable[..., Any], say: Callable[[str], Any] = lambda text: None,
                 ranks_per_group: int = 1) -> None:
        self.emit, self.say, self.ranks_per_group = emit, say, ranks_per_group
        self.open: dict[int, Loss] = {}
        self.recent: list[tuple[float, float]] = []   # the last TYPICAL_STEPS steps: (committed at, time)

    def typical_step_s(self) -> float:
        return statistics.median([step_s for _, step_s in self.recent] or [0.0])

    def lost(self, group: int, cause: str, fault_time: float, detected: float, last_step: int) -> None:
        """Group ``group`` was seen lost at ``detected`` (lost at ``fault_time``): its ``failure``."""
        self.emit("failure", level=RestartLevel.JOB, cause=cause, blame_rank=group, fault_time=fault_time,
                  detected_at=detected)
        loss = self.open[group] = Loss(cause, fault_time, detected, last_step, self.typical_step_s())
        # a cluster sees a pod or a step end seconds after the fault: a survivors' step read since, and
        # that began after the fault (one in flight at the fault did not wait for the Lighthouse), dates it
        self._stalled(loss, next((t for t, step_s in self.recent if t - step_s > fault_time), None))

    @staticmethod
    def _stalled(loss: Loss, committed: float | None) -> None:
        """The first step committed after the fault took longer by the survivors' stall."""
        if loss.stall is None and committed is not None and committed > loss.fault_time:
            loss.stall = max(0.0, committed - loss.fault_time - loss.typical_step_s)

    def clear(self) -> None:
        """Every group was lost: their incidents end with the job's (the job-level tier's)."""
        self.open.clear()

    def observe(self, e: Any) -> None:
        """A rank's event: a committed step dates the survivors' stall; a lost group's heal closes it."""
        if e.kind == "step":
            for loss in self.open.values():
                self._stalled(loss, e.t)
            self.recent = [*self.recent[-(TYPICAL_STEPS - 1):], (e.t, e["step_time"])]
        elif e.kind == "heal" and e.rank is not None and (group := e.rank // self.ranks_per_group) in \
                self.open:
            loss = self.open.pop(group)
            stall = loss.stall if loss.stall is not None else e.t - loss.fault_time
            self.emit("restart", level=RestartLevel.JOB, cause=loss.cause, blame_rank=group,
                      fault_time=loss.fault_time, detection_s=loss.detected - loss.fault_time,
                      downtime_s=stall,
                      rolled_back_steps=max(0, loss.last_step - e["step"]), resumed_step=e["step"],
                      restored_from="peer", group_downtime_s=e.t - loss.fault_time,
                      skipped_batches=e["skipped_batches"], replica_group=group)
            self.say(f"replica group {group} healed from a peer at step {e['step']}, "
                     f"{e.t - loss.fault_time:.1f}s after the fault (skipped {e['skipped_batches']} batches)")
