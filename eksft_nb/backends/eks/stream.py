"""A job's events on EKS, for the same :class:`JobMonitor` (and dashboard) as a local job's.

Two sources, merged in arrival order:

- the ranks' own events, which they print to stdout behind ``events.LOG_PREFIX``: each pod's log is
  followed and decoded as it is written;
- what the local supervisor would report, derived here from the pods and the workload: ``job_start``,
  ``failure``/``restart`` (a pod OOM-killed, evicted, deleted or lost; ft_launcher restarting its
  ranks; in-process restarts; a torchft replica group's pod lost, then its replacement healed, as the
  local supervisor's, :mod:`eksft_nb.engines.torchft.losses`; the job's pods drained on SIGTERM and
  recreated, one job-level restart whose cause is the drain) and ``job_end``, never "succeeded" for a
  job whose ranks stopped short of their last step;
- ``warning`` events for what the job waits on or loses: a pod not scheduled (what for, since when),
  NCCL falling back to TCP sockets on pods that have EFA.

Background threads only fetch (a pod watch, one log follower per container, a workload poll);
:meth:`EksEvents.read` turns what they fetched into events in the caller's thread.
"""

from __future__ import annotations

import dataclasses
import json
import queue
import re
import threading
import time
from typing import Any

import urllib3

from ...engines.registry import engine_of
from ...engines.torchft.losses import fault_time
from ...events import Event, decode, make
from ...incidents import Incidents
from ..launcher_log import parse_launcher_line
from ...monitor import JobMonitor
from ...spec import JobSpec
from ...states import JobState
from ...timeouts import derive
from . import names
from .cluster import ApiError, Cluster
from .instances import efa_per_node
from .pods import PodState, hung_reason, pod_state

CONFIGMAP = names.KINDS["ConfigMap"]
POD = names.KINDS["Pod"]

DRAINED = re.compile(r"drained on SIGTERM at step \d+ \([^)]*\)")   # what a drained pod's message says
NCCL_NETWORK = re.compile(r"NCCL INFO Using network (\S[^\r\n]*?)\s*$")   # NCCL's choice, at INFO for NET
LOG_DRAIN_S = 15.0      # once the workload has ended, how long to wait for the last log lines
NAMED_POD = re.compile(r"for pod [^/\s]+/(\S+)")   # the pod a Job's failure message names
FOLLOW_IDLE_S = 300.0   # a log stream with nothing new for this long is reopened


def workload_outcome(obj: dict[str, Any]) -> tuple[JobState, str] | None:
    """("succeeded" | "failed", reason) once a Job, JobSet or PyTorchJob has finished, else None."""
    for c in (obj.get("status") or {}).get("conditions") or []:
        if c.get("status") != "True":
            continue
        if c.get("type") in ("Complete", "Completed", "Succeeded"):
            return JobState.SUCCEEDED, "all pods finished"
        if c.get("type") == "Failed":
            reason = c.get("reason", "")
            if reason in ("FailedIndexes", "MaxFailedIndexesExceeded", "BackoffLimitExceeded",
                          "ReachedMaxRestarts"):
                why = "a node failed more often than max_job_restarts allows"
            else:
                why = "the workload failed"
            return JobState.FAILED, f"{why} ({reason}: {c.get('message', '')})".replace(": )", ")")
    return None


def with_cause(reason: str, pods: list[PodState]) -> str:
    """A failed workload's reason led by the pod behind it, in its own words (a prepare step's refusal, its
    termination message): the pod the Job's failure message names, else the one that failed last."""
    named = NAMED_POD.search(reason)
    failed = [p for p in pods if p.failed and p.reason]
    pod = next((p for p in failed if named and p.name == named.group(1)), None) or \
        max(failed, key=lambda p: p.ended_at or 0.0, default=None)
    return f"{pod.label}: {pod.reason} ({reason})" if pod is not None else reason


