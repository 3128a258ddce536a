"""A replica group's servers: on the one address its peers use, and answering only its job's processes.

torchft 0.2.0 binds its replica group's manager server to every interface and serves gRPC there to anyone
(``Kill`` among it); its HTTP checkpoint server, also on every interface, sends the whole state to anyone
and its client unpickles whatever a peer serves. :func:`install` replaces, in torchft's ``manager``
module (so the built-in trainer and a user's script that makes its own ``Manager`` alike):

- the manager server and client with :mod:`.coordination`'s, over :mod:`.wire`, which talk to the
  Lighthouse through its gateway and refuse a quorum with a stranger in it (the step is thrown away);
- the default checkpoint transport (``HTTPTransport``, also where a script imports it) with
  :class:`.transport.SealedTransport`; a ``Manager`` given another transport (torchft's ``PGTransport``
  unpickles what a peer sends) is refused in one line;

each listening on the group's address (:func:`.hosts.group_host`) alone, as the group's store does.
"""

from __future__ import annotations

import functools
import inspect
import os
from collections.abc import Callable
from typing import Any, TypeVar

from ... import loopback
from ...errors import EksftError
from . import secret
from .alarm import Alarm
from .coordination import GroupClient, GroupServer, QuorumRefused, Trust, bound
from .hosts import group_host

MARK = "eksft_trust"   # on torchft's Manager class: the Trust installed (installing twice changes nothing)
T = TypeVar("T")


class ForeignTransport(EksftError):
    """A Manager was given a checkpoint transport that is not the sealed one."""


def install(alarm: Alarm | None = None, refuse: Callable[[EksftError], Any] | None = None,
            host: str | None = None) -> Trust:
    """Put this process's torchft servers on ``host`` (default: :func:`.hosts.group_host`) behind the job's
    secret (see the module's docstring). ``alarm``: where refused peers are reported; ``refuse``: called
    with the one line when a Manager is given a foreign transport (default: it is raised)."""
    from torchft import checkpointing
    from torchft import manager as ft
    from torchft.checkpointing import http_transport

    from .transport import SealedTransport

    host = host or group_host()
    loopback.install(own=host)
    installed = getattr(ft.Manager, MARK, None)
    if installed is not None:
        return installed
    env = os.environ
    trust = Trust(key=secret.key(env), host=host, group=int(env.get("REPLICA_GROUP_ID") or 0),
                  groups=int(env.get("NUM_REPLICA_GROUPS") or 1), alarm=alarm or Alarm(None))

    class Transport(SealedTransport[T]):
        """torchft's default transport, as its Manager makes it (``HTTPTransport(timeout, num_chunks)``)."""

        def __init__(self, timeout: Any, num_chunks: int = 0) -> None:
            super().__init__(trust.key, trust.host, timeout, trust.alarm.reporter("transport"))

    ft.ManagerServer, ft.ManagerClient = bound(GroupServer, trust), bound(GroupClient, trust)
    ft.HTTPTransport = checkpointing.HTTPTransport = http_transport.HTTPTransport = Transport
    _guard(ft.Manager, refuse)
    setattr(ft.Manager, MARK, trust)
    return trust


def _guard(manager_type: type, refuse: Callable[[EksftError], Any] | None) -> None:
    """A Manager takes only the sealed transport, and a refused quorum throws its step away."""
    from .transport import SealedTransport

    init, quorum = manager_type.__init__, manager_type._async_quorum
    signature = inspect.signature(init)

    @functools.wraps(init)
    def __init__(manager: Any, *args: Any, **kwargs: Any) -> None:
        try:
            given = signature.bind(manager, *args, **kwargs).arguments.get("checkpoint_transport")
        except TypeError:
            given = None   # torchft's own call raises its own error
        if given is not None and not isinstance(given, SealedTransport):
            error = ForeignTransport(
                f"torchft's Manager was given a {type(given).__name__}, which loads what a peer sends "
                "without the job's secret (torchft's own transports unpickle it)",
                "drop checkpoint_transport (eksft gives every Manager a transport that only the job's "
                "groups reach)")
            if refuse is None:
                raise error
            refuse(error)
        init(manager, *args, **kwargs)

    @functools.wraps(quorum)
    def _async_quorum(manager: Any, *args: Any, **kwargs: Any) -> None:
        try:
            quorum(manager, *args, **kwargs)
        except QuorumRefused as e:   # before the process group or a heal: the step is thrown away
            manager.report_error(e)

    manager_type.__init__, manager_type._async_quorum = __init__, _async_quorum
