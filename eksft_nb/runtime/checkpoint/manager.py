"""Sharded checkpoints: DCP format, NVRx's persistent async writer, commit records, safe loading.

A save has three stages, like torchtitan's and Megatron's async checkpointing:

1. **stage** (blocks training): the state is copied into shared-memory buffers that are allocated
   once and reused, the DCP save plan is agreed on a checkpoint-only gloo group once and kept
   while the staged layout stays the same (later saves run no collective), and the write is
   handed to NVRx's ``PersistentAsyncCaller`` (a spawned writer process per rank). Training never
   races the writer: on CPU a "copy to host" is a no-op, so without staging the writer would read
   parameters that the next optimizer step is already changing.
2. **write** (background): NVRx's ``FileSystemWriterAsync`` writes this rank's shard and fsyncs it;
   the writer then records each file's size and SHA-256 in ``manifest-<rank>.json``.
3. **commit** (collective, at a step boundary once every rank's write is done): rank 0 writes the
   DCP ``.metadata`` and then ``commit.json`` (step, world size, every file with size and checksum)
   atomically. Only a folder with a ``commit.json`` is a checkpoint; a crash at any point before
   leaves the previous one untouched and loadable.

Loading verifies sizes and checksums first, then loads through :mod:`.safe_load`, which trusts
only what commit.json lists and unpickles nothing but DCP's own metadata records.
"""

from __future__ import annotations

import atexit
import contextlib
import inspect
import io
import itertools
import json
import os
import pickle
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import _is_wrapped_exception

from ...checkpoint_folders import (COMMIT, STEP_DIR, CheckpointInfo, list_checkpoints, parse_commit, reject,
                           sha256_file, share, step_dir, verify)
from ...errors import JobError
from .. import memcopy
from .safe_load import load, read_metadata

# ---- staging --------------------------------------------------------------------------------

class Stager:
    """Copies a state dict into shared-memory buffers that are allocated on first use and reused.

    Each buffer lives in a named shared-memory file of its own, a storage of its own (see
    :mod:`.memcopy`): once a save of them commits, they are the newest in-memory copy of the
    checkpoint, which a restart of the rank (in the same process or the next one on the node)
    restores from instead of storage."""

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}
        self._dtensors: dict[str, Any] = {}  # the staged DTensors, kept with their buffers (no new wrapper per save)
        self._values: dict[str, Any] = {}   # the plain values of the last staging, for the copy's record
        self._described: Callable[[], dict[str, Any]] | None = None  # the last staging's layout, to describe
        self._wanted: dict[str, tuple[torch.Size, torch.dtype]] = {}
        self._fits = True
        self.bytes = 0
        self.staged_bytes = 0
        self.shelf = memcopy.Shelf()

    def stage(self, state: Any) -> Any:
        """The staged copy of ``state``; ``staged_bytes`` is then the size of its tensors."""
        self.shelf.begin()  # the buffers change now: the copy they held is gone
        staged = self._walk(state)
        if staged is None:  # the first save, or the state changed shape: lay the buffers out anew
            self._allocate()
            staged = self._walk(state)
        buffers, dtensors, values = self._buffers, dict(self._dtensors), self._values
        self._described = lambda: _describe(buffers, dtensors, values)
        return staged

    def checksum(self) -> None:
        """Sum the staged buffers for the in-memory copy's record, in the background. Called once the
        save no longer blocks training: the summing thread's own Python (the layout it describes)
        would hold the GIL the training thread needs to finish the save's hand-over."""
        if self._described is not None:
            self.shelf.staged(self._described)

    def _walk(self, state: Any) -> Any:
        """Stage ``state`` into the buffers; None if they do not fit it (``_wanted`` says what would)."""
        self.staged_bytes, self._fits, self._wanted, self._values = 0, True, {}, {}
        staged = self._stage(state, "")
        return staged if self._fits and self._wanted.keys() == self._buffers.keys() else None

    def _allocate(self) -> None:
        self._buffers = self.shelf.allocate(self._wanted)
        self._dtensors = {}

    def _stage(self, state: Any, prefix: str) -> Any:
        from torch.distributed.tensor import DTensor

        if _is_stateful(state):
            return self._stage(state.state_dict(), prefix)
        if isinstance(state, dict):
            return {k: self._stage(v, f"{prefix}/{k}") for k, v in state.items()}
        if isinstance(state, list):
            return [self._stage(v, f"{prefix}/{i}") for i, v in enumerate(state)]
        if isinstance(state, DTensor):
            buf = self._copy(prefix, state._local_tensor)
            if buf is None:
                return state
            staged = self._dtensors.get(prefix)
            if staged is None or staged._local_tensor is not buf or staged._spec != state._spec:
                staged = self._dtensors[prefix] = DTensor(buf, state._spec, requires_grad=False)
            return staged
        if isinstance(state, torch.Tensor):
            return self._copy(prefix, state)
        if type(state) in (str, int, float, bool, bytes, type(None)):  # immutable: nothing to copy
            self._values[prefix] = state
            return state
        self._values[prefix] = copy = pickle.loads(pickle.dumps(state))  # other plain values: a private copy
        return copy

    def _copy(self, key: str, src: torch.Tensor) -> torch.Tensor | None:
        self._wanted[key] = (src.shape, src.dtype)
        buf = self._buffers.get(key)
        if buf is None or buf.shape != src.shape or buf.dtype != src.dtype:
            self._fits = False
            return None
        buf.copy_(src.detach())
        self.staged_bytes += buf.numel() * buf.element_size()
        return buf

    def total_bytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._buffers.values())


