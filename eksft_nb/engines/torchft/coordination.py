"""A replica group's coordination service, in place of torchft's ``ManagerServer`` and ``ManagerClient``.

torchft's ManagerServer (one per group, in its rank 0) serves gRPC to whoever reaches its port: ``Kill``
ends the group, ``Quorum`` takes a stranger's step and checkpoint address as one of the group's ranks',
``ShouldCommit`` a stranger's vote, ``CheckpointMetadata`` says where the group's state is served. The
:class:`GroupServer` here is the same service, over :mod:`.wire` (only the job's processes reach it; there
is no kill), with torchft's semantics (:func:`compute`: the results its ``compute_quorum_results`` gives);
it heartbeats and asks for quorums through the Lighthouse's gateway (:mod:`.gateway`).

Membership: each group's request to the Lighthouse carries, in its member's ``data``, its group number
and an HMAC under the job's secret over everything the member says (replica id, addresses, step, world
size...). A quorum is taken only if every member's HMAC checks out and no two claim one group
(:func:`strangers`); else the group's ranks get :class:`QuorumRefused`: the step is thrown away (no heal
from it, no commit), and each stranger is reported. A member record replayed as it was (all its fields
under the HMAC) is one of the job's groups saying what it said, and every address in it is one of the job's
servers, which answer only the job (:mod:`.wire`).
"""

from __future__ import annotations

import datetime
import hashlib
import hmac
import ipaddress
import json
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from ... import loopback
from . import wire
from .alarm import Alarm
from .gateway import ANSWER as GATEWAY_ANSWER
from .gateway import HEARTBEAT, QUORUM as GATEWAY_QUORUM
from .hosts import endpoint

ROLE = b"M"
QUORUM, METADATA, COMMIT, ANSWER = 1, 2, 3, 4
REFUSED = "refused the quorum: "
KEEP_ROUNDS = 8   # outcomes kept for ranks still to read theirs
MARGIN_S = 5.0    # a call's socket waits this much longer than the call's own timeout


class QuorumRefused(RuntimeError):
    """The quorum had a member that is not one of the job's groups: this step is thrown away."""


@dataclass(frozen=True)
class Trust:
    """What a replica group's process speaks for its job with: the key, the address its servers listen on,
    its group number of ``groups``, where refusals are reported."""

    key: bytes
    host: str
    group: int
    groups: int
    alarm: Alarm


@dataclass
class QuorumResult:
    """What torchft's ``ManagerClient._quorum`` returns (the fields its Manager and eksft read)."""

    quorum_id: int
    replica_rank: int
    replica_world_size: int
    recover_src_manager_address: str
    recover_src_replica_rank: int | None
    recover_dst_replica_ranks: list[int]
    store_address: str
    max_step: int
    max_replica_rank: int | None
    max_world_size: int
    heal: bool
    commit_failures: int
    replica_ids: list[str] = field(default_factory=list)


# -- membership ------------------------------------------------------------------------------------------
SIGNED = ("replica_id", "address", "store_address", "step", "world_size", "shrink_only")


def seal(key: bytes, member: dict[str, Any], group: int, commit_failures: int) -> dict[str, Any]:
    """``member`` with its data: the group, its commit failures, and the HMAC over all of it."""
    data = {"group": group, "commit_failures": commit_failures}
    return {**member, "data": {**data, "mac": _member_mac(key, member, data)}}


def _member_mac(key: bytes, member: dict[str, Any], data: dict[str, Any]) -> str:
    said = json.dumps([member[k] for k in SIGNED] + [data["group"], data["commit_failures"]])
    return hmac.new(key, b"member" + said.encode(), hashlib.sha256).hexdigest()


def strangers(key: bytes, participants: list[dict[str, Any]],
              groups: int) -> list[tuple[dict[str, Any], str]]:
    """The quorum's members that are not this job's groups, and why (see the module's docstring)."""
    out, claimed = [], set()
    for p in participants:
        data = p.get("data") if isinstance(p.get("data"), dict) else {}
        group, failures, mac = data.get("group"), data.get("commit_failures"), data.get("mac")
        if type(group) is not int or type(failures) is not int or type(mac) is not str:
            out.append((p, "it carries no proof that it is one of the job's groups"))
        elif not hmac.compare_digest(mac, _member_mac(key, p, data)):
            out.append((p, "its proof does not check out under the job's secret"))
        elif not 0 <= group < groups:
            out.append((p, f"it claims group {group}, and the job has {groups}"))
        elif group in claimed:
            out.append((p, f"another member claims group {group} too"))
        else:
            claimed.add(group)
    return out


