"""EKS-specific checks of a job spec: everything the cluster would reject, or accept and then never
run, fails here first with one line naming the problem and the fix."""

from __future__ import annotations

import re
from pathlib import Path

import kubernetes_validate
from kubernetes_validate.utils import all_versions

from ...errors import SpecError, shown
from ...spec import JobSpec
from ...spec_checks import DNS1123_LABEL
from . import engine_parts, fsx, names
from .instances import NEURON_FAMILIES, efa_per_node, family, lookup
from .sizing import GiB, gib, min_memory, quantity, rank_floor, shm_size

MAX_GPUS_PER_NODE = 8      # no EC2 instance type has more NVIDIA GPUs
MAX_EFA_PER_NODE = 32      # p5.48xlarge, the most EFA interfaces of any instance type
CONFIGMAP_LIMIT = 1 << 20  # the API server's limit on a ConfigMap (spec + script)
_DNS1123_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$")
_LABEL_VALUE = re.compile(r"^([A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?)?$")
MIN_JOIN_TIMEOUT = 60   # seconds: a pod's start (image pull, prepare) takes at least this long


def image_tag(image: str) -> str | None:
    """The image's tag (None: untagged or pinned by digest)."""
    if "@" in image:
        return None
    name = image.rsplit("/", 1)[-1]
    return name.rpartition(":")[2] if ":" in name else None


def check(spec: JobSpec) -> JobSpec:
    """Raise SpecError on the first EKS-specific problem; return the spec when all is well."""
    e = spec.eks
    if not e.image or any(c.isspace() for c in e.image):
        raise SpecError(f"container image {shown(e.image)} is missing or invalid",
                        "use --image REGISTRY/REPO:TAG, an image with eksft-nb installed (see the README)")
    if image_tag(e.image) == "latest" and not e.allow_latest:
        raise SpecError(f"container image {shown(e.image)} is tagged :latest: the job's pods, and the pods "
                        "that replace them, could run different builds",
                        "use an immutable tag or a digest (REPO:0.1.0, REPO@sha256:...), or "
                        "--allow-latest-image")
    if not DNS1123_LABEL.match(e.namespace or "") or len(e.namespace) > 63:
        raise SpecError(f"namespace {shown(e.namespace)} is not a DNS-1123 label",
                        "use e.g. --namespace training")
    if not e.checkpoint_pvc:
        raise SpecError("no checkpoint PVC name: ranks save to a shared FSx for Lustre volume",
                        "use --pvc NAME (an existing ReadWriteMany claim), or add --create-pvc to render one")
    if not _DNS1123_SUBDOMAIN.match(e.checkpoint_pvc) or len(e.checkpoint_pvc) > 253:
        raise SpecError(f"checkpoint PVC name {shown(e.checkpoint_pvc)} is not a valid Kubernetes name",
                        "use lower-case letters, digits, '-' and '.', e.g. --pvc fsx-claim")
    longest = names.longest_host(spec)
    if len(longest) > 63:
        room = 63 - (len(longest) - len(spec.name))
        raise SpecError(f"job name {spec.name!r} is too long for --kind {e.kind} with {spec.nnodes} "
                        "nodes: the pod "
                        f"host name {longest!r} would exceed 63 characters",
                        f"use a --name of at most {room} characters")
    if spec.spare_nodes and e.kind == "pytorchjob":
        raise SpecError("--spare-nodes needs pods that wait in ft_launcher's rendezvous; the "
                        "PyTorchJob operator "
                        "sizes the world itself", "use --kind job (or jobset) for hot spares")
    engine_parts.of(spec).check(spec)   # what an EKS job of its engine may not be
    _check_devices(spec)
    _check_sizes(spec)
    _check_pods(spec)
    if not 1024 <= e.port <= 65533:
        raise SpecError(f"rendezvous port {e.port} is out of range (it and the next two ports are used)",
                        "use --rdzv-port between 1024 and 65533, e.g. 29500")
    if spec.checkpoint.dir and not _under(spec.checkpoint.dir, names.CKPT_MOUNT):
        raise SpecError(f"checkpoint folder {spec.checkpoint.dir} is not on the shared volume, so a "
                        "pod that is "
                        "replaced loses it",
                        f"use a folder under {names.CKPT_MOUNT}, or leave --ckpt-dir unset")
    if spec.resume not in ("latest", "none") and not spec.resume.startswith("step:") \
            and not _under(spec.resume, names.CKPT_MOUNT):
        raise SpecError(f"resume checkpoint {spec.resume} is not on the shared volume the pods mount",
                        f"pick a checkpoint under {names.CKPT_MOUNT} (list them with `ckpts NAME`)")
    if spec.script:
        script = Path(spec.script).expanduser()
        if not script.is_file():
            raise SpecError(f"training script {spec.script} does not exist", "check the --script path")
        if script.stat().st_size > CONFIGMAP_LIMIT // 2:
            raise SpecError(f"training script {spec.script} is larger than "
                            f"{CONFIGMAP_LIMIT // 2 >> 10} KiB, too "
                            "large for the job's ConfigMap",
                            "bake it into the image and pass its path in the image")
    oldest, latest = (_minor(v) for v in (all_versions()[0], kubernetes_validate.latest_version()))
    if not re.fullmatch(r"1\.\d+", e.k8s_version) or not oldest <= _minor(e.k8s_version) <= latest:
        raise SpecError(f"cannot validate for Kubernetes {shown(e.k8s_version)}",
                        f"use --k8s-version 1.{oldest} to 1.{latest}: your cluster's (`kubectl version`)")
    return spec