def _describe(buffers: dict[str, torch.Tensor], dtensors: dict[str, Any], values: dict[str, Any]) -> dict[str, Any]:
    """The layout of a staged state, for the in-memory copy's record (run in the background; the
    shelf adds each buffer's file and checksums)."""
    entries = [{"key": key, "dtype": str(buf.dtype).removeprefix("torch."), "shape": list(buf.shape),
                "nbytes": buf.numel() * buf.element_size(),
                "dtensor": memcopy.dtensor_layout(dtensors[key]) if key in dtensors else None}
               for key, buf in buffers.items()]
    return {"entries": entries, "values": {key: memcopy.encode_value(v) for key, v in values.items()}}


def _save_planner() -> Any:
    """DCP's default save planner, less a per-tensor cost: a staged DTensor's shard is its local
    tensor, taken as it is instead of through ``to_local()`` (an autograd call per tensor per save)."""
    from torch.distributed.checkpoint import DefaultSavePlanner
    from torch.distributed.tensor import DTensor

    class Planner(DefaultSavePlanner):
        def lookup_object(self, index: Any) -> Any:
            obj = self.state_dict.get(index.fqn)
            if isinstance(obj, DTensor) and type(obj._local_tensor) is torch.Tensor and not any(
                    p.is_partial() for p in obj.placements):
                return obj._local_tensor
            return super().lookup_object(index)

    return Planner()


def _layout(staged: Any) -> tuple:
    """What a save plan depends on in the staged state: its nesting, keys and value types, and the
    identity of every staged tensor (the stager's reused buffers and DTensors, which it replaces when
    a shape, dtype or sharding changes). Plain values may change from save to save without changing
    the plan: they are serialized anew every save."""
    out: list[Any] = []

    def walk(o: Any) -> None:
        if isinstance(o, dict):
            out.append(("{", len(o)))
            for k, v in o.items():
                out.append(("k", k))
                walk(v)
        elif isinstance(o, list):
            out.append(("[", len(o)))
            for v in o:
                walk(v)
        elif isinstance(o, torch.Tensor):  # a reshaped or retyped buffer, a new spec: new objects (Stager)
            out.append((id(o), id(getattr(o, "_local_tensor", o))))
        else:
            out.append(type(o))
    walk(staged)
    return tuple(out)


@dataclass
class _PlanCache:
    """A save plan kept while the staged state keeps its :func:`_layout` on every rank: the DCP
    metadata (rank 0), this rank's files and the write items in each. A save with it hot skips DCP's
    flattening and planning and NVRx's write buckets, and hands the writer process only its folder
    and plain values: the writer keeps the plan, buffers included, under ``key``."""

    layout: tuple
    staged: Any  # holds the staged objects, so that no id in ``layout`` is reused while the plan is kept
    metadata: Any
    files: list[tuple[str, list[tuple[Any, tuple]], list[tuple[Any, torch.Tensor]]]]  # name, bytes items and where, tensor items
    write_fn: Any
    key: str
    reused: int = 0

    @classmethod
    def of(cls, layout: tuple, staged: Any, writer: Any, planner: Any, metadata: Any, key: str) -> _PlanCache | None:
        """The plan DCP and NVRx just made, to keep; None where it cannot be kept (another NVRx
        release's bucket format, or a write item that is not one of the staged buffers)."""
        buckets = getattr(writer, "write_buckets", None)
        if not isinstance(buckets, list) or not buckets:
            return None
        buffers = {getattr(t, "_local_tensor", t).data_ptr() for t in _tensors(staged)}
        files = []
        for _, name, (bytes_data, tensor_data) in buckets:
            if any(t.data_ptr() not in buffers for _, t in tensor_data):  # a copy, not a view of a staged buffer
                return None
            where = [(item, planner.mappings[item.index.fqn] if planner.flatten_state_dict else (item.index.fqn,))
                     for item, _ in bytes_data]
            files.append((name, where, list(tensor_data)))
        return cls(layout, staged, metadata, files, writer.get_save_function_and_args()[0], key)

    def write(self, staged: Any, path: Path, send_plan: bool) -> _ShardWrite:
        """This save's part for the writer: its folder and the plain values (the writer serializes
        them), with the plan itself only if this writer process has not got it yet."""
        values = [[_element(staged, where) for _, where in bytes_items] for _, bytes_items, _ in self.files]
        plan = (self.write_fn, [(name, [item for item, _ in b], t) for name, b, t in self.files]) if send_plan else None
        return _ShardWrite(self.key, plan, str(path), values)


