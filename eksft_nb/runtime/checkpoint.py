"""Sharded checkpoints: DCP format, NVRx's persistent async writer, commit records, safe loading.

A save has three stages, like torchtitan's and Megatron's async checkpointing:

1. **stage** (blocks training): the state is copied into shared-memory buffers that are allocated
   once and reused, the DCP save plan is agreed on a checkpoint-only gloo group (NVRx caches it
   once two saves agree, so later saves skip that collective), and the write is
   handed to NVRx's ``PersistentAsyncCaller`` (a spawned writer process per rank). Training never
   races the writer: on CPU a "copy to host" is a no-op, so without staging the writer would read
   parameters that the next optimizer step is already changing.
2. **write** (background): NVRx's ``FileSystemWriterAsync`` writes this rank's shard and fsyncs it;
   the writer then records each file's size and SHA-256 in ``manifest-<rank>.json``.
3. **commit** (collective, at a step boundary once every rank's write is done): rank 0 writes the
   DCP ``.metadata`` and then ``commit.json`` (step, world size, every file with size and checksum)
   atomically. Only a folder with a ``commit.json`` is a checkpoint; a crash at any point before
   leaves the previous one untouched and loadable.

Loading verifies sizes and checksums first, and unpickles nothing but DCP's own metadata classes
and plain values.
"""

from __future__ import annotations

import atexit
import contextlib
import inspect
import io
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

from ..checkpoints import COMMIT, CheckpointInfo, list_checkpoints, reject, sha256_file, step_dir, verify
from ..errors import JobError

# ---- safe loading ---------------------------------------------------------------------------

_SAFE_GLOBALS = {("collections", "OrderedDict"), ("torch", "Size"), ("torch.serialization", "_get_layout"),
                 ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath")}
_SAFE_TORCH_ATTRS = (torch.dtype, torch.layout, torch.memory_format)


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP metadata: DCP's own classes, torch dtypes/sizes/layouts and plain values only."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _SAFE_GLOBALS:
            return super().find_class(module, name)
        if module.startswith("torch.distributed.checkpoint."):
            obj = super().find_class(module, name)
            if isinstance(obj, type):  # dataclasses and enums, never functions
                return obj
        if module == "torch" and isinstance(getattr(torch, name, None), _SAFE_TORCH_ATTRS):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"refusing to load {module}.{name} from checkpoint metadata")


def _reader_and_planner(path: Path) -> tuple[Any, Any]:
    from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader

    class SafeReader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            with open(Path(self.path) / ".metadata", "rb") as f:
                metadata = _MetadataUnpickler(f).load()
            if getattr(metadata, "storage_meta", None) is not None:
                metadata.storage_meta.load_id = self.load_id
            return metadata

    class SafePlanner(DefaultLoadPlanner):
        def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
            obj = torch.load(value, weights_only=True)
            if self.flatten_state_dict:
                from torch.distributed.checkpoint._nested_dict import unflatten_state_dict  # noqa: F401
                from torch.distributed.checkpoint._traverse import set_element

                set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
            else:
                self.state_dict[read_item.dest_index.fqn] = obj

    return SafeReader(str(path)), SafePlanner()


def load(path: Path, state: dict[str, Any], group: dist.ProcessGroup | None) -> None:
    """Load a DCP checkpoint into ``state`` in place (tensors are filled, plain values replaced)."""
    import torch.distributed.checkpoint as dcp

    with open(Path(path) / ".metadata", "rb") as f:  # fail with the reason, before any collective
        _MetadataUnpickler(f).load()
    reader, planner = _reader_and_planner(path)
    dcp.load(state, storage_reader=reader, planner=planner, process_group=group)


# ---- staging --------------------------------------------------------------------------------

