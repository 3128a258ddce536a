"""torchft's Lighthouse, which forms each step's quorum of replica groups, as a job runs it: behind its
gateway (:mod:`.gateway`), which answers only the job's processes, on a loopback of its own (:mod:`.netns`,
where the machine is shared: a local job, a Slurm node; an EKS pod's is its own). Its command line, and
a cluster pod's entry (``python -m eksft_nb.engines.torchft.lighthouse PORT``), which binds the pod's IP:
the kubelet fills ``$(POD_IP)`` in, but cannot put an IPv6 address in the brackets a bind needs."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from .hosts import endpoint, group_host

HEARTBEAT_TIMEOUT_MS = 1000  # a group silent this long is out of the quorum: the healthy ones stall as long
JOIN_TIMEOUT_MS = 10000  # how long a quorum waits for a group that heartbeats but has not asked to join
QUORUM_TICK_MS = 100
MODULE = "eksft_nb.engines.torchft.lighthouse"
GATEWAY = "eksft_nb.engines.torchft.gateway"
NETNS = Path(__file__).with_name("netns.py")   # run by its path (see netns.py)


def argv(port: int, host: str = "127.0.0.1", min_replicas: int = 1, private: bool = True) -> list[str]:
    """The gateway listening on ``host:port`` only (the Lighthouse behind it); ``private``: in a network
    namespace of its own (False in an EKS pod, whose network is its own already)."""
    gateway = [sys.executable, "-m", GATEWAY, "--bind", endpoint(host, port), *flags(min_replicas)]
    return [sys.executable, "-I", "-S", str(NETNS), "--", *gateway] if private else gateway


def flags(min_replicas: int = 1) -> list[str]:
    """The Lighthouse's options (torchft's names)."""
    return [
        "--min_replicas",
        str(min_replicas),
        "--quorum_tick_ms",
        str(QUORUM_TICK_MS),
        "--join_timeout_ms",
        str(JOIN_TIMEOUT_MS),
        "--heartbeat_timeout_ms",
        str(HEARTBEAT_TIMEOUT_MS),
    ]


def main(args: list[str]) -> None:
    """An EKS pod: become the gateway on ``PORT`` at this pod's address (:func:`.hosts.group_host`)."""
    if len(args) != 1 or not args[0].isdigit():
        sys.exit(f"usage: python -m {MODULE} PORT")
    command = argv(int(args[0]), group_host(), private=False)
    os.execv(command[0], command)


if __name__ == "__main__":
    main(sys.argv[1:])
