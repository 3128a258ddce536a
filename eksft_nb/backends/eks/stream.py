"""A job's events on EKS, for the same :class:`JobMonitor` (and dashboard) as a local job's.

Two sources, merged in arrival order:

- the ranks' own events, which they print to stdout behind ``events.LOG_PREFIX``: each pod's log is
  followed and decoded as it is written;
- what the local supervisor would report, derived here from the pods and the workload: ``job_start``,
  ``failure``/``restart`` (a pod OOM-killed, evicted, deleted or lost; ft_launcher restarting its
  ranks; in-process restarts) and ``job_end``.

Background threads only fetch (a pod watch, one log follower per container, a workload poll);
:meth:`EksEvents.read` turns what they fetched into events in the caller's thread.
"""

from __future__ import annotations

import json
import queue
import re
import signal
import threading
import time
from dataclasses import dataclass
from typing import Any

import urllib3
from kubernetes import watch
from kubernetes.client.rest import ApiException

from ...events import Event, decode, make
from ...monitor import JobMonitor
from ...spec import JobSpec
from . import names
from .cluster import ApiError, Cluster
from .pods import PodState, pod_state

WORKER_FAILED = re.compile(r"failed \(exitcode: (-?\d+)\) local_rank: (\d+) \(pid: (\d+)\)")  # ft_launcher
FT_TIMEOUT = re.compile(r"FT timeout elapsed")
LOG_DRAIN_S = 15.0      # once the workload has ended, how long to wait for the last log lines
FOLLOW_IDLE_S = 300.0   # a log stream with nothing new for this long is reopened


def workload_outcome(obj: dict[str, Any]) -> tuple[str, str] | None:
    """("succeeded" | "failed", reason) once a Job, JobSet or PyTorchJob has finished, else None."""
    for c in (obj.get("status") or {}).get("conditions") or []:
        if c.get("status") != "True":
            continue
        if c.get("type") in ("Complete", "Completed", "Succeeded"):
            return "succeeded", "all pods finished"
        if c.get("type") == "Failed":
            reason = c.get("reason", "")
            if reason in ("FailedIndexes", "BackoffLimitExceeded", "ReachedMaxRestarts"):
                why = "a node failed more often than max_job_restarts allows"
            else:
                why = "the workload failed"
            return "failed", f"{why} ({reason}: {c.get('message', '')})".replace(": )", ")")
    return None


@dataclass
class Incident:
    """A failure being recovered from: opened at detection, closed by the first step after it."""

    level: str
    cause: str
    blame_rank: int | None
    fault_time: float
    detected_at: float
    last_step: int
    resumed_step: int | None = None


