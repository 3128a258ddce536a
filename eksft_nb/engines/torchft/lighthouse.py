"""torchft's Lighthouse, which forms each step's quorum of replica groups: its command line, and a cluster
pod's entry (``python -m eksft_nb.engines.torchft.lighthouse PORT``), which binds the pod's IP: the kubelet
fills ``$(POD_IP)`` in, but cannot put an IPv6 address in the brackets ``--bind`` needs."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from .hosts import endpoint, group_host

HEARTBEAT_TIMEOUT_MS = 1000  # a group silent this long is out of the quorum: the healthy ones stall as long
JOIN_TIMEOUT_MS = 10000  # how long a quorum waits for a group that heartbeats but has not asked to join
QUORUM_TICK_MS = 100
COMMAND = "torchft_lighthouse"   # torchft's console script
MODULE = "eksft_nb.engines.torchft.lighthouse"


def argv(port: int, host: str = "127.0.0.1", min_replicas: int = 1) -> list[str]:
    """The Lighthouse listening on ``host:port`` only (gRPC and its HTTP status page share the port)."""
    # torchft's own console script: its Rust command line reads the process's arguments after the
    # interpreter's, so `python -c` or `-m` would be taken for the program and its first argument
    script = Path(sys.executable).with_name(COMMAND)
    return [sys.executable, str(script), *flags(endpoint(host, port), min_replicas)]


def flags(bind: str, min_replicas: int = 1) -> list[str]:
    """Its options, listening on ``bind`` (``host:port``) only: a cluster's pod runs ``COMMAND`` with them."""
    return [
        "--min_replicas",
        str(min_replicas),
        "--quorum_tick_ms",
        str(QUORUM_TICK_MS),
        "--join_timeout_ms",
        str(JOIN_TIMEOUT_MS),
        "--heartbeat_timeout_ms",
        str(HEARTBEAT_TIMEOUT_MS),
        "--bind",
        bind,
    ]


def main(args: list[str]) -> None:
    """Become the Lighthouse on ``PORT`` at this host's address (:func:`.hosts.group_host`)."""
    if len(args) != 1 or not args[0].isdigit():
        sys.exit(f"usage: python -m {MODULE} PORT")
    command = argv(int(args[0]), group_host())
    os.execv(command[0], command)


if __name__ == "__main__":
    main(sys.argv[1:])
