"""EksBackend: a job's lifecycle on Amazon EKS, through the official ``kubernetes`` client.

A job is a handful of namespaced objects named after it: a ConfigMap (its record: the spec as
submitted, the spec the ranks read, scheduled faults, a user script), a headless Service (Indexed
Job only) and the workload (Job, JobSet or PyTorchJob). The job folder and its checkpoints live on
the FSx volume at ``/checkpoints/<name>``. Any notebook or shell attaches by name: all state is in
the cluster.
"""

from __future__ import annotations

import json
import os
import time
import uuid
from pathlib import Path, PurePosixPath
from collections.abc import Mapping
from typing import Any

import urllib3
from kubernetes import client

from ...timeouts import derive
from ...checkpoint_folders import CheckpointInfo, list_checkpoints
from ...control import FaultCommand
from ...errors import JobError, UnknownJobError, shown
from ...events import LOG_PREFIX
from ...spec import JobSpec
from ...spec_checks import valid_name
from ...states import ACTIVE, JobState
from ...tails import bounded
from ..base import Backend, JobSummary, readable
from . import checks, engine_parts, live, names, schemas
from .cluster import ApiError, Cluster, kubeconfig_files, unreachable
from .inpod import NOT_HERE
from .pods import PodState, hung_reason, parse_time, pod_state
from .render import INPOD, Manifests, render
from .stream import EksEvents, with_cause, workload_outcome

CONFIGMAP, SERVICE, POD, PVC = (names.KINDS[k] for k in ("ConfigMap", "Service", "Pod",
                                                         "PersistentVolumeClaim"))
PODMONITOR, NETPOL = names.KINDS["PodMonitor"], names.KINDS["NetworkPolicy"]
PDB = names.KINDS["PodDisruptionBudget"]


