"""A torchft job (``--engine torchft``) on EKS: the Lighthouse as a Deployment behind a Service, the replica
groups as one JobSet replicated job with one child Job (one pod) per group.

Replica ids: torchft ranks a group in each quorum by the trailing digits of its replica id, so the ids
must be ``0 .. groups-1`` and stay a group's own across its restarts. One replicated job with ``replicas``
= groups gives exactly that: JobSet numbers its child Jobs ``0 .. replicas-1`` and puts the number on
their pods (``jobset.sigs.k8s.io/job-index``), a replaced pod keeps its child Job's number, and the
groups share one template (a replicated job per group would be N templates differing in a number).

A group's pod that fails is replaced by its own child Job (up to ``max_job_restarts`` times) while the
other groups train on, and heals from a peer; a group out of retries fails the JobSet, which is not
restarted as a whole (the surviving groups hold the job's state, a restarted set would lose it).

Ports (see :mod:`eksft_nb.engines.torchft.hosts`): every server binds the pod's IP, not every interface.
The Lighthouse's gateway listens on ``--rdzv-port`` and accepts connections only from the job's pods (a
NetworkPolicy of its own), the Lighthouse itself on its pod's loopback behind it; a group's store, manager
and checkpoint servers on ephemeral ports, which reach the peers through the Lighthouse (the job's
NetworkPolicy lets only the job's pods reach them). The Lighthouse's objects carry the job's label, its pod
does not: the job's pods are its replica groups.

The job's secret (:mod:`eksft_nb.engines.torchft.secret`), which the gateway and the groups' servers
require of every peer, is a Secret of the job, made at launch (a dry run shows no value), mounted read-only
into the Lighthouse's pod and the groups' (never in an environment value or a command line).
"""

from __future__ import annotations

from typing import Any

from ...engines.torchft import hosts, lighthouse, secret
from ...engines.torchft.plan import TRAINER_MODULE, job_env
from ...engines.torchft.trainer import RESTART_ENV
from ...errors import SpecError
from ...procs import JOB_UID_ENV
from ...runtime.quiet import quiet_env
from ...spec import JobSpec
from . import failures, names
from .pod_values import field_env, literal, pod_view

LIGHTHOUSE_LABEL = "eksft.io/lighthouse-of"   # the Lighthouse's pod: the job it serves
SECRET_MOUNT = "/var/run/eksft/torchft"   # the job's secret, in the Lighthouse's pod and the groups'
SECRET_VOLUME = "torchft-secret"
SECRET_MODE = 0o440   # its file: root's, read by the pod's group (an fsGroup, for an image that is not root)
# what the control Role grants beside the common rules (API group, resource, verbs): the Lighthouse's, and
# the job's secret (never read back: no list)
RULES = (("apps", "deployments", ["get", "create", "delete"]), ("", "secrets", ["get", "create", "delete"]))


def check(spec: JobSpec) -> None:
    """What a torchft job on EKS may not be (beside what the engine refuses anywhere)."""
    if spec.eks.kind != "jobset":
        raise SpecError("--engine torchft on EKS runs its replica groups as a JobSet, not --kind "
                        f"{spec.eks.kind}",
                        "use --kind jobset (the JobSet controller must be installed)")
    if spec.eks.queue:
        raise SpecError("--engine torchft cannot be queued yet: Kueue admits its JobSet of replica groups as "
                        "one workload, but not its Lighthouse's Deployment with it",
                        "drop --queue, or use --engine nvrx")


def lighthouse_name(job: str) -> str:
    return f"{job}-lighthouse"


def lighthouse_kinds(job: str) -> list[tuple[names.Kind, str]]:
    """The Lighthouse's objects (:func:`lighthouse_objects`) by kind and name, in the order they are deleted:
    its Deployment, Service and NetworkPolicy, then the job's secret (no process of the job is left)."""
    kinds = ("Deployment", "Service", "NetworkPolicy")
    return [*((names.KINDS[k], lighthouse_name(job)) for k in kinds),
            (names.KINDS["Secret"], secret_name(job))]


def secret_name(job: str) -> str:
    return f"{job}-torchft"


def secret_object(spec: JobSpec) -> dict[str, Any]:
    """The job's secret: a new one for each rendering (a launch submits the one it rendered)."""
    meta = {"name": secret_name(spec.name), "namespace": spec.eks.namespace, "labels": names.labels(spec),
            "annotations": {names.DIGEST: spec.digest()}}
    return {"apiVersion": "v1", "kind": "Secret", "metadata": meta, "type": "Opaque",
            "stringData": {secret.NAME: secret.generate()}}


def with_secret(pod: dict[str, Any], container: dict[str, Any], job: str) -> None:
    """Mount the job's secret into ``container`` of ``pod`` (a pod spec), its path in the container's env."""
    pod["volumes"] = [*pod.get("volumes", []), {"name": SECRET_VOLUME, "secret": {
        "secretName": secret_name(job), "defaultMode": SECRET_MODE}}]
    container["volumeMounts"] = [*container.get("volumeMounts", []),
                                 {"name": SECRET_VOLUME, "mountPath": SECRET_MOUNT, "readOnly": True}]
    container["env"] = [*container.get("env", []),
                        {"name": secret.ENV, "value": f"{SECRET_MOUNT}/{secret.NAME}"}]


