"""The Kubernetes manifests of a job, derived from its spec.

Every pod runs the same ``ft_launcher`` line as a local launcher (``launch.launcher_argv``) under
``inpod launch`` (which starts the pod's zygote first with warm ranks, and ends the pod as its ranks
did: a drain is not a success, see :mod:`.pod_entry`), with
the rendezvous on node 0's stable DNS name: the pods of an Indexed Job (or JobSet) have host names
``<job>-<index>`` and a headless Service as their subdomain, so no pod sleeps or polls DNS to find
node 0. Job folders and checkpoints live on an FSx for Lustre volume at ``/checkpoints``; the async
checkpoint writer stages state in a memory-backed ``/dev/shm`` sized for it.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from ...control import FaultCommand
from ...nccl import nccl_env as shared_nccl_env
from ...launcher import Ports, launcher_argv, rank_env
from ...runtime.quiet import quiet_env
from ...spec import JobSpec
from ...procs import JOB_UID_ENV
from . import disruption, engine_parts, failures, fsx, kueue, names, sizing
from .instances import efa_per_node, lookup
from .pod_entry import IGNORED_ENV
from .security import container_security, pod_security
from .network import network_policy
from .pod_values import field_env, literal, pod_view, script_key

# what the control plane calls, and nothing else: (api group, resource, verbs). RBAC cannot select
# pods by label, and the pods of an Indexed Job or a JobSet have generated names, so the pod rules
# hold for every pod of the namespace: run eksft jobs in a namespace of their own (README, Security).
# No pod is ever modified (a node-loss note is a ConfigMap of its own); `delete` is the node-loss fault.
CONTROL_RULES: list[tuple[str, str, list[str]]] = [
    ("", "configmaps", ["get", "list", "create", "delete"]),     # the job record; node-loss notes
    ("", "services", ["get", "create", "delete"]),               # the headless Service that names node 0
    # watch the job's pods; delete one to lose a node
    ("", "pods", ["list", "watch", "delete"]),
    ("", "pods/log", ["get"]),                                   # stream the ranks' telemetry
    # exec (control commands, signals, checkpoint listing) is a WebSocket upgrade of a GET: older API
    # servers authorize it as `get`, newer ones (the WebSocket exec hardening) as `create`
    ("", "pods/exec", ["get", "create"]),
    ("", "events", ["list"]),                                    # explain pods stuck in Pending
    ("monitoring.coreos.com", "podmonitors", ["get", "create", "delete"]),   # Prometheus scrapes the pods
    # only the job's pods reach its ports
    ("networking.k8s.io", "networkpolicies", ["get", "create", "delete"]),
    ("policy", "poddisruptionbudgets", ["get", "create", "delete"]),   # evictions take no node the job needs
]
# a queued job (--queue): what Kueue says of its Workload, read to tell "queued" from "admitted"
QUEUE_RULES: list[tuple[str, str, list[str]]] = [("kueue.x-k8s.io", "workloads", ["list"])]
INPOD = ["python", "-m", "eksft_nb.backends.eks.inpod"]   # the in-pod commands (exec'd, and the pods' own)
# the trainer's command; its args are the launch line (see pod_entry)
ENTRY = [*INPOD, "launch"]


@dataclass
class Manifests:
    """``admin``: applied once per namespace by a cluster admin (RBAC for the control plane, the FSx
    StorageClass). ``job``: what launching submits, in order, the workload last."""

    admin: list[dict[str, Any]] = field(default_factory=list)
    job: list[dict[str, Any]] = field(default_factory=list)

    def all(self) -> list[dict[str, Any]]:
        return self.admin + self.job

    def to_yaml(self) -> str:
        """One YAML stream, ``kubectl apply -f`` ready, with a comment heading each group; a Secret's values
        are not shown (a launch makes its own)."""
        admin = "RBAC for the eksft control plane" + (
            " and the FSx StorageClass" if any(m["kind"] == "StorageClass" for m in self.admin) else "")
        heads = {0: f"# applied once per namespace by an admin: {admin}\n",
                 len(self.admin): "# submitted by `run --backend eks`, in this order\n"}
        return "---\n".join(heads.get(i, "") + _dump(_unsaid(m)) for i, m in enumerate(self.all()))

    def workload(self) -> dict[str, Any]:
        return self.job[-1]


class _Dumper(yaml.SafeDumper):
    """Multi-line strings (the spec, a script) as literal blocks, and no YAML aliases, so the dry
    run reads well."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