class EksBackend(Backend):
    """Jobs in one namespace of one cluster.

    ``namespace``/``context`` default to ``$EKSFT_NAMESPACE``/``$EKSFT_CONTEXT``, then to the
    kubeconfig's current context (or the in-cluster service account). A launched job's spec picks
    its own (``--namespace``, ``--context``). ``checkpoints_mount`` (``$EKSFT_CHECKPOINTS_MOUNT``)
    is where this machine mounts the FSx volume, if it does; otherwise checkpoints are listed from
    inside a running pod.
    """

    name = "eks"
    locator_keys = ("namespace", "context")

    def __init__(self, namespace: str | None = None, context: str | None = None, *,
                 api_client: client.ApiClient | None = None, checkpoints_mount: str | None = None,
                 request_timeout: float = 30.0) -> None:
        self.namespace = namespace or os.environ.get("EKSFT_NAMESPACE")
        self.context = context or os.environ.get("EKSFT_CONTEXT")
        self.mount = checkpoints_mount or os.environ.get("EKSFT_CHECKPOINTS_MOUNT")
        self.timeout = request_timeout
        self._api_client = api_client
        self._clusters: dict[tuple[str | None, str | None], Cluster] = {}
        # jobs launched here: (context, namespace)
        self._where: dict[str, tuple[str | None, str | None]] = {}

    def locator(self, spec: JobSpec) -> dict[str, str]:
        context = {"context": spec.eks.context} if spec.eks.context else {}
        return {"namespace": spec.eks.namespace, **context}

    def configured(self) -> bool:
        """A kubeconfig, or a pod's service account."""
        return bool(self._api_client or self.context or kubeconfig_files()
                    or os.environ.get("KUBERNETES_SERVICE_HOST"))

    def _cluster(self, context: str | None = None, namespace: str | None = None) -> Cluster:
        key = (context or self.context, namespace or self.namespace)
        if key not in self._clusters:
            if self._api_client is not None:
                self._clusters[key] = Cluster(self._api_client, key[1] or "default", self.timeout)
            else:
                self._clusters[key] = Cluster.connect(key[0], key[1], self.timeout)
        return self._clusters[key]

    def _job(self, name: str) -> tuple[Cluster, JobSpec, dict[str, Any]]:
        """The job's cluster, spec and record (its ConfigMap)."""
        cluster = self._cluster(*self._where.get(name, (None, None)))
        record = cluster.get(CONFIGMAP, name) if valid_name(name) else None
        if record is None or (record["metadata"].get("labels") or {}).get(names.JOB_LABEL) != name:
            raise UnknownJobError(f"no EKS job named {shown(name)} in namespace {cluster.namespace}",
                           "check the name, --namespace and --context (EksBackend().jobs() lists them)")
        data = record.get("data") or {}
        return cluster, JobSpec.from_json(data.get(names.SUBMITTED_SPEC) or data[names.POD_SPEC]), record

    # ---- launch ---------------------------------------------------------------------------------------
    def check(self, spec: JobSpec, launching: bool = True) -> JobSpec:
        """Everything the cluster would reject, or accept and then never run (see :mod:`.checks`)."""
        return checks.check(spec)

    def manifests(self, spec: JobSpec, faults: list[FaultCommand] | None = None,
                  queue_objects: bool = False) -> Manifests:
        """Render every manifest of a spec :meth:`check` passed, and validate it against its schema."""
        assert spec.backend == self.name
        m = render(spec, faults, queue_objects)
        schemas.validate_all(m.all(), spec.eks.k8s_version)
        return m

    def render(self, spec: JobSpec, queue_objects: bool = False) -> str:
        manifests = self.manifests(spec, queue_objects=queue_objects).to_yaml()
        notes = derive(spec).lines()
        if "@" not in spec.eks.image and checks.image_tag(spec.eks.image) is None:
            notes.append(f"warning: image {spec.eks.image} has no tag, so the nodes pull :latest: the job's "
                         "pods, and the pods that replace them, could run different builds (use an immutable "
                         "tag)")
        return "".join(f"# {line}\n" for line in notes) + manifests

    def launch(self, spec: JobSpec, faults: list[FaultCommand] | None = None) -> None:
        """Submit the job. Submitting the same spec again is a no-op (objects that exist with this
        spec are kept); if any object cannot be created, those created so far are removed."""
        m = self.manifests(spec, faults)
        cluster = self._cluster(spec.eks.context, spec.eks.namespace)
        if not spec.eks.create_pvc:
            _check_claim(cluster, spec)
        submit(cluster, m.job)
        self._where[spec.name] = (spec.eks.context, spec.eks.namespace)

    # ---- queries --------------------------------------------------------------------------------------
    def jobs(self) -> list[JobSummary]:
        cluster = self._cluster()
        records = cluster.list(CONFIGMAP, f"{names.MANAGED_BY}={names.MANAGER}")
        records.sort(key=lambda r: r["metadata"].get("creationTimestamp") or "")
        return [self.state(r["metadata"]["labels"][names.JOB_LABEL]) for r in records
                if names.JOB_LABEL in (r["metadata"].get("labels") or {})]

    def spec(self, name: str) -> JobSpec:
        return self._job(name)[1]

    def state(self, name: str) -> JobSummary:
        cluster, spec, _ = self._job(name)
        obj = cluster.get(names.workload(spec), name)
        if obj is None or obj["metadata"].get("deletionTimestamp"):
            return JobSummary(name, self.name, JobState.STOPPED, "stopped: its workload was deleted")
        outcome = workload_outcome(obj)
        if outcome and outcome[0] == JobState.FAILED:   # said with the pod behind it, in its own words
            pods = [pod_state(p, names.container(spec), names.process(spec))
                    for p in cluster.list(POD, names.selector(name))]
            return JobSummary(name, self.name, JobState.FAILED, with_cause(outcome[1], pods))
        if outcome:
            return JobSummary(name, self.name, *outcome)
        if spec.eks.queue and _suspended(obj):   # Kueue has not admitted it (or has evicted it) yet
            return JobSummary(name, self.name, "starting", self._queue_state(cluster, spec, obj))
        pods = sorted((pod_state(p, names.container(spec), names.process(spec))
                       for p in cluster.list(POD, names.selector(name))),
                      key=lambda p: (p.node is None, p.node or 0))
        stuck = next((p for p in pods if p.stuck), None)
        if stuck:
            return JobSummary(name, self.name, JobState.FAILED,
                              f"{stuck.label}: {stuck.reason} (stop the job, fix it and "
                              "launch again)")
        waiting = sorted((p for p in pods if p.phase == "pending" and not p.deleting),
                         # telling ones first
                         key=lambda p: p.reason in ("", "ContainerCreating", "PodInitializing"))
        if not pods or waiting or len(pods) < spec.nnodes:
            detail = (f"{waiting[0].label}: {self._pending_reason(cluster, waiting[0])}{_since(waiting[0])}"
                      if waiting else f"{len(pods)} of {spec.nnodes} pods created")
            # Kueue unsuspends only what it admitted
            return JobSummary(name, self.name, JobState.STARTING,
                              f"admitted; {detail}" if spec.eks.queue else detail)
        hung = next((p for p in pods if p.hung(derive(spec).grace.seconds, time.time())), None)
        if hung is not None:
            return JobSummary(name, self.name, JobState.RUNNING, f"recovering: {hung_reason(hung)}")
        failed = next((p for p in pods if p.failed or p.drained), None)
        return JobSummary(name, self.name, JobState.RUNNING,
                          f"recovering: {failed.label}: {failed.reason}" if failed else "")

    def _queue_state(self, cluster: Cluster, spec: JobSpec, obj: dict[str, Any]) -> str:
        """What Kueue says of a suspended workload: "queued: ..." until its Workload is admitted (one call:
        the namespace's Workloads, the job's found by its owner reference)."""
        queue = spec.eks.queue
        for version in names.WORKLOAD_VERSIONS:   # the newest this cluster's Kueue serves
            try:
                found = cluster.request("GET", version.path(cluster.namespace),
                                        "list Kueue's workloads").get("items", [])
                break
            except ApiError as e:
                if e.status != 404:
                    raise
        else:
            return (f"queued: suspended for queue {queue}, but this cluster has no Kueue (no Workload "
                    "API) to admit "
                    "it: install Kueue, or stop the job and launch it without --queue")
        uid = obj["metadata"].get("uid")
        mine = [w for w in found
                if any(r.get("uid") == uid for r in w["metadata"].get("ownerReferences") or [])]
        if not mine:
            return f"queued: waiting for quota in {queue} (Kueue has not taken the workload yet)"
        conditions = {c.get("type"): c for c in (mine[0].get("status") or {}).get("conditions") or []}
        if (conditions.get("Admitted") or {}).get("status") == "True":
            return "admitted"
        if (conditions.get("QuotaReserved") or {}).get("status") == "True":
            return f"queued: quota reserved in {queue}, waiting for its admission checks"
        why = next((c.get("message") for t in ("Evicted", "QuotaReserved") if (c := conditions.get(t))
                    and c.get("message") and (t != "Evicted" or c.get("status") == "True")), "")
        return f"queued: waiting for quota in {queue}" + (f" ({why})" if why else "")

    def _pending_reason(self, cluster: Cluster, pod: PodState) -> str:
        """Why a pod waits: its status, or else the newest warning about it (e.g. a volume that cannot
        mount)."""
        if pod.reason not in ("", "ContainerCreating", "PodInitializing"):
            return pod.reason
        events = cluster.request("GET", f"/api/v1/namespaces/{cluster.namespace}/events",
                                 f"list the events of {pod.name}",
                                 query={"fieldSelector": f"involvedObject.name={pod.name}"}).get("items", [])
        warnings = [e for e in events if e.get("type") == "Warning"]
        if warnings:
            newest = max(warnings, key=lambda e: e.get("lastTimestamp") or e.get("eventTime") or "")
            return f"{newest.get('reason')}: {newest.get('message', '').strip()}"
        return pod.reason or "starting"

    def events(self, name: str) -> EksEvents:
        cluster, spec, record = self._job(name)
        return EksEvents(cluster, spec,
                         parse_time(record["metadata"].get("creationTimestamp")) or time.time())

    def checkpoints(self, name: str) -> list[CheckpointInfo]:
        """The job's checkpoints, with their paths as the pods see them (what ``resume`` needs)."""
        cluster, spec, _ = self._job(name)
        pod_root = PurePosixPath(names.ckpt_dir(spec))
        if self.mount and Path(self.mount, pod_root.relative_to(names.CKPT_MOUNT)).is_dir():
            local = Path(self.mount, pod_root.relative_to(names.CKPT_MOUNT))
            infos = list_checkpoints(local)
            for info in infos:
                info.path = Path(pod_root / info.path.name)
            return infos
        pod = self._running_pods(cluster, spec, "list its checkpoints")[0]
        code, out = cluster.exec(pod, names.container(spec), INPOD + ["ckpts"])
        if code != 0:
            raise JobError(f"listing checkpoints in pod {pod} failed: {out.strip()[-300:]}",
                           "check that the image has the same eksft-nb version")
        return [CheckpointInfo(d["step"], Path(d["path"]), d["state"], d["bytes"], d["time"], d["world_size"],
                               d["reason"])
                for d in json.loads(out.strip().splitlines()[-1])]

    def logs(self, name: str, lines: int = 200, debug: bool = False) -> str:
        cluster, spec, _ = self._job(name)
        out = []
        pods = sorted(cluster.list(POD, names.selector(name)),
                      key=lambda p: p["metadata"].get("creationTimestamp") or "")
        for pod in pods:
            state = pod_state(pod, names.container(spec), names.process(spec))
            try:
                text_lines = list(cluster.lines(f"{POD.path(cluster.namespace, state.name)}/log",
                                                f"read the log of pod {state.name}",
                                                {"container": names.container(spec), "tailLines": lines},
                                                cluster.timeout))
            except ApiError as e:
                if e.status == 400:  # not started yet
                    continue
                raise
            except (urllib3.exceptions.HTTPError, OSError) as e:
                raise unreachable(e, cluster) from None
            tag = f"[node {state.node}] " if state.node is not None else f"[{state.name}] "
            out += [tag + line
                    for line in (text_lines if debug
                                 else readable([x for x in text_lines if LOG_PREFIX not in x]))]
        return bounded("\n".join(out[-lines:]))

    # ---- control ----------------------------------------------------------------------------------------
    def inject(self, name: str, command: FaultCommand) -> FaultCommand:
        """Queue a fault command in the job folder, from inside a running pod (the ranks fire it)."""
        assert command.fault not in self.refused_faults
        cluster, spec, _ = self._job(name)
        pod = self._running_pods(cluster, spec, "deliver the fault")[0]
        code, out = cluster.exec(pod, names.container(spec), INPOD + ["inject", command.to_json()])
        if code != 0:
            raise JobError(f"queueing the fault in pod {pod} failed: {out.strip()[-300:]}",
                           "check that the image has the same eksft-nb version")
        return command

    def set_settings(self, name: str, changes: Mapping[str, int]) -> dict[str, Any]:
        """Queue checked live settings in the job folder, from inside a running pod (see :mod:`.live`)."""
        return live.set_settings(self, name, changes)

    def settings(self, name: str) -> dict[str, Any]:
        return live.settings(self, name)

    def signal(self, name: str, rank: int, signame: str = "SIGKILL") -> str:
        """Signal a rank process directly (wherever it runs); returns its pod's name."""
        cluster, spec, _ = self._job(name)
        if not 0 <= rank < spec.world_size:
            raise JobError(f"rank {rank} is out of range for a job of {spec.world_size} ranks",
                           f"use a rank between 0 and {spec.world_size - 1}")
        for pod in self._running_pods(cluster, spec, "signal a rank"):
            code, out = cluster.exec(pod, names.container(spec), INPOD + ["signal", str(rank), signame])
            if code == 0:
                return pod
            if code != NOT_HERE:
                raise JobError(f"signalling rank {rank} in pod {pod} failed: {out.strip()[-300:]}",
                               "check the signal name (e.g. SIGKILL, SIGTERM, SIGUSR1)")
        raise JobError(f"rank {rank} of job {name} is not running in any pod right now",
                       "retry in a few seconds (it may be restarting)")

    def lose_node(self, name: str, node: int) -> str:
        """Delete the pod of ``node`` at once, as if its node were lost; returns the pod's name.

        A note (a ConfigMap named after the pod) first marks the deletion as the fault, so every
        watcher reports it as injected."""
        cluster, spec, _ = self._job(name)
        pods = [pod_state(p, names.container(spec), names.process(spec))
                for p in cluster.list(POD, names.selector(name))]
        target = next((p for p in pods if p.node == node and not p.deleting and p.phase != "succeeded"), None)
        if target is None:
            raise JobError(f"job {name} has no live pod for node {node}",
                           f"pick a node between 0 and {spec.nnodes - 1} whose pod runs")
        note = {"fault": "node-loss", "id": uuid.uuid4().hex[:12], "node": node}
        cluster.create({"apiVersion": "v1", "kind": "ConfigMap",
                        "data": {names.FAULT_ANNOTATION: json.dumps(note)},
                        "metadata": {"name": names.fault_note(name, target.uid),
                                     "namespace": cluster.namespace,
                                     "labels": {names.MANAGED_BY: names.MANAGER, names.FAULT_OF: name}}})
        cluster.delete(POD, target.name, propagation="Background", grace=0)
        return target.name

    def stop(self, name: str, timeout: float = 60.0) -> None:
        """Delete the workload (its pods first), the Service, and once the pods are gone the NetworkPolicy;
        keep the record (the ConfigMap)."""
        cluster, spec, _ = self._job(name)
        cluster.delete(names.workload(spec), name, propagation="Foreground")
        cluster.delete(SERVICE, name)
        cluster.delete(PDB, name)
        beside = engine_parts.of(spec).beside(name)   # what its engine runs beside the workload
        for kind, other in beside:
            if kind != NETPOL:   # a NetworkPolicy goes with the job's, below
                cluster.delete(kind, other)
        cluster.delete(PODMONITOR, name)   # False (a 404) also where the cluster has no PodMonitor API
        deadline = time.time() + timeout
        while (left := cluster.list(POD, names.selector(name))) and time.time() < deadline:
            time.sleep(1.0)
        if left:   # the NetworkPolicy stays while they do (`remove` deletes it)
            raise JobError(f"{len(left)} pod(s) of job {name} still exist after {timeout:g}s "
                           f"({', '.join(p['metadata']['name'] for p in left)})",
                           "their node may be unreachable: check `kubectl get pods -l "
                           "eksft.io/job=NAME -o wide`")
        cluster.delete(NETPOL, name)   # its pods are gone: nothing is left for it to guard
        for kind, other in beside:
            if kind == NETPOL:
                cluster.delete(kind, other)

    def remove(self, name: str) -> None:
        """Forget a job that no longer runs (its folder and checkpoints on the volume stay)."""
        cluster, spec, _ = self._job(name)
        status = self.state(name)
        if status.state in ACTIVE:
            raise JobError(f"job {name!r} is still {status.state}", "stop it first")
        cluster.delete(SERVICE, name)
        cluster.delete(PDB, name)
        cluster.delete(NETPOL, name)
        for kind, other in engine_parts.of(spec).beside(name):   # what its engine runs beside the workload
            cluster.delete(kind, other)
        for note in cluster.list(CONFIGMAP, f"{names.FAULT_OF}={name}"):
            cluster.delete(CONFIGMAP, note["metadata"]["name"])
        cluster.delete(CONFIGMAP, name)

    def _running_pods(self, cluster: Cluster, spec: JobSpec, purpose: str) -> list[str]:
        pods = [pod_state(p, names.container(spec), names.process(spec))
                for p in cluster.list(POD, names.selector(spec.name))]
        running = [p.name for p in sorted(pods, key=lambda p: p.node or 0) if p.phase == "running"
                   and not p.deleting]
        if not running:
            raise JobError(f"job {spec.name} has no running pod to {purpose}",
                           "retry once it runs"
                           + (", or set EKSFT_CHECKPOINTS_MOUNT to where the FSx volume is "
                                                   "mounted here" if "checkpoints" in purpose else ""))
        return running


