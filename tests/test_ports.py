"""A local job listens on loopback only: every process of a running job (supervisor, launchers, zygotes,
ranks, spares), through in-process and in-job restarts; and its rendezvous port cannot be reached
through this machine's other addresses (whoever could write to that store runs code in the launcher:
NVRx's rendezvous unpickles what it reads there)."""

from __future__ import annotations

import ipaddress
import json
import re
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import pytest

from eksft_nb import loopback, procs
from eksft_nb.jobdir import JobDir
import nvrx_releases as releases
from jobs import BASE, story, wait_for


def is_loopback(ip: str) -> bool:
    return ipaddress.ip_address(ip.split("%")[0]).is_loopback


@dataclass
class Listeners:
    """The listening sockets of a job's processes, sampled until it ends: (ip, port) -> who."""

    uid: str
    seen: dict[tuple[str, int], str] = field(default_factory=dict)
    launchers: list[str] = field(default_factory=list)   # their command lines
    halt: threading.Event = field(default_factory=threading.Event)
    sampler: threading.Thread | None = None

    def sample(self) -> None:
        for p in procs.marked(self.uid):
            try:
                cmdline = " ".join(p.cmdline())
                listening = [c.laddr for c in p.net_connections(kind="inet") if c.status
                             == psutil.CONN_LISTEN]
            except psutil.Error:   # ended meanwhile
                continue
            if "--rdzv-endpoint=" in cmdline and cmdline not in self.launchers:
                self.launchers.append(cmdline)
            for addr in listening:
                self.seen.setdefault((addr.ip, addr.port), f"pid {p.pid}: {cmdline[:150]}")

    def start(self) -> None:
        self.sampler = threading.Thread(target=self._run, daemon=True)
        self.sampler.start()

    def stop(self) -> None:
        self.halt.set()
        self.sampler.join()

    def _run(self) -> None:
        while not self.halt.wait(0.2):
            self.sample()

    def listening(self, port: int | None) -> int | None:
        """``port``, once a process of the job was seen listening on it."""
        return port if port is not None and port in {p for _, p in list(self.seen)} else None

    def rendezvous_port(self) -> int | None:
        ports = {
            int(m.group(1)) for line in list(self.launchers) if (
                m := re.search(r"--rdzv-endpoint=\S+:(\d+)", line))}
        return ports.pop() if len(ports) == 1 else None


SCRIPTS = Path(__file__).resolve().parent / "scripts"
RUNS = {
    # the built-in trainer: rank 0 hosts its process group's store and inprocess.Wrapper's
    "trainer": [*BASE, "--steps", "60", "--inprocess", "--fault", "exception:1@15", "--fault",
                "sigkill:0@35"],
    # a user's script with its own Wrapper and its own TCPStore from MASTER_ADDR/MASTER_PORT
    "script": ["--script", str(SCRIPTS / "wrapped.py"), "--script-args", "60 0.1", "--no-inprocess",
               "--heartbeat-timeout", "20", "--fault", "exception:1@15", "--fault", "sigkill:0@35"],
}


# (what runs, the NVRx release, hot spares): with a spare the supervisor (NVRx 0.4) or the nvrx-control it
# starts (0.6+) hosts the rendezvous store, without one the first launcher does
@pytest.fixture(scope="module", params=[("trainer", "installed", 1), ("trainer", releases.NEWEST, 1),
                                        ("script", "installed", 1)],
                ids=lambda p: f"{p[0]}-nvrx-{p[1]}-spares-{p[2]}")