def _tensors(o: Any) -> list[torch.Tensor]:
    if isinstance(o, dict):
        return [t for v in o.values() for t in _tensors(v)]
    if isinstance(o, list):
        return [t for v in o for t in _tensors(v)]
    return [o] if isinstance(o, torch.Tensor) else []


def _element(o: Any, where: tuple) -> Any:
    for k in where:
        o = o[k]
    return o


_WRITER_PLAN: tuple[str, Any] | None = None  # in the writer process: the plan of the saves it is sent


class _ShardWrite:
    """One save's write as the writer process gets it (see :meth:`_PlanCache.write`)."""

    def __init__(self, key: str, plan: Any, directory: str, values: list[list[Any]]) -> None:
        self.key, self.plan, self.directory, self.values = key, plan, directory, values

    def resolve(self) -> tuple[Any, list[Any]]:
        """In the writer process: NVRx's write function and write buckets for this save."""
        global _WRITER_PLAN
        if self.plan is not None:
            _WRITER_PLAN = (self.key, self.plan)
        if _WRITER_PLAN is None or _WRITER_PLAN[0] != self.key:
            raise RuntimeError("the checkpoint writer does not hold this save's plan")
        write_fn, files = _WRITER_PLAN[1]
        buckets = []
        for (name, bytes_items, tensor_data), values in zip(files, self.values):
            blobs = []
            for item, value in zip(bytes_items, values):
                blob = io.BytesIO()
                torch.save(value, blob)  # what DCP's planner does on the training thread
                blob.seek(0)
                blobs.append((item, blob))
            buckets.append((os.path.join(self.directory, name), name, (blobs, tensor_data)))
        return write_fn, buckets


# ---- the background write (runs in NVRx's persistent writer process) -----------------------

def write_shard(write_fn: Any, rank: int, write_buckets: Any, results_queue: Any,
                manifest_path: str, save_id: str, fault: tuple[str, float] | None) -> None:
    """Write this rank's files with NVRx's ``write_fn``, then record their sizes and checksums in the
    manifest. ``write_buckets`` is a callable on NVRx 0.6+, which builds the buckets in the writer process,
    or a :class:`_ShardWrite` (then ``write_fn`` comes with its plan).

    Puts exactly one ``(save_id, result)`` on ``results_queue``: NVRx's write results, or the first
    error (of the write or of the manifest), so a failed save can never shift the results of the
    saves after it. Never raises: the persistent writer would die. ``fault``: an injected storage
    fault, see :func:`_apply_storage_fault`."""
    box = _Box()
    try:
        if isinstance(write_buckets, _ShardWrite):
            write_fn, write_buckets = write_buckets.resolve()
        write_buckets = write_buckets() if callable(write_buckets) else write_buckets
        _apply_storage_fault(fault, [p for p, _, _ in write_buckets], (manifest_path + ".tmp",))
        write_fn(rank, write_buckets, box)
        if isinstance(box.value, dict):
            files = {Path(p).name: {"size": Path(p).stat().st_size, "sha256": sha256_file(Path(p))}
                     for p, _, _ in write_buckets}
            tmp = manifest_path + ".tmp"
            Path(tmp).write_text(json.dumps(files))
            os.replace(tmp, manifest_path)
    except Exception as e:  # noqa: BLE001 - reported, not swallowed
        box.value = e
    results_queue.put((save_id, box.value if box.value is not None else RuntimeError("the write produced no result")))


class _Box:
    """Takes the one result NVRx's write puts, in place of its results queue."""

    value: Any = None

    def put(self, value: Any) -> None:
        if self.value is None:
            self.value = value


class _Delivered:
    """Hands a result already taken from the queue to NVRx's ``retrieve_write_results``."""

    def __init__(self, value: Any) -> None:
        self.value = value

    def get_nowait(self) -> Any:
        return self.value


def _apply_storage_fault(fault: tuple[str, float] | None, data: list[str], other: tuple[str, ...] = ()) -> None:
    """Injected storage faults, applied to the files a write is about to create (``data``: the
    checkpoint's data files, ``other``: the records written with them):

    - ``fail`` (``save-failure``): partial data files, then an error;
    - ``full`` (``disk-full``): each file becomes a link to ``/dev/full``, so the real writes into it
      fail with the kernel's ENOSPC;
    - ``slow`` (``slow-storage``): the write starts ``value`` seconds late."""
    kind, value = fault or ("", 0.0)
    if kind == "fail":
        for path in data:
            Path(path).write_bytes(b"partial")
        raise OSError("injected save failure: the checkpoint write failed")
    if kind == "full":
        for path in [*data, *other]:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
            os.symlink("/dev/full", path)
    if kind == "slow":
        time.sleep(value)


WRITER_NICE = 10  # the writer's nice level: a step never waits for it, so it yields the cores to the ranks