# -- torchft's quorum results ----------------------------------------------------------------------------
def compute(replica_id: str, group_rank: int, quorum_id: int, participants: list[dict[str, Any]],
            init_sync: bool) -> QuorumResult:
    """What torchft's ManagerServer answers rank ``group_rank`` of replica ``replica_id`` for a quorum
    (its ``compute_quorum_results``: who heals from whom, whose store the quorum's process group uses)."""
    members = sorted(participants, key=lambda p: p["replica_id"])
    ids = [p["replica_id"] for p in members]
    if replica_id not in ids:
        raise RuntimeError(f"replica {replica_id} not participating in returned quorum")
    replica_rank = ids.index(replica_id)
    max_step = max(p["step"] for p in members)
    at_max = [p for p in members if p["step"] == max_step]
    max_replica_rank = next((i for i, p in enumerate(at_max) if p["replica_id"] == replica_id), None)
    primary = at_max[group_rank % len(at_max)]
    force = init_sync and max_step == 0
    recovering = [i for i, p in enumerate(members)
                  if p["step"] != max_step or (force and p["replica_id"] != primary["replica_id"])]
    up_to_date = [i for i in range(len(members)) if i not in set(recovering)]
    assignments: dict[int, list[int]] = {}
    src: int | None = None
    for i, dst in enumerate(recovering):
        source = up_to_date[(i + group_rank) % len(up_to_date)]
        assignments.setdefault(source, []).append(dst)
        if dst == replica_rank:
            src = source
    failures = [p["data"].get("commit_failures", 0) for p in members if isinstance(p.get("data"), dict)]
    return QuorumResult(
        quorum_id=quorum_id, replica_rank=replica_rank, replica_world_size=len(members),
        recover_src_manager_address=members[src]["address"] if src is not None else "",
        recover_src_replica_rank=src, recover_dst_replica_ranks=assignments.get(replica_rank, []),
        store_address=primary["store_address"], max_step=max_step, max_replica_rank=max_replica_rank,
        max_world_size=len(at_max), heal=src is not None, commit_failures=max(failures, default=0),
        replica_ids=ids)


# -- the channels --------------------------------------------------------------------------------------
def parse_peer(address: str) -> tuple[str, int]:
    """A group server's address as a peer gave it (``http://IP:PORT``): never a name to resolve."""
    host, port = _split(address)
    return str(ipaddress.ip_address(host)), port


def _split(address: str) -> tuple[str, int]:
    if not isinstance(address, str) or not address.startswith("http://") or len(address) > 300:
        raise ValueError(f"{str(address)[:80]!r} is not an http://HOST:PORT address")
    host, sep, port = address[len("http://"):].rstrip("/").rpartition(":")
    if not sep or not port.isdigit() or not 0 < int(port) < 65536 or not host:
        raise ValueError(f"{address[:80]!r} has no port")
    return host.strip("[]"), int(port)


class Link:
    """Calls to one server, one at a time per channel; a channel is kept for the next call, and a call that
    failed gets a fresh one."""

    def __init__(self, host: str, port: int, key: bytes, role: bytes, connect_timeout: float) -> None:
        self.host, self.port, self.key, self.role = host, port, key, role
        self.connect_timeout = connect_timeout
        self._idle: list[wire.Channel] = []
        self._lock = threading.Lock()

    def call(self, kind: int, message: dict[str, Any], answer: int, timeout: float | None) -> dict[str, Any]:
        with self._lock:
            channel = self._idle.pop() if self._idle else None
        if channel is None:
            channel = wire.connect(self.host, self.port, self.key, self.role, self.connect_timeout)
        try:
            channel.sock.settimeout(None if timeout is None else timeout + MARGIN_S)
            channel.send_json(kind, message)
            reply = channel.recv_json(answer)
        except wire.WireError as e:
            channel.close()
            if str(e).startswith(REFUSED):
                raise QuorumRefused(str(e)) from None
            raise
        with self._lock:
            self._idle.append(channel)
        return reply

    def close(self) -> None:
        with self._lock:
            for channel in self._idle:
                channel.close()
            self._idle.clear()