_Dumper.add_representer(str, lambda d,
                        s: d.represent_scalar("tag:yaml.org,2002:str", s, style="|" if "\n" in s else None))


def _unsaid(obj: dict[str, Any]) -> dict[str, Any]:
    """A Secret with its values replaced by what a launch puts there."""
    if obj.get("kind") != "Secret":
        return obj
    return {**obj, "stringData": {k: f"<{len(v) // 2} random bytes, hex, made at launch>"
                                  for k, v in obj.get("stringData", {}).items()}}


def _dump(obj: dict[str, Any]) -> str:
    return yaml.dump(obj, Dumper=_Dumper, sort_keys=False, width=1000)


def render(spec: JobSpec, faults: list[FaultCommand] | None = None, queue_objects: bool = False,
           job_uid: str | None = None) -> Manifests:
    """All manifests of a job (the spec must have passed ``spec.validate()`` and ``checks.check``);
    ``queue_objects``: also Kueue's objects for its ``--queue`` (admin), sized to admit this job;
    ``job_uid``: this launch's id (default: a new one), kept in the job's record."""
    parts = engine_parts.of(spec)
    m = Manifests(admin=control_rbac(spec))
    if spec.eks.create_pvc:
        m.admin.append(storage_class(spec))
        m.job.append(checkpoint_pvc(spec))
    if parts.workload is not None:   # the engine's own (torchft: its replica groups as a JobSet)
        workload = parts.workload(spec, pod_template(spec), _workload_meta(spec))
    else:
        workload = {"job": indexed_job, "jobset": jobset, "pytorchjob": pytorchjob}[spec.eks.kind](spec)
    kueue.place(workload, spec)
    if queue_objects and spec.eks.queue:
        m.admin += kueue.objects(spec, workload)
    m.job.append(config_map(spec, faults or [], job_uid or new_job_uid()))
    m.job.append(network_policy(spec, serves_metrics(spec)))   # before any pod exists
    if serves_metrics(spec):
        m.job.append(pod_monitor(spec))
    m.job.append(disruption.pod_disruption_budget(spec))
    m.job += parts.objects(spec)
    if spec.eks.kind == "job":
        m.job.append(headless_service(spec))
    m.job.append(workload)
    return m


def _meta(spec: JobSpec, name: str) -> dict[str, Any]:
    return {"name": name, "namespace": spec.eks.namespace, "labels": names.labels(spec),
            "annotations": {names.DIGEST: spec.digest()}}


def _workload_meta(spec: JobSpec) -> dict[str, Any]:
    """The workload's metadata: with ``--queue``, Kueue's labels (its LocalQueue, its priority class)."""
    meta = _meta(spec, spec.name)
    if spec.eks.queue:
        meta["labels"][names.QUEUE_LABEL] = spec.eks.queue
        if spec.eks.priority:
            meta["labels"][names.PRIORITY_LABEL] = spec.eks.priority
    return meta


# ---- the job -----------------------------------------------------------------------------------

def new_job_uid() -> str:
    """A launch's id, as a local job's (``EKSFT_JOB_UID``): its commits name it, so a relaunch under the
    same name and spec never takes the checkpoints an earlier launch left for its own."""
    return uuid.uuid4().hex[:16]


def config_map(spec: JobSpec, faults: list[FaultCommand], job_uid: str) -> dict[str, Any]:
    view = pod_view(spec)
    data = {names.POD_SPEC: view.to_json(),
            names.FAULTS: json.dumps([json.loads(f.to_json()) for f in faults]),
            names.JOB_UID: job_uid}
    if view != spec:  # the record keeps the submitted spec (the script's path, the timeouts left unset)
        data[names.SUBMITTED_SPEC] = spec.to_json()
    if spec.script:  # the ranks run the ConfigMap's copy
        data[script_key(spec)] = Path(spec.script).expanduser().read_text()
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": _meta(spec, spec.name), "data": data}


