"""Forged torchft peers against a running local torchft job (issue 34), each built with torchft's own API in
a process of its own (forged_peer.py), as another user of the machine would run them, with the
Lighthouse's address read from the process list:

- one joins at the job's start with a replica id that sorts first (the primary every group would heal
  from at step 0);
- one joins at step 1000 serving a pickle that creates a file when it is loaded (code in every group);
- one joins behind the groups (it would be sent their whole state);
- the Lighthouse's status page and kill route are called for every replica id, and torchft's manager
  ``Kill`` RPC at every manager address the Lighthouse's quorum gave;
- a live settings change is asked for (a torchft job's groups do not take one).

None of it gets through: no code runs, nothing is served or stolen, no group is killed or heals, each
refusal is an ``intruder`` event naming what the peer did, the settings change is refused in one line,
and the job trains on to its last step with identical weights in both groups. One small job, paced
(2 s a step) until the attacks are done."""

from __future__ import annotations

import re
import socket
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from eksft_nb import commands
from eksft_nb.errors import ControlError, EksftError
from eksft_nb.jobdir import JobDir
from jobs import wait_for
from test_torchft import of, pace, torchft_spec, watched

pytest.importorskip("torchft")

STEPS = 30
PEER = Path(__file__).with_name("forged_peer.py")


def lighthouse_url(name: str) -> str | None:
    """The Lighthouse's address as the process list shows it (its process runs in the job's folder)."""
    folder = str(JobDir.for_name(name).path)
    for p in psutil.process_iter(["cmdline"]):
        try:
            line = " ".join(p.info["cmdline"] or [])
            if "--bind 127.0.0.1:" in line and p.cwd() == folder:
                return "http://" + re.search(r"--bind (\S+)", line).group(1)
        except psutil.Error:
            continue
    return None


def manager_addresses(name: str) -> set[tuple[str, int]]:
    """The groups' manager addresses the Lighthouse's log shows (its quorums' members)."""
    log = (JobDir.for_name(name).logs / "lighthouse.log").read_text(errors="replace")
    return {(host, int(port)) for host, port in re.findall(r'address: "http://([0-9.]+):([0-9]+)"', log)}


def http(method: str, url: str) -> str | None:
    """An HTTP request's answer, None if there was none."""
    try:
        with urllib.request.urlopen(urllib.request.Request(url, method=method), timeout=10) as answer:
            return answer.read().decode(errors="replace")
    except urllib.error.HTTPError as e:
        return e.read().decode(errors="replace")
    except OSError:
        return None


def grpc_kill(host: str, port: int) -> None:
    """torchft's ``ManagerService/Kill`` RPC over HTTP/2 (gRPC without TLS), by hand: a manager server of
    torchft's exits at once."""
    def frame(kind: int, flags: int, stream: int, payload: bytes) -> bytes:
        return len(payload).to_bytes(3, "big") + bytes([kind, flags]) + stream.to_bytes(4, "big") + payload

    fields = [(b":method", b"POST"), (b":scheme", b"http"), (b":path", b"/torchft.ManagerService/Kill"),
              (b":authority", f"{host}:{port}".encode()), (b"content-type", b"application/grpc"),
              (b"te", b"trailers")]
    headers = b"".join(b"\x00" + bytes([len(n)]) + n + bytes([len(v)]) + v for n, v in fields)
    message = b"\x0a\x04evil"   # KillRequest{msg: "evil"}
    body = b"\x00" + len(message).to_bytes(4, "big") + message
    request = (b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + frame(4, 0, 0, b"") + frame(1, 4, 1, headers)
               + frame(0, 1, 1, body))
    try:
        with socket.create_connection((host, port), timeout=5) as s:
            s.sendall(request)
            s.recv(64)
    except OSError:
        pass


