"""A local job listens on loopback only.

torch's TCPStore server listens on every interface whatever host it is given (``*:<port>``), and what
a store holds is trusted: NVRx's rendezvous unpickles its state from it, so whoever reaches the port
runs code as the job's user. A local job gives every store a loopback endpoint: the rendezvous's is
``127.0.0.1`` and the launch line's ``--local-addr`` makes the ranks' ``MASTER_ADDR`` loopback too.
Then

- :func:`install` makes any TCPStore server whose endpoint is a loopback address listen on that
  address alone: it binds the socket and hands it to torch (``master_listen_fd``). Every process of a
  local job that may host a store installs it: the launchers (the rendezvous store, see
  :mod:`.backends.local.standby`), the supervisor (the rendezvous store with hot spares), and the
  ranks (the trainer's store, ``inprocess.Wrapper``'s, and the one ``init_process_group`` makes from
  ``MASTER_ADDR``/``MASTER_PORT`` for a user's script). A store for another endpoint (an EKS pod's)
  is torch's own, as before;
- :func:`env` points gloo's and NCCL's sockets at the loopback interface.
"""

from __future__ import annotations

import contextlib
import datetime
import ipaddress
import random
import socket
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import psutil

MARK = "eksft_loopback"   # set on the installed ``TCPStore.__init__`` (installing twice changes nothing)


def loopback_address(host: str) -> str | None:
    """The address to listen on for clients that connect to ``host``, if that is this machine's
    loopback (``localhost``, ``127.0.0.0/8``, ``::1``); else None."""
    if host == "localhost":
        return "127.0.0.1"
    try:
        return host if ipaddress.ip_address(host).is_loopback else None
    except ValueError:
        return None


def listener(address: str, port: int) -> socket.socket:
    """A TCP socket listening on ``address``:``port`` (0: a free port) and nowhere else."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)   # as torch's own: restarts reuse the port
        sock.bind((address, port))
        sock.listen(socket.SOMAXCONN)
    except OSError:
        sock.close()
        raise
    return sock


def install(own: str | None = None) -> None:
    """Make every TCPStore server this process hosts for a loopback endpoint listen on loopback only,
    and (``own``: the address its peers reach this host by, see :mod:`.engines.torchft.hosts`) one it
    hosts for ``own`` listen on that address alone.

    Patched on torch's class itself, so NVRx's subclasses (``inprocess.store.TCPStore``) and every
    module that imported the name follow. A port already taken fails as torch's own bind would
    (DistNetworkError: callers that may host a store then connect to it instead), except for a
    multi-tenant store, which torch may serve from its own server already on that port."""
    import torch.distributed as dist

    if not dist.is_available():
        return
    host_store = dist.TCPStore.__init__
    if getattr(host_store, MARK, False):
        return

    def __init__(self: Any, host_name: str, port: int, world_size: int | None = None, is_master: bool = False,
                 timeout: datetime.timedelta = datetime.timedelta(seconds=300), wait_for_workers: bool = True,
                 multi_tenant: bool = False, master_listen_fd: int | None = None, use_libuv: bool = True,
                 **more: Any) -> None:
        address = (loopback_address(host_name) or (own if host_name == own else None)
                   if is_master and master_listen_fd is None else None)
        if address is not None:
            try:
                sock = listener(address, port)
            except OSError as e:
                if not multi_tenant:
                    raise dist.DistNetworkError(
                        f"cannot listen on {address}:{port}: {e.strerror or e}") from e
            else:   # the store owns the socket from here on (it closes it when it goes)
                port, master_listen_fd = sock.getsockname()[1], sock.detach()
        host_store(self, host_name=host_name, port=port, world_size=world_size, is_master=is_master,
                   timeout=timeout, wait_for_workers=wait_for_workers, multi_tenant=multi_tenant,
                   master_listen_fd=master_listen_fd, use_libuv=use_libuv, **more)

    setattr(__init__, MARK, True)
    __init__.__doc__ = host_store.__doc__
    dist.TCPStore.__init__ = __init__


def interface() -> str:
    """The name of this machine's loopback interface (``lo`` on Linux)."""
    for name, addresses in psutil.net_if_addrs().items():
        if any(a.family == socket.AF_INET and loopback_address(a.address) for a in addresses):
            return name
    return "lo"


def env() -> dict[str, str]:
    """Environment for a local job's ranks: gloo's and NCCL's listening sockets on loopback (by
    default both take the address the host name resolves to, or the first network interface)."""
    name = interface()
    return {"GLOO_SOCKET_IFNAME": name, "NCCL_SOCKET_IFNAME": name}


PORTS_FROM = 10000   # above the registered services' most-used ports


def free_ports(n: int, *, consecutive: bool = False) -> list[int]:
    """``n`` distinct loopback ports free now (each held until all are found, so none repeats; with
    ``consecutive``, ``n`` in a row), below the kernel's ephemeral range, where a cluster's fixed ports sit
    (29500). They are bound seconds later, by other processes: one the kernel picks (bind to 0) is in the
    ephemeral range, where any process's outgoing connection may take it meanwhile (in CI a Slurm test's
    store port, taken from the kernel's pick, was held by another process for a minute: EADDRINUSE, six
    restarts)."""
    pick, low = random.SystemRandom(), _ephemeral_low()
    top = low if low - n > PORTS_FROM else 65536   # where nearly every port is ephemeral: from them all
    for _ in range(500):
        if consecutive:
            first = pick.randrange(PORTS_FROM, top - n)
            wanted: Sequence[int] = range(first, first + n)
        else:
            wanted = pick.sample(range(PORTS_FROM, top), n)
        try:
            with contextlib.ExitStack() as held:
                for port in wanted:
                    held.enter_context(socket.socket()).bind(("127.0.0.1", port))
            return list(wanted)
        except OSError:   # one is in use
            continue
    raise OSError(f"no {n} free loopback ports between {PORTS_FROM} and {top}")


def _ephemeral_low() -> int:
    """The first port of Linux's ephemeral range (32768 where it cannot be read: also below macOS's)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768