def headless_service(spec: JobSpec) -> dict[str, Any]:
    """Gives each pod ``<host>.<job>.<namespace>.svc`` in DNS, published before the pods are ready."""
    ports = Ports.from_base(spec.eks.port)
    return {"apiVersion": "v1", "kind": "Service", "metadata": _meta(spec, spec.name),
            "spec": {"clusterIP": "None", "publishNotReadyAddresses": True,
                     "selector": {names.JOB_LABEL: spec.name},
                     "ports": [{"name": n, "port": p, "targetPort": p}
                               for n,
                               p in (("rdzv", ports.rdzv), ("store", ports.store),
                                     ("wrapper", ports.wrapper))]}}


def indexed_job(spec: JobSpec) -> dict[str, Any]:
    """Pods are replaced one index at a time (up to max_job_restarts each; before Kubernetes 1.29, up to
    max_job_restarts in all); a replacement rejoins the rendezvous under the same host name. The job
    fails once any index runs out of retries. See :mod:`.failures` for what is not charged."""
    return {"apiVersion": "batch/v1", "kind": "Job", "metadata": _workload_meta(spec),
            "spec": {**_suspended(spec), "completionMode": "Indexed", "completions": names.pods(spec),
                     "parallelism": names.pods(spec),
                     **failures.job_retries(spec), **failures.pod_failure_policy(spec),
                     "template": pod_template(spec, subdomain=spec.name, attempt_from=names.INDEX_FAILURES)}}


def jobset(spec: JobSpec) -> dict[str, Any]:
    """Any failed pod restarts the whole set (up to max_job_restarts), like the local supervisor."""
    child = {"completionMode": "Indexed", "completions": names.pods(spec), "parallelism": names.pods(spec),
             "backoffLimit": 0, **failures.pod_failure_policy(spec),
             "template": pod_template(spec, attempt_from=names.JOBSET_RESTARTS)}
    return {"apiVersion": "jobset.x-k8s.io/v1alpha2", "kind": "JobSet", "metadata": _workload_meta(spec),
            "spec": {**_suspended(spec), "failurePolicy": failures.jobset_failure_policy(spec),
                     "network": {"enableDNSHostnames": True, "publishNotReadyAddresses": True,
                                 "subdomain": spec.name},
                     "replicatedJobs": [{"name": "node", "replicas": 1,
                                         "template": {"metadata": {"labels": names.labels(spec)},
                                                      "spec": child}}]}}


def pytorchjob(spec: JobSpec) -> dict[str, Any]:
    """Master and workers under the operator's ExitCode policy: a pod that drained (138, the code it retries
    as the user's own), was killed (137) or terminated (143) is recreated, without limit; a configuration
    error (78) or a launcher that gave up (1) fails the job (the job-level restart budget of ``--kind job``
    and ``jobset`` has no equivalent here)."""
    template = pod_template(spec, node_rank="$(RANK)")
    replicas = {"Master": {"replicas": 1, "restartPolicy": "ExitCode", "template": template}}
    if spec.nnodes > 1:
        replicas["Worker"] = {"replicas": spec.nnodes - 1, "restartPolicy": "ExitCode", "template": template}
    return {"apiVersion": "kubeflow.org/v1", "kind": "PyTorchJob", "metadata": _workload_meta(spec),
            "spec": {"nprocPerNode": str(spec.nproc_per_node),
                     "runPolicy": {"backoffLimit": spec.ft.max_job_restarts, "cleanPodPolicy": "Running",
                                   **_suspended(spec)},
                     "pytorchReplicaSpecs": replicas}}


def _suspended(spec: JobSpec) -> dict[str, Any]:
    """A queued workload is created suspended: Kueue unsuspends it once its quota is admitted."""
    return {"suspend": True} if spec.eks.queue else {}