def outcomes(log: Path) -> list[str]:
    """What a forged peer printed of its quorums (joined or refused)."""
    text = log.read_text(errors="replace") if log.exists() else ""
    return [ln for ln in text.splitlines() if ln.startswith(("joined", "refused"))]


@pytest.fixture(scope="module")
def attacked(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path, list]]:
    name, out = "tft-attacked", tmp_path_factory.mktemp("forged")
    commands.launch(torchft_spec(name, steps=STEPS), [pace(0, step=1)])
    peers: list[subprocess.Popen] = []

    def peer(mode: str) -> Path:
        log = out / f"{mode}.log"
        peers.append(subprocess.Popen([sys.executable, str(PEER), mode, url, str(out)], stdout=log.open("w"),
                                      stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL))
        return log

    refusals: list = []
    with watched(name):
        try:
            url = wait_for("the Lighthouse's address in the process list", lambda: lighthouse_url(name),
                           timeout=120, every=0.05)
            logs = [peer("first")]
            wait_for("the job's first step", lambda: of(name, "step") or of(name, "job_end"), timeout=300)
            logs += [peer("ahead"), peer("behind")]
            for replica in re.findall(r"/replica/([^/\"]+)/kill", http("GET", f"{url}/status") or "") or [
                    "group0", "group1"]:
                http("POST", f"{url}/replica/{replica}/kill")
            for host, port in manager_addresses(name):
                grpc_kill(host, port)
            for change in (lambda: commands.set_settings(name, ["ckpt-every=5"]),
                           lambda: commands.apply_whatif(name)):
                try:
                    refusals.append(change())
                except EksftError as e:
                    refusals.append(e)
            wait_for("every forged peer's first quorum", lambda: all(outcomes(log) for log in logs)
                     or of(name, "job_end"), timeout=300)
            def last() -> int:
                return max((e["step"] for e in of(name, "step")), default=0)

            at = last()
            wait_for("two more steps", lambda: last() >= min(at + 2, STEPS) or of(name, "job_end"),
                     timeout=120)
        finally:
            for p in peers:
                p.kill()
                p.wait()
        if not of(name, "job_end"):
            commands.inject_command(name, pace(0, delay=0.01, duration=1))   # at full speed to the end
        wait_for("the job to end", lambda: of(name, "job_end"), timeout=600)
    yield name, out, refusals


@pytest.mark.slow
def test_forged_peers_run_no_code_steal_nothing_kill_nothing_and_the_job_trains_on(attacked) -> None:
    name, out, refusals = attacked
    printed = {p.stem: outcomes(p) for p in out.glob("*.log")}
    # no code ran, nothing was served by the first joiner, nothing was sent to the peer behind
    assert not [p.name for p in out.iterdir() if p.suffix != ".log"], (sorted(out.iterdir()), printed)
    assert not any(line.startswith("joined") for lines in printed.values() for line in lines), printed
    # no group was killed, none healed from anyone, and the job trained on to identical weights
    assert not of(name, "failure") and not of(name, "restart") and not of(name, "heal"), of(name, "failure")
    end = of(name, "job_end")[0]
    assert end["state"] == "succeeded" and end["final_step"] == STEPS, end.data
    digests = {e["replica_group"]: e["digest"] for e in of(name, "rank_end")}
    assert set(digests) == {0, 1} and len(set(digests.values())) == 1, digests
    # each refusal said, naming what the peer did
    said = [(e["where"], e["reason"]) for e in of(name, "intruder")]
    for where, did in (("lighthouse", "PRI * HTTP/2.0"), ("lighthouse", "GET /status"),
                       ("lighthouse", "POST /replica/"), ("manager", "PRI * HTTP/2.0")):
        assert any(w == where and did in r for w, r in said), (where, did, said)
    # the live settings change (and whatif --apply) refused in one line, nothing queued
    assert [type(r) for r in refusals] == [ControlError, ControlError], refusals
    assert all("take no live settings" in str(r) and "\n" not in str(r) for r in refusals), refusals
