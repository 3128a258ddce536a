"""What a Slurm job's watcher tells its user while the job runs, beside the failures and restarts: what the
launchers wait for and why (:class:`Waiting`, shown by ``status`` until the ranks start), the network NCCL
took (:class:`Networks`), and the cluster's limits on a drain's save (:func:`grace_warnings`)."""

from __future__ import annotations

import json
import os
import re
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path

from ...errors import shown
from ...jobdir import atomic_write
from ...nccl import network_of
from . import cluster
from .render import NODE_NOTE

WAITING = "waiting.json"   # in the job folder: what the launchers of the current run wait for
MAX_WAITING_BYTES = 4096
_NODE_NOTE = re.compile(rf"{re.escape(NODE_NOTE)} the rendezvous host \S+ does not resolve on "
                        r"([\w.-]{1,100})$")


@dataclass
class Waiting:
    """The launchers' wait at the rendezvous, said in the job folder (``status`` reads it) until a rank
    starts, with why it may last (nodes on which the rendezvous host's name does not resolve) as soon as
    that is known."""

    path: Path
    attempt: int
    endpoint: str            # HOST:PORT
    since: float = field(default_factory=time.time)
    unresolved: list[str] = field(default_factory=list)   # the nodes where the host's name does not resolve
    error: str = ""

    def start(self) -> str | None:
        """Say the wait; the rendezvous host's name is resolved here (the allocation's first node): a
        problem is returned for a warning."""
        host, _, port = self.endpoint.rpartition(":")
        try:
            socket.getaddrinfo(host, int(port) if port.isdigit() else None)
        except (OSError, UnicodeError) as e:
            self.error = str(e)
            self.unresolved.append(os.environ.get("SLURMD_NODENAME") or socket.gethostname())
        self._write()
        return self.why()

    def note(self, line: str) -> str | None:
        """A node's note in its launcher log (:data:`NODE_NOTE`): the why, when it names a new node."""
        m = _NODE_NOTE.search(line)
        if m is None or m.group(1) in self.unresolved:
            return None
        self.unresolved.append(m.group(1))
        self._write()
        return self.why()

    def why(self) -> str | None:
        if not self.unresolved:
            return None
        return (f"its name does not resolve on {', '.join(self.unresolved)}"
                + (f" ({self.error})" if self.error else ""))

    def end(self) -> None:
        self.path.unlink(missing_ok=True)

    def _write(self) -> None:
        atomic_write(self.path, json.dumps({"attempt": self.attempt, "endpoint": self.endpoint,
                                            "since": self.since, "why": self.why()}))


def waiting_detail(path: Path, attempt: int, now: float | None = None) -> str | None:
    """What ``status`` says of a run whose ranks have not started: the file is the job's (anyone in the job
    can write it), so it is read bounded and shown bounded."""
    try:
        with open(path, "rb") as f:
            data = json.loads(f.read(MAX_WAITING_BYTES + 1)[:MAX_WAITING_BYTES])
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or data.get("attempt") != attempt:
        return None   # a run before this one's (its watcher died)
    since, endpoint, why = data.get("since"), data.get("endpoint"), data.get("why")
    if not (isinstance(since, (int, float)) and isinstance(endpoint, str)
            and isinstance(why, (str, type(None)))):
        return None
    now = time.time() if now is None else now
    text = (f"waiting since {time.strftime('%H:%M:%S', time.localtime(since))} ({max(0, now - since):.0f} s) "
            f"for the rendezvous at {shown(endpoint, 100)[1:-1]}")
    if why:
        text += (f": {shown(why, 300)[1:-1]} (the launchers wait for it until their join timeout: fix the "
                 "nodes' name resolution, DNS or /etc/hosts)")
    return text


@dataclass
class Networks:
    """The network NCCL says each node's ranks took (its INFO lines in the launcher logs)."""

    efa: bool                          # EFA was asked for
    seen: dict[int, str] = field(default_factory=dict)

    def line(self, node: int, text: str) -> tuple[str, str] | None:
        """A node's first network line: ``("failure", why)`` for sockets where EFA was asked for,
        ``("warning", why)`` for sockets otherwise; None for anything else."""
        net = network_of(text)
        if net is None or node in self.seen:
            return None
        self.seen[node] = net
        if net != "socket":
            return None
        if self.efa:
            return ("failure", f"NCCL on node {node} fell back to sockets (TCP) although EFA was asked "
                               "for: aws-ofi-nccl did not load or libfabric found no EFA device (see `logs "
                               "--debug`); install the EFA software and aws-ofi-nccl on the nodes, or drop "
                               "--efa")
        return ("warning", f"NCCL on node {node} uses sockets (TCP), not EFA: collectives run at a fraction "
                           "of the speed EFA gives; on nodes with EFA add --efa (or --slurm-instance-type)")


def grace_warnings(grace_s: float, partition_name: str) -> list[tuple[str, str]]:
    """The cluster's limits that end a drain's save early: KillWait (a cancel, a node's drain: SIGKILL that
    long after SIGTERM) and, where the partition can be preempted, its GraceTime."""
    config = cluster.config()
    out = []
    kill_wait = cluster.seconds(config.get("KillWait"))
    if kill_wait is not None and kill_wait < grace_s:
        out.append(("slurm-killwait",
                    f"Slurm's KillWait is {kill_wait} s, shorter than a drain's save ({grace_s:g} s): a "
                    "scancel or a node's drain kills the ranks before their save is committed (the time "
                    "limit is covered: the job is warned the grace period before it); ask for KillWait="
                    f"{grace_s:g}"))
    part = cluster.partition(partition_name) if partition_name else {}
    preempted = config.get("PreemptType", "preempt/none") != "preempt/none"
    if preempted and part.get("PreemptMode", "OFF") != "OFF":
        grace_time = cluster.seconds(part.get("GraceTime")) or 0
        if grace_time < grace_s:
            out.append(("slurm-gracetime",
                        f"partition {partition_name} can be preempted (PreemptMode="
                        f"{part.get('PreemptMode')}) with GraceTime={grace_time} s, shorter than a drain's "
                        f"save ({grace_s:g} s): a preemption kills the ranks before their save is committed; "
                        f"ask for GraceTime={grace_s:g} or use a partition that is not preempted"))
    return out
