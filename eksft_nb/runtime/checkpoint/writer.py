"""The background write: NVRx's persistent async writer process, one per rank process.

The write (in the writer process) writes this rank's shard with NVRx's ``FileSystemWriterAsync``,
fsyncs it and records each file's size and SHA-256 in ``manifest-<rank>.json``.
"""

from __future__ import annotations

import atexit
import contextlib
import inspect
import itertools
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from ...checkpoint_folders import parse_commit, sha256_file
from . import storage_faults
from .plan import ShardWrite


def write_shard(write_fn: Any, rank: int, write_buckets: Any, results_queue: Any,
                manifest_path: str, save_id: str, fault: tuple[str, float] | None) -> None:
    """Write this rank's files with NVRx's ``write_fn``, then record their sizes and checksums in the
    manifest. ``write_buckets`` is a callable on NVRx 0.6+, which builds the buckets in the writer process,
    or a :class:`~.plan.ShardWrite` (then ``write_fn`` comes with its plan).

    Puts exactly one ``(save_id, result)`` on ``results_queue``: NVRx's write results, or the first
    error (of the write or of the manifest), so a failed save can never shift the results of the
    saves after it. Never raises: the persistent writer would die. ``fault``: an injected storage
    fault, see :func:`.storage_faults.apply`."""
    box = _Box()
    try:
        if isinstance(write_buckets, ShardWrite):
            write_fn, write_buckets = write_buckets.resolve()
        write_buckets = write_buckets() if callable(write_buckets) else write_buckets
        storage_faults.apply(fault, [p for p, _, _ in write_buckets], (manifest_path + ".tmp",))
        write_fn(rank, write_buckets, box)
        if isinstance(box.value, dict):
            files = {Path(p).name: {"size": Path(p).stat().st_size, "sha256": sha256_file(Path(p))}
                     for p, _, _ in write_buckets}
            tmp = manifest_path + ".tmp"
            Path(tmp).write_text(json.dumps(files))
            os.replace(tmp, manifest_path)
    except Exception as e:  # noqa: BLE001 - reported, not swallowed
        box.value = e
    results_queue.put((save_id,
                       box.value if box.value is not None else RuntimeError("the write produced no result")))


class _Box:
    """Takes the one result NVRx's write puts, in place of its results queue."""

    value: Any = None

    def put(self, value: Any) -> None:
        if self.value is None:
            self.value = value


class Delivered:
    """Hands a result already taken from the queue to NVRx's ``retrieve_write_results``."""

    def __init__(self, value: Any) -> None:
        self.value = value

    def get_nowait(self) -> Any:
        return self.value


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

    if os.environ.get("EKSFT_WARM_RANK") != "1" or len(
        os.listdir("/proc/self/task")) > threading.active_count():
        yield
        return
    nvrx_context = tmp.get_context
    tmp.get_context = lambda method=None: multiprocessing.get_context("fork" if method == "spawn" else method)
    try:
        yield
    finally:
        tmp.get_context = nvrx_context


