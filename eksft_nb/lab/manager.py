"""The server side of the JupyterLab panel: one fold per job, shared by every connected browser.

While at least one client listens to the stream, a task in the server's event loop ticks every
``interval`` seconds. Each tick runs in one worker thread (so the folds are only ever touched by
it): it lists the local jobs folder, folds the new events of every job still running (an ended
job is folded once more, then left alone, and its row kept in its folder: a job found ended with
its row kept there is never folded, see :mod:`eksft_nb.row_cache`), and returns what changed; the
loop then pushes a ``jobs`` event, and a ``restart`` or ``failure`` event per new record, to every
client. ``GET /eksft/jobs`` is answered from the same folds, after a tick of its own: a listing
costs the events that arrived since the last one, not every job's whole history. The jobs of a
cluster (EKS where a kubeconfig is set, Slurm where a shared folder is set or this machine launched
one) are listed by a slower task per cluster, so a slow or failing cluster never delays the local
list: its error shows in ``backends.<name>.error``.
"""

from __future__ import annotations

import asyncio
import logging
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from .. import commands, row_cache
from ..backends import get_backend
from ..errors import EksftError
from ..job import Job, attach

log = logging.getLogger(__name__)

Message = tuple[str, dict[str, Any]]     # (SSE event name, its data)
MAX_BEHIND = 1000                         # messages a client may have left unread


def eks_configured() -> bool:
    """Whether a kubeconfig is set ($KUBECONFIG or ~/.kube/config): only then are EKS jobs listed."""
    from ..backends.eks.cluster import kubeconfig_files

    return bool(kubeconfig_files())


def slurm_configured() -> bool:
    """Whether Slurm jobs can be listed here (the backend's own answer)."""
    from ..backends.slurm.backend import SlurmBackend

    return SlurmBackend().configured()


# each cluster is listed by a task of its own, once it is set up here
CLUSTERS = MappingProxyType({"eks": eks_configured, "slurm": slurm_configured})


def describe_error(e: BaseException) -> str:
    """One line for a failure the panel shows (ours are already one line; others get their type)."""
    return str(e) if isinstance(e, EksftError) else f"{type(e).__name__}: {e}"


@dataclass
class Fold:
    """One job's events folded once for all clients: its handle, the row they saw, what they were told."""

    job: Job
    order: float                        # where it sits in the list: its folder's age
    row: dict[str, Any] | None = None
    restarts: int | None = None         # restart / failure records already announced
    failures: int | None = None
    final_ticks: int = 0                # ticks since it ended (one more fold catches the last events)
    figure: Any = None                  # its TrainingFigure, made when a client first asks for it
    folded_from: row_cache.Key | None = None   # its files as they were before the last fold

    @property
    def done(self) -> bool:
        return self.final_ticks >= 2