def lighthouse_url(spec: JobSpec) -> str:
    """The Lighthouse's Service, as the groups reach it."""
    return (f"http://{lighthouse_name(spec.name)}.{spec.eks.namespace}.svc.{names.CLUSTER_DOMAIN}:"
            f"{spec.eks.port}")


def lighthouse_objects(spec: JobSpec) -> list[dict[str, Any]]:
    """The job's secret and the Lighthouse's NetworkPolicy (both before any pod exists), Service and
    Deployment."""
    name, port, e = lighthouse_name(spec.name), spec.eks.port, spec.eks
    meta = {"name": name, "namespace": e.namespace, "annotations": {names.DIGEST: spec.digest()},
            "labels": {**names.labels(spec), LIGHTHOUSE_LABEL: spec.name}}
    selector = {LIGHTHOUSE_LABEL: spec.name}
    pod_labels = {names.MANAGED_BY: names.MANAGER, **selector}   # not the job's: its pods are the groups
    groups = {"podSelector": {"matchLabels": {names.JOB_LABEL: spec.name}}}
    policy = {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy", "metadata": meta,
              "spec": {"podSelector": {"matchLabels": selector}, "policyTypes": ["Ingress"],
                       "ingress": [{"from": [groups], "ports": [{"protocol": "TCP", "port": port}]}]}}
    service = {"apiVersion": "v1", "kind": "Service", "metadata": meta,
               "spec": {"selector": selector,
                        "ports": [{"name": "lighthouse", "port": port, "targetPort": port}]}}
    container = {"name": "lighthouse", "image": e.image, "command": ["python", "-m", lighthouse.MODULE],
                 "args": [str(port)],   # on the pod's IP, an IPv6 one in brackets
                 "env": [field_env(hosts.POD_IP, "status.podIP"),
                         {"name": hosts.HOST_ENV, "value": hosts.rendered("eks")}],
                 "ports": [{"name": "lighthouse", "containerPort": port}],
                 "resources": {"requests": {"cpu": "250m", "memory": "256Mi"}}}
    pod = {"automountServiceAccountToken": False, "enableServiceLinks": False, "containers": [container],
           "tolerations": failures.tolerations(spec)[-2:]}   # a lost node's: evicted as fast as the groups
    with_secret(pod, container, spec.name)
    deployment = {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": meta,
                  "spec": {"replicas": 1, "selector": {"matchLabels": selector},
                           "template": {"metadata": {"labels": pod_labels}, "spec": pod}}}
    return [secret_object(spec), policy, service, deployment]


def jobset(spec: JobSpec, template: dict[str, Any], meta: dict[str, Any]) -> dict[str, Any]:
    """The replica groups, from the job's pod ``template`` (its volumes, init containers, placement) with
    the trainer container made a torchft group's; ``meta`` the workload's metadata."""
    template = {**template, "spec": {**template["spec"]}}
    [trainer] = template["spec"]["containers"]
    trainer = {k: v for k, v in trainer.items() if k != "ports"}   # a group's are ephemeral (hosts.py)
    trainer = {**trainer, "command": ["python", "-m", TRAINER_MODULE], "args": [], "env": group_env(spec)}
    with_secret(template["spec"], trainer, spec.name)
    template["spec"]["containers"] = [trainer]
    child = {"completionMode": "Indexed", "completions": 1, "parallelism": 1, **failures.job_retries(spec),
             **failures.pod_failure_policy(spec), "template": template}
    return {"apiVersion": "jobset.x-k8s.io/v1alpha2", "kind": "JobSet", "metadata": meta,
            "spec": {"failurePolicy": {**failures.jobset_failure_policy(spec), "maxRestarts": 0},
                     "replicatedJobs": [{"name": "group", "replicas": spec.nnodes,
                                         "template": {"metadata": {"labels": names.labels(spec)},
                                                      "spec": child}}]}}


def group_env(spec: JobSpec) -> list[dict[str, Any]]:
    """A group's environment: its number from JobSet, its restarts from its child Job (per-index retries
    only), its servers on the pod's IP, the Lighthouse's Service."""
    env: list[dict[str, Any]] = [field_env("NODE_NAME", "spec.nodeName"),
                                 field_env(hosts.POD_IP, "status.podIP"),
                                 field_env("REPLICA_GROUP_ID", f"metadata.annotations['{names.JOB_INDEX}']")]
    if failures.per_index(spec):
        env.append(field_env(RESTART_ENV, f"metadata.annotations['{names.INDEX_FAILURES}']"))
    values = job_env(pod_view(spec), job_dir=names.job_dir(spec), lighthouse=lighthouse_url(spec),
                     host="", store_port=hosts.ANY_PORT)
    values.update({"EKSFT_SPEC": f"{names.CONFIG_MOUNT}/{names.POD_SPEC}", "EKSFT_EVENTS_STDOUT": "1"})
    env += [{"name": k, "value": literal(v)} for k, v in quiet_env(values).items()]
    # the references the kubelet fills in (after the variables they name)
    rendered = {"RANK": "$(REPLICA_GROUP_ID)", "GROUP_RANK": "$(REPLICA_GROUP_ID)",
                hosts.HOST_ENV: hosts.rendered("eks"), "MASTER_ADDR": hosts.rendered("eks")}
    env = [v for v in env if v["name"] not in rendered]
    env += [{"name": k, "value": v} for k, v in rendered.items()]
    env.append({"name": JOB_UID_ENV,
                "valueFrom": {"configMapKeyRef": {"name": spec.name, "key": names.JOB_UID}}})
    return env

