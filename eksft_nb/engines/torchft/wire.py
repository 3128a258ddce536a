"""The channel every server of a torchft job speaks: a connection whose two ends proved they hold the
job's key (:mod:`.secret`), carrying frames that each end authenticates.

Handshake (client first; the key never crosses the wire):

1. client: ``MAGIC``, the service's role (1 byte), a fresh 32-byte nonce ``nc``;
2. server: its fresh nonce ``ns`` and ``HMAC(key, "server" role nc ns)``: the client goes on only if the
   server holds the key (a forged server is never sent a request, nor read);
3. client: ``HMAC(key, "client" role nc ns)``: the server answers only if the client holds the key.

Both ends then use ``session = HMAC(key, "session" role nc ns)``. A frame is its body's length (4 bytes),
its kind (1 byte), the body, and ``HMAC(session, direction seq kind length body)``: a frame that was
changed, replayed, reordered or reflected back fails its check and ends the connection. Lengths are
bounded before anything is read. Nothing is encrypted: what a peer sends (a healing group's state) is as
readable on the wire as the job's collectives are.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import secrets
import socket
import struct
import threading
from collections.abc import Callable
from typing import Any

from .hosts import endpoint

MAGIC = b"EKSFTW1\n"
NONCE = 32
TAG = 32
HEAD = struct.Struct(">IB")   # body length, kind
MAX_CONTROL = 1 << 20          # a control message's body (JSON)
MAX_CONNECTIONS = 64           # handshakes a server runs at once; more connections are closed unanswered
ERROR = 255                    # a frame kind: the body is the reason (UTF-8), the call failed
MAX_REASON = 800               # the characters of an ERROR frame's reason that are kept


class WireError(ConnectionError):
    """The other end broke the protocol, failed a check, or went away; ``str()`` is one line."""


class Refused(WireError):
    """The other end did not prove it holds the job's key."""


def _mac(key: bytes, *parts: bytes) -> bytes:
    return hmac.new(key, b"".join(parts), hashlib.sha256).digest()


def recv_exactly(sock: socket.socket, n: int) -> bytes:
    """``n`` bytes from ``sock`` (its timeout applies to each read); WireError if it closes first."""
    buf = bytearray(n)
    _fill(sock, memoryview(buf))
    return bytes(buf)


def _fill(sock: socket.socket, view: memoryview) -> None:
    got = 0
    while got < len(view):
        try:
            k = sock.recv_into(view[got:], len(view) - got)
        except socket.timeout:
            raise WireError("the other end went silent") from None
        except OSError as e:
            raise WireError(f"the connection failed ({e.strerror or e})") from None
        if k == 0:
            raise WireError("the other end closed the connection")
        got += k


def shown(raw: bytes) -> str:
    """The first bytes a peer sent, printable (what it spoke instead: an HTTP request, gRPC's preface)."""
    text = raw[:48].decode("ascii", "backslashreplace")
    return "".join(c if c.isprintable() else "." for c in text)


class Channel:
    """One authenticated connection (see the module's docstring)."""

    def __init__(self, sock: socket.socket, session: bytes, client: bool, peer: str) -> None:
        self.sock, self.session, self.peer = sock, session, peer
        self._out, self._in = (b"c", b"s") if client else (b"s", b"c")
        self._sent = self._received = 0

    def send(self, kind: int, body: bytes | memoryview = b"") -> None:
        head = HEAD.pack(len(body), kind)
        tag = hmac.new(self.session, self._out + struct.pack(">Q", self._sent) + head, hashlib.sha256)
        tag.update(body)
        self._sent += 1
        try:
            self.sock.sendall(head)
            self.sock.sendall(body)
            self.sock.sendall(tag.digest())
        except OSError as e:
            raise WireError(f"the connection to {self.peer} failed ({e.strerror or e})") from None

    def recv(self, limit: int = MAX_CONTROL) -> tuple[int, bytes]:
        """The next frame's kind and body, checked; a body over ``limit`` bytes ends the connection unread."""
        head = recv_exactly(self.sock, HEAD.size)
        length, kind = HEAD.unpack(head)
        if length > limit:
            raise WireError(f"{self.peer} sent a frame of {length} bytes (at most {limit})")
        body = recv_exactly(self.sock, length)
        tag = recv_exactly(self.sock, TAG)
        want = _mac(self.session, self._in, struct.pack(">Q", self._received), head, body)
        if not hmac.compare_digest(tag, want):
            raise WireError(f"a frame from {self.peer} failed its check")
        self._received += 1
        return kind, body

    def recv_into(self, kind: int, into: memoryview) -> int:
        """The next frame, of kind ``kind``, its body read straight into the front of ``into`` (a tensor's
        bytes: no copy); its length. A frame longer than ``into``, of another kind, or that fails its
        check ends the connection (what was written into ``into`` then is never used: the caller fails)."""
        head = recv_exactly(self.sock, HEAD.size)
        length, got = HEAD.unpack(head)
        if got != kind or not 0 < length <= len(into):
            raise WireError(f"{self.peer} sent a frame of kind {got} and {length} bytes where {len(into)} "
                            f"bytes of kind {kind} were due")
        _fill(self.sock, into[:length])
        want = hmac.new(self.session, self._in + struct.pack(">Q", self._received) + head, hashlib.sha256)
        want.update(into[:length])
        if not hmac.compare_digest(recv_exactly(self.sock, TAG), want.digest()):
            raise WireError(f"a frame from {self.peer} failed its check")
        self._received += 1
        return length

    def send_json(self, kind: int, message: dict[str, Any]) -> None:
        self.send(kind, json.dumps(message, separators=(",", ":")).encode())

    def recv_json(self, want: int) -> dict[str, Any]:
        """The next frame, a JSON object of kind ``want`` (an ERROR frame raises its reason)."""
        kind, body = self.recv()
        if kind == ERROR:
            raise WireError(body.decode("utf-8", "replace")[:MAX_REASON])
        try:
            message = json.loads(body)
        except (ValueError, RecursionError):
            message = None
        if kind != want or not isinstance(message, dict):
            raise WireError(f"{self.peer} answered with a malformed message (kind {kind})")
        return message

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass


