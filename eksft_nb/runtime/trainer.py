"""The built-in trainer (see :mod:`eksft_nb.runtime.trainer_main` for the entry point)."""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import os
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ..engines.torchft.hold import hold, step_point
from ..timeouts import PROCESS_GROUP_S, derive, wrapper_barrier
from .checkpoint import ModelState
from .checkpoint.resume import NoStartPoint
from .checkpoint.writer import WAIT_SLICE_S
from .data import SyntheticCorpus
from .keepalive import keepalive
from .live import LiveSettings
from .model import build_model, loss_fn
from .peers import abort_chain
from .peers import shutdown as shutdown_gloo
from .session import Session, session


LAST_CALL_WAIT_S = 0.1


class Trainer:
    def __init__(self, s: Session, call_wrapper: Any = None, t_enter: float | None = None) -> None:
        self.s, self.spec, self.call_wrapper, self.t_enter = s, s.spec, call_wrapper, t_enter
        spec = self.spec
        use_cuda = spec.device == "cuda" or (spec.device == "auto" and torch.cuda.is_available())
        self.device = torch.device("cuda", s.info.local_rank) if use_cuda else torch.device("cpu")
        if use_cuda:
            torch.cuda.set_device(self.device)
        torch.set_num_threads(spec.threads_per_rank)
        self._init_process_group("nccl" if use_cuda else "gloo")
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        if self.world != spec.world_size:
            raise RuntimeError(f"world size {self.world} != spec {spec.world_size}: restarting "
                               "the whole group")
        self.ckpt_group = dist.new_group(backend="gloo", timeout=s.checkpoint_group_timeout())
        self.t_group = time.time()   # the process groups are formed (a recovery's re-formation ends)
        vocab, d_model, n_layers, n_heads = spec.model.dims()
        self.model = build_model(vocab, d_model, n_layers, n_heads, spec.seq, spec.seed, self.device,
                                 fsdp=True)
        self.optim = torch.optim.AdamW(self.model.parameters(), lr=spec.lr)
        self.data = SyntheticCorpus(vocab, spec.seq, spec.batch, spec.seed, self.rank)
        self.step = 0
        self.state = {"train": ModelState(self.model, self.optim), "data": self.data}
        self.ckpt = s.checkpoints(self.ckpt_group, atomic=call_wrapper.atomic if call_wrapper else None,
                                  keepalive=self._keepalive)
        self.live = LiveSettings(s.job_dir, spec, self.rank, s.emit, s.warn)
        self._set_live(self.live.values)

    def _set_live(self, values: dict[str, int]) -> None:
        """The checkpoint manager saves and prunes by the live settings in force (see .live)."""
        self.ckpt.every, self.ckpt.keep_last = values["ckpt-every"], values["keep-last"]

    def _keepalive(self) -> None:
        self.s.heartbeat()
        if self.call_wrapper is not None:
            self.call_wrapper.ping()

    def _save_without_writer(self) -> None:
        """A drain saves synchronously on every rank: a cold rank's async writer dies of the same SIGTERM
        (its process group's), at a moment no rank can agree on, so the save in flight is abandoned
        (never committed) and the writer stopped. A rank whose writer is alive (its peer was signalled, not
        it) waits for the writer to end (up to 10 s), and its peers for it before they save, in a polled
        barrier: a blocking collective stalls NVRx's progress watchdog as a blocking join does (see
        ``writer._join``), and the in-process soft timeout would take the waiting rank for hung."""
        self.ckpt.writer.stop()
        self.ckpt.pending, self.ckpt.mode = None, "sync"
        stopped = dist.barrier(group=self.ckpt_group, async_op=True)
        while not stopped.is_completed():
            time.sleep(WAIT_SLICE_S)
        stopped.wait()   # raises what failed it

    def _beat_through_drain(self) -> contextlib.AbstractContextManager[None]:
        """Beat for this rank (heartbeats, in-process pings) from the drain's agreement to its end: every rank
        waits there, for its writer to stop or for its peers', without stepping, and ft_launcher or the
        in-process soft timeout would restart it mid-drain. Within the grace period only: a rank hung in its
        drain is still caught."""
        return keepalive(self._keepalive, budget=derive(self.spec).grace.seconds)

    def _drained(self, step: int, asked: int, save_s: float) -> None:
        """Every rank saved ``step`` (or it was committed already) and stops: rank 0 says so, and each rank
        leaves its mark for the process around its launcher (see :mod:`.drain`)."""
        committed = self.ckpt.last_committed == step
        if self.rank == 0:
            self.s.emit("drain", step=step, committed=committed, ranks_asked=asked, save_s=save_s,
                        path=str(self.ckpt.root) if committed else None)
        dist.barrier(group=self.ckpt_group)
        if self.s.drain is not None:
            self.s.drain.drained(step, committed)

    def _restore_overrun(self, budget: float, took: float | None = None) -> None:
        """Warn that a restore outlasts the keepalive's budget: from then on the timeouts count it as a
        hang."""
        if self.rank != 0:
            return
        ft, mbps = self.spec.ft, self.spec.checkpoint.storage_mbps
        what = f"took {took:.0f} s" if took is not None else f"has run {budget:.0f} s"
        self.s.warn("slow-restore", f"the restore {what}, longer than the timeouts allow ({budget:.0f} s of "
                    f"keepalive, then the heartbeat timeout of {ft.heartbeat_timeout:g} s): set "
                    "--storage-mbps to "
                    f"what the storage delivers (now {mbps:g}) or raise --initial-heartbeat-timeout")

    def _check_save_pace(self, step: int, save_s: float, was_deferred: bool, loop_s: float,
                         steps: int) -> None:
        """Warn when a save takes longer than the checkpoint interval: an async save still being written
        when the next is due (so that one is deferred), or a sync save that blocks for longer."""
        every = self.ckpt.every
        if self.rank != 0 or not every:
            return
        interval_s = every * (loop_s - save_s) / steps   # the steps' time, without this save's
        if self.ckpt.deferred and not was_deferred:
            self.s.warn("slow-save",
                        f"the save before step {step} is still being written when the next is due "
                        f"(every {every} steps, ~{interval_s:.1f} s): saves take longer than the checkpoint "
                        "interval; raise --ckpt-every or use faster storage")
        elif self.spec.checkpoint.mode == "sync" and save_s > interval_s > 0:
            self.s.warn("slow-save", f"the save at step {step} blocked for {save_s:.1f} s, longer than the "
                        f"checkpoint interval (every {every} steps, ~{interval_s:.1f} s); raise --ckpt-every "
                        "or use --ckpt-mode async")

    def _init_process_group(self, backend: str) -> None:
        if self.call_wrapper is None:
            dist.init_process_group(backend, timeout=datetime.timedelta(seconds=PROCESS_GROUP_S))
            return
        env = os.environ
        rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
        base = dist.TCPStore(env["MASTER_ADDR"], int(env["EKSFT_STORE_PORT"]), world, is_master=rank == 0,
                             multi_tenant=True, wait_for_workers=False, use_libuv=True,
                             timeout=datetime.timedelta(minutes=5))
        # rank 0 hosts the store, so it is new for every worker-group incarnation; the prefix needs only
        # the (collective) in-process iteration. TORCHELASTIC_RESTART_COUNT differs between nodes once a
        # membership change restarted some of them, so it must not be part of any shared key.
        store = dist.PrefixStore(f"eksft/{self.call_wrapper.iteration}", base)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=self.spec.ft.collective_timeout))

    def train(self) -> None:
        s, spec = self.s, self.spec
        t_restore, budget = time.perf_counter(), derive(spec).initial.seconds
        # hashing and loading a large state read for minutes: beat for the rank meanwhile, within a budget
        with keepalive(self._keepalive, budget=budget, on_overrun=self._restore_overrun):
            self.step = self.ckpt.restore(self.state, spec.resume, s.restarting)
        if time.perf_counter() - t_restore > budget:
            self._restore_overrun(budget, time.perf_counter() - t_restore)
        s.rank_start(self.step, t_enter=self.t_enter, t_group=self.t_group, device=str(self.device),
                     settings=self.live.values)
        tokens_per_step = spec.batch * spec.seq * self.world
        first, t_loop = self.step + 1, time.perf_counter()
        with contextlib.ExitStack() as drain_beats:   # from a drain's agreement: see _beat_through_drain
            for step in range(first, spec.steps + 1):
                # a test's hold (unset: a look at the environment)
                hold(step_point(self.rank, step), self._keepalive)
                s.step_begin(step)
                t0 = time.perf_counter()
                tokens = self.data.next_batch().to(self.device)
                loss = loss_fn(self.model, tokens)
                loss.backward()
                self.optim.step()
                self.optim.zero_grad(set_to_none=True)
                # in one all-reduce: the loss summed over ranks, how many ranks were asked to drain (SIGTERM),
                # and rank 0's live settings (the others add zeros)
                drain = float(s.drain is not None and s.drain.requested)
                mean = torch.cat([loss.detach().float().reshape(1),
                                  torch.tensor([drain, *self.live.proposal()], device=self.device)])
                dist.all_reduce(mean)
                total, draining, *proposed = mean.tolist()
                if draining > 0:   # every rank drains at this step boundary
                    drain_beats.enter_context(self._beat_through_drain())
                    if s.drain is not None:
                        s.drain.agree()
                if self.live.agree(proposed, step) is not None:
                    self._set_live(self.live.values)
                if draining > 0 and self.ckpt.mode == "async":
                    self._save_without_writer()
                step_s = time.perf_counter() - t0
                s.step_end(step, total / self.world, tokens_per_step, step_s)
                if s.drain is not None:
                    s.drain.step_s = step_s
                if self.call_wrapper is not None:
                    self.call_wrapper.ping()
                self.step = step
                last = step == spec.steps or draining > 0   # a drain saves now, blocking, like the last step
                # a due save, or an async one's commit (which may wait on its writer)
                saving = self.ckpt.due(step, last=last) or self.ckpt.pending is not None
                if saving and spec.ft.checkpoint_timeout is not None:
                    s.section("checkpointing", True)
                t_save, deferred = time.perf_counter(), self.ckpt.deferred
                self.ckpt.maybe_save(step, self.state, last=last)
                self._check_save_pace(step, time.perf_counter() - t_save, deferred,
                                      time.perf_counter() - t_loop, step - first + 1)
                if saving:
                    if spec.ft.checkpoint_timeout is not None:
                        s.section("checkpointing", False)
                    # a save that ended is progress: the next step's time is not added to the save's (the
                    # in-process soft timeout took a slow save followed by a slow step for a hang)
                    self._keepalive()
                if draining > 0 and step < spec.steps:
                    self._drained(step, int(draining), time.perf_counter() - t_save)
                    return
        bounded = spec.ft.checkpoint_timeout is not None
        if bounded:   # the last save's wait, the digest's gather of the full weights, the last barrier
            s.section("checkpointing", True)
        self.ckpt.finish()
        loop_s = time.perf_counter() - t_loop
        digest = self.digest()
        if self.rank == 0:
            s.emit("rank_end", final_step=self.step, digest=digest, steps_run=self.step - first + 1,
                   loop_s=loop_s)
        dist.barrier()
        if bounded:
            s.section("checkpointing", False)

    def digest(self) -> str:
        """SHA-256 over the full parameters in name order (collective)."""
        h = hashlib.sha256()
        for name, p in sorted(self.model.named_parameters()):
            full = p.full_tensor() if hasattr(p, "full_tensor") else p
            if self.rank == 0:
                h.update(name.encode())
                h.update(full.detach().cpu().contiguous().numpy().tobytes())
        return h.hexdigest()[:16]

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