def _check_claim(cluster: Cluster, spec: JobSpec) -> None:
    """The checkpoint volume exists and every pod, on any node, can mount it (ReadWriteMany)."""
    pvc = spec.eks.checkpoint_pvc
    claim = cluster.get(PVC, pvc)
    if claim is None:
        raise JobError(f"the checkpoint volume claim {pvc!r} does not exist in namespace "
                       f"{cluster.namespace}",
                       "create it (FSx for Lustre, ReadWriteMany: see the README) or add "
                       "--create-pvc with --fsx-subnet and --fsx-security-groups")
    modes = (claim.get("spec") or {}).get("accessModes") or []
    if "ReadWriteMany" not in modes:
        raise JobError(f"the checkpoint volume claim {pvc!r} is "
                       f"{', '.join(map(str, modes)) or 'without access modes'}, "
                       "not ReadWriteMany: the pods of other nodes could not mount it",
                       "use an FSx for Lustre claim with accessModes [ReadWriteMany] (see the README), or "
                       "--create-pvc")


def _since(pod: PodState) -> str:
    """Since when a pending pod waits, in words."""
    if pod.since is None:
        return ""
    waited = max(0, int(time.time() - pod.since))
    since = time.strftime('%H:%M:%S', time.localtime(pod.since))
    return f" (since {since}, {waited // 60}m{waited % 60:02d}s)"