class JobsManager:
    """Owns the folds and the stream's clients; see the module docstring."""

    def __init__(self, interval: float = 0.5, cluster_interval: float = 5.0) -> None:
        self.interval, self.cluster_interval = interval, cluster_interval
        self.local = get_backend("local")
        self.folds: dict[str, Fold] = {}                     # local jobs, by name
        # once a cluster is set up: name -> {"ok", "error", "jobs"}
        self.clusters: dict[str, dict[str, Any]] = {}
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="eksft-fold")
        self._clients: set[asyncio.Queue[Message | None]] = set()
        self._tasks: list[asyncio.Task[None]] = []
        self._snapshot: dict[str, Any] | None = None

    # ---- folding (in the worker thread) --------------------------------------------------------
    def tick(self, quiet: bool = False) -> tuple[bool, list[Message]]:
        """Fold what arrived since the last tick: (whether any job's row changed, the restart and
        failure events to announce). ``quiet``: records already there are history, not news."""
        changed = self._discover()
        news: list[Message] = []
        for fold in list(self.folds.values()):
            if fold.done:
                continue
            try:
                changed |= self._refresh(fold, quiet, news)
            except (EksftError, OSError) as e:   # a folder removed or torn mid-read: the next tick retries
                log.debug("eksft: cannot fold %s: %s", fold.job.name, describe_error(e))
        return changed, news

    def _discover(self) -> bool:
        """Add the jobs that appeared in the local jobs folder, drop the ones removed."""
        root = self.local.root
        try:
            names = set(os.listdir(root))
        except OSError:
            names = set()
        gone = [n for n in self.folds if n not in names]
        for name in gone:
            del self.folds[name]
        added = False
        for name in sorted(names - set(self.folds)):
            try:
                order = (root / name / "spec.json").stat().st_mtime
                fold = self.folds[name] = Fold(Job(name, self.local), order)
            except (EksftError, OSError):
                continue    # not a job folder, or one still being created
            kept = row_cache.read(self.local.folder(name), commands.JobRow)
            if kept is not None:   # ended before: its row, and nothing of its history to announce
                fold.row, fold.final_ticks = {"name": name, "backend": self.local.name, **kept}, 2
            added = True
        if added:
            self.folds = dict(sorted(self.folds.items(), key=lambda kv: kv[1].order))
        return added or bool(gone)

    def _refresh(self, fold: Fold, quiet: bool, news: list[Message]) -> bool:
        folder = self.local.folder(fold.job.name)
        before = row_cache.key(folder)
        try:
            row = commands.job_row(fold.job)
        except EksftError as e:   # a folder that cannot be read is listed with its problem, as by `list`
            row = commands.summary_row(self.local.state(fold.job.name), str(e))
        mon = fold.job.monitor
        if quiet:                  # history: nothing to announce
            fold.restarts, fold.failures = len(mon.restarts), len(mon.failures)
        elif fold.restarts is None:    # a job that appeared while clients listen: all of it is news
            fold.restarts = fold.failures = 0
        name = fold.job.name
        news += [("failure", {"job": name, "level": f["level"], "cause": f["cause"]})
                 for f in mon.failures[fold.failures:]]
        news += [("restart",
                  {"job": name, **{k: r.get(k) for k in ("level", "cause", "blame_rank", "downtime_s",
                                                                      "resumed_step")}})
                 for r in mon.restarts[fold.restarts:]]
        fold.restarts, fold.failures = len(mon.restarts), len(mon.failures)
        if row["ended"]:
            fold.final_ticks += 1
            if fold.done and mon.finished:
                row_cache.write(folder, row, before)
        changed, fold.row = row != fold.row, row
        return changed

    async def figure(self, name: str, backend: str = "local") -> str:
        """The job's dashboard figure as plotly JSON, built by the widget's own figure code (in the
        worker thread: the figure feeds on the job's fold)."""
        pool = self._pool if backend == "local" else None   # an EKS job's events come slowly, from its pods
        return await asyncio.get_running_loop().run_in_executor(pool, self._figure, name, backend)

    def _figure(self, name: str, backend: str) -> str:
        from ..dashboard.figure import TrainingFigure

        fold = self.folds.get(name) if backend == "local" else None
        fold = fold or Fold(attach(name, backend), 0.0)   # not listed (yet): a fold of its own
        fold.figure = fold.figure or TrainingFigure()
        fold.figure.ingest(fold.job.refresh())
        return fold.figure.figure().to_json()

    async def listing(self) -> dict[str, Any]:
        """``GET /eksft/jobs``: :meth:`rows` after a tick (in the worker thread, as the stream's; what it
        finds new goes to the stream's clients), with each cluster's jobs as the stream has them, or, with
        no stream running, listed now."""
        loop = asyncio.get_running_loop()
        streaming = bool(self._tasks)
        changed, news = await loop.run_in_executor(self._pool, self.tick, not streaming)
        if streaming:
            if changed:
                self._publish("jobs", self.rows())
            for kind, data in news:
                self._publish(kind, data)
            return self.rows()
        listed = self.rows(clusters=False)
        for name, configured in CLUSTERS.items():
            if not await loop.run_in_executor(None, configured):
                continue
            try:
                listed["jobs"] += await loop.run_in_executor(None, commands.list_jobs, name)
                listed["backends"][name] = {"ok": True, "error": None}
            except Exception as e:   # unreachable cluster, expired credentials: shown, never fatal
                listed["backends"][name] = {"ok": False, "error": describe_error(e)}
        return listed

    def rows(self, clusters: bool = True) -> dict[str, Any]:
        """The ``jobs`` event's data: every job's row, and how each backend's listing went (``clusters``:
        with the clusters' jobs as their tasks last listed them)."""
        jobs = [f.row for f in self.folds.values() if f.row is not None]
        backends: dict[str, Any] = {"local": {"ok": True}}
        for name, listed in self.clusters.items() if clusters else ():
            jobs += listed["jobs"]
            backends[name] = {"ok": listed["ok"], "error": listed["error"]}
        return {"jobs": jobs, "backends": backends}

    # ---- the stream (in the server's event loop) -------------------------------------------------
    def subscribe(self) -> asyncio.Queue[Message | None]:
        """A queue that receives every message from now on, the current ``jobs`` first."""
        queue: asyncio.Queue[Message | None] = asyncio.Queue()
        self._clients.add(queue)
        if self._snapshot is not None and self._tasks:
            queue.put_nowait(("jobs", self._snapshot))
        if not self._tasks:
            self._tasks = [asyncio.ensure_future(self._run())]
        return queue

    def unsubscribe(self, queue: asyncio.Queue[Message | None]) -> None:
        self._clients.discard(queue)

    def _publish(self, kind: str, data: dict[str, Any]) -> None:
        if kind == "jobs":
            self._snapshot = data
        for queue in list(self._clients):
            if queue.qsize() >= MAX_BEHIND:   # a client that stopped reading: let it go, keep the memory
                self._clients.discard(queue)
                queue.put_nowait(None)
            else:
                queue.put_nowait((kind, data))

    async def _run(self) -> None:
        """Tick while anyone listens; the first tick after a quiet spell announces no history."""
        loop = asyncio.get_running_loop()
        first = True
        try:
            for name, configured in CLUSTERS.items():   # the first list says which clusters are set up
                if name not in self.clusters and await loop.run_in_executor(None, configured):
                    self.clusters[name] = {"ok": True, "error": None, "jobs": []}
                self._tasks.append(asyncio.ensure_future(self._run_cluster(name)))
            while self._clients:
                try:
                    changed, news = await loop.run_in_executor(self._pool, self.tick, first)
                except Exception:   # the stream must outlive any one bad tick
                    log.exception("eksft: a tick of the jobs stream failed")
                    changed, news = False, []
                if changed or first:
                    self._publish("jobs", self.rows())
                for kind, data in news:
                    self._publish(kind, data)
                first = False
                await asyncio.sleep(self.interval)
        finally:
            for task in self._tasks:
                if task is not asyncio.current_task():
                    task.cancel()
            self._tasks, self._snapshot = [], None

    async def _run_cluster(self, name: str) -> None:
        """List the cluster's jobs every ``cluster_interval`` once it is set up (a Slurm job launched
        from a notebook sets it up later; looking for a kubeconfig imports the client, so in a thread)."""
        loop = asyncio.get_running_loop()
        while True:
            if name in self.clusters or await loop.run_in_executor(None, CLUSTERS[name]):
                before = self.clusters.setdefault(name, {"ok": True, "error": None, "jobs": []})
                try:
                    jobs, ok, error = await loop.run_in_executor(None, commands.list_jobs, name), True, None
                except Exception as e:   # unreachable cluster, expired credentials: shown, never fatal
                    jobs, ok, error = before["jobs"], False, describe_error(e)
                new = {"ok": ok, "error": error, "jobs": jobs}
                if new != before:
                    self.clusters[name] = new
                    self._publish("jobs", self.rows())
            await asyncio.sleep(self.cluster_interval)

    def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        for queue in self._clients:
            queue.put_nowait(None)
        self._pool.shutdown(wait=False, cancel_futures=True)
