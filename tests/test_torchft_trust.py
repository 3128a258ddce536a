"""A torchft job's servers answer only its own processes (issue 34), without a job: the sealed checkpoint
transport serves and fetches the state only between holders of the job's secret, as data (never a pickle),
and torchft's own HTTP client gets nothing from it; a quorum with a member that is not one of the job's
groups is refused and its step thrown away, and the job takes the next quorum without it; the quorum
results are torchft's own (checked against its Rust server); the secret is refused when others could have
written or read it; and the transport's and the channel's parsers, fuzzed, refuse what they do not know in
one line. The job-level attacks (a forged torchft peer against a running job) are test_torchft_attacks.py's.
"""

from __future__ import annotations

import datetime
import json
import os
import socket
import stat
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytest.importorskip("torchft")

from eksft_nb import commands, loopback  # noqa: E402
from eksft_nb.engines.torchft import checks, codec, listen, secret, wire  # noqa: E402
from eksft_nb.engines.torchft.alarm import Alarm  # noqa: E402
from eksft_nb.engines.torchft.coordination import QuorumRefused, compute, seal, strangers  # noqa: E402
from eksft_nb.engines.torchft.gateway import Gateway  # noqa: E402
from eksft_nb.engines.torchft.outcome import outcome  # noqa: E402
from eksft_nb.engines.torchft.transport import SealedTransport  # noqa: E402
from eksft_nb.errors import ControlError, JobError, SpecError  # noqa: E402
from eksft_nb.jobdir import JobDir  # noqa: E402
from eksft_nb.monitor import JobMonitor  # noqa: E402
from eksft_nb.events import make  # noqa: E402
from eksft_nb.spec import JobSpec  # noqa: E402

KEY, OTHER = bytes(range(32)), bytes(32)
T = datetime.timedelta(seconds=5)