def _suspended(obj: dict[str, Any]) -> bool:
    spec = obj.get("spec") or {}
    return bool((spec.get("runPolicy") or {}).get("suspend") if obj.get("kind") == "PyTorchJob"
                else spec.get("suspend"))


def submit(cluster: Cluster, objects: list[dict[str, Any]]) -> None:
    """Create ``objects`` in order. One that exists already is fine if it is this job's (same spec
    digest) or a shared volume claim; any other failure removes what this call created, so nothing
    is left half-created."""
    created: list[dict[str, Any]] = []
    try:
        for obj in objects:
            try:
                cluster.create(obj)
                created.append(obj)
            except ApiError as e:
                if e.status == 404 and obj["kind"] == PODMONITOR.kind:
                    # no Prometheus operator on this cluster: the pods serve metrics, nothing scrapes them
                    continue
                if e.status != 409:
                    raise
                _check_existing(cluster, obj)
    except JobError as e:
        left = []
        for obj in reversed(created):
            try:
                cluster.delete(names.KINDS[obj["kind"]], obj["metadata"]["name"], propagation="Background")
            except JobError:
                left.append(f"{obj['kind']} {obj['metadata']['name']}")
        if left:
            raise JobError(f"{e.problem}; could not remove what was created ({', '.join(left)})",
                           f"{e.fix}; then delete those with kubectl") from None
        raise


def _check_existing(cluster: Cluster, obj: dict[str, Any]) -> None:
    kind, name = names.KINDS[obj["kind"]], obj["metadata"]["name"]
    if kind is PVC:
        return  # the checkpoint volume is shared by jobs
    existing = cluster.get(kind, name) or {}
    meta = existing.get("metadata") or {}
    job = (meta.get("labels") or {}).get(names.JOB_LABEL)   # its job (a torchft Lighthouse: NAME-lighthouse)
    if job is None or job != obj["metadata"]["labels"].get(names.JOB_LABEL):
        raise ApiError(f"a {obj['kind']} named {name!r} already exists in namespace "
                       f"{cluster.namespace} and is not "
                       "an eksft job", "choose another --name", 409)
    if (meta.get("annotations") or {}).get(names.DIGEST) != obj["metadata"]["annotations"][names.DIGEST]:
        raise ApiError(f"job {name!r} already exists in namespace {cluster.namespace} with a different spec",
                       "choose another --name, or stop and remove that job first", 409)
