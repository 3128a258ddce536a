"""The processes of a local job's attempt, as its supervisor starts and ends them: one ``ft_launcher`` per
node (:class:`Node`; hot spares' too, with the rendezvous store the supervisor then hosts), each node's
warm-rank zygote (:mod:`eksft_nb.runtime.zygote`), and a standby ``ft_launcher`` per node for the next
attempt (:mod:`.standby`). Every process carries the job's mark (``procs.JOB_UID_ENV``) and its node's
(``procs.NODE_MARK``), and is ended by them, never by a group id that may by now be another's.

:class:`Launchers` is a base of :class:`.supervisor.Supervisor` (and so of the torchft one, which starts
replica groups instead): it uses the supervisor's job folder, spec, mark, attempt and events, and its
``say``, ``_write_state`` and launcher-log reading.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

from ... import loopback, nvrx, procs
from ...events import EventWriter
from ...jobdir import JobDir
from ...launcher import ZYGOTE_MODULE, Ports, control_argv, launcher_argv, rank_env
from ...runtime.keepalive import keepalive
from ...runtime.quiet import quiet_env
from ...runtime.warm_shim import SOCKET_ENV as WARM_SOCKET
from ...runtime.warm_shim import ZYGOTE_ENV as WARM_ZYGOTE
from ...spec import JobSpec
from ...states import JobState
from .beat import Heart

STANDBY_MODULE = "eksft_nb.backends.local.standby"   # a local job's ft_launcher (see its module)
UNKNOWN_EXIT = -256    # an adopted launcher ended (not our child: its exit status is unknown)
# a local job's nodes are launchers on one machine: NVRx 0.7's rendezvous host otherwise takes two
# participants with one address for a misconfiguration and closes the rendezvous (its documented switch)
ONE_MACHINE = {"NVRX_ENABLE_MULTI_LAUNCHERS_PER_NODE": "1"}
STORE_START_S = 120.0  # the most the rendezvous store's start (torch's import) is given to beat for


@dataclass
class Node:
    """A node's ft_launcher as the supervisor watches it (a torchft replica group's processes:
    :class:`.torchft_group.Group`)."""

    index: int
    log: Path
    tag: str
    identity: dict[str, Any]                # pid and start time (see procs.identity)
    popen: subprocess.Popen | None = None   # None: adopted from a supervisor that died
    proc: psutil.Process | None = None      # the adopted launcher, if it still ran when adopted
    offset: int = 0
    # its log says it joined a rendezvous round (not only waited as a spare)
    joined: bool = False

    @property
    def pid(self) -> int:
        return self.identity["pid"]

    def poll(self) -> int | None:
        """None while the launcher runs, else its exit status (:data:`UNKNOWN_EXIT` if adopted)."""
        if self.popen is not None:
            return self.popen.poll()
        return None if self.proc is not None and procs.running(self.proc) else UNKNOWN_EXIT


class Launchers:
    """Start and end the processes of an attempt (see the module's docstring)."""

    jd: JobDir
    spec: JobSpec
    job_uid: str
    attempt: int
    events: EventWriter
    nvrx: nvrx.NVRx | None
    nodes: list[Node]
    standby: dict[int, subprocess.Popen]   # node -> a warm ft_launcher for the next attempt
    zygotes: dict[str, subprocess.Popen]   # node tag -> its warm-rank zygote (this attempt's, the next's)
    store: Any                             # the rendezvous store, when the supervisor hosts it (hot spares)
    control: subprocess.Popen | None = None   # NVRx's nvrx-control, the store host for standby spares (0.6+)
    rdzv_id: str                           # this attempt's rendezvous id
    t_launch: float
    ranks_started: dict[int, float]
    ranks_done: set[int]
    heart: Heart                           # the supervisor's heartbeat (see .beat)

    def _launch(self) -> None:
        """Start this attempt: an ft_launcher per node and spare (handed to its standby where one waits),
        each with its node's warm-rank zygote."""
        ports = Ports(*loopback.free_ports(3))
        rdzv_id = self.rdzv_id = f"{self.spec.name}-{self.attempt}-{uuid.uuid4().hex[:6]}"
        self.nodes = []
        self.t_launch = time.time()
        self.ranks_started, self.ranks_done = {}, set()
        # with hot spares the rendezvous store lives outside the launchers (a launcher that hosted it could
        # not be lost): here for NVRx 0.4's handover, in NVRx's own nvrx-control (0.6+) for its standby nodes
        spares = self.spec.spare_nodes and self.nvrx is not None and self.nvrx.spares
        self.store = None
        if spares == "handover":
            with keepalive(self.heart.beat, budget=STORE_START_S):   # importing torch takes a while
                self.store = _rendezvous_store(ports.rdzv)
        elif spares == "standby":
            self._start_control(ports, rdzv_id)
        warm = []
        for node in range(self.spec.nnodes + self.spec.spare_nodes):   # spares wait in the rendezvous
            tag = f"{self.attempt}.{node}"
            zygote = self._start_zygote(tag)
            argv = launcher_argv(self.spec, node_rank=node, rdzv_host="127.0.0.1", ports=ports,
                                 rdzv_id=rdzv_id,
                                 nvrx=self.nvrx, cycle_dir=str(self._cycle_dir(self.attempt)),
                                 store_elsewhere=bool(spares),
                                 warm_python=zygote and sys.executable)
            env = quiet_env({**os.environ,
                             **rank_env(self.spec, ports=ports, job_attempt=self.attempt,
                                        job_dir=str(self.jd.path),
                                        nvrx=self.nvrx),
                             **loopback.env(), **ONE_MACHINE, procs.JOB_UID_ENV: self.job_uid,
                             procs.NODE_MARK: tag,
                             **({WARM_SOCKET: zygote, WARM_ZYGOTE: str(self.zygotes[tag].pid)}
                                if zygote else {})})
            log = self._launcher_log(self.attempt, node)
            popen = self._hand_over(node, argv, env)
            if popen is None:
                # a module, not the console script: NVRx installed with `pip --target` (on PYTHONPATH) has
                # none; ours, so that the launcher's stores listen on loopback only
                command = [sys.executable, "-m", STANDBY_MODULE, *argv]
                with open(log, "ab") as out:
                    popen = subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT,
                                             stdin=subprocess.DEVNULL, cwd=self.jd.path,
                                             start_new_session=True)
            else:
                warm.append(node)
            try:
                ident = procs.identity(popen.pid)
            except psutil.Error:  # it has already ended (we have not reaped it: its pid is still ours)
                ident = {"pid": popen.pid, "started": None, "ticks": None}
            self.nodes.append(Node(node, log, tag, ident, popen=popen))
            self.events.emit("launch", attempt=self.attempt, node=node, pid=popen.pid, pgid=popen.pid)
        self.say(f"attempt {self.attempt}: started ft_launcher on {len(self.nodes)} node(s), "
                 f"pids {', '.join(str(n.pid) for n in self.nodes)}" + (" (warm standby)" if warm else ""))
        self._write_state(JobState.RUNNING)

    def _start_control(self, ports: Ports, rdzv_id: str) -> None:
        """Start this attempt's ``nvrx-control`` (see :func:`eksft_nb.launcher.control_argv`), marked as
        the job's; it ends with the rendezvous (or with the attempt's other processes)."""
        argv = control_argv(self.spec, rdzv_host="127.0.0.1", ports=ports, rdzv_id=rdzv_id,
                            cycle_dir=str(self._cycle_dir(self.attempt)), cycle_job=self.spec.name)
        env = quiet_env({**os.environ, **loopback.env(), **ONE_MACHINE, procs.JOB_UID_ENV: self.job_uid,
                         procs.NODE_MARK: f"{self.attempt}.control"})
        with open(self.jd.logs / f"nvrx-control-{self.attempt}.log", "ab") as out:
            self.control = subprocess.Popen([sys.executable, "-m", STANDBY_MODULE, *argv], env=env,
                                            stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                            cwd=self.jd.path, start_new_session=True)

    def _launcher_log(self, attempt: int, node: int) -> Path:
        return self.jd.logs / f"launcher-{attempt}-{node}.log"

    def _cycle_dir(self, attempt: int) -> Path:
        """Where NVRx 0.6+ writes this attempt's cycle records (its file names restart with each launcher)."""
        return self.jd.logs / "nvrx" / f"attempt-{attempt}"

    def _start_zygote(self, tag: str) -> str | None:
        """Start the warm-rank zygote of the node ``tag`` (see :mod:`eksft_nb.runtime.zygote`) unless it
        runs already (started as a standby); its socket's path (in the job's private folder: no one else
        can bind or reach it), None when the spec turns warm ranks off."""
        if not self.spec.ft.warm_ranks:
            return None
        self.jd.warm.mkdir(mode=0o700, exist_ok=True)
        name = self._zygote_socket(tag)
        if tag in self.zygotes and self.zygotes[tag].poll() is None:
            return name
        # what the ranks' interpreter and torch read at start-up must match theirs (see zygote.FIXED_AT_START)
        env = quiet_env({**os.environ, "OMP_NUM_THREADS": str(self.spec.threads_per_rank),
                         procs.JOB_UID_ENV: self.job_uid, procs.NODE_MARK: tag})
        with open(self.jd.logs / f"zygote-{tag}.log", "ab") as out:
            self.zygotes[tag] = subprocess.Popen([sys.executable, "-m", ZYGOTE_MODULE, name], env=env,
                                                 stdout=out,
                                                 stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                                 cwd=self.jd.path,
                                                 start_new_session=True)
        return name

    def _zygote_socket(self, tag: str) -> str:
        return str(self.jd.warm / f"{tag}.sock")

    def _start_standby(self) -> None:
        """Start a warm ft_launcher per node for the next attempt (see :mod:`.standby`) once every
        rank of this attempt has set up, so that its imports take no CPU from this attempt's start-up."""
        nxt = self.attempt + 1
        for node in range(self.spec.nnodes + self.spec.spare_nodes):
            self._start_zygote(f"{nxt}.{node}")
            env = quiet_env({**os.environ, procs.JOB_UID_ENV: self.job_uid, procs.NODE_MARK: f"{nxt}.{node}"})
            with open(self._launcher_log(nxt, node), "ab") as out:
                self.standby[node] = subprocess.Popen(
                    [sys.executable, "-m", STANDBY_MODULE], env=env, stdin=subprocess.PIPE,
                    stdout=out, stderr=subprocess.STDOUT, cwd=self.jd.path, start_new_session=True)

    def _hand_over(self, node: int, argv: list[str], env: dict[str, str]) -> subprocess.Popen | None:
        """Give this attempt's command line to the node's standby; None when there is none alive."""
        spare = self.standby.pop(node, None)
        if spare is None:
            return None
        try:
            spare.stdin.write(json.dumps({"argv": argv, "env": env}).encode() + b"\n")
            spare.stdin.close()
        except OSError:  # it died: start afresh
            spare.kill()
            spare.wait()
            return None
        return spare

    def _kill_everything(self, keep_standby: bool = False) -> None:
        """End every process of this job attempt: launchers, ranks, what escaped the launchers'
        groups (NVRx's double-forked monitors, checkpoint writers) and, unless kept for the next
        attempt, the standby launchers. Found by the job's mark, never by a group id that may by now
        be another's; the keeper (our parent) stays."""
        for node in self.nodes:
            if node.poll() is None:
                procs.signal_marked(self.job_uid, signal.SIGTERM, node_tag=node.tag)
        deadline = time.time() + 10
        while time.time() < deadline and any(n.poll() is None for n in self.nodes):
            self.heart.beat()
            time.sleep(0.1)
        nxt = f"{self.attempt + 1}."
        keep = [os.getppid()] + ([p.pid for p in self.standby.values()] +
                                 [z.pid for tag,
                                  z in self.zygotes.items() if tag.startswith(nxt)] if keep_standby else [])
        procs.kill_marked(self.job_uid, keep=keep)
        for tag, zygote in list(self.zygotes.items()):
            if zygote.pid not in keep:
                zygote.kill()
                zygote.wait()
                del self.zygotes[tag]
                with contextlib.suppress(OSError):   # killed, it cannot remove its socket itself
                    os.unlink(self._zygote_socket(tag))
        for node in self.nodes:
            if node.popen is not None:
                node.popen.wait()
        if self.control is not None:
            self.control.wait()
            self.control = None
            try:
                for seen in self._launcher_lines(node):
                    self._on_launcher_line(node, seen)
            except OSError:
                pass
        if not keep_standby:
            for spare in self.standby.values():
                spare.kill()
                spare.wait()
            self.standby = {}


def _rendezvous_store(port: int) -> Any:
    """A c10d TCPStore server for the launchers' rendezvous, on loopback only (torch is imported only
    for this)."""
    from torch.distributed import TCPStore

    loopback.install()
    return TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)