def _lower_priority(*_: Any) -> None:
    """The writer process's first request: lower its CPU priority, so that on hosts where it shares
    cores with the ranks it takes the cycles they leave (a save is deferred while a write runs,
    never blocked on it) instead of slowing every step it overlaps. Not SCHED_IDLE: on 2 cores it
    measured no better (bench/README, part 3), and on a host with no idle core it would never write,
    so no save would commit again; a nice level keeps a small share."""
    os.nice(WRITER_NICE)


@contextlib.contextmanager
def _light_main() -> Any:
    """Make the spawned writer processes import this module as their main instead of the training
    script: a spawned child re-runs ``__main__``, and a script without an ``if __name__ ==
    "__main__"`` guard would start training again inside it."""
    script_main = sys.modules["__main__"]
    sys.modules["__main__"] = sys.modules[__name__]
    try:
        yield
    finally:
        sys.modules["__main__"] = script_main


@contextlib.contextmanager
def _forked_if_warm() -> Any:
    """In a warm rank (forked from its node's zygote, see :mod:`.zygote`) whose threads are all
    Python's (no process group, no torch thread pool yet), let NVRx fork its writer and result-queue
    processes instead of spawning them: a spawned one starts an interpreter and imports torch again,
    seconds of CPU on the rank's critical path. A fork copies only the forking thread, and a native
    thread could hold a lock the copy then never sees released: with any, they spawn as before."""
    import multiprocessing
    import threading

    import torch.multiprocessing as tmp

    if os.environ.get("EKSFT_WARM_RANK") != "1" or len(os.listdir("/proc/self/task")) > threading.active_count():
        yield
        return
    nvrx_context = tmp.get_context
    tmp.get_context = lambda method=None: multiprocessing.get_context("fork" if method == "spawn" else method)
    try:
        yield
    finally:
        tmp.get_context = nvrx_context


class _AsyncWriter:
    """One NVRx persistent writer per rank process, shared across in-process restarts."""

    caller: Any = None
    outstanding = 0  # requests handed over whose local completion was not yet seen
    plan_sent: tuple[Any, str] | None = None  # (writer, plan key): the kept save plan that writer holds
    unfinished: Any = None  # the _Pending save handed over and not finalized: an in-process restart commits it
    _ids = itertools.count()

    @classmethod
    def start(cls) -> None:
        """Start the writer process and NVRx's result queue ahead of the first save, so the first
        save does not pay for spawning them (the spawned process imports torch in the background)."""
        if cls.caller is not None:
            return
        from nvidia_resiliency_ext.checkpointing.async_ckpt.core import AsyncRequest, PersistentAsyncCaller
        from nvidia_resiliency_ext.checkpointing.async_ckpt.filesystem_async import _get_write_results_queue

        with _light_main(), _forked_if_warm():
            _get_write_results_queue()
            # NVRx 0.6+ sets up CUDA in the writer unless told the staged state is in CPU shared memory
            cpu_only = "cpu_shm_mode" in inspect.signature(PersistentAsyncCaller).parameters
            cls.caller = PersistentAsyncCaller(**({"cpu_shm_mode": True} if cpu_only else {}))
            cls.caller.rank = int(os.environ.get("RANK", 0))  # so it needs no process group yet
            cls.caller.schedule_async_call(AsyncRequest(_lower_priority, (), []))
        cls.outstanding = 1
        atexit.register(cls.stop)

    @classmethod
    def new_id(cls) -> str:
        return f"{os.getpid()}-{next(cls._ids)}"

    @classmethod
    def schedule(cls, request: Any) -> None:
        cls.start()
        cls.caller.schedule_async_call(request)
        cls.outstanding += 1

    @classmethod
    def result(cls, save_id: str, timeout: float = 120.0) -> Any:
        """The result of the request ``save_id`` (once it is done locally). Results of requests
        abandoned by a restart are still in the queue ahead of it: they are dropped."""
        from queue import Empty

        from nvidia_resiliency_ext.checkpointing.async_ckpt.filesystem_async import _get_write_results_queue

        q = _get_write_results_queue()
        deadline = time.monotonic() + timeout
        while True:
            try:
                item = q.get(timeout=max(0.1, deadline - time.monotonic()))
            except Empty:
                return RuntimeError("the checkpoint writer returned no result")
            if isinstance(item, tuple) and len(item) == 2 and item[0] == save_id:
                return item[1]

    @classmethod
    def stop(cls) -> None:
        """End the writer process; a write still in flight is abandoned (its folder stays uncommitted)."""
        caller, cls.caller, cls.outstanding, cls.unfinished = cls.caller, None, 0, None
        process = getattr(caller, "process", None)
        if process is None:
            return
        if process.is_alive():
            caller.queue.put("DONE")
            process.join(timeout=5)
        if process.is_alive():
            process.kill()
            process.join(timeout=5)
        caller.process = None

    @classmethod
    def done_locally(cls, blocking: bool = False) -> bool:
        """True once every request handed to the writer has been written (in order)."""
        while cls.outstanding and cls.caller.is_current_async_call_done(blocking=blocking, no_dist=True):
            cls.outstanding -= 1
        return cls.outstanding == 0

    @classmethod
    def drain(cls) -> None:
        """After a restart: wait until the writer is done with an abandoned request (the staging
        buffers are then free again); its result is dropped by the next :meth:`result`, its folder
        stays uncommitted."""
        if cls.outstanding:
            cls.done_locally(blocking=True)