class GroupClient:
    """torchft's ``ManagerClient``, for a group's server reached over :mod:`.wire` (``trust``: set on the
    class :func:`bound` makes)."""

    trust: Trust

    def __init__(self, addr: str, connect_timeout: datetime.timedelta) -> None:
        host, port = parse_peer(addr)
        self.link = Link(host, port, self.trust.key, ROLE, connect_timeout.total_seconds())

    def _quorum(self, group_rank: int, step: int, checkpoint_metadata: str, shrink_only: bool,
                timeout: datetime.timedelta, commit_failures: int, init_sync: bool = True) -> QuorumResult:
        request = {"group_rank": group_rank, "step": step, "metadata": checkpoint_metadata,
                   "shrink_only": shrink_only, "timeout": timeout.total_seconds(),
                   "commit_failures": commit_failures, "init_sync": init_sync}
        reply = self.link.call(QUORUM, request, ANSWER, timeout.total_seconds())
        return QuorumResult(**reply)

    def _checkpoint_metadata(self, rank: int, timeout: datetime.timedelta) -> str:
        return str(self.link.call(METADATA, {"rank": rank}, ANSWER, timeout.total_seconds())["metadata"])

    def should_commit(self, group_rank: int, step: int, should_commit: bool,
                      timeout: datetime.timedelta) -> bool:
        reply = self.link.call(COMMIT, {"group_rank": group_rank, "step": step, "vote": should_commit,
                                        "timeout": timeout.total_seconds()}, ANSWER, timeout.total_seconds())
        return reply["decision"] is True


