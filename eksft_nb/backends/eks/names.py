"""Names, labels, paths and API coordinates shared by the manifests and the control plane."""

from __future__ import annotations

from dataclasses import dataclass

from ...engines.registry import engine_of
from ...spec import JobSpec

CKPT_MOUNT = "/checkpoints"         # the FSx for Lustre volume: job folders and checkpoints
CONFIG_MOUNT = "/etc/eksft"         # the job's ConfigMap: spec.json, faults.json, the user script
SHM_MOUNT = "/dev/shm"
CLUSTER_DOMAIN = "cluster.local"    # EKS does not let clusters change it

MANAGED_BY = "app.kubernetes.io/managed-by"
MANAGER = "eksft-nb"
JOB_LABEL = "eksft.io/job"
DIGEST = "eksft.io/spec-digest"
FAULT_ANNOTATION = "eksft.io/fault"  # a node-loss note, on the pod as the stream reports it
FAULT_OF = "eksft.io/fault-of"      # label of the ConfigMap that holds a node-loss note (see fault_note)
COMPLETION_INDEX = "batch.kubernetes.io/job-completion-index"
INDEX_FAILURES = "batch.kubernetes.io/job-index-failure-count"
INDEX_IGNORED = "batch.kubernetes.io/job-index-ignored-failure-count"   # failures a podFailurePolicy ignored
JOBSET_RESTARTS = "jobset.sigs.k8s.io/restart-attempt"
JOB_INDEX = "jobset.sigs.k8s.io/job-index"   # a JobSet child Job's number in its replicated job, on its pods
QUEUE_LABEL = "kueue.x-k8s.io/queue-name"          # Kueue: the LocalQueue a workload waits in
PRIORITY_LABEL = "kueue.x-k8s.io/priority-class"   # Kueue: its WorkloadPriorityClass
METRICS = "metrics"                 # the pods' Prometheus exporter: container and port name
METRICS_PORT = 9400
CONTROL = "eksft-control"           # ServiceAccount, Role and RoleBinding of the control plane
POD_SPEC = "spec.json"              # ConfigMap keys
SUBMITTED_SPEC = "submitted-spec.json"
FAULTS = "faults.json"
JOB_UID = "job-uid"                 # the launch's id (EKSFT_JOB_UID), kept in the record


@dataclass(frozen=True)
class Kind:
    """API coordinates of one resource type."""

    api_version: str
    kind: str
    plural: str
    namespaced: bool = True

    @property
    def group(self) -> str:
        return self.api_version.rpartition("/")[0]

    def path(self, namespace: str | None = None, name: str | None = None) -> str:
        base = f"/apis/{self.api_version}" if self.group else f"/api/{self.api_version}"
        if self.namespaced:
            base += f"/namespaces/{namespace}"
        return f"{base}/{self.plural}" + (f"/{name}" if name else "")