def connect(host: str, port: int, key: bytes, role: bytes, timeout: float) -> Channel:
    """A channel to the ``role`` server at ``host:port``, which must prove it holds ``key``."""
    peer = endpoint(host, port)
    try:
        sock = socket.create_connection((host, port), timeout=timeout)
    except OSError as e:
        raise WireError(f"cannot connect to {peer} ({e.strerror or e})") from None
    try:
        _no_delay(sock)
        nc = secrets.token_bytes(NONCE)
        sock.sendall(MAGIC + role + nc)
        answer = recv_exactly(sock, NONCE + TAG)
        ns, proof = answer[:NONCE], answer[NONCE:]
        if not hmac.compare_digest(proof, _mac(key, b"server", role, nc, ns)):
            raise Refused(f"{peer} does not hold the job's secret: it is no server of this job")
        sock.sendall(_mac(key, b"client", role, nc, ns))
    except OSError as e:
        sock.close()
        if isinstance(e, WireError):
            raise
        raise WireError(f"the connection to {peer} failed ({e.strerror or e})") from None
    return Channel(sock, _mac(key, b"session", role, nc, ns), client=True, peer=peer)


def accept(sock: socket.socket, key: bytes, role: bytes, timeout: float) -> Channel:
    """The server's end of the handshake on an accepted ``sock``; Refused (its reason names what the peer
    sent) unless the peer proves it holds ``key``."""
    peer = _peer(sock)
    sock.settimeout(timeout)
    hello = _hello(sock, len(MAGIC) + 1 + NONCE)
    if len(hello) < len(MAGIC) + 1 + NONCE or not hello.startswith(MAGIC):
        if hello and not MAGIC.startswith(hello[:len(MAGIC)]):
            hello += _some(sock)
            raise Refused(f"it did not speak eksft's protocol (it sent {shown(hello)!r})")
        raise Refused("it sent too little of eksft's protocol and went silent or hung up")
    if hello[len(MAGIC):len(MAGIC) + 1] != role:
        raise Refused("it asked for another service")
    nc, ns = hello[len(MAGIC) + 1:], secrets.token_bytes(NONCE)
    try:
        sock.sendall(ns + _mac(key, b"server", role, nc, ns))
        proof = recv_exactly(sock, TAG)
    except OSError:
        raise Refused("it did not prove it holds the job's secret (it hung up)") from None
    if not hmac.compare_digest(proof, _mac(key, b"client", role, nc, ns)):
        raise Refused("it did not prove it holds the job's secret")
    _no_delay(sock)
    return Channel(sock, _mac(key, b"session", role, nc, ns), client=False, peer=peer)


def _hello(sock: socket.socket, n: int) -> bytes:
    """Up to ``n`` bytes of a peer's first message: fewer if it closes, goes silent, or strays from
    :data:`MAGIC` (then at once: an HTTP or gRPC client waits for an answer)."""
    got = b""
    while len(got) < n:
        try:
            more = sock.recv(n - len(got))
        except OSError:
            return got
        if not more:
            return got
        got += more
        if not MAGIC.startswith(got[:len(MAGIC)]):
            return got
    return got


def _peer(sock: socket.socket) -> str:
    try:
        address = sock.getpeername()
    except OSError:
        return "?"
    return endpoint(address[0], address[1]) if isinstance(address, tuple) else "a local socket"


def _no_delay(sock: socket.socket) -> None:
    """Frames go out as they are sent (a TCP socket's option; nothing on another kind)."""
    if sock.family in (socket.AF_INET, socket.AF_INET6):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def _some(sock: socket.socket) -> bytes:
    """What else a peer that strayed from the protocol has sent already (for the report)."""
    try:
        return sock.recv(48, socket.MSG_DONTWAIT)
    except OSError:
        return b""


Handler = Callable[[Channel], None]
Refusal = Callable[[str, str], None]   # (peer, reason)


class Server:
    """A listening socket whose connections, once a peer proved the key, each get a thread running
    ``handler``; a peer that did not is closed and reported to ``refused`` (peer, reason)."""

    def __init__(self, listener: socket.socket, key: bytes, role: bytes, handler: Handler,
                 refused: Refusal, timeout: float) -> None:
        self.listener, self.key, self.role = listener, key, role
        self.handler, self.refused, self.timeout = handler, refused, timeout
        self._slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        self._closed = threading.Event()
        self.thread = threading.Thread(target=self._accept, daemon=True, name=f"eksft-wire-{role.decode()}")
        self.thread.start()

    @property
    def port(self) -> int:
        return self.listener.getsockname()[1]

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                sock, _ = self.listener.accept()
            except OSError:
                if self._closed.is_set():
                    return
                continue
            if not self._slots.acquire(blocking=False):   # handshakes in progress: a flood is not served
                sock.close()
                continue
            threading.Thread(target=self._serve, args=(sock,), daemon=True).start()

    def _serve(self, sock: socket.socket) -> None:
        try:
            try:
                channel = accept(sock, self.key, self.role, self.timeout)
            finally:
                self._slots.release()
        except Refused as e:
            self.refused(_peer(sock), str(e))
            sock.close()
            return
        try:
            self.handler(channel)
        except WireError:
            pass   # the client went away or broke the protocol mid-call: its call failed, not the server
        finally:
            sock.close()

    def close(self) -> None:
        self._closed.set()
        try:
            self.listener.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.listener.close()
