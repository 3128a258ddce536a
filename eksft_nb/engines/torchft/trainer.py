"""The built-in trainer as one torchft replica group (``python -m eksft_nb.engines.torchft.trainer``).

A group is one rank (torchft DDP) or, with ``--nproc-per-node N``, N ranks that shard the model with FSDP
(torchft HSDP, see :mod:`.hsdp`). Its rank 0 hosts the group's store (a Manager is only a store client);
the group forms each step's quorum through the Lighthouse, all-reduces gradients across the groups in it,
and applies them only when the quorum commits the step. A group behind the quorum (restarted, or one that
threw a step away) heals from a peer's live state and skips the batches it did not train.

It reports through the one event schema, from its rank 0: ``step`` for each committed step, once, by the
group first in its quorum or, where that group threw it away, by the first that committed it, at the next
quorum (:mod:`.steps`; after the last step every group takes one more quorum, which also heals a group that
threw that step away), ``quorum`` when its quorum changes, ``heal`` with the skipped batches,
``step_discarded`` when its gradients were thrown away.

Checkpoints cover the loss of every group: the group that reports a step saves it, if due, through the one
checkpoint package (sharded across its ranks; it holds the committed state, and only one group reports a
step), so no two groups write one folder; the others only commit an async save of theirs that finished.
Every group
restores the same checkpoint when the whole job starts (``--resume``) or restarts after every group was
lost (from the in-memory copy of the group that saved it, where it is on this host and checks out; else
from storage, with why); a group restarted alone heals from a peer instead.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ...errors import JobError
from ...runtime.quiet import quiet_process
from ...runtime.zygote import WARM_ENV
from .startup import all_groups_up
from .heal import skipped_batches
from .hold import hold, restart_point, step_point
from .hosts import group_host
from .steps import StepReport, StepReports

LAUNCHER_PID_ENV = "EKSFT_LAUNCHER_PID"  # whose process group the registry's kill-launcher kills
LAST_STEP_ENV = "EKSFT_TORCHFT_LAST_STEP"  # a restarted group: the job's last committed step when it was lost
RESTART_ENV = "EKSFT_TORCHFT_RESTART"  # a restarted group: how many times the supervisor restarted it
TIMEOUT_S = 10  # a collective or a checkpoint fetch from a peer


def main() -> None:
    quiet_process()
    from ...runtime.session import session
    from ...runtime.trainer_main import exit_cleanly
    from .alarm import Alarm
    from .listen import install

    if restart := int(os.environ.get(RESTART_ENV) or 0):
        hold(restart_point(int(os.environ["RANK"]), restart))
    setup = {"imports": time.time()}  # each set-up phase -> when it ended (rank_start's t_setup)
    # the group's ranks share one process group (its rank 0 leads it, see group.py): the
    # registry's kill-launcher, a whole replica group lost, kills that group, every rank of it
    os.environ[LAUNCHER_PID_ENV] = str(os.getpid())
    os.environ[LAST_STEP_ENV] = str(last_step(os.environ))   # before this process's beacon replaces it
    s = session()
    # the group's store, manager and checkpoint servers on the group's address alone (hosts.py), answering
    # only the job's processes (listen.py); the peers they refuse reported as intruder events
    install(Alarm(s.emit))
    setup["session"] = time.time()
    try:
        GroupTrainer(s, setup).train()
    except BaseException as e:
        s.rank_error(e)
        raise
    finally:
        s.close()
    exit_cleanly()


def last_step(env: Mapping[str, str]) -> int:
    """The step a restarted group had trained to: what its supervisor says (local, Slurm), else (a cluster's
    controller restarted it: a pod's child Job) the last progress beacon of its lost process in the job
    folder, to within one beacon interval (a read that fails: 0, and its heal counts from step 0)."""
    if env.get(LAST_STEP_ENV) or not int(env.get(RESTART_ENV) or 0):
        return int(env.get(LAST_STEP_ENV) or 0)
    try:
        beacon = Path(env["EKSFT_JOB_DIR"]) / "progress" / f"rank-{env['RANK']}.json"
        step = json.loads(beacon.read_text())["step_done"]
    except (OSError, ValueError, KeyError, TypeError):
        return 0
    return step if type(step) is int and step >= 0 else 0


class GroupTrainer:
    def __init__(self, s: Any, setup: dict[str, float] | None = None) -> None:
        import torch
        import torch.distributed as dist
        from torch.distributed import TCPStore
        from torchft import Manager, ProcessGroupGloo

        from ...runtime.checkpoint import ModelState
        from ...runtime.data import SyntheticCorpus
        from ...runtime.model import build_model
        from .hsdp import join, replicate

        self.s, self.spec, self.setup = s, s.spec, setup if setup is not None else {}
        env, spec = os.environ, s.spec
        self.group = int(env["REPLICA_GROUP_ID"])
        self.local_rank, size = s.info.local_rank, spec.nproc_per_node   # the rank within the group
        self.lead = self.local_rank == 0   # the group's rank 0: it reports for the group
        self.last_step = int(env.get(LAST_STEP_ENV) or 0)
        self.shared: int | None = None   # a step it threw away after its gradients went out (.heal)
        if env.get(WARM_ENV) == "1" and spec.checkpoint.mode == "async":
            # forked from its zygote: its writer processes are forked too while no native thread runs yet
            # (the store's and the Manager's would make them spawn, importing torch again: checkpoint.writer)
            s.checkpointing().writer.start()
        torch.set_num_threads(spec.threads_per_rank)
        port, host = int(env["MASTER_PORT"]), group_host()   # the peers reach this group's store there
        # the group's rank 0 hosts its store, its other ranks join it
        self.store = TCPStore(host, port, is_master=self.local_rank == 0, wait_for_workers=False)
        timeout = datetime.timedelta(seconds=TIMEOUT_S)
        # the checkpoint package's collectives, and FSDP's with N ranks, run within the group
        join(self.store, self.local_rank, size, s.checkpoint_group_timeout())
        vocab, d_model, n_layers, n_heads = spec.model.dims()
        self.model = build_model(
            vocab, d_model, n_layers, n_heads, spec.seq, spec.seed, torch.device("cpu"), fsdp=size > 1
        )
        self.optim = torch.optim.AdamW(self.model.parameters(), lr=spec.lr)
        self.setup["model"] = time.time()
        self.data = SyntheticCorpus(vocab, spec.seq, spec.batch, spec.seed, s.rank)
        self.manager = Manager(
            pg=ProcessGroupGloo(timeout=timeout),
            min_replica_size=1,
            load_state_dict=self._load,
            state_dict=self._state,
            use_async_quorum=False,
            replica_id=f"group{self.group}",
            rank=self.local_rank,
            world_size=size,
            store_addr=host,
            store_port=self.store.port,  # the one it took, where a cluster's group asks for any
            timeout=timeout,
            connect_timeout=timeout,
        )
        self.setup["manager"] = time.time()  # it heartbeats: the Lighthouse counts the group healthy
        self.ddp = replicate(self.manager, self.model)
        self.reports = StepReports(s, self.manager, report=self.lead)
        self.quorum_id: int | None = None
        self.ckpt = s.checkpoints(dist.group.WORLD)
        if self.lead:
            self.ckpt.emit = s.emit  # every group reports its own saves (the session's filter is rank 0's)
        # each rank's staging buffers in shared memory of its own (its rank in the job); after every group
        # was lost, a rank restores from the copy of the same rank of whichever group on this host holds
        # the newest committed checkpoint (one group saves each step), checked as its own would be
        self.ckpt.shelf.bind(self.ckpt.job_uid, s.rank, spec.world_size)
        self.ckpt.peer_copies = tuple(g * size + self.local_rank for g in range(spec.nnodes))
        self.state = {"train": ModelState(self.model, self.optim), "torchft": self.manager}
        self.setup["wiring"] = time.time()  # DDP, the group's own process group, the checkpoint package

    def _state(self) -> dict[str, Any]:
        from .hsdp import local_state

        return local_state(self.model, self.optim)

    def _load(self, state: dict[str, Any]) -> None:
        from .hsdp import load_local_state

        load_local_state(self.model, self.optim, state)

    def train(self) -> None:
        from ...runtime.model import loss_fn
        from ...runtime.session import InjectedFault
        from .hsdp import replicate

        s, spec, manager = self.s, self.spec, self.manager
        tokens_per_step = spec.batch * spec.seq * spec.nproc_per_node   # a group's
        restart = int(os.environ.get(RESTART_ENV) or 0)
        if not restart:  # the whole job (re)starts: every group from the same checkpoint
            self._restore()
            all_groups_up(s, self.group)
        s.rank_start(manager.current_step(), replica_group=self.group, group_restart=restart,
                     t_setup=self.setup)
        while True:  # after the last step, one more quorum (see the module's docstring)
            before = manager.current_step()
            hold(step_point(s.rank, before + 1))
            armed: InjectedFault | None = None
            try:
                if before < spec.steps:
                    s.step_begin(before + 1)
            except InjectedFault as e:  # raised inside this step's backward instead (see _raise_in_backward)
                armed = e
            t0 = time.perf_counter()
            try:
                manager.start_quorum()  # synchronous: heals from a peer here when behind the quorum
            except Exception as e:
                if before < spec.steps:
                    raise
                # the quorum after the last step (which heals a group that threw that step away) failed:
                # this group committed the last step itself, and its weights are the job's to report
                if self.lead:
                    s.warn("last-quorum", f"replica group {self.group}'s quorum after the last step failed "
                           f"({str(e)[:200]}); it committed step {before} itself and reports its weights")
                break
            self.optim.zero_grad(set_to_none=True)
            self._after_quorum(before, time.perf_counter() - t0)
            if manager.current_step() >= spec.steps:
                break
            step = manager.current_step() + 1
            loss = loss_fn(self.ddp, self.data.batch_at(step - 1))
            if armed is not None:
                self._raise_in_backward(armed)
            try:
                loss.backward()
            except InjectedFault as e:
                manager.report_error(e)
                # DDP's reducer was left mid-iteration: a fresh wrapper (cheap: it broadcasts nothing)
                self.ddp = replicate(manager, self.model)
            if manager.should_commit():
                self.optim.step()
                took, value = time.perf_counter() - t0, float(loss.detach())
                groups = manager.num_participants()
                tokens = tokens_per_step * groups
                s.step_end(step, value, tokens, took, report=False)
                batches = groups * spec.nproc_per_node   # one a rank
                self.reports.committed(StepReport(step, value, tokens, took, batches, time.time()))
                if manager.participating_rank() == 0:  # it holds the committed state; no other group is first
                    # (every rank of it: the save is sharded across them)
                    self.ckpt.maybe_save(step, self.state, last=step == spec.steps)
                else:
                    self.ckpt.settle()
            else:  # the group's vote: one rank's error throws the step away on every rank of it
                self.shared = step  # its gradients went out: the peers that commit the step hold its batches
                if self.lead:
                    error = manager.errored()
                    s.emit("step_discarded", step=step, reason=str(error.original_exception)[:200] if error
                           else "the quorum did not commit the step")
        self.ckpt.finish()
        s.emit("rank_end", final_step=manager.current_step(), digest=self.digest(), replica_group=self.group)
        manager.shutdown(wait=False)

    def _restore(self) -> None:
        """Load the checkpoint the job starts from (``--resume``; after every group was lost, this job's
        newest that loads) into the model, the optimizer and the manager's step. A restart that finds none
        starts from step 0, said (a checkpoint skipped for an older one is said by the checkpoint package)."""
        step = self.ckpt.restore(self.state, self.spec.resume, self.s.restarting)
        if step == 0 and self.s.restarting and self.lead:
            self.s.warn(
                "fresh-start",
                f"every replica group was lost and no checkpoint of this job loads: replica group "
                f"{self.group} trains again from step 0",
            )

    def _after_quorum(self, before: int, quorum_s: float) -> None:
        """Report (and save, if due) a step this group held that went unreported (see :mod:`.steps`: its
        state is still that step's), a new quorum, and a heal from a peer with the batches this group
        skipped."""
        manager = self.manager
        if (late := self.reports.after_quorum()) is not None:  # and it saves the step, if one is due
            self.ckpt.maybe_save(late, self.state, last=late == self.spec.steps)
        now = manager.current_step()
        quorum_id = manager._quorum_id  # torchft 0.2.0 has no public accessor for it
        if quorum_id != self.quorum_id:
            self.quorum_id = quorum_id
            if self.lead:
                self.s.emit("quorum", quorum_id=quorum_id, participants=manager.num_participants(), step=now)
        if now < self.last_step:  # no group in the quorum holds the job's state any more
            raise JobError(
                f"replica group {self.group} found no peer at step {self.last_step} or later to heal "
                f"from (the quorum is at step {now}): every group that held the job's state was lost",
                "the supervisor restarts every group from the newest checkpoint",
            )
        if now != before and self.lead:
            trained = before or self.last_step  # a fresh process starts at 0: it trained up to last_step
            skipped = skipped_batches(trained, now, ranks=self.spec.nproc_per_node, shared=self.shared,
                                      async_quorum=False)
            self.s.emit("heal", from_step=trained, step=now, skipped_batches=skipped, heal_s=quorum_s)

    def _raise_in_backward(self, error: BaseException) -> None:
        """Raise ``error`` at the end of this step's backward, after every gradient went out to the other
        groups (so the peers' all-reduce completes) but before the optimizer: the step is then thrown away
        (by every rank of the group: their commit vote is one)."""
        from torch.autograd import Variable

        def fail() -> None:
            raise error

        def hook(_: Any) -> None:
            handle.remove()
            Variable._execution_engine.queue_callback(fail)

        # the token embedding's gradient is the last backward computes: DDP's reducer queued its own
        # callback (which waits for every bucket's all-reduce) earlier, so it runs first; FSDP calls the
        # hook on the gradient's shard after its all-reduce hook, in its own end-of-backward callback
        handle = self.model.tok.weight.register_post_accumulate_grad_hook(hook)

    def digest(self) -> str:
        """SHA-256 over the full parameters in name order, as the NVRx trainer's (sharded: gathered within
        the group, a collective; every rank of a group reports the same)."""
        h = hashlib.sha256()
        for name, p in sorted(self.model.named_parameters()):
            full = p.full_tensor() if hasattr(p, "full_tensor") else p
            h.update(name.encode())
            h.update(full.detach().cpu().contiguous().numpy().tobytes())
        return h.hexdigest()[:16]


if __name__ == "__main__":
    main()