class Stager:
    """Copies a state dict into shared-memory buffers that are allocated on first use and reused."""

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}
        self.bytes = 0

    def stage(self, state: Any, prefix: str = "") -> Any:
        from torch.distributed.tensor import DTensor

        if _is_stateful(state):
            return self.stage(state.state_dict(), prefix)
        if isinstance(state, dict):
            return {k: self.stage(v, f"{prefix}/{k}") for k, v in state.items()}
        if isinstance(state, list):
            return [self.stage(v, f"{prefix}/{i}") for i, v in enumerate(state)]
        if isinstance(state, DTensor):
            return DTensor(self._copy(prefix, state._local_tensor), state._spec, requires_grad=False)
        if isinstance(state, torch.Tensor):
            return self._copy(prefix, state)
        return pickle.loads(pickle.dumps(state))  # plain values: a private copy

    def _copy(self, key: str, src: torch.Tensor) -> torch.Tensor:
        buf = self._buffers.get(key)
        if buf is None or buf.shape != src.shape or buf.dtype != src.dtype:
            buf = torch.empty(src.shape, dtype=src.dtype, device="cpu").share_memory_()
            self._buffers[key] = buf
        buf.copy_(src.detach())
        return buf

    def total_bytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._buffers.values())


# ---- the background write (runs in NVRx's persistent writer process) -----------------------

def write_shard(write_fn: Any, rank: int, write_buckets: Any, results_queue: Any,
                manifest_path: str, fail: bool) -> None:
    """Write this rank's files with NVRx's ``write_fn``, then record their sizes and checksums.
    ``write_buckets`` is a callable on NVRx 0.6+, which builds the buckets in the writer process.
    Never raises: the persistent writer would die, so errors travel back through ``results_queue``."""
    try:
        write_buckets = write_buckets() if callable(write_buckets) else write_buckets
    except Exception as e:  # noqa: BLE001 - reported, not swallowed
        results_queue.put(e)
        return
    if fail:
        for file_path, _, _ in write_buckets:
            Path(file_path).write_bytes(b"partial")
        results_queue.put(OSError("injected save failure: the checkpoint write failed"))
        return
    try:
        write_fn(rank, write_buckets, results_queue)
        files = {Path(p).name: {"size": Path(p).stat().st_size, "sha256": sha256_file(Path(p))}
                 for p, _, _ in write_buckets}
        tmp = manifest_path + ".tmp"
        Path(tmp).write_text(json.dumps(files))
        os.replace(tmp, manifest_path)
    except Exception as e:  # noqa: BLE001 - reported, not swallowed
        results_queue.put(e)


def _noop(*_: Any) -> None:
    return None


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


