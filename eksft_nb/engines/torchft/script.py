"""A user's torchft script as one replica group (``python -m eksft_nb.engines.torchft.script SCRIPT ARGS``).

The script runner (:mod:`eksft_nb.runtime.script`) runs it unmodified, as torchrun would run one replica
group of one rank: this process hosts the group's store on loopback (``MASTER_ADDR``/``MASTER_PORT``, which
the script's ``Manager`` and any ``init_process_group`` connect to), and the script sees ``RANK=0`` and
``WORLD_SIZE=1`` (its rank in its group; the job's events still name the group). :class:`TorchftProbe` adds,
around torchft's ``Manager``, with no change to the script:

- torchft's manager and checkpoint servers on loopback (:mod:`.listen`), and at the job's start every group
  waits for the others (:mod:`.startup`);
- a ``step`` event for each step torchft committed, numbered as torchft does (``current_step()``), counted
  by the optimizer-step hook and reported once: by the group first in the step's quorum or, where that group
  threw it away, by the first that committed it, at the next quorum (:mod:`.steps`; the script's last step
  has no next quorum);
- ``quorum`` when the group's quorum, or who takes part in it, changes and ``heal`` when it healed from
  a peer (from its quorum thread), ``step_discarded`` when ``should_commit()`` threw the step away;
- the ``exception`` fault thrown into the next step: the error is reported to the Manager before it decides
  the commit (as torchft's own wrappers report a failed collective), so the group throws that step away and
  heals it from a peer; sigkill and slow-rank fire as for any script;
- the weights' digest (the primary optimizer's parameters) in ``rank_end``, to compare the groups.

What cannot work is refused in one line (the job ends with it, not restarted): a script that steps its
optimizer, or ends, with no torchft ``Manager``; a restarted group that finds no peer holding the job's
state. The group's process then exits with :data:`REFUSED_EXIT`.
"""

from __future__ import annotations

import functools
import hashlib
import os
import signal
import time
from types import ModuleType
from typing import Any, NoReturn

from ...errors import EksftError, JobError
from ...runtime.quiet import quiet_process
from ...runtime.script import ScriptProbe, when_imported
from ...runtime.script import main as run_script
from .heal import skipped_batches
from .hold import hold, restart_point
from .startup import all_groups_up
from .steps import StepReport, StepReports
from .trainer import LAST_STEP_ENV, RESTART_ENV

REFUSED_EXIT = 78  # sysexits' EX_CONFIG: the script cannot run under --engine torchft; restarting won't help
FIX = "create a torchft Manager (see examples/torchft_train.py), or run the script with --engine nvrx"


def main() -> None:
    quiet_process()
    from torch.distributed import TCPStore

    from ...loopback import install
    from ...runtime.session import session

    install()
    if restart := int(os.environ.get(RESTART_ENV) or 0):
        hold(restart_point(int(os.environ["RANK"]), restart))
    session()  # names the group (RANK) before the script's environment below replaces it
    env = os.environ
    # a replica group's store, as torchrun's agent hosts it (kept open while the script runs), on a port
    # it takes itself: one the supervisor found free seconds before can be taken meanwhile (CI saw
    # "Address already in use" restart a group); the script reads the one it took
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    env.update(MASTER_PORT=str(store.port), RANK="0", LOCAL_RANK="0", GROUP_RANK="0", WORLD_SIZE="1",
               LOCAL_WORLD_SIZE="1", TORCHELASTIC_USE_AGENT_STORE="True")
    try:
        run_script(TorchftProbe)
    finally:
        del store


def refuse(s: Any, error: EksftError) -> NoReturn:
    """End this group with ``error`` (one line), which the supervisor ends the job with."""
    s.emit("rank_error", error=str(error), step=s.step_entered or None, origin="exception")
    s.close()
    os._exit(REFUSED_EXIT)


def refusal(rank_errors: list[dict[str, Any]], group: int) -> str:
    """The line a group that exited with :data:`REFUSED_EXIT` ended the job with (``rank_errors``: the
    job monitor's)."""
    said = [e["error"] for e in rank_errors if e["rank"] == group]
    return said[-1] if said else f"replica group {group}'s script cannot run under --engine torchft: {FIX}"