class GroupServer:
    """torchft's ``ManagerServer`` (its constructor's arguments), over :mod:`.wire` (see the module's
    docstring; ``trust``: set on the class :func:`bound` makes)."""

    trust: Trust

    def __init__(self, replica_id: str, lighthouse_addr: str, hostname: str, bind: str, store_addr: str,
                 world_size: int, heartbeat_interval: datetime.timedelta, connect_timeout: datetime.timedelta,
                 quorum_retries: int = 0) -> None:
        trust = self.trust
        self.replica_id, self.store_addr, self.world_size = replica_id, store_addr, world_size
        self.retries = max(0, quorum_retries)
        host, port = _split(lighthouse_addr)   # the job's own setting (on EKS a Service's name)
        self._heartbeat_link = Link(host, port, trust.key, b"L", connect_timeout.total_seconds())
        self._quorum_link = Link(host, port, trust.key, b"L", connect_timeout.total_seconds())
        self._cond = threading.Condition()
        self._joined: dict[int, dict[str, Any]] = {}     # this round's quorum requests, by rank
        self._round = 0
        self._outcomes: dict[int, tuple[Any, str | None]] = {}   # round -> (quorum, why it failed)
        self._metadata: dict[int, str] = {}              # rank -> where its state is served
        self._votes: dict[int, bool] = {}
        self._vote_round = 0
        self._decisions: dict[int, bool] = {}
        self._stop = threading.Event()
        listener = loopback.listener(trust.host, int(bind.rsplit(":", 1)[1]))
        self.server = wire.Server(listener, trust.key, ROLE, self._serve, trust.alarm.reporter("manager"),
                                  timeout=10)
        self._address = f"http://{endpoint(trust.host, self.server.port)}"
        self._interval = heartbeat_interval.total_seconds()
        threading.Thread(target=self._heartbeats, daemon=True, name="eksft-heartbeat").start()

    def address(self) -> str:
        return self._address

    def shutdown(self) -> None:
        self._stop.set()
        self.server.close()
        self._heartbeat_link.close()
        self._quorum_link.close()

    def _heartbeats(self) -> None:
        while not self._stop.is_set():
            try:
                self._heartbeat_link.call(HEARTBEAT, {"replica_id": self.replica_id}, GATEWAY_ANSWER, 5.0)
            except (wire.WireError, QuorumRefused):
                pass   # the Lighthouse is away: the next beat tries again (torchft's server does the same)
            self._stop.wait(self._interval)

    # -- requests -------------------------------------------------------------------------------------------
    def _serve(self, channel: wire.Channel) -> None:
        while True:
            channel.sock.settimeout(None)
            kind, body = channel.recv()
            try:
                request = json.loads(body)
                if not isinstance(request, dict):
                    raise ValueError("not an object")
                if kind == QUORUM:
                    channel.send_json(ANSWER, vars(self._quorum(request)))
                elif kind == METADATA:
                    channel.send_json(ANSWER, {"metadata": self._checkpoint_metadata(request["rank"])})
                elif kind == COMMIT:
                    channel.send_json(ANSWER, {"decision": self._should_commit(request)})
                else:
                    channel.send(wire.ERROR, b"unknown request")
            except (ValueError, KeyError, TypeError, RuntimeError, TimeoutError) as e:
                channel.send(wire.ERROR, str(e)[:wire.MAX_REASON].encode())

    def _quorum(self, request: dict[str, Any]) -> QuorumResult:
        rank, timeout = int(request["group_rank"]), float(request["timeout"])
        with self._cond:
            self._metadata[rank] = str(request["metadata"])
            self._joined[rank] = request
            mine = self._round
            last = len(self._joined) >= self.world_size
            if last:   # every rank of the group asked: this round goes to the Lighthouse (closed to others)
                self._joined.clear()
                self._round += 1
        if last:
            try:
                outcome = self._ask_lighthouse(request, timeout)
            except Exception as e:   # still an outcome: the group's other ranks wait on it
                outcome = None, f"the group's quorum failed ({type(e).__name__}: {e})"
            with self._cond:
                self._outcomes[mine] = outcome
                for old in [r for r in self._outcomes if r <= mine - KEEP_ROUNDS]:
                    del self._outcomes[old]
                self._cond.notify_all()
        else:
            with self._cond:
                if not self._cond.wait_for(lambda: mine in self._outcomes, timeout):
                    raise TimeoutError(f"the group's quorum timed out after {timeout:.0f} s")
        quorum, failed = self._outcomes[mine]
        if failed is not None:
            raise RuntimeError(failed)
        return compute(self.replica_id, rank, quorum["quorum_id"], quorum["participants"],
                       bool(request.get("init_sync", True)))

    def _ask_lighthouse(self, request: dict[str, Any], timeout: float) -> tuple[Any, str | None]:
        """The Lighthouse's quorum for this group's member (torchft's retries), and the refusal if it has
        a stranger."""
        trust = self.trust
        member = seal(trust.key, {"replica_id": self.replica_id, "address": self._address,
                                  "store_address": self.store_addr, "step": int(request["step"]),
                                  "world_size": self.world_size, "shrink_only": bool(request["shrink_only"])},
                      trust.group, int(request["commit_failures"]))
        error = ""
        deadline = time.monotonic() + timeout
        for _ in range(self.retries + 1):
            left = max(1.0, deadline - time.monotonic())
            try:
                quorum = self._quorum_link.call(GATEWAY_QUORUM, {"member": member, "timeout": left},
                                                GATEWAY_ANSWER, left)
                break
            except wire.WireError as e:
                error = f"lighthouse quorum failed: {e}"
        else:
            return None, error
        found = strangers(trust.key, quorum["participants"], trust.groups)
        if not found:
            return quorum, None
        for p, why in found:
            trust.alarm.refused("quorum", str(p.get("address"))[:100], why, claimed=str(p.get("replica_id")))
        who = ", ".join(f"{str(p.get('replica_id'))[:60]} at {str(p.get('address'))[:60]} ({why})"
                        for p, why in found[:3])
        return None, (f"{REFUSED}quorum {quorum['quorum_id']} has members that are not this job's replica "
                      f"groups: {who}; the step is thrown away")

    def _checkpoint_metadata(self, rank: Any) -> str:
        with self._cond:
            if rank not in self._metadata:
                raise KeyError(f"rank {rank} has not served a checkpoint")
            return self._metadata[rank]

    def _should_commit(self, request: dict[str, Any]) -> bool:
        rank, timeout = int(request["group_rank"]), float(request["timeout"])
        with self._cond:
            self._votes[rank] = request["vote"] is True
            mine = self._vote_round
            if len(self._votes) >= self.world_size:   # one rank's failure throws the step away in every rank
                self._decisions[mine] = all(self._votes.values())
                self._votes.clear()
                self._vote_round += 1
                for old in [r for r in self._decisions if r <= mine - KEEP_ROUNDS]:
                    del self._decisions[old]
                self._cond.notify_all()
            elif not self._cond.wait_for(lambda: mine in self._decisions, timeout):
                raise TimeoutError(f"the group's commit vote timed out after {timeout:.0f} s")
            return self._decisions[mine]


def bound(cls: type, trust: Trust) -> type:
    """``cls`` (GroupServer, GroupClient) speaking with ``trust``."""
    return type(cls.__name__, (cls,), {"trust": trust})