def serves_metrics(spec: JobSpec) -> bool:
    """Whether the pods run the metrics sidecar: native sidecars are on by default from Kubernetes 1.29
    (before, a sidecar that never exits would hold the pod in its init phase)."""
    return tuple(int(p) for p in spec.eks.k8s_version.split(".")[:2]) >= (1, 29)


def pod_monitor(spec: JobSpec) -> dict[str, Any]:
    """Prometheus (kube-prometheus-stack's operator) scrapes every pod of the job on its ``metrics``
    port; ``honorLabels`` keeps the exporter's ``job`` label (the job's name). The ``release`` label
    (``--prometheus-release``) is what the chart's default PodMonitor selector looks for. Each series
    gets its pod's node as ``Hostname``, dcgm-exporter's label for it, so the dashboard shows the GPUs of
    the job's nodes only (the job's own GPU-health series, which name their node themselves, keep
    theirs)."""
    meta = _meta(spec, spec.name)
    meta["labels"]["release"] = spec.eks.prometheus_release
    return {"apiVersion": "monitoring.coreos.com/v1", "kind": "PodMonitor", "metadata": meta,
            "spec": {"selector": {"matchLabels": {names.JOB_LABEL: spec.name}},
                     "namespaceSelector": {"matchNames": [spec.eks.namespace]},
                     "podMetricsEndpoints": [{"port": names.METRICS, "path": "/metrics", "interval": "15s",
                                              "honorLabels": True, "relabelings": [
                                                  {"sourceLabels": ["__meta_kubernetes_pod_node_name"],
                                                   "targetLabel": "Hostname", "action": "replace"}]}]}}


# ---- the pod -----------------------------------------------------------------------------------

def pod_template(spec: JobSpec, *, subdomain: str | None = None, attempt_from: str | None = None,
                 node_rank: str = "$(EKSFT_NODE_RANK)") -> dict[str, Any]:
    e = spec.eks
    view = pod_view(spec)
    # the rendezvous waits for every pod to be scheduled, not only started (see --rdzv-join-timeout); a
    # SIGTERM to a pod is a drain, whose save may take the grace period, on CPU pods too
    argv = [literal(a) for a in launcher_argv(view, node_rank=node_rank, rdzv_host=names.rank0_host(spec),
                                              ports=Ports.from_base(e.port), rdzv_id=spec.name,
                                              rdzv_conf={"join_timeout": str(e.join_timeout)})]
    ours = next(i for i, a in enumerate(argv) if a.startswith("--node-rank="))   # before any user text
    argv[ours] = f"--node-rank={node_rank}"   # the one reference the kubelet fills in
    env = container_env(spec, attempt_from)
    mounts = [{"name": "checkpoints", "mountPath": names.CKPT_MOUNT},
              {"name": "config", "mountPath": names.CONFIG_MOUNT, "readOnly": True}]
    # the in-pod entry runs this ft_launcher line and ends as the pod's ranks did; with warm ranks it starts
    # the pod's zygote first and makes the shim of the image's eksft-nb (a path only the container knows)
    # the launcher's worker
    trainer: dict[str, Any] = {
        "name": names.container(spec), "image": e.image, "command": ENTRY, "args": argv, "env": env,
        "ports": [{"name": n, "containerPort": p} for n, p in
                  zip(("rdzv", "store", "wrapper"), (e.port, e.port + 1, e.port + 2))],
        "volumeMounts": mounts + [{"name": "shm", "mountPath": names.SHM_MOUNT}],
    }
    trainer["resources"] = resources(spec)
    # a refusal's one line becomes the pod's termination message (what `status` shows): written by the step,
    # else the end of its log
    prepare = {"name": "prepare", "image": e.image, "env": env, "volumeMounts": mounts,
               "command": [*INPOD, "prepare"], "terminationMessagePolicy": "FallbackToLogsOnError"}
    # the EFA devices, so that `prepare` can check them (the trainer reuses an init container's)
    if efa_per_node(spec):
        efa = {"vpc.amazonaws.com/efa": str(efa_per_node(spec))}
        prepare["resources"] = {"requests": dict(efa), "limits": dict(efa)}
    # the job's Prometheus metrics, from its folder on the shared volume, in a native sidecar (an init
    # container that keeps running, started after `prepare` and stopped once the trainer ends)
    metrics = {"name": names.METRICS, "image": e.image, "restartPolicy": "Always",
               "command": ["python", "-m", "eksft_nb", "metrics", spec.name, "--root", names.CKPT_MOUNT,
                           "--addr", "0.0.0.0", "--port", str(names.METRICS_PORT)],
               "ports": [{"name": names.METRICS, "containerPort": names.METRICS_PORT}],
               "resources": {"requests": {"cpu": "50m", "memory": "128Mi"}},
               "volumeMounts": [{"name": "checkpoints", "mountPath": names.CKPT_MOUNT, "readOnly": True}]}
    for container in (trainer, prepare, metrics):   # no capability, no privilege escalation (Pod Security)
        container["securityContext"] = container_security(spec)
    pod: dict[str, Any] = {"restartPolicy": "Never"} if spec.eks.kind != "pytorchjob" else {}
    if subdomain:
        pod["subdomain"] = subdomain
    pod.update({
        # the pods need no Kubernetes API; the pause container as PID 1 lets a node fault kill
        # ft_launcher (PID 1 ignores SIGKILL from inside its container) and reaps NVRx's helpers
        "automountServiceAccountToken": False, "enableServiceLinks": False, "shareProcessNamespace": True,
        "securityContext": pod_security(spec),
        "terminationGracePeriodSeconds": failures.termination_grace_s(spec),
        "initContainers": [prepare, metrics] if serves_metrics(spec) else [prepare], "containers": [trainer],
        "volumes": [{"name": "checkpoints", "persistentVolumeClaim": {"claimName": e.checkpoint_pvc}},
                    {"name": "config", "configMap": {"name": spec.name}},
                    {"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": sizing.shm_size(spec)}}],
    })
    if e.instance_type:   # as given: a HyperPod node's label is the ml. name
        pod["nodeSelector"] = {"node.kubernetes.io/instance-type": e.instance_type}
    pod["tolerations"] = failures.tolerations(spec)
    pod["affinity"] = failures.affinity(spec)
    annotations = {names.DIGEST: spec.digest(), **disruption.pod_annotations(spec)}
    return {"metadata": {"labels": names.labels(spec), "annotations": annotations}, "spec": pod}