class Tracker:
    """Turns fetched items (workload states, pod states, log lines) into the job's events."""

    def __init__(self, spec: JobSpec, created: float, server: str) -> None:
        self.spec, self.created, self.server = spec, created, server
        self.container = names.container(spec)
        self.mon = JobMonitor()
        self.out: list[Event] = []
        self.started = False
        self.outcome: tuple[JobState, str] | None = None
        self.outcome_at = 0.0
        self.ended = False
        self.incidents = Incidents(self.mon, self._emit, created)
        # a torchft job: a group's pod lost is the group's incident, not the job's (the others train on)
        self.groups = engine_of(spec).group_losses(self._emit)
        self.started_at: dict[int, float] = {}         # rank -> its latest start (a torchft group's too)
        # a torchft group's pod seen failed while its log is still read: (group, cause, ended, detected, seen)
        self.pending: dict[Any, tuple[int, str, float | None, float, float]] = {}
        self.counted: set[str] = set()                 # pod failures already reported (uid, restarts)
        self.fault_seen: set[str] = set()              # pods whose fault annotation was reported
        self.rank_of: dict[tuple[str, int], int] = {}  # (pod, pid) -> rank, for each rank's latest start
        self.started_as: dict[int, tuple[str, int]] = {}  # rank -> its (pod, pid) key in rank_of
        self.open_logs: set[Any] = set()               # (pod uid, restarts) of the logs being followed
        self.log_pod: dict[Any, str] = {}              # ...and the pod each belongs to
        self.pod_of: dict[int, str] = {}               # rank -> the pod of its latest start
        self.ended_ranks: set[int] = set()             # ranks whose latest start has ended (rank_end)
        self.lag: float | None = None                  # least (our clock - a rank event's t) seen
        self.drain_incident: Any = None                # the incident a drain opened (one for all its pods)
        self.said: set[str] = set()                    # warnings given once (pending pods, NCCL's network)
        self.pods: dict[str, PodState] = {}            # pod uid -> its latest state

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
            self._emit("job_start", t=self.created, spec_digest=s.digest(), world_size=s.world_size,
                       steps=None if s.script else s.steps, backend="eks", host=self.server, pid=0,
                       namespace=s.eks.namespace, workload=s.eks.kind)

    # ---- inputs ------------------------------------------------------------------------------------
    def feed(self, item: tuple[Any, ...]) -> None:
        self._start()
        {"workload": self.on_workload, "pod": self.on_pod, "line": self.on_line,
         "log_start": self.on_log_start, "log_end": self.on_log_end}[item[0]](*item[1:])

    def on_log_start(self, key: Any, pod: str = "") -> None:
        self.open_logs.add(key)
        self.log_pod[key] = pod

    def on_log_end(self, key: Any) -> None:
        self.open_logs.discard(key)
        if key in self.pending:
            self._group_lost(*self.pending.pop(key)[:4])

    def pod_now(self) -> float:
        """Now, on the pods' clock: failures the notebook notices are compared with times the pods
        wrote, so they are dated on that clock (our clock less the smallest delay seen between a rank
        writing an event and its arrival here, which absorbs any skew between the two clocks)."""
        return time.time() - (self.lag or 0.0)

    def on_workload(self, obj: dict[str, Any] | None) -> None:
        if self.outcome is not None:
            return
        if obj is None:
            self.outcome = (JobState.STOPPED, "stopped by the user (the workload was deleted)")
        elif (obj.get("metadata") or {}).get("deletionTimestamp"):
            self.outcome = (JobState.STOPPED, "stopped by the user")
        else:
            self.outcome = workload_outcome(obj)
        if self.outcome is not None:
            self.outcome_at = time.time()

    def on_pod(self, kind: str, pod: dict[str, Any], ending: bool) -> None:
        meta = pod.get("metadata") or {}
        uid = meta.get("uid", "")
        fault = _note((meta.get("annotations") or {}).get(names.FAULT_ANNOTATION))
        ps = pod_state(pod, self.container, names.process(self.spec))
        self.pods[uid] = ps
        if fault and uid not in self.fault_seen:
            # the fault happened when the pod's deletion began (the cluster's clock)
            self.fault_seen.add(uid)
            self._emit("fault", t=ps.ended_at or self.pod_now(), fault=fault["fault"], id=fault["id"],
                       target_rank=None, at_step=self.mon.last_step, node=fault["node"], pod=meta.get("name"))
        if ending or self.outcome is not None:
            return
        key = f"{uid}/{ps.restarts}"
        if ps.drained:
            if key not in self.counted:
                self.counted.add(key)
                self._drained(ps)
            return
        unscheduled = ps.phase == "pending" and ps.reason.startswith("not scheduled")
        if unscheduled and f"pending/{uid}" not in self.said:
            self.said.add(f"pending/{uid}")
            self._emit("warning", what="pod-pending", message=self._pending(ps))
        lost = kind == "DELETED" or ps.deleting
        if (ps.failed or lost) and ps.phase != "succeeded" and key not in self.counted:
            self.counted.add(key)
            cause = f"{ps.label}: {ps.reason}" if ps.failed else f"{ps.label} was deleted: its node is lost"
            if self.groups is not None and ps.node is not None:
                # its log's last lines (an injected fault's event, which dates the loss) first
                loss = (ps.node, f"replica group {ps.node}'s {cause}", ps.ended_at, self.pod_now(),
                        time.time())
                if (uid, ps.restarts) in self.open_logs:
                    self.pending[(uid, ps.restarts)] = loss
                else:
                    self._group_lost(*loss[:4])
            else:
                self._open_node_incident(ps, cause, ps.ended_at)
        elif ps.restarts and f"{uid}/{ps.restarts - 1}" not in self.counted:
            # restarted in place (PyTorchJob) since the last look
            self.counted.add(f"{uid}/{ps.restarts - 1}")
            self._open_node_incident(ps, f"{ps.label}: ft_launcher {ps.last_exit}, restarted in place", None)

    def _drained(self, ps: PodState) -> None:
        """A pod whose ranks drained: the workload recreates it (and the others, which drained with it), and
        they resume from the drain's save. One job-level restart for the drain, not one per pod."""
        if self.drain_incident is not None and self.incidents.incident is self.drain_incident:
            return
        # the ranks' drain event, else the pod's termination message (its log may come after its state)
        said = DRAINED.search(ps.reason)
        what = self._drain_words() or (said.group(0) if said else "stopped on SIGTERM")
        self._open_node_incident(ps, f"{what}: {ps.label} and the job's other pods are recreated by the "
                                 "workload", ps.ended_at)
        self.drain_incident = self.incidents.incident

    def _drain_words(self) -> str | None:
        d = self.mon.drain
        if d is None:
            return None
        saved = "saved and committed" if d["committed"] else "its save could NOT be committed"
        return f"drained on SIGTERM at step {d['step']} ({saved})"

    def _pending(self, ps: PodState) -> str:
        """What a pod that is not scheduled waits for, since when, and what that holds up."""
        since = time.strftime("%H:%M:%S", time.localtime(ps.since)) if ps.since else "its creation"
        waits = (f"the other pods wait for it in the rendezvous for up to {self.spec.eks.join_timeout} s "
                 "(--rdzv-join-timeout), then fail") if self.spec.nnodes > 1 else "training waits for it"
        return f"{ps.label} is {ps.reason} (since {since}); {waits}"

    def _network(self, pod: str, network: str) -> None:
        """NCCL's network, as a rank logs it: TCP sockets on a pod with EFA devices is a warning."""
        efa = efa_per_node(self.spec)
        if efa and "socket" in network.lower() and "nccl-socket" not in self.said:
            self.said.add("nccl-socket")
            self._emit("warning", what="nccl-socket",
                       message=f"NCCL in pod {pod} uses TCP sockets, not its {efa} EFA devices (\"Using "
                               f"network {network}\"): collectives run many times slower; the image's "
                               "aws-ofi-nccl did not load (see `logs --debug`)")

    def _open_node_incident(self, ps: PodState, cause: str, ended_at: float | None) -> None:
        """A node (pod) failed: the job-level tier, as when the local supervisor relaunches. The
        container's end (or the pod's deletion) is when it failed, and Kubernetes reports it at once."""
        self.incidents.node_failed(cause, ended_at or self.pod_now(), ended_at)

    def _group_lost(self, group: int, cause: str, ended_at: float | None, detected: float) -> None:
        """A torchft group's pod failed: its child Job replaces it, and the replacement heals from a peer.
        An injected fault on the group dates the loss, else the container's end (or the deletion)."""
        assert self.groups is not None
        when = fault_time(self.mon.faults, group, self.started_at.get(group, 0.0), detected, ended_at)
        self.groups.lost(group, cause, when, detected, self.mon.last_step)

    def on_line(self, pod: str, text: str) -> None:
        event = decode(text, log=True)
        if event is not None:
            lag = time.time() - event.t
            self.lag = lag if self.lag is None else min(self.lag, lag)
            self._fold(event)
            self._on_rank_event(event, pod)
            return
        seen = parse_launcher_line(text)   # the one reader of ft_launcher's lines (NVRx 0.4.1 to 0.7)
        if seen is not None:
            seen = dataclasses.replace(seen, at=self.pod_now())
            self.incidents.launcher_line(pod, seen, self.rank_of.get((pod, seen.pid)))
        elif m := NCCL_NETWORK.search(text):
            self._network(pod, m.group(1))

    def _cause_to_hear(self) -> bool:
        """Whether the pod a failed workload's message names is not yet seen failed: the pods' watch may bring
        its state (its own words, a refusal of ``prepare``) after the workload's."""
        named = NAMED_POD.search(self.outcome[1] if self.outcome else "")
        return named is not None and not any(p.name == named.group(1) and p.failed and p.reason
                                             for p in self.pods.values())

    def finish(self, now: float) -> None:
        """``job_end`` once the workload has ended and its pods' logs are read (or stopped coming); a lost
        group's failure whose pod's log stopped coming, without it."""
        for key, loss in list(self.pending.items()):
            if now - loss[4] > LOG_DRAIN_S:
                del self.pending[key]
                self._group_lost(*loss[:4])
        grace = derive(self.spec).grace.seconds
        for uid, ps in self.pods.items():
            if self.outcome is None and f"hung/{uid}" not in self.said and ps.hung(grace, self.pod_now()):
                self.said.add(f"hung/{uid}")
                self._emit("warning", what="pod-hung", message=hung_reason(ps))
        if self.outcome is None or self.ended:
            return
        draining = self.open_logs or (self.outcome[0] == JobState.SUCCEEDED and self._ranks_to_hear()) or \
            (self.outcome[0] == JobState.FAILED and self._cause_to_hear())
        if draining and now - self.outcome_at < LOG_DRAIN_S and self.outcome[0] != JobState.STOPPED:
            return
        self.ended = True
        state, reason = self.outcome
        self.incidents.end(now)
        if state == JobState.SUCCEEDED and (short := self._stopped_short()) is not None:
            state, reason = short
        elif state == JobState.FAILED:
            reason = self.incidents.named(with_cause(reason, list(self.pods.values())))
        self._emit("job_end", state=state, reason=reason, final_step=self.mon.last_step,
                   digest=self.mon.digest,
                   restarts=self.mon.restarts_by_level())

    def _stopped_short(self) -> tuple[JobState, str] | None:
        """A workload Complete while the built-in trainer's ranks stopped before their last step (pods whose
        eksft-nb exits 0 on a drain, or a launcher that exited 0 early): not a success. A script's own loop
        decides when it is done."""
        mon, steps = self.mon, self.spec.steps
        if self.spec.script or mon.digest is not None or mon.last_step >= steps:
            return None
        if (d := mon.drain) is not None:
            saved = "saved and committed" if d["committed"] else "its save could NOT be committed"
            return JobState.STOPPED, (f"drained on SIGTERM at step {d['step']} of {steps} ({saved}), and the "
                                      "workload ended Complete: its image's eksft-nb predates drain exits; "
                                      f"resume it with `python -m eksft_nb resume {self.spec.name}`")
        return JobState.FAILED, (f"the pods finished at step {mon.last_step} of {steps}: the workload is "
                                 "Complete but training is not (see `logs --debug`)")

    def _ranks_to_hear(self) -> list[int]:
        """Ranks whose end may still come: not ended since their start, and their pod's log still
        open, or not seen at all (its pod's log may not be followed yet). Each pod's lines arrive in
        order, so a log that has ended has delivered its ranks' ends, if they wrote any."""
        open_pods = {self.log_pod.get(k) for k in self.open_logs}
        return [r for r in range(self.spec.world_size) if r not in self.ended_ranks
                and (r not in self.pod_of or self.pod_of[r] in open_pods)]

    def _on_rank_event(self, e: Event, pod: str) -> None:
        if e.kind == "rank_start" and isinstance(e.rank, int):
            old = self.started_as.get(e.rank)   # a process that has been replaced exits no more
            if old is not None and self.rank_of.get(old) == e.rank:
                del self.rank_of[old]
            self.rank_of[(pod, e["pid"])], self.started_as[e.rank] = e.rank, (pod, e["pid"])
            self.pod_of[e.rank] = pod
            self.started_at[e.rank] = e.t
            self.ended_ranks.discard(e.rank)
        elif e.kind == "rank_end" and isinstance(e.rank, int):
            self.ended_ranks.add(e.rank)
            self.pod_of.setdefault(e.rank, pod)
        self.incidents.observe(e)
        if e.kind == "drain" and self.drain_incident is not None \
                and self.incidents.incident is self.drain_incident:
            # the drain's own words, for its restart, once its event arrives after the pods' states
            rest = self.drain_incident.cause.split(": ", 1)[-1]
            self.drain_incident.cause = f"{self._drain_words()}: {rest}"
        if self.groups is not None:
            for key in [k for k, loss in self.pending.items() if e.kind == "heal" and loss[0] == e.rank]:
                self._group_lost(*self.pending.pop(key)[:4])   # its replacement healed before its log ended
            self.groups.observe(e)