def state() -> dict[str, Any]:
    model = {"w": torch.randn(5, 3), "b": torch.zeros(3, dtype=torch.bfloat16)}
    optim = {"state": {0: {"step": torch.tensor(4.0)}},
             "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.95), "params": [0]}]}
    return {"user": {"default": {"model": model, "optim": optim}},
            "torchft": {"step": 5, "batches_committed": 10}}


# ---- the sealed transport -------------------------------------------------------------------------------

def test_a_healing_peer_is_served_the_state_only_by_and_for_the_jobs_processes() -> None:
    refused: list[tuple[str, str]] = []
    source = SealedTransport(KEY, "127.0.0.1", datetime.timedelta(seconds=1),
                             lambda peer, reason: refused.append((peer, reason)))
    healer = SealedTransport(KEY, "127.0.0.1", T, lambda p, r: None)
    sent = state()
    source.send_checkpoint([1], 5, sent, T)
    try:
        got = healer.recv_checkpoint(0, source.metadata(), 5, T)
        mine, theirs = got["user"]["default"], sent["user"]["default"]
        assert torch.equal(mine["model"]["w"], theirs["model"]["w"])
        assert mine["model"]["b"].dtype == torch.bfloat16
        assert mine["optim"]["param_groups"] == theirs["optim"]["param_groups"]
        assert mine["optim"]["state"] == {0: {"step": torch.tensor(4.0)}}
        assert got["torchft"] == {"step": 5, "batches_committed": 10}
        # a thief without the job's secret: refused before a byte of the state, and reported
        thief = SealedTransport(OTHER, "127.0.0.1", T, lambda p, r: None)
        with pytest.raises(wire.Refused, match="does not hold the job's secret"):
            thief.recv_checkpoint(0, source.metadata(), 5, T)
        # torchft's own fetch (HTTP, then an unpickling load): no answer at all
        from torchft.checkpointing.http_transport import HTTPTransport

        port = source.metadata().rsplit(":", 1)[1]
        with pytest.raises(OSError):   # the connection closed unanswered
            HTTPTransport._load_from_address(f"http://127.0.0.1:{port}/checkpoint/5/full", T)
        deadline = time.monotonic() + 10
        while len(refused) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        reasons = sorted(r for _, r in refused)
        assert len(reasons) == 2, refused
        assert reasons[0].startswith("it did not prove it holds the job's secret"), refused
        spoke = "it did not speak eksft's protocol (it sent 'GET /checkpoint/5/full"
        assert reasons[1].startswith(spoke), refused
        # a forged server a healer is pointed at: refused before the healer asks, nothing read
        forged = SealedTransport(OTHER, "127.0.0.1", T, lambda p, r: None)
        forged.send_checkpoint([0], 5, {"user": {"default": {"w": torch.ones(2)}}}, T)
        with pytest.raises(wire.Refused, match="no server of this job"):
            healer.recv_checkpoint(0, forged.metadata(), 5, T)
        # an address a peer could give: never a name to resolve, never another scheme
        for address in ("sealed://attacker.example:80", "http://127.0.0.1:80/checkpoint/", "sealed://::1:80"):
            with pytest.raises(ValueError):
                healer.recv_checkpoint(0, address, 5, T)
        # once torchft disallowed serving (its optimizer changes the state next), nothing is served
        source.disallow_checkpoint()
        with pytest.raises(wire.WireError, match="serves nothing, not step 5"):
            healer.recv_checkpoint(0, source.metadata(), 5, T)
        # what the transport does not carry is refused when it is sent, naming it
        with pytest.raises(codec.CodecError, match="socket.socket"):
            source.send_checkpoint([1], 6, {"x": socket.socket()}, T)
    finally:
        source.shutdown()
        healer.shutdown()


# ---- quorum membership ---------------------------------------------------------------------------------

def member(group: int, step: int = 3, key: bytes = KEY, replica: str | None = None) -> dict[str, Any]:
    said = {"replica_id": replica or f"group{group}:u", "address": f"http://127.0.0.1:{4000 + group}",
            "store_address": f"127.0.0.1:{5000 + group}", "step": step, "world_size": 1, "shrink_only": False}
    return seal(key, said, group, 0)


def test_a_member_that_is_not_one_of_the_jobs_groups_is_a_stranger() -> None:
    ours = [member(0), member(1)]
    assert strangers(KEY, ours, 2) == []
    cases = [
        ("it carries no proof", {**member(1), "data": {}}),
        ("does not check out", member(1, key=OTHER)),   # another job's, or a forger's
        ("does not check out", {**member(1), "step": 1000}),   # a genuine record with its step changed
        ("claims group 2, and the job has 2", member(2)),
        ("another member claims group 1 too", member(1, replica="group1:v")),
    ]
    for why, stranger in cases:
        found = strangers(KEY, [member(1), stranger] if "another" in why else [member(0), stranger], 2)
        assert len(found) == 1 and found[0][0] is stranger and why in found[0][1], (why, found)


def test_the_quorum_results_are_torchfts_own() -> None:
    """:func:`compute` answers what torchft's ManagerServer (Rust) answers, rank by rank: a group behind
    heals from one at the max step, the quorum's store is the primary's, and at step 0 every group heals
    from the primary (init_sync)."""
    from torchft._torchft import LighthouseServer, ManagerClient, ManagerServer

    lighthouse = LighthouseServer(bind="127.0.0.1:0", min_replicas=3, join_timeout_ms=5000, quorum_tick_ms=20,
                                  heartbeat_timeout_ms=5000)
    address = f"http://127.0.0.1:{lighthouse.address().rsplit(':', 1)[1]}"
    servers = [ManagerServer(replica_id=f"r{i}", lighthouse_addr=address, hostname="127.0.0.1",
                             bind="127.0.0.1:0", store_addr=f"127.0.0.1:{7000 + i}", world_size=2,
                             heartbeat_interval=datetime.timedelta(milliseconds=100), connect_timeout=T,
                             quorum_retries=0) for i in range(3)]
    try:
        for steps in ([7, 5, 7], [0, 0, 0]):
            theirs: dict[tuple[int, int], Any] = {}

            def ask(i: int, rank: int, steps: list[int] = steps, theirs: dict = theirs) -> None:
                theirs[i, rank] = ManagerClient(servers[i].address(), T)._quorum(
                    group_rank=rank, step=steps[i], checkpoint_metadata="", shrink_only=False,
                    timeout=datetime.timedelta(seconds=20), commit_failures=i, init_sync=True)

            threads = [threading.Thread(target=ask, args=(i, r)) for i in range(3) for r in range(2)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(60)
            assert len(theirs) == 6, theirs
            participants = [{"replica_id": f"r{i}", "address": servers[i].address(), "step": steps[i],
                             "store_address": f"127.0.0.1:{7000 + i}", "data": {"commit_failures": i}}
                            for i in range(3)]
            for (i, rank), result in theirs.items():
                ours = compute(f"r{i}", rank, result.quorum_id, participants, init_sync=True)
                for name in ("quorum_id", "replica_rank", "replica_world_size", "recover_src_manager_address",
                             "recover_src_replica_rank", "recover_dst_replica_ranks", "store_address",
                             "max_step", "max_replica_rank", "max_world_size", "heal",
                             "replica_ids"):
                    assert getattr(ours, name) == getattr(result, name), (steps, i, rank, name)
    finally:
        for s in servers:
            s.shutdown()
        lighthouse.shutdown()


def test_a_quorum_with_a_stranger_throws_its_step_away_and_the_next_quorum_without_it_commits(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A group (torchft's own Manager, with what :func:`listen.install` puts in place) behind its gateway;
    a stranger joins the Lighthouse from inside its network (where only the gateway can reach it) claiming
    group 1 with no proof. The group's quorum is refused and reported, its step not committed; once the
    stranger is gone, the group commits again."""
    from torch.distributed import TCPStore
    from torchft import ProcessGroupGloo
    from torchft import checkpointing, manager as ft
    from torchft._torchft import LighthouseClient, LighthouseServer
    from torchft.checkpointing import http_transport

    for owner, name in ((ft, "ManagerServer"), (ft, "ManagerClient"), (ft, "HTTPTransport"),
                        (checkpointing, "HTTPTransport"), (http_transport, "HTTPTransport"),
                        (ft.Manager, "__init__"), (ft.Manager, "_async_quorum")):
        monkeypatch.setattr(owner, name, getattr(owner, name))   # undone after the test
    monkeypatch.setattr(ft.Manager, listen.MARK, None, raising=False)
    key_file = tmp_path / "secret"
    key_file.write_text(KEY.hex())
    key_file.chmod(0o600)
    for k, v in {secret.ENV: str(key_file), "REPLICA_GROUP_ID": "0", "NUM_REPLICA_GROUPS": "2"}.items():
        monkeypatch.setenv(k, v)
    lighthouse = LighthouseServer(bind="127.0.0.1:0", min_replicas=1, join_timeout_ms=200, quorum_tick_ms=20,
                                  heartbeat_timeout_ms=600)
    inner = f"http://127.0.0.1:{lighthouse.address().rsplit(':', 1)[1]}"
    gateway = Gateway(loopback.listener("127.0.0.1", 0), KEY, inner, Alarm(None))
    events: list[dict[str, Any]] = []
    listen.install(Alarm(lambda kind, **data: events.append({"kind": kind, **data})), host="127.0.0.1")
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    weights = torch.zeros(2)
    manager = ft.Manager(pg=ProcessGroupGloo(timeout=T), min_replica_size=1, load_state_dict=lambda s: None,
                         state_dict=lambda: {"w": weights}, use_async_quorum=False, replica_id="group0",
                         rank=0, world_size=1, store_addr="127.0.0.1", store_port=store.port,
                         lighthouse_addr=f"http://127.0.0.1:{gateway.server.port}", timeout=T,
                         quorum_timeout=T, connect_timeout=T)
    stop = threading.Event()

    def stranger() -> None:
        client = LighthouseClient(inner, T)
        while not stop.is_set():
            client.heartbeat("group1:evil")
            try:
                client.quorum(replica_id="group1:evil", timeout=datetime.timedelta(seconds=1),
                              address="http://127.0.0.1:1", store_address="127.0.0.1:1", step=1000,
                              world_size=1, shrink_only=False, data={"group": 1})
            except Exception:
                pass

    intruder = threading.Thread(target=stranger, daemon=True)
    intruder.start()
    try:
        time.sleep(0.3)   # it heartbeats: the next quorum waits for it
        manager.start_quorum()
        assert isinstance(manager.errored().original_exception, QuorumRefused), manager.errored()
        assert "group1:evil" in str(manager.errored().original_exception)
        assert manager.should_commit() is False and manager.current_step() == 0
        [report] = [e for e in events if e["kind"] == "intruder"]
        assert (report["where"], report["claimed"], report["peer"]) == ("quorum", "group1:evil", "http://127.0.0.1:1")
        assert "no proof" in report["reason"], report
        stop.set()
        intruder.join(10)
        time.sleep(0.8)   # its heartbeats expired
        manager.start_quorum()
        assert manager.errored() is None and manager.should_commit() is True and manager.current_step() == 1
    finally:
        stop.set()
        manager.shutdown(wait=False)
        gateway.server.close()
        lighthouse.shutdown()


# ---- the secret ------------------------------------------------------------------------------------------

def test_the_jobs_secret_is_made_once_private_and_refused_when_others_could_touch_it(tmp_path: Path) -> None:
    where = tmp_path / "torchft" / "secret"
    keys = []
    threads = [threading.Thread(target=lambda: keys.append(secret.ensure(where))) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(keys)) == 1 and len(keys[0]) == secret.BYTES and not list(where.parent.glob(".secret*"))
    assert stat.S_IMODE(where.stat().st_mode) == 0o600 and stat.S_IMODE(where.parent.stat().st_mode) == 0o700
    for mode, words in ((0o640, "is shared with other users"), (0o604, "is shared with other users")):
        where.chmod(mode)
        with pytest.raises(JobError, match=words):
            secret.load(where)
    where.chmod(0o600)
    if os.geteuid() == 0:   # another owner
        os.chown(where, 65534, 65534)
        with pytest.raises(JobError, match="owner 65534"):
            secret.load(where)
        os.chown(where, 0, 0)
    where.write_text("not hex")
    with pytest.raises(JobError, match="64 hex digits"):
        secret.load(where)
    where.write_text(KEY.hex())
    where.chmod(0o440)   # a Secret's mount: its pod's group may read it, nothing more
    assert secret.load(where, mounted=True) == KEY
    for mode in (0o460, 0o444):
        where.chmod(mode)
        with pytest.raises(JobError, match="is shared with other users"):
            secret.load(where, mounted=True)
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo, 0o600)
    with pytest.raises(JobError, match="not a regular file"):
        secret.load(fifo)
    with pytest.raises(JobError, match="cannot be read"):
        secret.load(tmp_path / "missing")


# ---- where the Lighthouse cannot be private -----------------------------------------------------------

def test_a_local_torchft_job_is_refused_where_its_lighthouse_cannot_have_a_network_of_its_own(
        monkeypatch: pytest.MonkeyPatch) -> None:
    assert checks.private() is None   # this machine allows it: the probe's own answer
    reason = "cannot make a private network namespace for torchft's Lighthouse (not permitted here)"
    monkeypatch.setattr(checks, "private", lambda: reason)
    spec = JobSpec(name="tft-netns", engine="torchft", nnodes=2, steps=3)
    with pytest.raises(SpecError) as refused:
        commands.prepare(spec)
    said = str(refused.value)
    assert reason in said and "unprivileged user namespaces" in said and "\n" not in said, said
    commands.prepare(spec, launching=False)   # a dry run shows what would run


# ---- live settings ---------------------------------------------------------------------------------------

def test_live_settings_are_refused_for_a_torchft_job_in_one_line() -> None:
    """Its replica groups read the checkpoint settings once: a change is refused, never answered "queued"
    (CLI, REST and the dashboard go through the command layer; whatif --apply too, before its work)."""
    spec = JobSpec(name="tft-live", engine="torchft", nnodes=2, steps=3)
    JobDir.for_name(spec.name).create(spec)
    for change in (lambda: commands.set_settings(spec.name, ["ckpt-every=5"]),
                   lambda: commands.apply_whatif(spec.name)):
        with pytest.raises(ControlError) as refused:
            change()
        assert "take no live settings" in str(refused.value) and "\n" not in str(refused.value)
    assert not (JobDir.for_name(spec.name).path / "control" / "settings.json").exists()


# ---- a job's end -----------------------------------------------------------------------------------------

def test_a_job_whose_groups_all_raised_after_the_last_step_does_not_succeed() -> None:
    spec = JobSpec(name="tft-end", engine="torchft", nnodes=2, steps=3)
    mon = JobMonitor()
    mon.update([make("step", "tft-end", 0, step=s, loss=1.0, tokens=1, step_time=0.1) for s in (1, 2, 3)])
    mon.update([make("rank_error", "tft-end", r, error="RuntimeError: quorum failed", step=None,
                     origin="exception") for r in (0, 1)])
    state, reason = outcome(spec, mon)
    assert state.value == "failed" and "no replica group reported its final weights" in reason, reason
    mon.update([make("rank_end", "tft-end", 1, final_step=3, digest="abc")])
    assert outcome(spec, mon)[0].value == "succeeded"


# ---- the parsers, fuzzed ---------------------------------------------------------------------------------

JSONISH = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=3), inner, max_size=4),
    max_leaves=25)
FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@FUZZ
@given(st.one_of(st.binary(max_size=300), JSONISH.map(lambda v: json.dumps(v).encode()), JSONISH.map(
    lambda v: json.dumps({"v": 1, "tree": v, "tensors": [["float32", [2]]]}).encode())))
def test_a_header_is_a_state_this_module_wrote_or_refused_in_one_line(raw: bytes) -> None:
    try:
        tree, specs = codec.decode_header(raw)
    except codec.CodecError as e:
        assert "\n" not in str(e)
        return
    built = codec.build(tree, [codec.empty(s)[0] for s in specs])
    assert codec.flatten(built)[0] is not None or built is None


STATES = st.recursive(
    st.none() | st.booleans() | st.integers(-2**63, 2**63) | st.floats() | st.text(max_size=6)
    | st.builds(lambda n, d: (torch.arange(n) % 3).to(d), st.integers(0, 5),
                st.sampled_from([torch.float32, torch.int64, torch.bfloat16, torch.bool, torch.float16])),
    lambda inner: st.lists(inner, max_size=3) | st.tuples(inner, inner)
    | st.dictionaries(st.one_of(st.text(max_size=3), st.integers(0, 9)), inner, max_size=3),
    max_leaves=12)


def same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, float) and a != a:
        return isinstance(b, float) and b != b
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return type(b) is dict and list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    return type(a) is type(b) and a == b


@FUZZ
@given(STATES)
def test_a_state_arrives_as_it_was_sent(sent: Any) -> None:
    tree, tensors = codec.flatten(sent)
    tree2, specs = codec.decode_header(codec.encode_header(tree, tensors))
    data = b"".join(bytes(c) for c in codec.chunks(tensors, 5))
    received, at = [], 0
    for spec in specs:
        tensor, into = codec.empty(spec)
        into[:] = data[at:at + spec.nbytes]
        at += spec.nbytes
        received.append(tensor)
    assert at == len(data) and same(sent, codec.build(tree2, received))


def channel_pair() -> tuple[wire.Channel, socket.socket]:
    """A server's channel, its handshake done with a genuine client, and the client's raw socket."""
    server_sock, client_sock = socket.socketpair()
    client_sock.settimeout(10)
    made: list[wire.Channel] = []
    thread = threading.Thread(target=lambda: made.append(wire.accept(server_sock, KEY, b"C", 5)))
    thread.start()
    nc = os.urandom(wire.NONCE)
    client_sock.sendall(wire.MAGIC + b"C" + nc)
    answer = wire.recv_exactly(client_sock, wire.NONCE + wire.TAG)
    client_sock.sendall(wire._mac(KEY, b"client", b"C", nc, answer[:wire.NONCE]))
    thread.join(10)
    return made[0], client_sock


@FUZZ
@given(st.binary(max_size=200), st.booleans())
def test_a_frame_that_was_not_made_with_the_session_is_refused(raw: bytes, into: bool) -> None:
    channel, client = channel_pair()
    try:
        client.sendall(raw)
        client.shutdown(socket.SHUT_WR)
        with pytest.raises(wire.WireError):   # a control frame, or a tensor's bytes read in place
            channel.recv_into(3, memoryview(bytearray(64))) if into else channel.recv()
    finally:
        client.close()
        channel.close()


@FUZZ
@given(st.binary(max_size=120))
def test_a_stranger_is_refused_whatever_it_sends(raw: bytes) -> None:
    server_sock, client_sock = socket.socketpair()
    try:
        client_sock.sendall(raw)
        client_sock.shutdown(socket.SHUT_WR)
        with pytest.raises(wire.Refused) as refused:
            wire.accept(server_sock, KEY, b"C", 2)
        assert "\n" not in str(refused.value)
    finally:
        server_sock.close()
        client_sock.close()