def container_env(spec: JobSpec, attempt_from: str | None) -> list[dict[str, Any]]:
    """The launcher's environment: the local one (``launch.rank_env``) with per-pod values from the
    pod's annotations, events on stdout (the pod logs carry them), and the NCCL/EFA settings."""
    # the GPU health sampler's Hostname label, as dcgm-exporter's (its DaemonSet reads NODE_NAME too)
    env: list[dict[str, Any]] = [field_env("NODE_NAME", "spec.nodeName")]
    if attempt_from:
        env.append(field_env("EKSFT_NODE_RANK", f"metadata.annotations['{names.COMPLETION_INDEX}']"))
        env.append(field_env("EKSFT_JOB_ATTEMPT", f"metadata.annotations['{attempt_from}']"))
    if attempt_from == names.INDEX_FAILURES and failures.per_index(spec):   # drains and disruptions
        env.append(field_env(IGNORED_ENV, f"metadata.annotations['{names.INDEX_IGNORED}']"))
    values = rank_env(pod_view(spec), ports=Ports.from_base(spec.eks.port), job_attempt=0,
                      job_dir=names.job_dir(spec), spec_path=f"{names.CONFIG_MOUNT}/{names.POD_SPEC}",
                      events_stdout=True)
    if attempt_from:
        del values["EKSFT_JOB_ATTEMPT"]
    values = quiet_env(values)
    values.update(nccl_env(spec))
    env += [{"name": k, "value": literal(v)} for k, v in values.items()]
    # the launch's id for checkpoint lineage, from the job's record: the same in every pod and across
    # restarts of one workload (whose Jobs and pods are recreated), new for every launch
    env.append({"name": JOB_UID_ENV,
                "valueFrom": {"configMapKeyRef": {"name": spec.name, "key": names.JOB_UID}}})
    return env