class TorchftProbe(ScriptProbe):
    """The script runner's probe, with torchft's Manager watched (see the module's docstring)."""

    def __init__(self, s: Any) -> None:
        from ...runtime.faults import FAULT_SIGNAL

        super().__init__(s)
        self.manager: Any = None  # the script's (first) torchft Manager
        self.reports: StepReports | None = None  # its committed steps' reports (see .steps)
        self.group = s.rank
        self.last_step = int(os.environ.get(LAST_STEP_ENV) or 0)
        self.quorum: tuple[int, int] | None = None  # the last reported: its id, how many groups take part
        self.armed: BaseException | None = None  # an injected exception, for the next commit decision
        self.shared: int | None = None  # a step it threw away after its gradients went out (.heal)
        signal.signal(FAULT_SIGNAL, self._arm)
        when_imported("torchft.manager", self._hook_manager)

    # ---- steps -------------------------------------------------------------------------------------
    def count(self) -> tuple[int, bool] | None:
        """A step counts once torchft committed it (its number: the Manager's); :mod:`.steps` says which
        group reports it."""
        if self.manager is None:
            refuse(self.s, JobError("the script stepped its optimizer before creating a torchft Manager: "
                                    "--engine torchft runs replica groups that train through one", FIX))
        step = self.manager.current_step()
        if step <= self.steps:  # the optimizer stepped though torchft did not commit (nothing new)
            return None
        self.steps = step
        return step, True

    def report(self, step: int, step_time: float) -> None:
        self.reports.committed(StepReport(step, None, None, step_time, self.manager.num_participants(),
                                          time.time()))

    def on_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        from ...runtime.session import InjectedFault

        try:
            super().on_step(optimizer, args, kwargs)
        except InjectedFault as e:  # fired at the end of this step: it goes into the next one
            self.armed = e

    def _arm(self, *_signal: Any) -> None:
        """The fault signal's handler (in the main thread): arm the injected exception for the next
        commit decision rather than raise it wherever the script is."""
        from ...runtime.session import InjectedFault

        try:
            self.s.raise_pending()
        except InjectedFault as e:
            self.armed = e

    def ended(self, exit_code: int) -> dict[str, Any]:
        if self.manager is None and exit_code == 0:
            refuse(self.s, JobError("the script ended without creating a torchft Manager: --engine torchft "
                                    "runs replica groups that train through one", FIX))
        return {"digest": self.digest(), "replica_group": self.group}

    def digest(self) -> str | None:
        """SHA-256 over the primary optimizer's parameters, in its order (None before its first step)."""
        optimizer = self.primary() if self.primary is not None else None
        if optimizer is None:
            return None
        h = hashlib.sha256()
        for group in optimizer.param_groups:
            for p in group["params"]:
                h.update(p.detach().cpu().contiguous().numpy().tobytes())
        return h.hexdigest()[:16]

    # ---- torchft's Manager -------------------------------------------------------------------------
    def _hook_manager(self, module: ModuleType) -> None:
        """Watch the first Manager the script creates: its quorums, heals and commit decisions."""
        from .alarm import Alarm
        from .listen import install

        # before the Manager starts its servers: they answer only the job's processes; a transport of the
        # script's own that would load what a peer sends ends the group with one line
        install(Alarm(self.s.emit), refuse=lambda error: refuse(self.s, error))
        manager_type, probe = module.Manager, self
        init, quorum, commit = manager_type.__init__, manager_type._async_quorum, manager_type.should_commit

        @functools.wraps(init)
        def __init__(manager: Any, *args: Any, **kwargs: Any) -> None:
            init(manager, *args, **kwargs)
            if probe.manager is None:
                probe.manager, probe.reports = manager, StepReports(probe.s, manager)
                if not int(os.environ.get(RESTART_ENV) or 0):
                    all_groups_up(probe.s, probe.group)  # its manager heartbeats meanwhile

        @functools.wraps(quorum)
        def _async_quorum(manager: Any, *args: Any, **kwargs: Any) -> None:
            before, t0 = manager._step, time.perf_counter()
            quorum(manager, *args, **kwargs)
            if manager is probe.manager:
                probe.after_quorum(before, time.perf_counter() - t0)

        @functools.wraps(commit)
        def should_commit(manager: Any, *args: Any, **kwargs: Any) -> bool:
            if manager is probe.manager and probe.armed is not None:
                manager.report_error(probe.armed)
                probe.armed = None
            ours = manager is probe.manager
            took_part = ours and manager.is_participating()  # its gradients went out (not zeroed: healing)
            committed = commit(manager, *args, **kwargs)
            if ours and not committed:
                error = manager.errored()
                if took_part:
                    probe.shared = manager.current_step() + 1
                probe.s.emit("step_discarded", step=manager.current_step() + 1,
                             reason=str(error.original_exception)[:200] if error
                             else "the quorum did not commit the step")
            return committed

        manager_type.__init__, manager_type._async_quorum = __init__, _async_quorum
        manager_type.should_commit = should_commit

    def after_quorum(self, before: int, quorum_s: float) -> None:
        """In the Manager's quorum thread: report a new quorum, and a heal from a peer with the batches
        this group skipped (torchft 0.2.0 has no public accessors for what is read here)."""
        manager, s = self.manager, self.s
        self.reports.after_quorum()
        now = manager._step
        # with torchft's async quorum (its default) a group that heals takes part from the next step on, in
        # the same quorum: a change of who takes part is reported as a change of quorum is
        quorum = (manager._quorum_id, manager._participating_replica_world_size)
        if quorum != self.quorum:
            self.quorum = quorum
            s.emit("quorum", quorum_id=quorum[0], participants=quorum[1], step=now)
        if now < self.last_step:
            refuse(s, JobError(
                f"replica group {self.group} found no peer at step {self.last_step} or later to heal from "
                f"(its quorum is at step {now}): every group that held the job's state was lost",
                "run the job again (from the script's own checkpoint, if it writes one)"))
        if manager._healing and now != before:
            trained = before or self.last_step  # a fresh process starts at 0: it trained up to last_step
            s.emit("heal", from_step=trained, step=now, heal_s=quorum_s, skipped_batches=skipped_batches(
                trained, now, ranks=1, shared=self.shared, async_quorum=manager._use_async_quorum))


if __name__ == "__main__":
    main()
