"""How a replica group heals from a peer: torchft's ``CheckpointTransport``, over :mod:`.wire`, carrying the
state as :mod:`.codec` data.

torchft's default transport serves the state over HTTP to anyone who asks and loads what it fetches as a
pickle (``weights_only=False``): any process that reaches the job could read the model and optimizer, or
run code in every group. This one:

- serves (:meth:`SealedTransport.send_checkpoint`) only to a peer that proves it holds the job's secret,
  only the step torchft is serving, and only until torchft disallows it (the optimizer may then change it:
  :meth:`disallow_checkpoint` waits for a fetch in flight);
- fetches (:meth:`recv_checkpoint`) only from a peer that proves it holds the secret, reads every frame's
  authentication before using it, and builds the state with :func:`.codec.decode_header` and raw tensor
  bytes: nothing is unpickled.

Its address (``metadata()``, which torchft hands to a healing peer) is ``sealed://HOST:PORT``, HOST an IP
address (a fetch never resolves a name a peer gave).
"""

from __future__ import annotations

import datetime
import ipaddress
import threading
import time
from typing import Any, Generic, TypeVar

from torchft.checkpointing.transport import CheckpointTransport

from ... import loopback
from . import codec, wire
from .hosts import endpoint

T = TypeVar("T")
ROLE = b"C"
SCHEME = "sealed://"
FETCH, HEADER, DATA, END = 1, 2, 3, 4
CHUNK = 4 << 20   # bytes of tensor data per frame


def parse_address(text: str) -> tuple[str, int]:
    """``sealed://HOST:PORT`` (an IPv6 HOST in brackets) as (host, port); ValueError if it is not one."""
    if not isinstance(text, str) or not text.startswith(SCHEME) or len(text) > 80:
        raise ValueError(f"{str(text)[:80]!r} is not a sealed transport's address")
    host, sep, port = text[len(SCHEME):].rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    elif ":" in host:
        raise ValueError(f"{text!r}: an IPv6 host goes in brackets")
    if not sep or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{text!r} has no port")
    return str(ipaddress.ip_address(host)), int(port)


class SealedTransport(CheckpointTransport[T], Generic[T]):
    """``key``, ``host``: the job's secret and the address this group's servers listen on; ``refused``:
    called with (peer, reason) for each peer refused."""

    def __init__(self, key: bytes, host: str, timeout: datetime.timedelta, refused: wire.Refusal) -> None:
        self.key, self.timeout = key, timeout.total_seconds()
        self._state = threading.Condition()
        self._step: int | None = None        # the step served, None when torchft disallows serving
        self._header = b""
        self._tensors: list[Any] = []
        self._fetches = 0                    # fetches in flight
        listener = loopback.listener(host, 0)
        self._address = f"{SCHEME}{endpoint(host, listener.getsockname()[1])}"
        self.server = wire.Server(listener, key, ROLE, self._serve, refused, timeout=10)

    # -- serving ------------------------------------------------------------------------------------------
    def metadata(self) -> str:
        return self._address

    def send_checkpoint(self, dst_ranks: list[int], step: int, state_dict: T,
                        timeout: datetime.timedelta) -> None:
        tree, tensors = codec.flatten(state_dict)   # CodecError: torchft counts the step errored
        header = codec.encode_header(tree, tensors)
        with self._state:
            self._step, self._header, self._tensors = step, header, tensors
            self._state.notify_all()

    def disallow_checkpoint(self) -> None:
        """Stop serving; return once no fetch is in flight (up to the timeout): torchft changes the state
        next."""
        deadline = time.monotonic() + self.timeout
        with self._state:
            self._step = None
            while self._fetches and self._state.wait(max(0.0, deadline - time.monotonic())):
                pass
            self._header, self._tensors = b"", []

    def _serve(self, channel: wire.Channel) -> None:
        asked = channel.recv_json(FETCH).get("step")
        if type(asked) is not int:
            channel.send(wire.ERROR, b"a fetch names no step")
            return
        deadline = time.monotonic() + self.timeout
        with self._state:   # the peer may ask a moment before torchft here hands over the state
            while self._step != asked and self._state.wait(max(0.0, deadline - time.monotonic())):
                pass
            if self._step != asked:
                served = "nothing" if self._step is None else f"step {self._step}"
                channel.send(wire.ERROR, f"this group serves {served}, not step {asked}".encode())
                return
            header, tensors = self._header, self._tensors
            self._fetches += 1
        try:
            channel.send(HEADER, header)
            for piece in codec.chunks(tensors, CHUNK):
                channel.send(DATA, piece)
            channel.send_json(END, {"tensors": len(tensors)})
        finally:
            with self._state:
                self._fetches -= 1
                self._state.notify_all()

    # -- fetching -----------------------------------------------------------------------------------------
    def recv_checkpoint(self, src_rank: int, metadata: str, step: int, timeout: datetime.timedelta) -> T:
        host, port = parse_address(metadata)
        channel = wire.connect(host, port, self.key, ROLE, timeout.total_seconds())
        try:
            channel.send_json(FETCH, {"step": step})
            kind, raw = channel.recv(limit=codec.MAX_HEADER)
            if kind == wire.ERROR:
                raise wire.WireError(f"the peer at {channel.peer} sent no state: "
                                     f"{raw.decode('utf-8', 'replace')[:200]}")
            if kind != HEADER:
                raise wire.WireError(f"the peer at {channel.peer} broke the protocol (kind {kind})")
            tree, specs = codec.decode_header(raw)
            tensors = [self._receive(channel, spec) for spec in specs]
            if channel.recv_json(END).get("tensors") != len(tensors):
                raise wire.WireError(f"the peer at {channel.peer} ended its state early")
            return codec.build(tree, tensors)
        finally:
            channel.close()

    @staticmethod
    def _receive(channel: wire.Channel, spec: codec.TensorSpec) -> Any:
        tensor, into = codec.empty(spec)
        got = 0
        while got < len(into):
            got += channel.recv_into(DATA, into[got:got + CHUNK])
        return tensor

    def shutdown(self, wait: bool = True) -> None:
        self.server.close()