def start_writer() -> None:
    """Start this process's async checkpoint writer now: it spawns and imports torch in the
    background while the trainer sets up, instead of delaying the first save."""
    _AsyncWriter.start()


def stop_writer() -> None:
    """End this process's async writer; a write in flight is abandoned (its folder stays uncommitted)."""
    _AsyncWriter.stop()


# ---- the manager ----------------------------------------------------------------------------

def run_id() -> str:
    """Who commits: the job's id (the same across its restarts at every level, new for every job).
    A restart resumes only from its own job's checkpoints or from where the job started, never from
    a newer checkpoint another job left in the folder. Empty when unknown (then every checkpoint
    of the folder counts as the job's own, as before)."""
    return os.environ.get("EKSFT_JOB_UID", "")


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
    force, if any (see :func:`_apply_storage_fault`).
    """

    def __init__(self, root: Path, *, rank: int, world_size: int, group: dist.ProcessGroup | None,
                 every: int, mode: str, keep_last: int, emit: Callable[..., Any],
                 atomic: Callable[[], Any] | None = None, keepalive: Callable[[], Any] | None = None,
                 storage_fault: Callable[[], tuple[str, float] | None] | None = None, run: str | None = None) -> None:
        self.root, self.rank, self.world_size, self.group = Path(root), rank, world_size, group
        self.every, self.mode, self.keep_last, self.emit = every, mode, keep_last, emit
        self.atomic = atomic
        self.keepalive = keepalive or (lambda: None)
        self.keepalive_every = 0.5  # seconds between keepalive calls while waiting or hashing
        self.storage_fault = storage_fault or (lambda: None)
        self.run = run_id() if run is None else run
        self.pending: _Pending | None = None
        self.retry = False
        self.deferred = False
        self.fail_next_write = False
        self.last_committed: int | None = None
        self.stager = _STAGER
        self.shelf = _STAGER.shelf  # where the staged buffers live, and the record of the copy they hold
        self.shelf.bind(self.run, rank, world_size)
        self.ahead: set[int] | None = None  # step folders to clear before saving there, see _clear; None: not listed yet
        self.plan_cache: _PlanCache | None = None  # the save plan, kept while the staged layout stays the same
        self.plan_metadata: Any = None  # the DCP metadata of the last plan made (rank 0)
        _AsyncWriter.drain()
        if mode == "async":
            _AsyncWriter.start()
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
        allows. Only the last save waits (and is retried at once if it fails). ``state`` maps names to tensors, plain values or objects
        with ``state_dict()`` / ``load_state_dict()`` (see :class:`ModelState`); it is read only when a
        save starts."""
        if self.pending is not None:
            self._finalize_if_done(blocking=last)
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

        writer = _sync_writer(path, self._fault())
        files: dict[str, Any] = {}
        try:  # collective on every rank, so a failing rank fails the save everywhere instead of hanging it
            dcp.save(state, storage_writer=writer, process_group=self.group)
            # every rank hashes the files it wrote (rank 0 also the metadata), in parallel
            mine = sorted(path.glob(f"__{self.rank}_*.distcp")) + ([path / ".metadata"] if self.rank == 0 else [])
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
        self.pending = _AsyncWriter.unfinished = _Pending(step, path, writer, (writer, metadata, None), t_staged,
                                                          t_staged - t0, save_id)
        self.emit("checkpoint", phase="staged", step=step, blocked_s=t_staged - t0, bytes=self.stager.staged_bytes)
        self.stager.checksum()  # last: training goes on as it starts

    def _hand_over(self, path: Path, staged: Any, writer: Any, cache: _PlanCache | None) -> tuple[str, Any]:
        """Schedule this rank's write of ``staged`` into ``path``; its id and the save's DCP metadata."""
        from nvidia_resiliency_ext.checkpointing.async_ckpt.core import AsyncRequest
        from nvidia_resiliency_ext.checkpointing.async_ckpt.filesystem_async import _get_write_results_queue

        manifest = str(path / f"manifest-{self.rank}.json")
        save_id = _AsyncWriter.new_id()
        if cache is not None:  # the plan is kept: this rank's files with this save's folder and plain values
            path.mkdir(parents=True, exist_ok=True)
            shard = cache.write(staged, path, send_plan=_AsyncWriter.plan_sent != (_AsyncWriter.caller, cache.key))
            writer.write_buckets, writer.results_queue = cache.files, _get_write_results_queue()
            metadata = cache.metadata
            args: tuple = (None, self.rank, shard, writer.results_queue, manifest, save_id, self._fault())
        else:  # planned anew, handed over whole
            metadata = self.plan_metadata
            write_fn, preload_fn, nvrx_args = writer.get_save_function_and_args()
            buckets = nvrx_args[1] if nvrx_args[1] is not None else preload_fn  # NVRx 0.6+: built by the writer process
            args = (write_fn, self.rank, buckets, nvrx_args[2], manifest, save_id, self._fault())
        _AsyncWriter.schedule(AsyncRequest(write_shard, args, []))
        if cache is not None:
            _AsyncWriter.plan_sent = (_AsyncWriter.caller, cache.key)
        return save_id, metadata

    def _plan(self, staged: Any, writer: Any) -> tuple[bool, _PlanCache | None]:
        """Whether this rank writes this save, and with which kept plan (None: ``writer`` is prepared).

        Every rank keeps a plan or none (agreed when it is made), so a rank without one knows that
        none has one and plans with the others (DCP's planning is collective). A rank with one
        decides alone, with no collective on the save path: its staged layout is the plan's, and it
        writes with it; or it changed, and it writes nothing (planning alone would hang the others,
        and their kept plans would not match its files): the commit, collective anyway, fails the
        save on every rank, which drops the kept plans, so the retry plans anew everywhere."""
        from nvidia_resiliency_ext.checkpointing.async_ckpt.state_dict_saver import save_state_dict_async_plan

        layout = _layout(staged)
        kept = self.plan_cache
        if kept is not None:
            if kept.layout != layout:
                return False, None
            kept.reused += 1
            return True, kept
        planner = _save_planner()
        _, self.plan_metadata, _ = save_state_dict_async_plan(staged, writer, self.group, 0, planner=planner)
        cache = _PlanCache.of(layout, staged, writer, planner, self.plan_metadata, _AsyncWriter.new_id())
        everywhere = torch.tensor([int(cache is not None)], dtype=torch.int32)  # e.g. another NVRx on one rank
        dist.all_reduce(everywhere, op=dist.ReduceOp.MIN, group=self.group)
        self.plan_cache = cache if everywhere.item() else None
        return True, self.plan_cache

    def _finalize_if_done(self, blocking: bool) -> None:
        """Commit the pending async save once every rank's write is done (collective)."""
        p = self.pending
        t_wait = time.perf_counter()
        tick = self._ticker()
        while True:
            flag = torch.tensor([1 if _AsyncWriter.done_locally() else 0], dtype=torch.int32)
            dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self.group)
            if flag.item() == 1:
                break
            if not blocking:
                return
            tick()  # waiting on the writer is progress, not a hang
            time.sleep(0.01)
        waited = time.perf_counter() - t_wait if blocking else 0.0
        self.pending = _AsyncWriter.unfinished = None
        results, files = None, {}
        error = "its staged state changed layout under the kept save plan: the next save plans anew"
        if p.save_id:  # it handed a write over (see _plan)
            p.writer.results_queue = _Delivered(_AsyncWriter.result(p.save_id))
            try:
                results, error = p.writer.retrieve_write_results(), None
                if _is_wrapped_exception(results):  # NVRx 0.6+ returns a write error instead of raising it
                    raise results[0]
                files, error = _read_manifest(p.path, self.rank)
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
                          "run": self.run, "bytes": sum(f["size"] for f in files.values()), "files": files}
                tmp = path / (COMMIT + ".tmp")
                fault = self.storage_fault()
                if fault is not None and fault[0] == "full":  # a full disk fails the record too
                    _apply_storage_fault(fault, [], (str(tmp),))
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
        self.retry = True
        self.plan_cache = None  # the retry plans anew (and hands the writer the whole plan)
        if self.ahead is not None:  # its folder stays: the last save retries at the same step
            self.ahead.add(step)
        if self.rank == 0:
            reasons = "; ".join(f"rank {r}: {e}" for r, e in enumerate(errors) if e)
            self.emit("checkpoint", phase="failed", step=step, error=reasons, retry="next step")

    def _prune(self, newest: int) -> None:
        infos = list_checkpoints(self.root)
        committed = [i for i in infos if i.state == "committed"]
        keep = {i.step for i in committed[-self.keep_last:]}
        for info in infos:
            if info.step not in keep and info.step < newest:
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
                listing[0] = resume_candidates(self.root, resume, restarting, self.run)
            except JobError as e:
                listing[0] = e
        dist.broadcast_object_list(listing, src=0, group=self.group)
        if isinstance(listing[0], JobError):
            raise listing[0]
        # async saves stage into the in-memory copies; sync saves keep none
        from_memory = self._restore_from_memory(listing[0][0], state) if listing[0] and self.mode == "async" else None
        if isinstance(from_memory, int):
            return from_memory
        skipped: list[dict[str, Any]] = []
        touched = None  # a checkpoint that verified but failed to load, part of it maybe in ``state``
        for info in listing[0]:
            t0 = time.perf_counter()
            reason = _verify_share(info, self.rank, self.world_size, self._ticker())
            reasons = self._gather(reason)
            verify_s, t1 = time.perf_counter() - t0, time.perf_counter()
            if not any(reasons):  # it verified everywhere: load it (files that verify may still not fit)
                try:
                    load(info.path, state, self.group)
                except JobError as e:
                    reason, touched = e.problem, info
                reasons = self._gather(reason)
                if not any(reasons):
                    break
            if reason:  # the rank that found it says so
                self.emit("checkpoint", phase="rejected", step=info.step, path=str(info.path), reason=reason)
            found = next(r for r, why in enumerate(reasons) if why)
            skipped.append({"step": info.step, "path": str(info.path), "reason": reasons[found], "rank": found})
            if self.rank == 0 and info.path.parent == self.root:
                reject(info, reasons[found])
        else:
            if resume not in ("latest", "none"):  # a start point was named: never a silent start from step 0
                where = (f"checkpoint step {resume.split(':')[1]} is not available in {self.root}"
                         if resume.startswith("step:") else f"no checkpoint in {resume} can be loaded")
                why = f" (step {skipped[-1]['step']}: {skipped[-1]['reason']})" if skipped else ""
                raise JobError(where + why,
                               "list them with `python -m eksft_nb ckpts NAME` and pick a committed one")
            if touched is not None:  # not a fresh state any more: the restart that follows skips it
                raise JobError(f"checkpoint {touched.path} verified but failed to load, and no other checkpoint "
                               "is left to load over it", "the job restarts and starts fresh")
            if skipped:  # every candidate was rejected: say so, then start fresh
                self.emit("resume", step=0, path="", load_s=0.0, skipped=skipped)
            return 0
        if info.path.parent == self.root:
            self.last_committed = info.step
        self.emit("resume", step=info.step, path=str(info.path), load_s=time.perf_counter() - t1, skipped=skipped,
                  verify_s=verify_s, verified_files=[len(share(info, r, self.world_size)) for r in range(self.world_size)],
                  source="storage", **(from_memory or {}))
        return info.step

    def _commit_unfinished(self) -> None:
        """Commit the async save an in-process restart interrupted between its staging and its commit
        (collective). Its commit waits for a step boundary after the write, so a fault a few steps
        after a save would otherwise resume from the checkpoint before it, or from scratch, though
        the same processes staged it and their writer finished it. Committed only if every rank
        handed over that same save; a failed write is reported and retried like any other."""
        p, _AsyncWriter.unfinished = _AsyncWriter.unfinished, None
        if self.mode != "async":
            return
        mine = (p.step, str(p.path)) if p is not None and p.path.parent == self.root else None
        if self._gather(mine) == [mine] * self.world_size and mine is not None:
            self.pending = p
            self._finalize_if_done(blocking=True)

    def _restore_from_memory(self, newest: CheckpointInfo, state: dict[str, Any]) -> int | dict[str, Any]:
        """Load ``newest`` from the ranks' in-memory copies if every rank's is intact (collective):
        its step, or what the storage restore that follows reports about the copies (why not, time spent)."""
        t0 = time.perf_counter()
        try:
            load_fn, reason, verify_s = memcopy.prepare(self.run, self.rank, self.world_size, newest.step, newest.time,
                                                        state, self._ticker())
        except Exception as e:  # noqa: BLE001 - every rank must reach the gather below, whatever this one met
            load_fn, reason, verify_s = None, f"it cannot be read: {type(e).__name__}: {e}"[:300], 0.0
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
        self.emit("resume", step=newest.step, path=str(newest.path), load_s=time.perf_counter() - t0, skipped=[],
                  verify_s=verify_s, source="memory")
        return newest.step