class _AsyncWriter:
    """One NVRx persistent writer per rank process, shared across in-process restarts."""

    caller: Any = None
    outstanding = 0  # requests handed over whose local completion was not yet seen

    @classmethod
    def start(cls) -> None:
        """Start the writer process and NVRx's result queue ahead of the first save, so the first
        save does not pay for spawning them (the spawned process imports torch in the background)."""
        if cls.caller is not None:
            return
        from nvidia_resiliency_ext.checkpointing.async_ckpt.core import AsyncRequest, PersistentAsyncCaller
        from nvidia_resiliency_ext.checkpointing.async_ckpt.filesystem_async import _get_write_results_queue

        with _light_main():
            _get_write_results_queue()
            # NVRx 0.6+ sets up CUDA in the writer unless told the staged state is in CPU shared memory
            cpu_only = "cpu_shm_mode" in inspect.signature(PersistentAsyncCaller).parameters
            cls.caller = PersistentAsyncCaller(**({"cpu_shm_mode": True} if cpu_only else {}))
            cls.caller.rank = int(os.environ.get("RANK", 0))  # so it needs no process group yet
            cls.caller.schedule_async_call(AsyncRequest(_noop, (), []))
        cls.outstanding = 1
        atexit.register(cls.stop)

    @classmethod
    def schedule(cls, request: Any) -> None:
        cls.start()
        cls.caller.schedule_async_call(request)
        cls.outstanding += 1

    @classmethod
    def stop(cls) -> None:
        """End the writer process; a write still in flight is abandoned (its folder stays uncommitted)."""
        caller, cls.caller, cls.outstanding = cls.caller, None, 0
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
        buffers are then free again) and drop its result; its folder stays uncommitted."""
        if cls.outstanding:
            cls.done_locally(blocking=True)
            from queue import Empty

            from nvidia_resiliency_ext.checkpointing.async_ckpt.filesystem_async import (
                _get_write_results_queue,
            )

            q = _get_write_results_queue()
            try:
                while True:
                    q.get_nowait()
            except Empty:
                pass


def start_writer() -> None:
    """Start this process's async checkpoint writer now: it spawns and imports torch in the
    background while the trainer sets up, instead of delaying the first save."""
    _AsyncWriter.start()


# ---- the manager ----------------------------------------------------------------------------

@dataclass
class _Pending:
    step: int
    path: Path
    writer: Any
    plan: tuple
    t_staged: float
    blocked_s: float


class CheckpointManager:
    """Saves, commits, prunes and restores checkpoints for one rank.

    Call :meth:`maybe_save` at every step boundary on every rank (it is collective), and
    :meth:`finish` before exiting. ``emit(kind, **fields)`` receives checkpoint events;
    ``keepalive()`` is called while a save waits on the writer (heartbeats, in-process pings).
    """

    def __init__(self, root: Path, *, rank: int, world_size: int, group: dist.ProcessGroup | None,
                 every: int, mode: str, keep_last: int, emit: Callable[..., Any],
                 atomic: Callable[[], Any] | None = None, keepalive: Callable[[], Any] | None = None) -> None:
        self.root, self.rank, self.world_size, self.group = Path(root), rank, world_size, group
        self.every, self.mode, self.keep_last, self.emit = every, mode, keep_last, emit
        self.atomic = atomic
        self.keepalive = keepalive or (lambda: None)
        self.pending: _Pending | None = None
        self.retry = False
        self.deferred = False
        self.fail_next_write = False
        self.last_committed: int | None = None
        self.stager = _STAGER
        self.plan_cache: Any = None  # NVRx's plan cache: once two saves agree, later ones skip the planning collective
        _AsyncWriter.drain()
        if mode == "async":
            _AsyncWriter.start()
        if self.rank == 0:
            self.root.mkdir(parents=True, exist_ok=True, mode=0o700)

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
        if self.rank == 0 and path.exists():  # leftover of a crashed save, or a rejected one
            shutil.rmtree(path)
        if self.mode == "sync":
            self._save_sync(step, path, state, t0)
        else:
            self._save_async(step, path, state, t0)

    def _save_sync(self, step: int, path: Path, state: dict[str, Any], t0: float) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint import FileSystemWriter

        fail, self.fail_next_write = self.fail_next_write, False
        writer = (_FailingWriter if fail else FileSystemWriter)(str(path), thread_count=1)
        try:  # collective on every rank, so a failing rank fails the save everywhere instead of hanging it
            dcp.save(state, storage_writer=writer, process_group=self.group)
            error = None
        except Exception as e:  # noqa: BLE001
            error = f"{type(e).__name__}: {e}"
        errors = self._gather(error)
        if any(errors):
            self._failed(step, errors)
        else:
            files = {p.name: {"size": p.stat().st_size, "sha256": sha256_file(p)}
                     for p in path.iterdir() if p.is_file()} if self.rank == 0 else {}
            self._commit(step, path, files, blocked_s=time.perf_counter() - t0, background_s=0.0)

    def _save_async(self, step: int, path: Path, state: dict[str, Any], t0: float) -> None:
        from nvidia_resiliency_ext.checkpointing.async_ckpt.core import AsyncRequest
        from nvidia_resiliency_ext.checkpointing.async_ckpt.filesystem_async import FileSystemWriterAsync
        from nvidia_resiliency_ext.checkpointing.async_ckpt.state_dict_saver import (
            CheckpointMetadataCache,
            save_state_dict_async_plan,
        )
        from torch.distributed.checkpoint import DefaultSavePlanner

        staged = self.stager.stage(state)
        writer = FileSystemWriterAsync(str(path), thread_count=1)
        if self.plan_cache is None:
            self.plan_cache = CheckpointMetadataCache()
        plan = save_state_dict_async_plan(staged, writer, self.group, 0, planner=DefaultSavePlanner(),
                                          enable_cache=True, metadata_cache=self.plan_cache)
        write_fn, preload_fn, args = writer.get_save_function_and_args()
        fail, self.fail_next_write = self.fail_next_write, False
        manifest = str(path / f"manifest-{self.rank}.json")
        buckets = args[1] if args[1] is not None else preload_fn  # NVRx 0.6+: built by the writer process
        request = AsyncRequest(write_shard, (write_fn, self.rank, buckets, args[2], manifest, fail), [])
        _AsyncWriter.schedule(request)
        t_staged = time.perf_counter()
        self.pending = _Pending(step, path, writer, plan, t_staged, t_staged - t0)
        self.emit("checkpoint", phase="staged", step=step, blocked_s=t_staged - t0, bytes=_tensor_bytes(staged))

    def _finalize_if_done(self, blocking: bool) -> None:
        """Commit the pending async save once every rank's write is done (collective)."""
        p = self.pending
        t_wait = time.perf_counter()
        last_alive = t_wait
        while True:
            flag = torch.tensor([1 if _AsyncWriter.done_locally() else 0], dtype=torch.int32)
            dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self.group)
            if flag.item() == 1:
                break
            if not blocking:
                return
            if time.perf_counter() - last_alive > 0.5:  # waiting on the writer is progress, not a hang
                self.keepalive()
                last_alive = time.perf_counter()
            time.sleep(0.01)
        waited = time.perf_counter() - t_wait if blocking else 0.0
        self.pending = None
        try:
            results, error = p.writer.retrieve_write_results(), None
            if _is_wrapped_exception(results):  # NVRx 0.6+ returns a write error instead of raising it
                raise results[0]
        except Exception as e:  # noqa: BLE001
            results, error = None, str(e.__cause__ or e)
        gathered = [None] * self.world_size
        dist.all_gather_object(gathered, (results, error), group=self.group)
        errors = [err for _, err in gathered]
        if any(errors):
            self._failed(p.step, errors)
            return
        files: dict[str, Any] = {}
        if self.rank == 0:
            writer, metadata, _ = p.plan
            writer.finish(metadata, [r for r, _ in gathered])
            for r in range(self.world_size):
                mf = p.path / f"manifest-{r}.json"
                if mf.exists():
                    files.update(json.loads(mf.read_text()))
            meta = p.path / ".metadata"
            files[".metadata"] = {"size": meta.stat().st_size, "sha256": sha256_file(meta)}
        self._commit(p.step, p.path, files, blocked_s=p.blocked_s + waited,
                     background_s=time.perf_counter() - p.t_staged)

    def _gather(self, error: str | None) -> list[str | None]:
        gathered: list[Any] = [None] * self.world_size
        dist.all_gather_object(gathered, error, group=self.group)
        return gathered

    def _commit(self, step: int, path: Path, files: dict[str, Any], *, blocked_s: float, background_s: float) -> None:
        self.last_committed = step
        if self.rank != 0:
            return
        record = {"step": step, "world_size": self.world_size, "time": time.time(), "mode": self.mode,
                  "bytes": sum(f["size"] for f in files.values()), "files": files}
        ctx = self.atomic() if self.atomic else _null()
        with ctx:
            tmp = path / (COMMIT + ".tmp")
            with open(tmp, "w") as f:
                f.write(json.dumps(record, indent=1))
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path / COMMIT)
            _fsync_dir(path)
        self.emit("checkpoint", phase="committed", step=step, path=str(path), bytes=record["bytes"],
                  blocked_s=blocked_s, background_s=background_s)
        self._prune(step)

    def _failed(self, step: int, errors: list[str | None]) -> None:
        self.retry = True
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

        Rank 0 picks it (see :func:`choose_resume`), verifying checksums and skipping, with the
        reason, any checkpoint that does not verify; every rank then loads its shards."""
        choice: list[Any] = [None]
        if self.rank == 0:
            try:
                info, skipped = choose_resume(self.root, resume, restarting, self.emit)
                choice[0] = {"path": str(info.path) if info else None, "step": info.step if info else 0,
                             "skipped": skipped}
            except JobError as e:
                choice[0] = {"error": e}
        dist.broadcast_object_list(choice, src=0, group=self.group)
        picked = choice[0]
        if "error" in picked:
            raise picked["error"]
        if picked["path"] is None:
            if picked["skipped"]:  # every candidate was rejected: say so, then start fresh
                self.emit("resume", step=0, path="", load_s=0.0, skipped=picked["skipped"])
            return 0
        t0 = time.perf_counter()
        load(Path(picked["path"]), state, self.group)
        if Path(picked["path"]).parent == self.root:
            self.last_committed = picked["step"]
        self.emit("resume", step=picked["step"], path=picked["path"], load_s=time.perf_counter() - t0,
                  skipped=picked["skipped"])
        return picked["step"]


def choose_resume(root: Path, resume: str, restarting: bool,
                  emit: Callable[..., Any]) -> tuple[CheckpointInfo | None, list[dict[str, Any]]]:
    """The checkpoint to start from, and the ones skipped on the way (with reasons).

    A job that has committed checkpoints of its own (or is restarting) resumes from its newest one
    that verifies. Otherwise ``resume`` decides: latest, none, step:N or a checkpoint folder."""
    skipped: list[dict[str, Any]] = []
    own = [i for i in reversed(list_checkpoints(root)) if i.state == "committed"]
    if resume.startswith("step:"):
        want = int(resume.split(":")[1])
        candidates = [i for i in own if i.step >= want] if restarting else [i for i in own if i.step == want]
    elif resume not in ("latest", "none"):
        external = Path(resume).expanduser()
        candidates = own + [i for i in list_checkpoints(external.parent) if i.path == external]
    elif resume == "none" and not restarting:
        candidates = []
    else:
        candidates = own
    for info in candidates:
        reason = verify(info)
        if reason is None:
            return info, skipped
        skipped.append({"step": info.step, "path": str(info.path), "reason": reason})
        if info.path.parent == root:
            reject(info, reason)
        emit("checkpoint", phase="rejected", step=info.step, path=str(info.path), reason=reason)
    if resume.startswith("step:") and not restarting:
        raise JobError(f"checkpoint step {resume.split(':')[1]} is not available in {root}",
                       "list them with `python -m eksft_nb ckpts NAME` and pick a committed one")
    return None, skipped


class ModelState:
    """A model and its optimizer as one checkpointable object (FSDP2, DDP or plain modules):
    sharded state dicts on save, resharding loads on restore."""

    def __init__(self, model: torch.nn.Module, optim: torch.optim.Optimizer) -> None:
        self.model, self.optim = model, optim

    def state_dict(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        msd, osd = get_state_dict(self.model, self.optim)
        return {"model": msd, "optim": osd}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import set_state_dict

        set_state_dict(self.model, self.optim, model_state_dict=state["model"], optim_state_dict=state["optim"])


class _FailingWriter:
    """A FileSystemWriter whose data write fails (the ``save-failure`` fault, sync mode)."""

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        from torch.distributed.checkpoint import FileSystemWriter

        class Failing(FileSystemWriter):
            def write_data(self, plan: Any, planner: Any) -> Any:
                raise OSError("injected save failure: the checkpoint write failed")

        return Failing(*args, **kwargs)


_STAGER = Stager()  # process-wide: the buffers outlive in-process restarts


class _null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _is_stateful(obj: Any) -> bool:
    return callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))


def _tensor_bytes(state: Any) -> int:
    from torch.distributed.tensor import DTensor

    if isinstance(state, dict):
        return sum(_tensor_bytes(v) for v in state.values())
    if isinstance(state, list):
        return sum(_tensor_bytes(v) for v in state)
    if isinstance(state, DTensor):
        state = state._local_tensor
    if isinstance(state, torch.Tensor):
        return state.numel() * state.element_size()
    return 0
