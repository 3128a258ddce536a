"""The checkpoint manager: one rank's saves (stage, hand over, commit), pruning and restores.

See the package's docstring for the three stages of a save.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import _is_wrapped_exception

from ...checkpoint_folders import (COMMIT, STEP_DIR, CheckpointInfo, list_checkpoints, reject, sha256_file,
                                   share,
                                   step_dir)
from ...errors import JobError
from ...states import CheckpointState
from .. import memcopy
from . import storage_faults
from .plan import PlanCache, layout, save_planner
from .process import CheckpointProcess
from .resume import NoStartPoint, resume_candidates, verify_share
from .resume import job_uid as current_job_uid
from .safe_load import load
from .writer import Delivered, read_manifest, write_shard


@dataclass
class _Pending:
    step: int
    path: Path
    writer: Any
    plan: tuple
    t_staged: float
    blocked_s: float
    save_id: str


class CheckpointManager:
    """Saves, commits, prunes and restores checkpoints for one rank.

    Call :meth:`maybe_save` at every step boundary on every rank (it is collective), and
    :meth:`finish` before exiting. ``emit(kind, **fields)`` receives checkpoint events;
    ``keepalive()`` is called while a save waits on the writer and while files are hashed
    (heartbeats, in-process pings). ``storage_fault()`` returns the injected storage fault in
    force, if any (see :func:`.storage_faults.apply`). ``process``: the rank process's writer and
    staging buffers, shared by the managers of its in-process restarts (default: this manager's own).
    """

    def __init__(self, root: Path, *, rank: int, world_size: int, group: dist.ProcessGroup | None,
                 every: int, mode: str, keep_last: int, emit: Callable[..., Any],
                 atomic: Callable[[], Any] | None = None, keepalive: Callable[[], Any] | None = None,
                 storage_fault: Callable[[], tuple[str, float] | None] | None = None,
                 job_uid: str | None = None,
                 process: CheckpointProcess | None = None) -> None:
        self.root, self.rank, self.world_size, self.group = Path(root), rank, world_size, group
        self.every, self.mode, self.keep_last, self.emit = every, mode, keep_last, emit
        self.atomic = atomic
        self.keepalive = keepalive or (lambda: None)
        self.keepalive_every = 0.5  # seconds between keepalive calls while waiting or hashing
        self.storage_fault = storage_fault or (lambda: None)
        self.job_uid = current_job_uid() if job_uid is None else job_uid
        self.pending: _Pending | None = None
        self.retry = False
        self.deferred = False
        self.fail_next_write = False
        self.last_committed: int | None = None
        process = process or CheckpointProcess()
        self.writer, self.stager = process.writer, process.stager
        self.shelf = self.stager.shelf  # where the staged buffers live, and the record of the copy they hold
        self.shelf.bind(self.job_uid, rank, world_size)
        # the ranks (of the shelf's world) whose in-memory copies a restore may load besides the shelf's own:
        # none, but for a torchft rank the same rank of every replica group (the groups shard alike, and one
        # group saves each step)
        self.peer_copies: tuple[int, ...] = ()
        # step folders to clear before saving there, see _clear; None: not listed yet
        self.ahead: set[int] | None = None
        self.plan_cache: PlanCache | None = None  # the save plan, kept while the staged layout stays the same
        self.plan_metadata: Any = None  # the DCP metadata of the last plan made (rank 0)
        self.writer.drain()
        if mode == "async":
            self.writer.start()
        if self.rank == 0:
            self.root.mkdir(parents=True, exist_ok=True, mode=0o700)

    def _ticker(self) -> Callable[[], None]:
        """``keepalive``, at most every ``keepalive_every`` seconds: for loops that wait or hash."""
        last = [time.monotonic()]

        def tick() -> None:
            if time.monotonic() - last[0] >= self.keepalive_every:
                self.keepalive()
                last[0] = time.monotonic()
        return tick

    def _fault(self) -> tuple[str, float] | None:
        if self.fail_next_write:
            self.fail_next_write = False
            return ("fail", 0.0)
        return self.storage_fault()

    # -- saving --
    def due(self, step: int, last: bool = False) -> bool:
        """Whether this step calls for a save (it may still be deferred, see :meth:`maybe_save`)."""
        scheduled = self.every > 0 and step % self.every == 0
        return (scheduled or self.retry or self.deferred or last) and step != self.last_committed

    def maybe_save(self, step: int, state: dict[str, Any], last: bool = False) -> None:
        """Finalize a finished async save, then save if this step is due (or a failed save needs a retry).

        When a save is due while the previous one is still being written, it is deferred to the next
        step boundary instead of blocking training: on slow storage saves come as often as the writer
        allows. Only the last save waits (and is retried at once if it fails). ``state`` maps names to
        tensors, plain values or objects with ``state_dict()`` / ``load_state_dict()`` (see
        :class:`ModelState`); it is read only when a save starts."""
        if self.pending is not None:
            self._finalize_if_done(blocking=last)
            if self.pending is None:   # committed (or failed): progress, before the next save's own time
                self.keepalive()
        if not self.due(step, last):
            return
        if self.pending is not None:  # every rank agreed on this in _finalize_if_done
            self.deferred = True
            return
        for _ in range(3 if last else 1):  # the last save has no next step to retry at: retry now
            self.retry = self.deferred = False
            self._save(step, state)
            if last and self.pending is not None:
                self._finalize_if_done(blocking=True)
            if not self.retry:
                break

    def settle(self) -> None:
        """Commit a finished async save without starting one: a saver whose turn has passed (a torchft
        replica group no longer first in its quorum: another group saves the coming steps)."""
        if self.pending is not None:
            self._finalize_if_done(blocking=False)

    def _save(self, step: int, state: dict[str, Any]) -> None:
        path = step_dir(self.root, step)
        t0 = time.perf_counter()
        self.emit("checkpoint", phase="begin", step=step, mode=self.mode)
        if self.ahead is None or step in self.ahead:
            self._clear(step, path)
        if self.mode == "sync":
            self._save_sync(step, path, state, t0)
        else:
            self._save_async(step, path, state, t0)

    def _clear(self, step: int, path: Path) -> None:
        """Rank 0 removes a leftover folder at ``step`` (of a crashed, failed or rejected save, or a
        symbolic link, not ours to follow) and lists the step folders ahead of it; every rank waits for
        that (collective) before it writes. Later saves repeat this only for a listed step or a failed
        one: any other folder can only be this save's own, made by a rank already writing (nothing
        orders a rank's write after rank 0's listing), so rank 0 must not remove it."""
        ahead: list[Any] = [None]
        if self.rank == 0:
            if path.is_symlink():
                path.unlink()
            elif path.exists():
                shutil.rmtree(path)
            ahead[0] = {int(m.group(1)) for p in self.root.iterdir() if (m := STEP_DIR.match(p.name))}
        dist.broadcast_object_list(ahead, src=0, group=self.group)
        self.ahead = {s for s in ahead[0] if s > step}

    def _save_sync(self, step: int, path: Path, state: dict[str, Any], t0: float) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.api import CheckpointException

        writer = storage_faults.sync_writer(path, self._fault())
        files: dict[str, Any] = {}
        try:  # collective on every rank, so a failing rank fails the save everywhere instead of hanging it
            dcp.save(state, storage_writer=writer, process_group=self.group)
            # every rank hashes the files it wrote (rank 0 also the metadata), in parallel
            mine = sorted(path.glob(f"__{self.rank}_*.distcp")) + ([path / ".metadata"] if self.rank == 0
                                                                   else [])
            tick = self._ticker()
            files = {p.name: {"size": p.stat().st_size, "sha256": sha256_file(p, tick)} for p in mine}
            error = None
        except CheckpointException as e:  # a BaseException: every rank's failures, this one's among them
            own = e.failures.get(self.rank)
            error = None if own is None else f"{type(own[0]).__name__}: {own[0]}"
        except Exception as e:  # noqa: BLE001
            error = f"{type(e).__name__}: {e}"
        gathered = self._gather((error, files))
        errors = [err for err, _ in gathered]
        if any(errors):
            self._failed(step, errors)
            return

        def collect() -> dict[str, Any]:
            return {name: meta for _, part in gathered for name, meta in part.items()}

        self._commit(step, path, collect, blocked_s=time.perf_counter() - t0, background_s=0.0)

    def _save_async(self, step: int, path: Path, state: dict[str, Any], t0: float) -> None:
        from nvidia_resiliency_ext.checkpointing.async_ckpt.filesystem_async import FileSystemWriterAsync

        staged = self.stager.stage(state)
        writer = FileSystemWriterAsync(str(path), thread_count=1)
        planned, cache = self._plan(staged, writer)
        # not planned: nothing to write, and the commit fails this save on every rank (see _plan)
        save_id, metadata = self._hand_over(path, staged, writer, cache) if planned else ("", None)
        t_staged = time.perf_counter()
        self.pending = self.writer.unfinished = _Pending(step, path, writer, (writer, metadata, None),
                                                         t_staged, t_staged - t0, save_id)
        self.emit("checkpoint", phase="staged", step=step, blocked_s=t_staged - t0,
                  bytes=self.stager.staged_bytes, copy_s=self.stager.copy_s)
        self.stager.checksum()  # last: training goes on as it starts

    def _hand_over(self, path: Path, staged: Any, writer: Any, cache: PlanCache | None) -> tuple[str, Any]:
        """Schedule this rank's write of ``staged`` into ``path``; its id and the save's DCP metadata."""
        from nvidia_resiliency_ext.checkpointing.async_ckpt.core import AsyncRequest
        from nvidia_resiliency_ext.checkpointing.async_ckpt.filesystem_async import _get_write_results_queue

        manifest = str(path / f"manifest-{self.rank}.json")
        save_id = self.writer.new_id()
        if cache is not None:  # the plan is kept: this rank's files with this save's folder and plain values
            path.mkdir(parents=True, exist_ok=True)
            sent = self.writer.plan_sent == (self.writer.caller, cache.key)
            shard = cache.write(staged, path, send_plan=not sent)
            writer.write_buckets, writer.results_queue = cache.files, _get_write_results_queue()
            metadata = cache.metadata
            args: tuple = (None, self.rank, shard, writer.results_queue, manifest, save_id, self._fault())
        else:  # planned anew, handed over whole
            metadata = self.plan_metadata
            write_fn, preload_fn, nvrx_args = writer.get_save_function_and_args()
            # NVRx 0.6+: built by the writer process
            buckets = nvrx_args[1] if nvrx_args[1] is not None else preload_fn
            args = (write_fn, self.rank, buckets, nvrx_args[2], manifest, save_id, self._fault())
        self.writer.schedule(AsyncRequest(write_shard, args, []), save_id)
        if cache is not None:
            self.writer.plan_sent = (self.writer.caller, cache.key)
        return save_id, metadata

    def _plan(self, staged: Any, writer: Any) -> tuple[bool, PlanCache | None]:
        """Whether this rank writes this save, and with which kept plan (None: ``writer`` is prepared).

        Every rank keeps a plan or none (agreed when it is made), so a rank without one knows that
        none has one and plans with the others (DCP's planning is collective). A rank with one
        decides alone, with no collective on the save path: its staged layout is the plan's, and it
        writes with it; or it changed, and it writes nothing (planning alone would hang the others,
        and their kept plans would not match its files): the commit, collective anyway, fails the
        save on every rank, which drops the kept plans, so the retry plans anew everywhere."""
        from nvidia_resiliency_ext.checkpointing.async_ckpt.state_dict_saver import save_state_dict_async_plan

        shape = layout(staged)
        kept = self.plan_cache
        if kept is not None:
            if kept.layout != shape:
                return False, None
            kept.reused += 1
            return True, kept
        planner = save_planner()
        _, self.plan_metadata, _ = save_state_dict_async_plan(staged, writer, self.group, 0, planner=planner)
        cache = PlanCache.of(shape, staged, writer, planner, self.plan_metadata, self.writer.new_id())
        # e.g. another NVRx on one rank
        everywhere = torch.tensor([int(cache is not None)], dtype=torch.int32)
        dist.all_reduce(everywhere, op=dist.ReduceOp.MIN, group=self.group)
        self.plan_cache = cache if everywhere.item() else None
        return True, self.plan_cache

    def _finalize_if_done(self, blocking: bool) -> None:
        """Commit the pending async save once every rank's write is done (collective)."""
        p = self.pending
        t_wait = time.perf_counter()
        tick = self._ticker()
        while True:
            flag = torch.tensor([1 if self.writer.done_locally() else 0], dtype=torch.int32)
            dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self.group)
            if flag.item() == 1:
                break
            if not blocking:
                return
            tick()  # waiting on the writer is progress, not a hang
            time.sleep(0.01)
        waited = time.perf_counter() - t_wait if blocking else 0.0
        self.pending = self.writer.unfinished = None
        results, files = None, {}
        error = "its staged state changed layout under the kept save plan: the next save plans anew"
        if p.save_id:  # it handed a write over (see _plan)
            p.writer.results_queue = Delivered(self.writer.result(p.save_id))
            try:
                results, error = p.writer.retrieve_write_results(), None
                if _is_wrapped_exception(results):  # NVRx 0.6+ returns a write error instead of raising it
                    raise results[0]
                files, error = read_manifest(p.path, self.rank)
            except Exception as e:  # noqa: BLE001
                error = str(e.__cause__ or e)
        gathered = self._gather((results, error, files))
        errors = [err for _, err, _ in gathered]
        if any(errors):
            self._failed(p.step, errors)
            return

        def collect() -> dict[str, Any]:
            writer, metadata, _ = p.plan
            writer.finish(metadata, [r for r, _, _ in gathered])
            meta = p.path / ".metadata"
            return {**{n: m for _, _, part in gathered for n, m in part.items()},
                    ".metadata": {"size": meta.stat().st_size, "sha256": sha256_file(meta)}}

        self._commit(p.step, p.path, collect, blocked_s=p.blocked_s + waited,
                     background_s=time.perf_counter() - p.t_staged)

    def _gather(self, value: Any) -> list[Any]:
        gathered: list[Any] = [None] * self.world_size
        dist.all_gather_object(gathered, value, group=self.group)
        return gathered

    def _commit(self, step: int, path: Path, collect: Callable[[], dict[str, Any]], *, blocked_s: float,
                background_s: float) -> None:
        """Rank 0 writes the DCP metadata and the commit record; every rank learns whether it could
        (collective), so a failed commit is retried everywhere like a failed write."""
        error, record = None, {}
        if self.rank == 0:
            try:
                files = collect()
                record = {"step": step, "world_size": self.world_size, "time": time.time(), "mode": self.mode,
                          "job_uid": self.job_uid, "bytes": sum(f["size"] for f in files.values()),
                          "files": files}
                tmp = path / (COMMIT + ".tmp")
                fault = self.storage_fault()
                if fault is not None and fault[0] == "full":  # a full disk fails the record too
                    storage_faults.apply(fault, [], (str(tmp),))
                with self.atomic() if self.atomic else contextlib.nullcontext():
                    with open(tmp, "w") as f:
                        f.write(json.dumps(record, indent=1))
                        f.flush()
                        os.fsync(f.fileno())
                    os.replace(tmp, path / COMMIT)
                    _fsync_dir(path)
            except Exception as e:  # noqa: BLE001
                error = f"commit: {type(e).__name__}: {e}"
        verdict = [error, record.get("time")]
        dist.broadcast_object_list(verdict, src=0, group=self.group)
        if verdict[0]:
            self._failed(step, [verdict[0]] + [None] * (self.world_size - 1))
            return
        self.last_committed = step
        if self.mode == "async":  # the staged buffers are now the newest in-memory copy
            self.shelf.committed(step, verdict[1])
        if self.rank != 0:
            return
        self.emit("checkpoint", phase="committed", step=step, path=str(path), bytes=record["bytes"],
                  blocked_s=blocked_s, background_s=background_s)
        self._prune(step)

    def _failed(self, step: int, errors: list[str | None]) -> None:
        """A save failed on some rank (every rank learnt so together, once all were done writing it):
        rank 0 removes its folder, which no one will commit (what a full disk left half-written frees
        room), and the save is retried at the next step boundary."""
        self.retry = True
        self.plan_cache = None  # the retry plans anew (and hands the writer the whole plan)
        if self.ahead is not None:  # the last save retries at the same step: cleared again before it
            self.ahead.add(step)
        if self.rank == 0:
            path = step_dir(self.root, step)
            if not path.is_symlink() and not (path / COMMIT).exists():
                shutil.rmtree(path, ignore_errors=True)
            reasons = "; ".join(f"rank {r}: {e}" for r, e in enumerate(errors) if e)
            self.emit("checkpoint", phase="failed", step=step, error=reasons, retry="next step")

    def _prune(self, newest: int) -> None:
        """Keep the newest ``keep_last`` committed checkpoints. A folder not committed is left while it is
        newer than the oldest kept: it may be a save still in flight by another writer (torchft: the group
        that saved before another took over), which its own writer commits, or a later prune removes."""
        infos = list_checkpoints(self.root)
        committed = [i for i in infos if i.state == CheckpointState.COMMITTED]
        keep = {i.step for i in committed[-self.keep_last:]}
        oldest_kept = min(keep, default=newest)
        for info in infos:
            if info.step in keep or info.step >= newest:
                continue
            if info.state != CheckpointState.COMMITTED and info.step > oldest_kept:
                continue
            shutil.rmtree(info.path, ignore_errors=True)

    def finish(self) -> None:
        if self.pending is not None:
            self._finalize_if_done(blocking=True)

    # -- restoring --
    def restore(self, state: dict[str, Any], resume: str = "latest", restarting: bool = False) -> int:
        """Load the checkpoint to start from into ``state`` (collective); return its step, 0 if none.

        Rank 0 lists the candidates (see :func:`resume_candidates`); every rank verifies its share
        of each candidate's files (sizes, checksums, the metadata's allow-list) in parallel, sending
        heartbeats while it hashes, until all agree on one that also loads. A checkpoint that fails
        anywhere is skipped everywhere, with the reason and the rank that found it (a partial load
        is overwritten by the next candidate's). With none left, a start point that was named
        (step:N, a folder) fails with the reason, never a silent start from step 0; otherwise a
        partial load raises (the restart that follows starts fresh) and none starts at step 0, said."""
        self._commit_unfinished()
        listing: list[Any] = [None]
        if self.rank == 0:
            try:
                listing[0] = resume_candidates(self.root, resume, restarting, self.job_uid)
            except JobError as e:
                listing[0] = e
        dist.broadcast_object_list(listing, src=0, group=self.group)
        if isinstance(listing[0], JobError):
            raise listing[0]
        # async saves stage into the in-memory copies; sync saves keep none
        from_memory = self._restore_from_memory(listing[0][0],
                                                state) if listing[0] and self.mode == "async" else None
        if isinstance(from_memory, int):
            return from_memory
        skipped: list[dict[str, Any]] = []
        touched = None  # a checkpoint that verified but failed to load, part of it maybe in ``state``
        for info in listing[0]:
            t0 = time.perf_counter()
            reason = verify_share(info, self.rank, self.world_size, self._ticker())
            reasons = self._gather(reason)
            verify_s, t1 = time.perf_counter() - t0, time.perf_counter()
            if not any(reasons):  # it verified everywhere: load it (files that verify may still not fit)
                try:
                    load(info.path, state, self.group, self._ticker())
                except JobError as e:
                    reason, touched = e.problem, info
                reasons = self._gather(reason)
                if not any(reasons):
                    break
            if reason:  # the rank that found it says so
                self.emit("checkpoint", phase="rejected", step=info.step, path=str(info.path), reason=reason)
            found = next(r for r, why in enumerate(reasons) if why)
            skipped.append({"step": info.step, "path": str(info.path), "reason": reasons[found],
                            "rank": found})
            if self.rank == 0 and info.path.parent == self.root:
                reject(info, reasons[found])
        else:
            if resume not in ("latest", "none"):  # a start point was named: never a silent start from step 0
                where = (f"checkpoint step {resume.split(':')[1]} is not available in {self.root}"
                         if resume.startswith("step:") else f"no checkpoint in {resume} can be loaded")
                why = f" (step {skipped[-1]['step']}: {skipped[-1]['reason']})" if skipped else ""
                raise NoStartPoint(where + why,
                                   "list them with `python -m eksft_nb ckpts NAME` and pick a committed one")
            if touched is not None:  # not a fresh state any more: the restart that follows skips it
                raise JobError(f"checkpoint {touched.path} verified but failed to load, and no "
                               "other checkpoint "
                               "is left to load over it", "the job restarts and starts fresh")
            if skipped:  # every candidate was rejected: say so, then start fresh
                self.emit("resume", step=0, path="", load_s=0.0, skipped=skipped)
            return 0
        if info.path.parent == self.root:
            self.last_committed = info.step
        self.emit("resume", step=info.step, path=str(info.path), load_s=time.perf_counter() - t1,
                  skipped=skipped,
                  verify_s=verify_s,
                  verified_files=[len(share(info, r, self.world_size)) for r in range(self.world_size)],
                  source="storage", **(from_memory or {}))
        return info.step

    def _commit_unfinished(self) -> None:
        """Commit the async save an in-process restart interrupted between its staging and its commit
        (collective). Its commit waits for a step boundary after the write, so a fault a few steps
        after a save would otherwise resume from the checkpoint before it, or from scratch, though
        the same processes staged it and their writer finished it. Committed only if every rank
        handed over that same save; a failed write is reported and retried like any other."""
        p, self.writer.unfinished = self.writer.unfinished, None
        if self.mode != "async":
            return
        mine = (p.step, str(p.path)) if p is not None and p.path.parent == self.root else None
        if self._gather(mine) == [mine] * self.world_size and mine is not None:
            self.pending = p
            self._finalize_if_done(blocking=True)

    def _restore_from_memory(self, newest: CheckpointInfo, state: dict[str, Any]) -> int | dict[str, Any]:
        """Load ``newest`` from the ranks' in-memory copies if every rank's is intact (collective): its step,
        or what the storage restore that follows reports about the copies (why not, time spent). Each rank
        loads its shelf's own copy or, failing that, a peer's that holds ``newest`` (see ``peer_copies``)."""
        t0 = time.perf_counter()
        load_fn, reason, verify_s = self._memory_copy(newest, state)
        if reason and self.shelf.note:  # this process knows why it kept none
            reason = f"{reason}; {self.shelf.note}"
        reasons = self._gather(reason)
        if not any(reasons):
            try:
                load_fn()
            except Exception as e:  # noqa: BLE001 - storage has it: the load from there overwrites all of it
                reason = f"it does not load: {type(e).__name__}: {e}"[:300]
            reasons = self._gather(reason)
        if any(reasons):
            found = next(r for r, why in enumerate(reasons) if why)
            return {"memory": f"not restored from memory (rank {found}: {reasons[found]})",
                    "memory_s": time.perf_counter() - t0}
        if newest.path.parent == self.root:
            self.last_committed = newest.step
        self.emit("resume", step=newest.step, path=str(newest.path), load_s=time.perf_counter() - t0,
                  skipped=[],
                  verify_s=verify_s, source="memory")
        return newest.step

    def _memory_copy(self, newest: CheckpointInfo,
                     state: dict[str, Any]) -> tuple[Callable[[], None] | None, str | None, float]:
        """The first copy, of the shelf's own rank then of ``peer_copies``, that holds ``newest`` and
        passes every check (:func:`memcopy.prepare`): (its loader, None, seconds spent hashing), or (None,
        why each was refused, seconds)."""
        job_uid, own, world_size = self.shelf.identity
        sources = [own, *(r for r in self.peer_copies if r != own)]
        why, spent = [], 0.0
        for source in sources:
            try:
                load_fn, reason, verify_s = memcopy.prepare(job_uid, source, world_size, newest.step,
                                                            newest.time, state, self._ticker())
            except Exception as e:  # noqa: BLE001 - every rank must reach the gather that follows
                load_fn, reason, verify_s = None, f"it cannot be read: {type(e).__name__}: {e}"[:300], 0.0
            spent += verify_s
            if load_fn is not None:
                return load_fn, None, spent
            why.append(reason if len(sources) == 1 else f"rank {source}'s copy: {reason}")
        return None, "; ".join(why)[:600], spent


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