def _note(text: Any) -> dict[str, Any] | None:
    """A node-loss note, if ``text`` is a well-formed one (anyone who may write ConfigMaps can write one)."""
    try:
        note = json.loads(text) if isinstance(text, str) else None
    except ValueError:
        return None
    ok = isinstance(note, dict) and isinstance(note.get("fault"),
                                               str) and isinstance(note.get("id"), str) and \
        type(note.get("node")) is int
    return note if ok else None


class EksEvents:
    """The :class:`EventSource` of one EKS job: each :meth:`read` returns the events since the last."""

    def __init__(self, cluster: Cluster, spec: JobSpec, created: float, poll_s: float = 2.0) -> None:
        self.cluster, self.spec, self.poll_s = cluster, spec, poll_s
        self.tracker = Tracker(spec, created, cluster.server)
        self.kind = names.workload(spec)
        self._queue: queue.SimpleQueue[tuple[Any, ...]] = queue.SimpleQueue()
        self._closed = threading.Event()
        self._followed: set[tuple[str, int]] = set()
        self._noted: dict[str, str | None] = {}   # pod uid -> its node-loss note, once looked up
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
        """Each watch lasts 30 s (then it starts again at once, listing the pods anew); a failed one starts
        again a second later."""
        query = {"watch": "true", "labelSelector": names.selector(self.spec.name), "timeoutSeconds": 30}
        while not self._closed.is_set():
            try:
                for line in self.cluster.lines(POD.path(self.cluster.namespace), "watch pods", query, 60.0):
                    if self._closed.is_set():
                        return
                    if not line.strip():
                        continue
                    ev = json.loads(line)
                    if ev.get("type") == "ERROR":   # expired (410) or failed
                        raise ValueError(ev.get("object"))
                    pod = ev["object"]
                    ps = pod_state(pod, names.container(self.spec), names.process(self.spec))
                    gone = ev["type"] == "DELETED" or ps.deleting
                    ending = (gone or ps.failed) and self._workload_ending()
                    if gone:
                        self._attach_note(pod)
                    self._follow_logs(pod)
                    self._queue.put(("pod", ev["type"], pod, ending))
            except (ApiError, urllib3.exceptions.HTTPError, OSError, ValueError, KeyError, TypeError):
                self._closed.wait(1.0)

    def _attach_note(self, pod: dict[str, Any]) -> None:
        """A deleted pod carries its node-loss note (if the control plane deleted it as a fault)."""
        meta = pod.setdefault("metadata", {})
        uid = meta.get("uid", "")
        if uid not in self._noted:
            try:
                note = self.cluster.get(CONFIGMAP, names.fault_note(self.spec.name, uid))
            except ApiError:
                return   # asked again at the pod's next event
            self._noted[uid] = ((note or {}).get("data") or {}).get(names.FAULT_ANNOTATION)
        if self._noted[uid]:
            meta["annotations"] = {**(meta.get("annotations") or {}),
                                   names.FAULT_ANNOTATION: self._noted[uid]}

    def _follow_logs(self, pod: dict[str, Any]) -> None:
        container = names.container(self.spec)
        status = next(
            (c for c in (pod.get("status") or {}).get("containerStatuses") or [] if c["name"] == container),
            None)
        if not status or not ({"running", "terminated"} & set(status.get("state") or {})):
            return
        key = (pod["metadata"]["uid"], status.get("restartCount", 0))
        if key in self._followed:
            return
        self._followed.add(key)
        self._queue.put(("log_start", key, pod["metadata"]["name"]))
        self._spawn(self._follow, pod["metadata"]["name"], key)

    def _follow(self, pod: str, key: tuple[str, int]) -> None:
        """Every line of one container's log, once, however often the stream has to be reopened."""
        seen, failures = 0, 0
        path = f"{POD.path(self.cluster.namespace, pod)}/log"
        query = {"container": names.container(self.spec), "follow": "true"}
        while not self._closed.is_set() and failures < 5:
            try:
                n = 0
                for line in self.cluster.lines(path, f"read the log of pod {pod}", query, FOLLOW_IDLE_S):
                    n += 1
                    if n > seen:
                        seen = n
                        self._queue.put(("line", pod, line))
                break  # the container has ended and its log is read
            except ApiError as e:
                if e.status in (400, 404):  # the pod is gone, or its container has not started
                    break
                failures += 1
            except urllib3.exceptions.ReadTimeoutError:
                continue  # a quiet container: ask again
            except (urllib3.exceptions.HTTPError, OSError, ValueError):
                failures += 1
            self._closed.wait(1.0)
        self._queue.put(("log_end", key))