def run(call_wrapper: Any = None) -> None:
    s = session()
    s.inprocess_iteration = call_wrapper.iteration if call_wrapper is not None else 0
    t_enter = time.time() if s.inprocess_iteration > 0 else None  # else: the process start
    if call_wrapper is not None and s.inprocess_iteration == 0 and s.t_wrapper_setup is not None:
        s.emit("inprocess_wrapper", phase="setup", seconds=max(0.0, time.time() - s.t_wrapper_setup))
    trainer = None
    if s.drain is not None:
        s.drain.entered_loop()
    try:
        s.setup_begin()
        trainer = Trainer(s, call_wrapper, t_enter)
        trainer.train()
    except BaseException as e:
        if call_wrapper is not None:
            shutdown_gloo()   # peers blocked on this rank fail now, not at the collective timeout
        fatal = isinstance(e, NoStartPoint)
        s.rank_error(e, fatal=fatal)
        if s.drain is not None:
            s.drain.left_loop()          # a SIGTERM from now on cannot be drained: die of it at once
            s.drain.die_if_requested()   # a SIGTERM it could not drain for (a peer is gone): die of it
        if trainer is not None and call_wrapper is None:
            trainer.close()
        if fatal and call_wrapper is not None:  # every rank fails alike: no in-process restart, the job ends
            from nvidia_resiliency_ext.inprocess.exception import RestartAbort

            raise RestartAbort(str(e)) from e
        raise  # in-process restart: the Wrapper's abort tears the process group down
    trainer.close()
    s.t_wrapped_return = time.time()