class Tracker:
    """Turns fetched items (workload states, pod states, log lines) into the job's events."""

    def __init__(self, spec: JobSpec, created: float, server: str) -> None:
        self.spec, self.created, self.server = spec, created, server
        self.container = names.container(spec)
        self.mon = JobMonitor()
        self.out: list[Event] = []
        self.started = False
        self.outcome: tuple[str, str] | None = None
        self.outcome_at = 0.0
        self.ended = False
        self.incident: Incident | None = None
        self.recent_faults: list[dict[str, Any]] = []
        self.recent_errors: list[dict[str, Any]] = []
        self.counted: set[str] = set()                 # pod failures already reported (uid, restarts)
        self.fault_seen: set[str] = set()              # pods whose fault annotation was reported
        self.incarnation: dict[int, tuple[int, int, int]] = {}
        self.rank_of: dict[tuple[str, int], int] = {}  # (pod, pid) -> rank
        self.open_logs: set[Any] = set()
        self.rank_ended = False                        # a rank_end arrived (the digest, for the trainer)

    # ---- output ------------------------------------------------------------------------------------
    def take(self) -> list[Event]:
        out, self.out = self.out, []
        return out

    def _emit(self, kind: str, t: float | None = None, **data: Any) -> None:
        self._fold(make(kind, self.spec.name, None, t=t, **data))

    def _fold(self, event: Event) -> None:
        self.mon.update([event])
        self.out.append(event)

    def _start(self) -> None:
        if not self.started:
            self.started = True
            s = self.spec
            self._emit("job_start", t=self.created, spec_digest=s.digest(), world_size=s.world_size, steps=s.steps,
                       backend="eks", host=self.server, pid=0, namespace=s.eks.namespace, workload=s.eks.kind)

    # ---- inputs ------------------------------------------------------------------------------------
    def feed(self, item: tuple[Any, ...]) -> None:
        self._start()
        {"workload": self.on_workload, "pod": self.on_pod, "line": self.on_line,
         "log_start": self.open_logs.add, "log_end": self.open_logs.discard}[item[0]](*item[1:])

    def on_workload(self, obj: dict[str, Any] | None) -> None:
        if self.outcome is not None:
            return
        if obj is None:
            self.outcome = ("stopped", "stopped by the user (the workload was deleted)")
        elif (obj.get("metadata") or {}).get("deletionTimestamp"):
            self.outcome = ("stopped", "stopped by the user")
        else:
            self.outcome = workload_outcome(obj)
        if self.outcome is not None:
            self.outcome_at = time.time()

    def on_pod(self, kind: str, pod: dict[str, Any], ending: bool) -> None:
        meta = pod.get("metadata") or {}
        uid = meta.get("uid", "")
        note = (meta.get("annotations") or {}).get(names.FAULT_ANNOTATION)
        if note and uid not in self.fault_seen:
            self.fault_seen.add(uid)
            fault = json.loads(note)
            self._emit("fault", t=fault["t"], fault=fault["fault"], id=fault["id"], target_rank=None,
                       at_step=self.mon.last_step, node=fault["node"], pod=meta.get("name"))
            self.recent_faults.append({"t": fault["t"], "fault": fault["fault"], "node": fault["node"]})
        if ending or self.outcome is not None:
            return
        ps = pod_state(pod, self.container)
        key = f"{uid}/{ps.restarts}"
        lost = kind == "DELETED" or ps.deleting
        if (ps.failed or lost) and ps.phase != "succeeded" and key not in self.counted:
            self.counted.add(key)
            cause = f"{ps.label}: {ps.reason}" if ps.failed else f"{ps.label} was deleted: its node is lost"
            self._open_node_incident(ps, cause, ps.ended_at)
        elif ps.restarts and f"{uid}/{ps.restarts - 1}" not in self.counted:
            self.counted.add(f"{uid}/{ps.restarts - 1}")   # restarted in place (PyTorchJob) since the last look
            self._open_node_incident(ps, f"{ps.label}: ft_launcher {ps.last_exit}, restarted in place", None)

    def _open_node_incident(self, ps: PodState, cause: str, ended_at: float | None) -> None:
        """A node (pod) failed: the job-level tier, as when the local supervisor relaunches."""
        node_fault = next((f for f in reversed(self.recent_faults) if "node" in f), None)
        if node_fault:
            cause = f"injected {node_fault['fault']} on node {node_fault['node']} ({ps.name})"
        # the container's end (or the pod's deletion) is when it failed, and Kubernetes reports it at once
        detected = ended_at or time.time()
        fault_time = node_fault["t"] if node_fault else (ended_at or self._last_progress())
        self._open(Incident("job", cause, None, fault_time, detected, self.mon.last_step), force=True)

    def on_line(self, pod: str, text: str) -> None:
        event = decode(text)
        if event is not None:
            self._on_rank_event(event, pod)
            self._fold(event)
            return
        if m := WORKER_FAILED.search(text):
            code, pid = int(m.group(1)), int(m.group(3))
            rank = self.rank_of.get((pod, pid))
            self._open(Incident("injob", self._cause_from_exit(rank, code), self._blame(rank), self._fault_time(),
                                time.time(), self.mon.last_step))
        elif FT_TIMEOUT.search(text):
            blame = self._blame(None)
            self._open(Incident("injob", f"hang: no heartbeat from rank {blame} (ft_launcher timeout)"
                                if blame is not None else "hang detected by ft_launcher's heartbeat timeout",
                                blame, self._fault_time(), time.time(), self.mon.last_step))

    def finish(self, now: float) -> None:
        """``job_end`` once the workload has ended and its pods' logs are read (or stopped coming)."""
        if self.outcome is None or self.ended:
            return
        draining = self.open_logs or (self.outcome[0] == "succeeded" and not self.rank_ended)
        if draining and now - self.outcome_at < LOG_DRAIN_S and self.outcome[0] != "stopped":
            return
        self.ended = True
        state, reason = self.outcome
        self._emit("job_end", state=state, reason=reason, final_step=self.mon.last_step, digest=self.mon.digest,
                   restarts=self.mon.restarts_by_level())

    # ---- incidents -----------------------------------------------------------------------------------
    def _on_rank_event(self, e: Event, pod: str) -> None:
        if e.kind == "fault":
            target = {"rank": e["target_rank"]} if e["target_rank"] is not None else {"node": e.get("node", 0)}
            self.recent_faults.append({"t": e.t, "fault": e["fault"], **target})
        elif e.kind == "rank_error":
            self.recent_errors.append({"t": e.t, "rank": e.rank, "origin": e["origin"], "error": e["error"]})
        elif e.kind == "rank_start" and e.rank is not None:
            self.rank_of[(pod, e["pid"])] = e.rank
            now = (e["job_attempt"], e["injob_restart"], e["inprocess_iteration"])
            before = self.incarnation.get(e.rank)
            self.incarnation[e.rank] = now
            if before is not None and now != before and self.incident is None:
                same_process = now[:2] == before[:2]
                detected = max((x["t"] for x in self.recent_errors), default=e.t)
                self._open(Incident("inprocess" if same_process else "injob",
                                    self._cause_from_ranks("the wrapped training function was restarted"
                                                           if same_process else "the worker group was restarted"),
                                    self._blame(None), self._fault_time(), detected, self.mon.last_step))
            if self.incident is not None and e.rank == 0:
                self.incident.resumed_step = e["start_step"]
        elif e.kind == "rank_end":
            self.rank_ended = True
        elif e.kind == "step":
            started = e.t - e["step_time"]
            if self.incident is not None and e.t > self.incident.detected_at:
                self._close(started)
            # forget what a whole step has run after; pods' logs arrive interleaved, so not simply all
            self.recent_faults = [f for f in self.recent_faults if f["t"] >= started]
            self.recent_errors = [x for x in self.recent_errors if x["t"] >= started]

    def _open(self, incident: Incident, force: bool = False) -> None:
        if self.incident is not None and not force:
            return
        self.incident = incident
        self._emit("failure", level=incident.level, cause=incident.cause, blame_rank=incident.blame_rank,
                   fault_time=incident.fault_time, detected_at=incident.detected_at)

    def _close(self, first_step_start: float) -> None:
        i, self.incident = self.incident, None
        resumed = i.resumed_step or 0
        self._emit("restart", level=i.level, cause=i.cause, blame_rank=i.blame_rank, fault_time=i.fault_time,
                   detection_s=max(0.0, i.detected_at - i.fault_time),
                   downtime_s=max(0.0, first_step_start - i.fault_time),
                   rolled_back_steps=max(0, i.last_step - resumed), resumed_step=resumed)

    def _last_progress(self) -> float:
        return self.mon.steps.t[-1] if self.mon.steps.t else self.created

    def _fault_time(self) -> float:
        return self.recent_faults[0]["t"] if self.recent_faults else self._last_progress()

    def _cause_from_ranks(self, fallback: str) -> str:
        rank_faults = [f for f in self.recent_faults if "rank" in f]
        if rank_faults:
            return f"injected {rank_faults[0]['fault']} on rank {rank_faults[0]['rank']}"
        own = [x for x in self.recent_errors if x["origin"] in ("fault", "exception")]
        if own:
            return f"rank {own[0]['rank']} raised {own[0]['error'][:160]}"
        if any(x["origin"] == "interrupted" for x in self.recent_errors):
            return "a rank stopped making progress (in-process soft timeout)"
        return fallback

    def _cause_from_exit(self, rank: int | None, code: int) -> str:
        rank_faults = [f for f in self.recent_faults if "rank" in f]
        if rank_faults:
            return f"injected {rank_faults[0]['fault']} on rank {rank_faults[0]['rank']}"
        who = f"rank {rank}" if rank is not None else "a rank"
        if code < 0 and -code in signal.Signals._value2member_map_:
            return f"{who} died ({signal.Signals(-code).name})"
        return f"{who} exited with code {code}"

    def _blame(self, fallback: int | None) -> int | None:
        rank_faults = [f for f in self.recent_faults if "rank" in f]
        if rank_faults:
            return rank_faults[0]["rank"]
        own = [x["rank"] for x in self.recent_errors if x["origin"] in ("fault", "exception")]
        return own[0] if own else fallback