class AsyncWriter:
    """One NVRx persistent writer (a process) for the saves of one rank process. Whoever owns the
    rank process makes it (see :class:`~.process.CheckpointProcess`), so that it outlives the
    checkpoint managers of in-process restarts."""

    def __init__(self) -> None:
        self.caller: Any = None
        self.outstanding = 0  # requests handed over whose local completion was not yet seen
        self.plan_sent: tuple[Any, str] | None = None  # (NVRx caller, plan key): the kept save plan it holds
        # the save handed over and not finalized: an in-process restart commits it
        self.unfinished: Any = None
        self._ids = itertools.count()
        self.handed: set[str] = set()  # ids handed to the running writer process whose result was not read
        self.lost: dict[str, str] = {}  # ids handed to a writer process that died: why they have no result

    def start(self) -> None:
        """Start the writer process and NVRx's result queue ahead of the first save, so the first
        save does not pay for spawning them (the spawned process imports torch in the background)."""
        if self.caller is not None:
            return
        from nvidia_resiliency_ext.checkpointing.async_ckpt.core import AsyncRequest, PersistentAsyncCaller
        from nvidia_resiliency_ext.checkpointing.async_ckpt.filesystem_async import _get_write_results_queue

        with _light_main(), _forked_if_warm():
            _get_write_results_queue()
            # NVRx 0.6+ sets up CUDA in the writer unless told the staged state is in CPU shared memory
            cpu_only = "cpu_shm_mode" in inspect.signature(PersistentAsyncCaller).parameters
            self.caller = PersistentAsyncCaller(**({"cpu_shm_mode": True} if cpu_only else {}))
            self.caller.rank = int(os.environ.get("RANK", 0))  # so it needs no process group yet
            self.caller.schedule_async_call(AsyncRequest(_lower_priority, (), []))
        self.outstanding = 1
        atexit.register(self.stop)

    def new_id(self) -> str:
        """An id no other request of this process has (NVRx's results queue is the process's)."""
        return f"{os.getpid()}-{id(self):x}-{next(self._ids)}"

    def schedule(self, request: Any, save_id: str) -> None:
        """Hand ``request`` to the writer; it puts its result under ``save_id`` (see :meth:`result`)."""
        self.start()
        self.caller.schedule_async_call(request)
        self.outstanding += 1
        self.handed.add(save_id)

    def result(self, save_id: str, timeout: float = 120.0) -> Any:
        """The result of the request ``save_id`` (once it is done locally). Results of requests
        abandoned by a restart are still in the queue ahead of it: they are dropped."""
        from queue import Empty

        from nvidia_resiliency_ext.checkpointing.async_ckpt.filesystem_async import _get_write_results_queue

        q = _get_write_results_queue()
        deadline = time.monotonic() + timeout
        while True:
            if save_id in self.lost:  # its writer died: no result will come
                return RuntimeError(self.lost.pop(save_id))
            try:
                item = q.get(timeout=min(1.0, max(0.1, deadline - time.monotonic())))
            except Empty:
                if time.monotonic() >= deadline:
                    return RuntimeError("the checkpoint writer returned no result")
                self.done_locally()  # notices a writer that died
                continue
            if isinstance(item, tuple) and len(item) == 2:
                self.handed.discard(item[0])
                if item[0] == save_id:
                    return item[1]

    def stop(self) -> None:
        """End the writer process; a write still in flight is abandoned (its folder stays uncommitted)."""
        caller, self.caller, self.outstanding, self.unfinished = self.caller, None, 0, None
        self.handed.clear()
        process = getattr(caller, "process", None)
        if process is None:
            return
        if process.is_alive():
            caller.queue.put("DONE")
            _join(process, 5.0)
        if process.is_alive():
            process.kill()
            _join(process, 5.0)
        caller.process = None

    def done_locally(self, blocking: bool = False) -> bool:
        """True once every request handed to the writer has been written (in order), or the writer
        process died with them (see :meth:`_died`): NVRx's own wait polls a dead writer forever, and
        its non-blocking check never says done, so every later save would be deferred in silence."""
        while self.outstanding:
            if self.caller.is_current_async_call_done(blocking=False, no_dist=True):
                self.outstanding -= 1
            elif not self.caller.process.is_alive():
                if not self.caller.is_current_async_call_done(blocking=False, no_dist=True):
                    self._died()  # nothing it finished is left to read: the rest is lost
            elif blocking:
                time.sleep(0.05)
            else:
                break
        return self.outstanding == 0

    def _died(self) -> None:
        """The writer process is gone (killed, out of memory): the requests it held fail with the
        reason, and the next save starts a new writer (its folder is written anew, the plan sent again)."""
        code = self.caller.process.exitcode
        why = f"the checkpoint writer process died (exit code {code}) before writing this save"
        self.lost.update(dict.fromkeys(self.handed, why))
        self.handed.clear()
        self.caller.process.join(timeout=5)
        self.caller.process = None
        self.caller, self.outstanding, self.plan_sent = None, 0, None

    def drain(self) -> None:
        """After a restart: wait until the writer is done with an abandoned request (the staging
        buffers are then free again); its result is dropped by the next :meth:`result`, its folder
        stays uncommitted."""
        if self.outstanding:
            self.done_locally(blocking=True)


WAIT_SLICE_S = 0.05  # the longest a rank's main thread blocks at once in a wait that may be long (see _join)


def _join(process: Any, timeout: float) -> None:
    """Join ``process`` in slices of :data:`WAIT_SLICE_S`: a main thread blocked in one long join runs no
    Python, so NVRx's progress watchdog (a pending call the main thread runs) stalls and the in-process
    soft timeout takes the rank for hung; between slices it runs."""
    deadline = time.monotonic() + timeout
    while process.is_alive() and time.monotonic() < deadline:
        process.join(WAIT_SLICE_S)


def read_manifest(path: Path, rank: int) -> tuple[dict[str, Any], str | None]:
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