def wrapper_kwargs(s: Session) -> dict[str, Any]:
    from nvidia_resiliency_ext.inprocess.abort import AbortTorchDistributed

    ft = s.spec.ft
    td = datetime.timedelta
    logdir = (s.job_dir.path / "logs") if s.job_dir else Path("/tmp")
    return dict(
        store_kwargs={"port": int(os.environ["EKSFT_WRAPPER_PORT"]), "timeout": td(seconds=300)},
        soft_timeout=td(seconds=ft.soft_timeout), hard_timeout=td(seconds=ft.hard_timeout),
        heartbeat_timeout=td(seconds=max(ft.hard_timeout + 2, 10)),
        # (4 x the hard timeout made a GPU job wait 80 minutes on a rank that is gone)
        barrier_timeout=td(seconds=wrapper_barrier(ft.hard_timeout)),
        completion_timeout=td(seconds=wrapper_barrier(ft.hard_timeout)),
        monitor_process_logfile=str((logdir / "inprocess-monitor-{rank}.log").absolute()),
        abort=abort_chain(AbortTorchDistributed()),
        # how long the monitor threads wait, once a failure is recorded, for concurrent failures of
        # other ranks before they abort (NVRx: 1 s); a failure tells its peers at once (see .peers)
        last_call_wait=td(seconds=LAST_CALL_WAIT_S),
    )