def _check_devices(spec: JobSpec) -> None:
    e = spec.eks
    gpus, efa = e.gpus_per_node, efa_per_node(spec)
    if family(e.instance_type) in NEURON_FAMILIES:
        raise SpecError(f"{e.instance_type} has no NVIDIA GPUs (its accelerators are AWS Neuron devices, "
                        "aws.amazon.com/neuron): the pods would wait for nvidia.com/gpu forever",
                        "use an NVIDIA GPU instance type (p5.48xlarge, p4d.24xlarge, g6e.48xlarge...)")
    known = lookup(e.instance_type)
    max_gpus, max_efa = (known.gpus, known.efa) if known else (MAX_GPUS_PER_NODE, MAX_EFA_PER_NODE)
    where = e.instance_type if known else "an EC2 instance"
    if gpus > max_gpus:
        raise SpecError(f"{gpus} GPUs per node: {where} has at most {max_gpus}",
                        f"use --gpus-per-node {max_gpus} or fewer (and more --nnodes)")
    if efa > max_efa:
        raise SpecError(f"{efa} EFA devices per node: {where} has at most {max_efa}",
                        f"use --efa-per-node {max_efa} or fewer")
    if gpus and spec.nproc_per_node > gpus:
        raise SpecError(f"{spec.nproc_per_node} ranks per node but only {gpus} GPUs per pod (one "
                        "GPU per rank)",
                        f"use --nproc-per-node {gpus}, or --gpus-per-node "
                        f"{min(spec.nproc_per_node, max_gpus)}")
    if gpus and spec.device == "cpu":
        raise SpecError("--device cpu with GPU pods wastes the GPUs",
                        "use --device auto, or --gpus-per-node 0")
    if not gpus and spec.device == "cuda":
        raise SpecError("--device cuda needs GPUs in the pods", f"add --gpus-per-node {spec.nproc_per_node}")
    if efa and not gpus:
        raise SpecError("EFA devices are only used by NCCL on GPU pods (CPU ranks talk over TCP)",
                        "use --efa-per-node 0 with --gpus-per-node 0")