KINDS: dict[str, Kind] = {k.kind: k for k in (
    Kind("v1", "ConfigMap", "configmaps"),
    Kind("v1", "Secret", "secrets"),
    Kind("v1", "Service", "services"),
    Kind("v1", "ServiceAccount", "serviceaccounts"),
    Kind("v1", "PersistentVolumeClaim", "persistentvolumeclaims"),
    Kind("v1", "Pod", "pods"),
    Kind("batch/v1", "Job", "jobs"),
    Kind("apps/v1", "Deployment", "deployments"),
    Kind("jobset.x-k8s.io/v1alpha2", "JobSet", "jobsets"),
    Kind("kubeflow.org/v1", "PyTorchJob", "pytorchjobs"),
    Kind("rbac.authorization.k8s.io/v1", "Role", "roles"),
    Kind("rbac.authorization.k8s.io/v1", "RoleBinding", "rolebindings"),
    Kind("storage.k8s.io/v1", "StorageClass", "storageclasses", namespaced=False),
    Kind("monitoring.coreos.com/v1", "PodMonitor", "podmonitors"),
    Kind("networking.k8s.io/v1", "NetworkPolicy", "networkpolicies"),
    Kind("policy/v1", "PodDisruptionBudget", "poddisruptionbudgets"),
    Kind("kueue.x-k8s.io/v1beta2", "Workload", "workloads"),
    Kind("kueue.x-k8s.io/v1beta2", "LocalQueue", "localqueues"),
    Kind("kueue.x-k8s.io/v1beta2", "ClusterQueue", "clusterqueues", namespaced=False),
    Kind("kueue.x-k8s.io/v1beta2", "ResourceFlavor", "resourceflavors", namespaced=False),
    Kind("kueue.x-k8s.io/v1beta2", "WorkloadPriorityClass", "workloadpriorityclasses", namespaced=False),
)}
# Kueue's Workload API, newest first: v1beta2 from Kueue 0.15 (the only one from 0.20), v1beta1 before
WORKLOAD_VERSIONS = (KINDS["Workload"], Kind("kueue.x-k8s.io/v1beta1", "Workload", "workloads"))
WORKLOADS = {"job": KINDS["Job"], "jobset": KINDS["JobSet"], "pytorchjob": KINDS["PyTorchJob"]}


def workload(spec: JobSpec) -> Kind:
    return WORKLOADS[spec.eks.kind]


def container(spec: JobSpec) -> str:
    """The training container's name (the PyTorchJob operator requires "pytorch")."""
    return "pytorch" if spec.eks.kind == "pytorchjob" else "trainer"


def process(spec: JobSpec) -> str:
    """What the training container runs, as a pod's state names it: ft_launcher, or a torchft group's
    trainer."""
    return engine_of(spec).node_process


def pod_host(spec: JobSpec, node: int) -> str:
    """Host name of the pod of ``node`` (what ``socket.gethostname()`` returns in it)."""
    kind, name = spec.eks.kind, spec.name
    if kind == "job":
        return f"{name}-{node}"
    if kind == "jobset":
        return f"{name}-node-0-{node}"
    return f"{name}-master-0" if node == 0 else f"{name}-worker-{node - 1}"


def pods(spec: JobSpec) -> int:
    """Pods of the workload: a node each, and the hot spares (which wait in the rendezvous)."""
    return spec.nnodes + spec.spare_nodes


def longest_host(spec: JobSpec) -> str:
    return max((pod_host(spec, n) for n in (0, pods(spec) - 1)), key=len)


def rank0_host(spec: JobSpec) -> str:
    """The rendezvous host: node 0's stable DNS name.

    Job and JobSet pods have a host name and a headless-Service subdomain, so kubelet writes this
    fully qualified name into node 0's /etc/hosts (which makes it the rendezvous host at once,
    with no DNS lookup) and cluster DNS serves it to the others. The PyTorchJob operator gives
    the master pod a Service of its own name.
    """
    if spec.eks.kind == "pytorchjob":
        return pod_host(spec, 0)
    return f"{pod_host(spec, 0)}.{spec.name}.{spec.eks.namespace}.svc.{CLUSTER_DOMAIN}"


def job_dir(spec: JobSpec) -> str:
    """The job folder on the shared volume (events, control commands, progress, checkpoints)."""
    return f"{CKPT_MOUNT}/{spec.name}"


def ckpt_dir(spec: JobSpec) -> str:
    return spec.checkpoint.dir or f"{job_dir(spec)}/ckpt"


def labels(spec: JobSpec) -> dict[str, str]:
    return {MANAGED_BY: MANAGER, JOB_LABEL: spec.name}


def fault_note(name: str, pod_uid: str) -> str:
    """The ConfigMap that marks the deletion of pod ``pod_uid`` as an injected node loss: the control
    plane creates it before deleting the pod, so it needs no right to modify pods."""
    return f"{name}-fault-{pod_uid}"


def selector(name: str) -> str:
    return f"{JOB_LABEL}={name}"