def job(request: pytest.FixtureRequest) -> Iterator[tuple[subprocess.Popen, Listeners]]:
    """A running job with warm ranks, which will go through an in-process restart (an exception) and an
    in-job one (a rank killed), its listeners sampled until it ends."""
    what, release, spares = request.param
    env = releases.env(release)
    name = f"ports-{what}-{release.replace('.', '-')}"
    proc = subprocess.Popen([sys.executable, "-m", "eksft_nb", "run", "--name", name, *RUNS[what], "--nnodes",
                             "2",
                             "--nproc-per-node", "1", "--spare-nodes", str(spares), "--warm-ranks", "--json"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    jd = JobDir.for_name(name)
    uid = wait_for("the job's uid", lambda: proc.poll() is not None or jd.supervisor().get("job_uid"),
                   timeout=120)
    assert isinstance(uid, str), proc.communicate()
    listeners = Listeners(uid)
    listeners.start()
    yield proc, listeners
    listeners.stop()
    if proc.poll() is None:
        proc.kill()
    proc.communicate()


def outside_addresses() -> list[str]:
    """This machine's addresses other than loopback (link-local IPv6 left out: it needs a scope)."""
    found = []
    for addresses in psutil.net_if_addrs().values():
        for a in addresses:
            if a.family not in (socket.AF_INET, socket.AF_INET6) or is_loopback(a.address):
                continue
            if not ipaddress.ip_address(a.address.split("%")[0]).is_link_local:
                found.append(a.address)
    return found


@pytest.mark.slow
def test_the_rendezvous_port_is_refused_through_this_machines_other_addresses(job) -> None:
    proc, listeners = job
    outside = outside_addresses()
    if not outside:
        pytest.skip("this machine has no address but loopback to reach the port through")
    port = wait_for("the rendezvous store to listen",
                    lambda: proc.poll() is not None or listeners.listening(listeners.rendezvous_port()))
    assert isinstance(port, int) and not isinstance(port, bool), (listeners.launchers, listeners.seen)
    with socket.create_connection(("127.0.0.1", port), timeout=30):   # the store is there, on loopback
        pass
    for address in outside:
        family = socket.AF_INET6 if ":" in address else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.settimeout(30)
            with pytest.raises(ConnectionRefusedError):
                s.connect((address, port))


@pytest.mark.slow
def test_every_process_of_a_running_job_listens_on_loopback_only_through_its_restarts(job) -> None:
    proc, listeners = job
    out, err = proc.communicate(timeout=900)
    listeners.stop()
    assert out.strip(), f"no summary; stderr:\n{err[-3000:]}"
    summary = json.loads(out[out.index("{"):])
    assert summary["state"] == "succeeded", summary
    levels = [r["level"] for r in summary["restart_events"]]
    assert "inprocess" in levels and "injob" in levels, story(summary["name"])
    assert listeners.listening(listeners.rendezvous_port()), (listeners.launchers, listeners.seen)
    wide = {f"{ip}:{port}": who for (ip, port), who in listeners.seen.items() if not is_loopback(ip)}
    assert not wide, f"listening beyond loopback: {wide}"


STORE = """
import datetime, sys, psutil
from torch.distributed import TCPStore
from eksft_nb.loopback import install
host = sys.argv[1]
install()
install()   # twice changes nothing
store = TCPStore(host, 0, 1, True, datetime.timedelta(seconds=30), wait_for_workers=False)
client = TCPStore(host, store.port, 1, False, datetime.timedelta(seconds=30))
client.set("k", b"v")
assert store.get("k") == b"v"
print(*[c.laddr.ip for c in psutil.Process().net_connections(kind="inet")
        if c.status == psutil.CONN_LISTEN and c.laddr.port == store.port])
"""


@pytest.mark.parametrize("host", ["127.0.0.1", "::1", "localhost"])
def test_a_store_hosted_for_a_loopback_endpoint_listens_there_alone(host: str) -> None:
    """Any TCPStore a process of a local job hosts for a loopback endpoint (torch itself binds ``*``)."""
    from eksft_nb.loopback import listener, loopback_address

    try:
        listener(loopback_address(host), 0).close()
    except OSError as e:
        pytest.skip(f"cannot listen on {host} here: {e.strerror}")
    done = subprocess.run([sys.executable, "-c", STORE, host], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    listening = done.stdout.split()
    assert listening and all(is_loopback(ip) for ip in listening), listening


def test_the_ports_a_job_is_given_lie_below_the_ephemeral_range_free_and_distinct(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Ports handed to processes that bind them later: never where an outgoing connection may take them."""
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    for _ in range(20):
        ports = loopback.free_ports(6)
        run = loopback.free_ports(3, consecutive=True)
        assert len(set(ports)) == 6 and run == list(range(run[0], run[0] + 3)), (ports, run)
        assert all(loopback.PORTS_FROM <= p < low for p in ports + run), (ports, run, low)
    busy, free = loopback.free_ports(2, consecutive=True)

    class Picks:   # the port in use first, then the one after it
        def __init__(self) -> None:
            self.left = [busy, free]

        def randrange(self, *_: int) -> int:
            return self.left.pop(0)

        def sample(self, _: range, n: int) -> list[int]:
            return [self.left.pop(0) for _ in range(n)]

    monkeypatch.setattr(loopback.random, "SystemRandom", Picks)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", busy))
        taken.listen()
        assert loopback.free_ports(1) == [free]