class EksEvents:
    """The :class:`EventSource` of one EKS job: each :meth:`read` returns the events since the last."""

    def __init__(self, cluster: Cluster, spec: JobSpec, created: float, poll_s: float = 2.0) -> None:
        self.cluster, self.spec, self.poll_s = cluster, spec, poll_s
        self.tracker = Tracker(spec, created, cluster.server)
        self.kind = names.workload(spec)
        self._queue: queue.SimpleQueue[tuple[Any, ...]] = queue.SimpleQueue()
        self._closed = threading.Event()
        self._followed: set[tuple[str, int]] = set()
        self._threads: list[threading.Thread] = []

    def read(self) -> list[Event]:
        if not self._threads:
            self._spawn(self._watch_pods)
            self._spawn(self._poll_workload)
        while True:
            try:
                self.tracker.feed(self._queue.get_nowait())
            except queue.Empty:
                break
        self.tracker.finish(time.time())
        if self.tracker.ended:
            self.close()   # nothing more will come: let the threads end
        return self.tracker.take()

    def close(self) -> None:
        self._closed.set()

    def _spawn(self, target: Any, *args: Any) -> None:
        thread = threading.Thread(target=target, args=args, daemon=True, name=f"eksft-{self.spec.name}")
        thread.start()
        self._threads.append(thread)

    # ---- fetching threads --------------------------------------------------------------------------
    def _poll_workload(self) -> None:
        reported: Any = object()
        while not self._closed.is_set():
            try:
                obj = self.cluster.get(self.kind, self.spec.name)
            except ApiError:
                self._closed.wait(self.poll_s)
                continue
            state = None if obj is None else ((obj.get("metadata") or {}).get("deletionTimestamp"),
                                              json.dumps((obj.get("status") or {}).get("conditions")))
            if state != reported:
                reported = state
                self._queue.put(("workload", obj))
            if obj is None:
                return
            self._closed.wait(self.poll_s)

    def _workload_ending(self) -> bool:
        """Whether the workload is gone, being deleted or finished (pod losses are then no failures)."""
        try:
            obj = self.cluster.get(self.kind, self.spec.name)
        except ApiError:
            return False
        return obj is None or bool((obj.get("metadata") or {}).get("deletionTimestamp")) or \
            workload_outcome(obj) is not None

    def _watch_pods(self) -> None:
        core, ns = self.cluster.core, self.cluster.namespace
        while not self._closed.is_set():
            try:
                for ev in watch.Watch().stream(core.list_namespaced_pod, ns, label_selector=names.selector(self.spec.name),
                                               timeout_seconds=30, _request_timeout=(5, 60), deserialize=False):
                    if self._closed.is_set():
                        return
                    pod = ev["object"]
                    ps = pod_state(pod, names.container(self.spec))
                    ending = (ev["type"] == "DELETED" or ps.failed or ps.deleting) and self._workload_ending()
                    self._follow_logs(pod)
                    self._queue.put(("pod", ev["type"], pod, ending))
            except (ApiException, urllib3.exceptions.HTTPError, OSError, ValueError):
                self._closed.wait(1.0)

    def _follow_logs(self, pod: dict[str, Any]) -> None:
        container = names.container(self.spec)
        status = next((c for c in (pod.get("status") or {}).get("containerStatuses") or [] if c["name"] == container), None)
        if not status or not ({"running", "terminated"} & set(status.get("state") or {})):
            return
        key = (pod["metadata"]["uid"], status.get("restartCount", 0))
        if key in self._followed:
            return
        self._followed.add(key)
        self._queue.put(("log_start", key))
        self._spawn(self._follow, pod["metadata"]["name"], key)

    def _follow(self, pod: str, key: tuple[str, int]) -> None:
        """Every line of one container's log, once, however often the stream has to be reopened."""
        seen, failures = 0, 0
        while not self._closed.is_set() and failures < 5:
            try:
                n = 0
                for line in watch.Watch().stream(self.cluster.core.read_namespaced_pod_log, pod, self.cluster.namespace,
                                                 container=names.container(self.spec), follow=True,
                                                 _request_timeout=(5, FOLLOW_IDLE_S)):
                    n += 1
                    if n > seen:
                        seen = n
                        self._queue.put(("line", pod, line))
                break  # the container has ended and its log is read
            except ApiException as e:
                if e.status in (400, 404):  # the pod is gone, or its container has not started
                    break
                failures += 1
            except urllib3.exceptions.ReadTimeoutError:
                continue  # a quiet container: ask again
            except (urllib3.exceptions.HTTPError, OSError, ValueError):
                failures += 1
            self._closed.wait(1.0)
        self._queue.put(("log_end", key))