def _check_sizes(spec: JobSpec) -> None:
    e = spec.eks
    quantity(shm_size(spec), "--shm-size")   # a readable --shm-size
    if e.cpu is not None and quantity(e.cpu, "--cpu") < spec.nproc_per_node * spec.threads_per_rank * 0.5:
        raise SpecError(f"--cpu {e.cpu} is too little for {spec.nproc_per_node} ranks of "
                        f"{spec.threads_per_rank} "
                        "thread(s)", f"use --cpu {spec.nproc_per_node * spec.threads_per_rank} or more")
    floor = rank_floor(spec)
    if e.memory is not None and quantity(e.memory, "--memory") < min_memory(spec):
        raise SpecError(f"--memory {e.memory} does not cover the {shm_size(spec)} memory-backed "
                        "/dev/shm (it counts "
                        f"against the pod's memory) plus {gib(floor)} for each of the "
                        f"{spec.nproc_per_node} ranks",
                        f"use --memory {gib(min_memory(spec))} or more, or a smaller --shm-size")
    known = lookup(e.instance_type)
    if known and e.memory is not None and quantity(e.memory, "--memory") > known.memory_gib * GiB:
        raise SpecError(f"--memory {e.memory} is more than a {e.instance_type} has "
                        f"({known.memory_gib}Gi): the pods "
                        "would never be scheduled", f"use --memory {known.memory_request_gib}Gi or less")
    if known and e.memory is None and min_memory(spec) > known.memory_request_gib * GiB:
        raise SpecError(f"a {e.instance_type} pod cannot hold the {shm_size(spec)} /dev/shm plus "
                        f"{gib(floor)} for each "
                        f"of the {spec.nproc_per_node} ranks within {known.memory_request_gib}Gi",
                        "use a smaller --shm-size or more --nnodes")
    if known and e.cpu is not None and quantity(e.cpu, "--cpu") > known.vcpus:
        raise SpecError(f"--cpu {e.cpu} is more than a {e.instance_type} has ({known.vcpus} vCPUs): "
                        "the pods would "
                        "never be scheduled", f"use --cpu {known.cpu_request} or less")
    if e.create_pvc:
        size = quantity(e.storage_size, "--storage-size")
        if size != 1200 * GiB and (size < 2400 * GiB or size % (2400 * GiB)):
            raise SpecError(f"FSx for Lustre cannot be {e.storage_size}: it comes in 1200Gi or "
                            "multiples of 2400Gi",
                            "use --storage-size 1200Gi, 2400Gi, 4800Gi, ...")
        if not e.fsx_subnet or not e.fsx_security_groups:
            raise SpecError("--create-pvc provisions a new FSx file system, which needs a subnet and "
                            "security groups",
                            "add --fsx-subnet subnet-... (the GPU nodes' subnet) and "
                            "--fsx-security-groups sg-..."
                            " (allowing TCP 988 from the nodes)")
        if not _DNS1123_SUBDOMAIN.match(e.storage_class):
            raise SpecError(f"StorageClass name {shown(e.storage_class)} is invalid",
                            "use e.g. --storage-class fsx-sc")
        fsx.check(spec)


def _check_pods(spec: JobSpec) -> None:
    """What the pods run as and wait for."""
    e = spec.eks
    uid = e.run_as_user
    if isinstance(uid, bool) or not isinstance(uid, int) or not 0 <= uid < 2**31:
        raise SpecError(f"--run-as-user {shown(e.run_as_user)} is not a user id",
                        "use --run-as-user 1000 (any non-root UID the image can run as), or 0 for root")
    if isinstance(e.join_timeout, bool) or not isinstance(e.join_timeout, int) or \
            e.join_timeout < MIN_JOIN_TIMEOUT:
        raise SpecError(f"--rdzv-join-timeout {shown(e.join_timeout)} is too short for a pod to be scheduled "
                        "and started", f"use --rdzv-join-timeout {MIN_JOIN_TIMEOUT} or more (default 1800)")
    if not isinstance(e.prometheus_release, str) or not _LABEL_VALUE.match(e.prometheus_release) \
            or len(e.prometheus_release) > 63:
        raise SpecError(f"--prometheus-release {shown(e.prometheus_release)} is not a label value",
                        "use your Prometheus operator's release name, e.g. --prometheus-release "
                        "kube-prometheus-stack")


def _minor(version: str) -> int:
    return int(version.split(".")[1])


def _under(path: str, root: str) -> bool:
    return Path(path).is_absolute() and (Path(path) == Path(root) or Path(root) in Path(path).parents)
