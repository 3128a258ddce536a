"""A local job listens on loopback only, torchft's servers included.

torchft 0.2.0 binds its replica group's manager server to ``[::]:PORT`` (only the port is settable) and
its HTTP checkpoint server, from which a healing peer unpickles the state, to ``[::]:0``, advertising
``socket.gethostname()``: reachable from every network this machine is on (measured). :func:`install`
makes both listen on, and advertise, ``127.0.0.1`` in the rank process that hosts them.
"""

from __future__ import annotations

import socket
from http.server import ThreadingHTTPServer
from typing import Any

MARK = "eksft_loopback"  # set on what install() put in place (installing twice changes nothing)
HOST = "127.0.0.1"


class LoopbackHTTPServer(ThreadingHTTPServer):
    """torchft's checkpoint server, on loopback whatever address it is asked for."""

    address_family = socket.AF_INET
    request_queue_size = 1024

    def __init__(self, address: tuple[Any, ...], handler: Any) -> None:
        super().__init__((HOST, address[1]), handler)


def install() -> None:
    """Put torchft's manager server and checkpoint server on loopback (see the module's docstring)."""
    from torchft import manager
    from torchft.checkpointing import http_transport

    if getattr(manager.ManagerServer, MARK, False):
        return
    server = manager.ManagerServer

    def loopback_server(*args: Any, bind: str, **kw: Any) -> Any:
        return server(*args, **{**kw, "bind": f"{HOST}:{bind.rsplit(':', 1)[1]}", "hostname": HOST})

    def address(self: Any) -> str:
        return f"http://{HOST}:{self._server.socket.getsockname()[1]}/checkpoint/"

    setattr(loopback_server, MARK, True)
    manager.ManagerServer = loopback_server
    http_transport._IPv6HTTPServer = LoopbackHTTPServer
    http_transport.HTTPTransport.address = address
