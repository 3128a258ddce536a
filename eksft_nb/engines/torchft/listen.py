"""A replica group's servers listen on the one address its peers use, torchft's included.

torchft 0.2.0 binds its replica group's manager server to ``[::]:PORT`` (only the port is settable) and
its HTTP checkpoint server, from which a healing peer unpickles the state, to ``[::]:0``, advertising
``socket.gethostname()``: reachable from every network this machine is on (measured). :func:`install`
makes both listen on, and advertise, the group's address (:func:`.hosts.group_host`: ``127.0.0.1`` in a
local job, the pod's or the node's address on a cluster), and the store the group hosts too.
"""

from __future__ import annotations

import socket
from http.server import ThreadingHTTPServer
from typing import Any

from ... import loopback
from .hosts import endpoint, group_host

MARK = "eksft_loopback"  # set on what install() put in place (installing twice changes nothing)


def install(host: str | None = None) -> None:
    """Put the group's store, torchft's manager server and checkpoint server on ``host`` alone (default:
    :func:`.hosts.group_host`)."""
    from torchft import manager
    from torchft.checkpointing import http_transport

    host = host or group_host()
    loopback.install(own=host)
    if getattr(manager.ManagerServer, MARK, False):
        return
    server = manager.ManagerServer

    class HostHTTPServer(ThreadingHTTPServer):
        """torchft's checkpoint server, on ``host`` whatever address it is asked for."""

        address_family = socket.AF_INET6 if ":" in host else socket.AF_INET
        request_queue_size = 1024

        def __init__(self, address: tuple[Any, ...], handler: Any) -> None:
            super().__init__((host, address[1]), handler)

    named = f"[{host}]" if ":" in host else host   # as it goes into the manager's URL

    def host_server(*args: Any, bind: str, **kw: Any) -> Any:
        return server(*args, **{**kw, "bind": endpoint(host, bind.rsplit(":", 1)[1]), "hostname": named})

    def address(self: Any) -> str:
        return f"http://{endpoint(host, self._server.socket.getsockname()[1])}/checkpoint/"

    setattr(host_server, MARK, True)
    manager.ManagerServer = host_server
    http_transport._IPv6HTTPServer = HostHTTPServer
    http_transport.HTTPTransport.address = address