def _verify_share(info: CheckpointInfo, rank: int, world_size: int, tick: Callable[[], Any]) -> str | None:
    """Verify this rank's share of a checkpoint's files: sizes and checksums, and, for the rank
    that has ``.metadata``, that the loader would accept it."""
    mine = share(info, rank, world_size)
    reason = verify(info, mine, progress=tick)
    if reason is None and ".metadata" in mine:
        try:
            read_metadata(info.path, info.files)
        except JobError as e:
            reason = e.problem
    return reason


def resume_candidates(root: Path, resume: str, restarting: bool, run: str) -> list[CheckpointInfo]:
    """The committed checkpoints to try, best first (each is verified before it is used).

    A fresh start takes what ``resume`` names: latest, none, step:N, a checkpoint (``step_N`` folder)
    or another job's checkpoint folder (its checkpoints, newest first). A restart (at any level) takes
    this run's own newest checkpoint, else the one it started from: never a newer one that another
    run left in the folder."""
    committed = [i for i in reversed(list_checkpoints(root)) if i.state == "committed"]
    if resume.startswith("step:"):
        want = int(resume.split(":")[1])
        start = [i for i in committed if i.step == want]
    elif resume not in ("latest", "none"):
        external = Path(resume).expanduser()
        if STEP_DIR.match(external.name):  # that checkpoint and no other
            start = [i for i in reversed(list_checkpoints(external.parent))
                     if i.path == external and i.state == "committed"]
        else:  # another job's checkpoint folder: its newest that loads, else the next older
            start = [i for i in reversed(list_checkpoints(external)) if i.state == "committed"]
    elif resume == "none":
        start = []
    else:
        start = committed
    if not restarting:
        return start
    ours = [i for i in committed if i.run == run] if run else committed
    return ours + [i for i in start if i.path not in {o.path for o in ours}]


