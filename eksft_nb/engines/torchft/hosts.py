"""Where a torchft job's servers listen: the one decision, per backend, of the address each replica group's
store, manager server and checkpoint server bind and advertise (and the Lighthouse's ``--bind``).

torchft 0.2.0 binds its manager and checkpoint servers to every interface; a group's peers need them (a
healing group fetches the state from a peer's checkpoint server, every group joins the process group
through the first group's store), so they listen on the one address the peers use, and nowhere else:

- ``local``: ``127.0.0.1``, as every port of a local job (:mod:`eksft_nb.loopback`);
- ``eks``: the pod's IP (``status.podIP``): what the other pods and the Lighthouse's Service reach;
- ``slurm``: the address the node's host name resolves to, which is how the other nodes reach it.

The backends render it into :data:`HOST_ENV` (a pod's IP through the downward API, a node's host name in
its step's shell); the group's process binds :func:`group_host`, resolved to an address, IPv4 or IPv6 (an
IPv6 one in brackets wherever it meets a port: :func:`endpoint`).
"""

from __future__ import annotations

import ipaddress
import os
import socket

HOST_ENV = "EKSFT_TORCHFT_HOST"
LOCAL = "127.0.0.1"
POD_IP = "POD_IP"   # on EKS: the pod's IP, from the downward API (``status.podIP``)
ANY_PORT = 0   # a cluster group's store (its manager and checkpoint servers too): a free port, which its
# peers learn through the Lighthouse (groups may share a host: Slurm nodes of one machine, a replay)


def rendered(backend: str) -> str:
    """The value of :data:`HOST_ENV` a backend renders for a replica group."""
    return {"local": LOCAL, "eks": f"$({POD_IP})", "slurm": "$(hostname)"}[backend]


def resolve(host: str) -> str:
    """``host`` as an IP address (a name: the first address it resolves to here, IPv4 or IPv6, in the
    resolver's order of preference)."""
    try:
        return str(ipaddress.ip_address(host))
    except ValueError:
        return str(socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)[0][4][0])


def group_host() -> str:
    """In a replica group's process: the address its servers bind and advertise."""
    return resolve(os.environ.get(HOST_ENV) or LOCAL)


def endpoint(host: str, port: int | str) -> str:
    """``host:port``, an IPv6 address in brackets."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
