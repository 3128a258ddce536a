"""The GPU instance types the EKS backend knows, in one table: what a pod may ask of such a node.

HyperPod names the same instances ``ml.<type>`` (``ml.p5.48xlarge``): :func:`lookup` reads both, and
the pods' nodeSelector keeps the name as given (a HyperPod node's ``node.kubernetes.io/instance-type``
label carries the ``ml.`` name).
"""

from __future__ import annotations

from dataclasses import dataclass

from ...spec import JobSpec

GiB = 1 << 30


@dataclass(frozen=True)
class Instance:
    gpus: int          # NVIDIA GPUs
    efa: int           # EFA interfaces (vpc.amazonaws.com/efa the device plugin advertises)
    rdma_read: bool    # EFA with RDMA read: libfabric may use GPUDirect RDMA (FI_EFA_USE_DEVICE_RDMA=1)
    vcpus: int
    memory_gib: int

    @property
    def cpu_request(self) -> int:
        """The trainer's default CPU request: all but 1/16 of the vCPUs, which stay for the kubelet,
        the system and the node's DaemonSets (EFA and NVIDIA device plugins, CNI, CSI, exporters)."""
        return self.vcpus - self.vcpus // 16

    @property
    def memory_request_gib(self) -> int:
        """The trainer's default memory (request and limit): 7/8 of the node's, for the same reason."""
        return self.memory_gib * 7 // 8


# EC2's published figures. g5/g6/g6e have EFA without RDMA read: libfabric aborts there if asked for
# device RDMA ("EFA device has no rdma-read capability"). p6e-gb200 is an Arm (Grace) host: the image must
# be built for linux/arm64.
INSTANCE_TYPES: dict[str, Instance] = {
    "p4d.24xlarge": Instance(gpus=8, efa=4, rdma_read=True, vcpus=96, memory_gib=1152),
    "p4de.24xlarge": Instance(gpus=8, efa=4, rdma_read=True, vcpus=96, memory_gib=1152),
    "p5.48xlarge": Instance(gpus=8, efa=32, rdma_read=True, vcpus=192, memory_gib=2048),
    "p5e.48xlarge": Instance(gpus=8, efa=32, rdma_read=True, vcpus=192, memory_gib=2048),
    "p5en.48xlarge": Instance(gpus=8, efa=16, rdma_read=True, vcpus=192, memory_gib=2048),
    "g5.48xlarge": Instance(gpus=8, efa=1, rdma_read=False, vcpus=192, memory_gib=768),
    "g6.48xlarge": Instance(gpus=8, efa=1, rdma_read=False, vcpus=192, memory_gib=768),
    "g6e.48xlarge": Instance(gpus=8, efa=4, rdma_read=False, vcpus=192, memory_gib=1536),
    "p6-b200.48xlarge": Instance(gpus=8, efa=8, rdma_read=True, vcpus=192, memory_gib=2048),
    "p6e-gb200.36xlarge": Instance(gpus=4, efa=8, rdma_read=True, vcpus=144, memory_gib=960),
}
# accelerators that are not NVIDIA GPUs (AWS Trainium and Inferentia: aws.amazon.com/neuron devices)
NEURON_FAMILIES = ("trn1", "trn1n", "trn2", "trn2u", "inf1", "inf2")
HYPERPOD_PREFIX = "ml."


def family(instance_type: str | None) -> str:
    """``p5`` of ``p5.48xlarge`` (or of HyperPod's ``ml.p5.48xlarge``)."""
    return (instance_type or "").removeprefix(HYPERPOD_PREFIX).partition(".")[0]


def hyperpod(instance_type: str | None) -> bool:
    """Whether the name is HyperPod's (``ml.``): its nodes carry HyperPod's health label."""
    return bool(instance_type and instance_type.startswith(HYPERPOD_PREFIX))


def lookup(instance_type: str | None) -> Instance | None:
    """The instance behind an EC2 or HyperPod (``ml.``) type name, or None when unknown."""
    if not instance_type:
        return None
    return INSTANCE_TYPES.get(instance_type.removeprefix(HYPERPOD_PREFIX))


def efa_per_node(spec: JobSpec) -> int:
    """The EFA devices a pod asks for: ``--efa-per-node`` as given, else every device a known instance type
    has, on GPU pods (NCCL over TCP sockets is tens of times slower, and falls back silently)."""
    e = spec.eks
    if e.efa_per_node is not None:
        return e.efa_per_node
    known = lookup(e.instance_type)
    return known.efa if known and e.gpus_per_node else 0