def nccl_env(spec: JobSpec) -> dict[str, str]:
    """NCCL and libfabric settings (:func:`eksft_nb.nccl.nccl_env`); device RDMA where the instance type's
    EFA has RDMA read (an unknown type: libfabric decides from the device); NCCL on EFA only where
    ``--efa-per-node`` asked for it (by default, a fall back to sockets is the stream's warning)."""
    e = spec.eks
    known = lookup(e.instance_type)
    return shared_nccl_env(e.gpus_per_node, bool(efa_per_node(spec)), spec.ft.inprocess,
                           rdma_read=bool(known and known.rdma_read), require_efa=bool(e.efa_per_node))


def device_amounts(spec: JobSpec) -> dict[str, str]:
    e, efa = spec.eks, efa_per_node(spec)
    return {**({"nvidia.com/gpu": str(e.gpus_per_node)} if e.gpus_per_node else {}),
            **({"vpc.amazonaws.com/efa": str(efa)} if efa else {})}


def resources(spec: JobSpec) -> dict[str, Any]:
    """The trainer's: its devices, CPU and memory requested (see :mod:`.sizing`), memory limited to the
    request."""
    devices, memory = device_amounts(spec), sizing.memory(spec)
    return {"requests": {**devices, "cpu": sizing.cpu(spec), "memory": memory},
            "limits": {**devices, "memory": memory}}


# ---- shared and admin manifests ---------------------------------------------------------------

def checkpoint_pvc(spec: JobSpec) -> dict[str, Any]:
    e = spec.eks
    return {"apiVersion": "v1", "kind": "PersistentVolumeClaim",
            "metadata": {"name": e.checkpoint_pvc, "namespace": e.namespace,
                         "labels": {names.MANAGED_BY: names.MANAGER}},
            "spec": {"accessModes": ["ReadWriteMany"], "storageClassName": e.storage_class,
                     "resources": {"requests": {"storage": e.storage_size}}}}


def storage_class(spec: JobSpec) -> dict[str, Any]:
    """Dynamic FSx for Lustre provisioning through the FSx CSI driver, at the throughput the timeouts
    assume (see :mod:`.fsx`)."""
    e = spec.eks
    return {"apiVersion": "storage.k8s.io/v1", "kind": "StorageClass",
            "metadata": {"name": e.storage_class, "labels": {names.MANAGED_BY: names.MANAGER}},
            "provisioner": "fsx.csi.aws.com",
            "parameters": {"subnetId": e.fsx_subnet or "", "securityGroupIds": e.fsx_security_groups or "",
                           "deploymentType": "PERSISTENT_2",
                           "perUnitStorageThroughput": str(fsx.throughput_per_tib(spec))},
            "mountOptions": ["flock"], "reclaimPolicy": "Retain"}


def control_rbac(spec: JobSpec) -> list[dict[str, Any]]:
    """A ServiceAccount for a notebook running in the cluster, and a Role granting exactly the
    calls the control plane makes (bind it to your IAM-mapped user or group as well)."""
    ns = spec.eks.namespace
    w = names.workload(spec)
    meta = {"name": names.CONTROL, "namespace": ns, "labels": {names.MANAGED_BY: names.MANAGER}}
    rules = [{"apiGroups": [w.group], "resources": [w.plural], "verbs": ["get", "create", "delete"]}]
    granted = [*engine_parts.of(spec).rules, *CONTROL_RULES, *(QUEUE_RULES if spec.eks.queue else [])]
    rules += [{"apiGroups": [g], "resources": [r], "verbs": v} for g, r, v in granted]
    # the checkpoint volume is checked before submitting (and created with --create-pvc)
    rules.append({"apiGroups": [""], "resources": ["persistentvolumeclaims"],
                  "verbs": ["get", "create"] if spec.eks.create_pvc else ["get"]})
    return [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": meta},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role", "metadata": meta, "rules": rules},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding", "metadata": meta,
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": names.CONTROL},
         "subjects": [{"kind": "ServiceAccount", "name": names.CONTROL, "namespace": ns}]},
    ]
