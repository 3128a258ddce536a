"""torchft's Lighthouse behind a gateway that answers only the job's processes
(``python -m eksft_nb.engines.torchft.gateway --bind HOST:PORT [--listen-fd N] options``).

The Lighthouse (torchft's, in this process) listens on a loopback no one else reaches: a network namespace
of its own that :mod:`.netns` made (a local job, a Slurm node), or its pod's (EKS). Its front, the
gateway, listens where the job's groups reach it and speaks :mod:`.wire`: a peer that does not prove it
holds the job's secret is refused before a byte reaches the Lighthouse, and said (an ``intruder`` event);
it never joins a quorum, reads the status page or calls the kill route. A group's server
(:mod:`.coordination`) asks the gateway for heartbeats and quorums, which it makes on the Lighthouse with
torchft's own client.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import signal
import socket
import sys
import threading
from pathlib import Path
from typing import Any

from ... import loopback
from ...errors import EksftError
from . import secret, wire
from .alarm import Alarm

HEARTBEAT, QUORUM, ANSWER = 1, 2, 3
MAX_ID = 512          # a replica id's characters
MAX_ADDRESS = 512
MAX_DATA = 4096       # a member's data, as JSON


def member(raw: Any) -> dict[str, Any]:
    """A quorum request's member, checked (types and bounds) before torchft's client sees it."""
    if not isinstance(raw, dict):
        raise ValueError("the member is not an object")
    out: dict[str, Any] = {}
    for key, kind, bound in (("replica_id", str, MAX_ID), ("address", str, MAX_ADDRESS),
                             ("store_address", str, MAX_ADDRESS)):
        if type(raw.get(key)) is not kind or not 0 < len(raw[key]) <= bound:
            raise ValueError(f"the member's {key} is not a string of 1 to {bound} characters")
        out[key] = raw[key]
    for key in ("step", "world_size"):
        if type(raw.get(key)) is not int or not 0 <= raw[key] < 2**62:
            raise ValueError(f"the member's {key} is not a non-negative integer")
        out[key] = raw[key]
    if type(raw.get("shrink_only")) is not bool or not isinstance(raw.get("data"), dict):
        raise ValueError("the member's shrink_only or data is malformed")
    out["shrink_only"], out["data"] = raw["shrink_only"], raw["data"]
    if len(str(out["data"])) > MAX_DATA:
        raise ValueError("the member's data is too long")
    return out


def participants(quorum: Any) -> list[dict[str, Any]]:
    return [{"replica_id": p.replica_id, "address": p.address, "store_address": p.store_address,
             "step": p.step, "world_size": p.world_size, "shrink_only": p.shrink_only,
             "data": p.data if isinstance(p.data, dict) else {}} for p in quorum.participants]


class Gateway:
    def __init__(self, listener: socket.socket, key: bytes, inner: str, alarm: Alarm) -> None:
        self.inner = inner
        self.server = wire.Server(listener, key, b"L", self._serve, alarm.reporter("lighthouse"), timeout=10)

    def _serve(self, channel: wire.Channel) -> None:
        from torchft._torchft import LighthouseClient

        client = LighthouseClient(self.inner, datetime.timedelta(seconds=10))
        channel.sock.settimeout(None)   # a group's connection idles between its heartbeats and quorums
        while True:
            kind, body = channel.recv()
            try:
                request = json.loads(body)
                if kind == HEARTBEAT and type(request.get("replica_id")) is str:
                    client.heartbeat(request["replica_id"][:MAX_ID], datetime.timedelta(seconds=5))
                    channel.send_json(ANSWER, {})
                elif kind == QUORUM and type(request.get("timeout")) in (int, float):
                    m = member(request.get("member"))
                    timeout = datetime.timedelta(seconds=min(max(request["timeout"], 1), 86400))
                    q = client.quorum(timeout=timeout, **m)
                    channel.send_json(ANSWER, {"quorum_id": q.quorum_id, "participants": participants(q)})
                else:
                    channel.send(wire.ERROR, b"unknown request")
            except wire.WireError:
                raise
            except Exception as e:   # torchft's client: a quorum timed out, the Lighthouse is gone
                channel.send(wire.ERROR, str(e)[:wire.MAX_REASON].encode())


def job_dir() -> Path | None:
    """The job's folder: ``EKSFT_JOB_DIR``, else the working directory if it is one (the local supervisor
    starts the Lighthouse there); None on a cluster's pod."""
    if os.environ.get("EKSFT_JOB_DIR"):
        return Path(os.environ["EKSFT_JOB_DIR"])
    here = Path.cwd()
    return here if (here / "spec.json").is_file() else None


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog=f"python -m {__name__}")
    parser.add_argument("--bind", required=True, help="HOST:PORT to listen on")
    parser.add_argument("--listen-fd", type=int, help="the socket listening there already (from netns.py)")
    for option in ("--min_replicas", "--join_timeout_ms", "--quorum_tick_ms", "--heartbeat_timeout_ms"):
        parser.add_argument(option, type=int, required=True)
    args = parser.parse_args(argv)
    folder = job_dir()
    env = {**os.environ, **({"EKSFT_JOB_DIR": str(folder)} if folder else {})}
    alarm = Alarm.for_job(folder)
    try:
        key = secret.key(env)
        if args.listen_fd is not None:
            listener = socket.socket(fileno=args.listen_fd)
        else:
            host, _, port = args.bind.rpartition(":")
            listener = loopback.listener(host.strip("[]"), int(port))
    except EksftError as e:   # the secret refused
        print(f"eksft: error: {e}", file=sys.stderr)
        return 1
    except (OSError, ValueError, KeyError) as e:
        print(f"eksft: error: the Lighthouse's gateway cannot start ({e})", file=sys.stderr)
        return 1
    from torchft._torchft import LighthouseServer

    inner = LighthouseServer(bind="127.0.0.1:0", min_replicas=args.min_replicas,
                             join_timeout_ms=args.join_timeout_ms, quorum_tick_ms=args.quorum_tick_ms,
                             heartbeat_timeout_ms=args.heartbeat_timeout_ms)
    gateway = Gateway(listener, key, f"http://127.0.0.1:{inner.address().rsplit(':', 1)[1]}", alarm)
    print(f"eksft: torchft's Lighthouse on a private loopback behind its gateway on "
          f"{listener.getsockname()[:2]}", file=sys.stderr, flush=True)
    done = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: done.set())
    done.wait()
    gateway.server.close()
    inner.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