def _read_manifest(path: Path, rank: int) -> tuple[dict[str, Any], str | None]:
    """This rank's manifest (its files, sizes and checksums), or why it cannot be used."""
    name = f"manifest-{rank}.json"
    try:
        files = json.loads((path / name).read_text())
    except FileNotFoundError:
        return {}, f"{name} is missing: this rank's files are not recorded"
    except (OSError, ValueError) as e:
        return {}, f"{name} cannot be read ({type(e).__name__})"
    checked = parse_commit({"step": 0, "world_size": 1, "bytes": 0, "time": 0, "files": files}, 0)
    if isinstance(checked, str):
        return {}, f"{name} is invalid: {checked.replace('commit.json ', '')}"
    return files, None


class ModelState:
    """A model and its optimizer as one checkpointable object (FSDP2, DDP or plain modules):
    sharded state dicts on save, resharding loads on restore."""

    def __init__(self, model: torch.nn.Module, optim: torch.optim.Optimizer) -> None:
        self.model, self.optim = model, optim
        self._key: list[Any] = []
        self._info: Any = None
        self._fqns: dict[tuple, frozenset[str]] = {}  # torch's name -> FQNs walk, remembered with _info
        self._kept = True   # False once this torch lacks the private helpers the kept path calls

    def state_dict(self) -> dict[str, Any]:
        """What ``get_state_dict`` returns, without its per-call cost: it works out every parameter's
        name and the model's wrapping (most of the time a save blocks training at ~100 MB), which
        stays the same while the parameters are the same objects, so that is done once and kept.
        That uses torch's private helpers (measured on torch 2.13); where a torch release has other
        ones, the public ``get_state_dict`` does it all, every save, as before."""
        from torch.distributed.checkpoint import state_dict as sd

        if self._kept:
            try:
                return self._kept_state_dict(sd)
            except (AttributeError, TypeError):
                self._kept = False
        msd, osd = sd.get_state_dict(self.model, self.optim)
        return {"model": msd, "optim": osd}

    def _kept_state_dict(self, sd: Any) -> dict[str, Any]:
        key = [self.optim, *self.model.parameters()]  # the objects the kept work is about
        with sd._gc_context(), self._kept_fqns(sd):
            if self._info is None or len(key) != len(self._key) or any(a is not b for a, b in zip(key, self._key)):
                self._fqns.clear()
                self._info = sd._verify_options(self.model, (self.optim,), optim_only=False)
                self._key = key
            msd = sd._get_model_state_dict(self.model, self._info)
            osd = sd._get_optim_state_dict(self.model, (self.optim,), self._info)
            sd._verify_state_dict(msd, osd, self._info)
        return {"model": msd, "optim": osd}

    @contextlib.contextmanager
    def _kept_fqns(self, sd: Any) -> Any:
        """Within it, torch's walk from a state-dict name to its FQNs (module by module, once per
        tensor per save: half the rest of the time) answers from what it found before, while the
        parameters are the same objects."""
        walk, memo = sd._get_fqns, self._fqns

        def kept(model: Any, name: str, *args: Any, **kwargs: Any) -> set[str]:
            key = (id(model), name, args, tuple(sorted(kwargs.items())))
            if key not in memo:
                memo[key] = frozenset(walk(model, name, *args, **kwargs))
            return set(memo[key])
        sd._get_fqns = kept
        try:
            yield
        finally:
            sd._get_fqns = walk

    def load_state_dict(self, state: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import set_state_dict

        set_state_dict(self.model, self.optim, model_state_dict=state["model"], optim_state_dict=state["optim"])


def _sync_writer(path: Path, fault: tuple[str, float] | None) -> Any:
    """DCP's FileSystemWriter for a sync save, with an injected storage fault applied to the file this
    rank writes (one writer thread: ``<prefix>0.distcp``)."""
    from torch.distributed.checkpoint import FileSystemWriter

    class Writer(FileSystemWriter):
        def write_data(self, plan: Any, planner: Any) -> Any:
            _apply_storage_fault(fault, [str(Path(self.path) / f"{plan.storage_data.prefix}0.distcp")])
            return super().write_data(plan, planner)

    return Writer(str(path), thread_count=1)


_STAGER = Stager()  # process-wide: the buffers outlive in-process restarts


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _is_stateful(obj: Any) -> bool:
    return callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))
