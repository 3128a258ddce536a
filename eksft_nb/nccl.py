"""NCCL's environment on GPU nodes, as every cluster backend sets it (EKS pods, Slurm jobs), and the
network NCCL's log says it took."""

from __future__ import annotations

import re


def nccl_env(gpus_per_node: int, efa: bool, inprocess: bool, rdma_read: bool,
             require_efa: bool = False) -> dict[str, str]:
    """For ranks on GPUs: no loopback or container interfaces for NCCL's sockets, and NCCL's network
    choice logged at INFO for the INIT and NET subsystems only (one "NET/OFI ..." or "NET/Socket ..."
    line per rank), so a fall back to TCP shows in the log. With EFA: libfabric's provider and the
    fork-safety NVRx's restarts need (they fork ranks); huge pages off for libfabric's buffers (AWS's
    current guidance: with them a fork, a data loader's or a restart's, can fail with "Cannot allocate
    memory" once the node's huge pages run out); no ``RDMAV_FORK_SAFE``, which rdma-core no longer needs
    (the kernel copies registered memory on fork) and which costs every registration; device RDMA only
    where the EFA has RDMA read (``rdma_read``: p4d, p5...; elsewhere libfabric aborts). ``require_efa``
    (the user asked for EFA): NCCL may use aws-ofi-nccl's network only (``NCCL_NET``, the name it answers
    to in every release), so that a fall back to TCP sockets fails the job instead of slowing it down."""
    if not gpus_per_node:
        return {}
    env = {"NCCL_DEBUG": "INFO", "NCCL_DEBUG_SUBSYS": "INIT,NET", "NCCL_SOCKET_IFNAME": "^docker,lo,veth"}
    if inprocess:  # let inprocess.Wrapper see NCCL errors as exceptions it can restart from
        env.update({"TORCH_NCCL_RETHROW_CUDA_ERRORS": "0", "NCCL_NVLS_ENABLE": "0"})
    if efa:
        env.update({"FI_PROVIDER": "efa", "FI_EFA_FORK_SAFE": "1", "FI_EFA_USE_HUGE_PAGE": "0",
                    "FI_LOG_LEVEL": "warn"})
        if rdma_read:
            env["FI_EFA_USE_DEVICE_RDMA"] = "1"
        if require_efa:
            env["NCCL_NET"] = "AWS Libfabric"
    return env


# what NCCL_DEBUG=INFO (subsystems INIT,NET) says of the network it took: "NCCL INFO Using network AWS
# Libfabric" (aws-ofi-nccl loaded), "... Using network Socket" (TCP), and aws-ofi-nccl's own "NET/OFI
# Selected Provider is efa" (or tcp: libfabric without EFA)
_NETWORK = re.compile(r"NCCL INFO (?:Using network (?P<net>[\w ]+?)\s*$|NET/OFI Selected [Pp]rovider is "
                      r"(?P<provider>\w+))")


def network_of(line: str) -> str | None:
    """The network one NCCL log line says a rank uses: ``"efa"``, ``"socket"`` (a fall back to TCP),
    another transport's name (``"ib"``), or None for any other line."""
    m = _NETWORK.search(line)
    if m is None:
        return None
    if m.group("provider"):
        return "efa" if m.group("provider").lower() == "efa" else "socket"
    net = m.group("net").lower()
    return "socket" if net == "socket" else "efa" if ("libfabric" in net or "ofi" in net) else net
