"""The detached job supervisor: the job-level tier of fault tolerance for local jobs.

It runs in its own session (it outlives the notebook kernel or shell that launched it), starts one
``ft_launcher`` per node, and watches two sources: the launchers' logs (in-job restarts, hang
detection) and the job's events (steps, in-process restarts, checkpoints). It relaunches when a
launcher dies, emits the ``failure``/``restart`` events with cause, blamed rank and timings, and
gives up with a reason when restarts stop making progress.

Run as ``python -m eksft_nb.backends.supervisor JOB_DIR`` (the local backend does this).
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..events import EventTail, EventWriter
from ..jobdir import JobDir, atomic_write
from ..launcher import Ports, launcher_argv, rank_env
from ..incidents import Incidents
from ..monitor import JobMonitor
from ..runtime.quiet import quiet_env
from . import procs

POLL_S = 0.2
_WORKER_FAILED = re.compile(r"failed \(exitcode: (-?\d+)\) local_rank: (\d+) \(pid: (\d+)\)")
_FT_TIMEOUT = re.compile(r"FT timeout elapsed")
_ATTEMPTS = re.compile(r"Worker group (\w+)\. (\d+)/(\d+) attempts left")
_LOGGED_AT = re.compile(r"^\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d{3})\]")


@dataclass
class Node:
    index: int
    popen: subprocess.Popen
    log: Path
    tag: str
    offset: int = 0

    @property
    def pid(self) -> int:
        return self.popen.pid


@dataclass
class Supervisor:
    jd: JobDir
    job_uid: str = field(default_factory=lambda: uuid.uuid4().hex[:16])

    def __post_init__(self) -> None:
        self.spec = self.jd.spec()
        self.events = EventWriter(self.jd.events_path, self.spec.name, rank=None)
        self.tail = EventTail(self.jd.events_path)
        self.mon = JobMonitor()
        self.log = open(self.jd.logs / "supervisor.log", "a", buffering=1)
        self.attempt = 0
        self.nodes: list[Node] = []
        self.standby: dict[int, subprocess.Popen] = {}  # node -> a warm ft_launcher for the next attempt
        self.t_launch = 0.0
        self.ranks_started: set[int] = set()  # ranks of the current attempt that reported rank_start
        self.stop_requested = False
        self.t_start = time.time()
        self.incidents = Incidents(self.mon, self.events.emit, self.t_start, say=self.say,
                                   patience=self.spec.ft.progress_patience, steps_expected=not self.spec.script)
        self.folder_inode = os.stat(self.jd.path).st_ino

    # ---- lifecycle ----------------------------------------------------------------------
    def run(self) -> int:
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGINT, self._on_signal)
        what = f"script {self.spec.script}" if self.spec.script else f"{self.spec.steps} steps"
        self.say(f"supervising job {self.spec.name} ({self.spec.world_size} ranks, {what})")
        self.events.emit("job_start", spec_digest=self.spec.digest(), world_size=self.spec.world_size,
                         steps=None if self.spec.script else self.spec.steps, backend="local",
                         host=socket.gethostname(), pid=os.getpid())
        outcome = None
        while outcome is None:
            self._launch()
            outcome = self._watch()
        state, reason = outcome
        self._pump()
        self._kill_everything()
        self.events.emit("job_end", state=state, reason=reason, final_step=self.mon.last_step,
                         digest=self.mon.digest, restarts=self.mon.restarts_by_level())
        self.say(f"job {state}: {reason}")
        self._write_state(state, reason)
        return 0 if state == "succeeded" else 1

    def _folder_is_mine(self) -> bool:
        try:
            return os.stat(self.jd.path).st_ino == self.folder_inode
        except FileNotFoundError:
            return False

    def _on_signal(self, signum: int, frame: Any) -> None:
        self.stop_requested = True

    def _launch(self) -> None:
        ports = Ports(*_free_ports(3))
        run_id = f"{self.spec.name}-{self.attempt}-{uuid.uuid4().hex[:6]}"
        self.nodes = []
        self.t_launch = time.time()
        self.ranks_started = set()
        warm = []
        for node in range(self.spec.nnodes):
            argv = launcher_argv(self.spec, node_rank=node, rdzv_host="127.0.0.1", ports=ports, run_id=run_id)
            argv[0] = str(Path(sys.executable).with_name("ft_launcher"))
            tag = f"{self.attempt}.{node}"
            env = quiet_env({**os.environ,
                             **rank_env(self.spec, ports=ports, job_attempt=self.attempt, job_dir=str(self.jd.path)),
                             procs.JOB_MARK: self.job_uid, procs.NODE_MARK: tag})
            log = self._launcher_log(self.attempt, node)
            popen = self._hand_over(node, argv, env)
            if popen is None:
                with open(log, "ab") as out:
                    popen = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT,
                                             stdin=subprocess.DEVNULL, cwd=self.jd.path, start_new_session=True)
            else:
                warm.append(node)
            self.nodes.append(Node(node, popen, log, tag))
            self.events.emit("launch", attempt=self.attempt, node=node, pid=popen.pid, pgid=popen.pid)
        self.say(f"attempt {self.attempt}: started ft_launcher on {len(self.nodes)} node(s), "
                 f"pids {', '.join(str(n.pid) for n in self.nodes)}" + (" (warm standby)" if warm else ""))
        self._write_state("running")

    def _launcher_log(self, attempt: int, node: int) -> Path:
        return self.jd.logs / f"launcher-{attempt}-{node}.log"

    def _start_standby(self) -> None:
        """Start a warm ft_launcher per node for the next attempt (see :mod:`.standby`) once every
        rank of this attempt has set up, so that its imports take no CPU from this attempt's start-up."""
        nxt = self.attempt + 1
        for node in range(self.spec.nnodes):
            env = quiet_env({**os.environ, procs.JOB_MARK: self.job_uid, procs.NODE_MARK: f"{nxt}.{node}"})
            with open(self._launcher_log(nxt, node), "ab") as out:
                self.standby[node] = subprocess.Popen(
                    [sys.executable, "-m", "eksft_nb.backends.standby"], env=env, stdin=subprocess.PIPE,
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

    def _watch(self) -> tuple[str, str] | None:
        """Poll until the attempt ends. Returns the job outcome, or None to relaunch."""
        while True:
            self._pump()
            if self.stop_requested:
                self.say("stop requested: terminating the launchers")
                return "stopped", "stopped by the user"
            if not self._folder_is_mine():
                self._kill_everything()
                sys.exit(1)  # the job folder was deleted or replaced: nobody to report to
            if self.incidents.give_up:
                return "failed", self.incidents.give_up
            codes = [n.popen.poll() for n in self.nodes]
            if all(c == 0 for c in codes):
                self._pump()
                if self.spec.script:  # a user script's own loop decides when it is done; ft_launcher says it was
                    return "succeeded", "the script exited 0 on every rank"
                if self.mon.digest is not None or self.mon.last_step >= self.spec.steps:
                    return "succeeded", f"all {self.spec.steps} steps done"
                return "failed", "the launchers exited before training finished (see `logs --debug`)"
            dead = [(n, c) for n, c in zip(self.nodes, codes) if c not in (None, 0)]
            if dead:
                return self._node_died(*dead[0])
            if (not self.standby and self.attempt < self.spec.ft.max_job_restarts
                    and len(self.ranks_started) == self.spec.world_size):
                self._start_standby()
            time.sleep(POLL_S)

    def _node_died(self, node: Node, code: int) -> tuple[str, str] | None:
        detected = time.time()
        if code < 0:
            cause = f"ft_launcher on node {node.index} was killed ({signal.Signals(-code).name})"
        else:
            cause = (f"ft_launcher on node {node.index} gave up (exit {code}) after "
                     f"{self.spec.ft.max_injob_restarts} in-job restarts")
        self.say(cause)
        self._kill_everything(keep_standby=True)
        self._pump()
        self.incidents.node_failed(cause, detected)
        if self.incidents.give_up:
            return "failed", self.incidents.give_up
        if self.attempt >= self.spec.ft.max_job_restarts:
            return "failed", f"{cause}; no job restarts left (max_job_restarts={self.spec.ft.max_job_restarts})"
        self.attempt += 1
        self.say(f"relaunching (job restart {self.attempt} of {self.spec.ft.max_job_restarts})")
        return None

    # ---- one poll ---------------------------------------------------------------------------
    def _pump(self) -> None:
        self._read_events()
        for node in self.nodes:
            self._read_launcher_log(node)

    def _read_events(self) -> None:
        for event in self.tail.read():  # one at a time: incidents see the state just before each event
            self.mon.update([event])
            self._on_event(event)

    def _on_event(self, e: Any) -> None:
        if e.kind == "fault":
            target = f"rank {e['target_rank']}" if e["target_rank"] is not None else f"node {e.get('node', 0)}"
            self.say(f"fault injected: {e['fault']} on {target} at step {e['at_step']}")
        elif e.kind == "checkpoint" and e["phase"] in ("failed", "rejected"):
            self.say(f"checkpoint {e['step']} {e['phase']}: {e.get('error') or e.get('reason')}")
        elif e.kind == "rank_start" and e.t >= self.t_launch:
            self.ranks_started.add(e.rank)
        elif e.kind == "resume":
            skipped = "".join(f"; skipped step {x['step']} ({x['reason']})" for x in e["skipped"])
            self.say(f"resuming from checkpoint step {e['step']} (loaded in {e['load_s']:.1f}s){skipped}")
        self.incidents.observe(e)

    def _read_launcher_log(self, node: Node) -> None:
        try:
            with open(node.log, "rb") as f:
                f.seek(node.offset)
                chunk = f.read()
        except FileNotFoundError:
            return
        end = chunk.rfind(b"\n")
        if end < 0:
            return
        node.offset += end + 1
        for line in chunk[: end + 1].decode(errors="replace").splitlines():
            hang, failed = _FT_TIMEOUT.search(line), _WORKER_FAILED.search(line)
            if (hang or failed) and self.incidents.incident is None:
                self._read_events()  # a rank may have reported the fault just before it died
                if hang:
                    self.incidents.hang(_logged_at(line), self.spec.ft.heartbeat_timeout, self._stuck_rank())
                else:
                    code, local_rank, pid = int(failed.group(1)), int(failed.group(2)), int(failed.group(3))
                    rank = next((r for r, p in self.mon.rank_pids.items() if p == pid),
                                node.index * self.spec.nproc_per_node + local_rank)
                    self.incidents.worker_failed(rank, code, _logged_at(line))
            elif m := _ATTEMPTS.search(line):
                self.say(f"ft_launcher restarts the worker group ({m.group(2)}/{m.group(3)} in-job restarts left)")

    def _stuck_rank(self) -> int | None:
        """From the progress beacons: the rank not waiting for its peers in a collective (else the
        least advanced one)."""
        beacons = []
        for p in self.jd.progress.glob("rank-*.json"):
            try:
                beacons.append(json.loads(p.read_text()))
            except (ValueError, OSError):
                continue
        if not beacons:
            return None
        pool = [b for b in beacons if not b.get("in_collective")] or beacons
        return min(pool, key=lambda b: (b.get("step_done", 0), b.get("t_done", 0)))["rank"]

    # ---- processes ----------------------------------------------------------------------------
    def _kill_everything(self, keep_standby: bool = False) -> None:
        """End every process of this job attempt: launchers (and their groups), ranks, what escaped
        the groups (NVRx's double-forked monitors, checkpoint writers) and, unless kept for the next
        attempt, the standby launchers."""
        for node in self.nodes:
            if node.popen.poll() is None:
                procs.kill_group(node.pid, signal.SIGTERM)
        deadline = time.time() + 10
        while time.time() < deadline and any(n.popen.poll() is None for n in self.nodes):
            time.sleep(0.1)
        for node in self.nodes:
            procs.kill_group(node.pid, signal.SIGKILL)
            node.popen.wait()
            self._read_launcher_log(node)
        keep = [p.pid for p in self.standby.values()] if keep_standby else []
        procs.kill_marked(self.job_uid, keep=keep)
        if not keep_standby:
            for spare in self.standby.values():
                spare.kill()
                spare.wait()
            self.standby = {}

    def _write_state(self, state: str, reason: str = "") -> None:
        record = {"pid": os.getpid(), "pgid": os.getpgid(0), "job_uid": self.job_uid, "state": state,
                  "reason": reason, "attempt": self.attempt, "started": self.t_start, "updated": time.time(),
                  "launchers": [{"node": n.index, "pid": n.pid, "pgid": n.pid, "log": str(n.log)}
                                for n in self.nodes]}
        atomic_write(self.jd.supervisor_path, json.dumps(record, indent=1))

    def say(self, message: str) -> None:
        self.log.write(f"{time.strftime('%H:%M:%S')} {message}\n")


def _logged_at(line: str) -> float:
    """When ft_launcher logged ``line`` (its own timestamp: this supervisor reads the log up to a poll
    later, and by then the launcher may already be restarting the group); now if it carries none."""
    now = time.time()
    m = _LOGGED_AT.match(line)
    if m is None:
        return now
    return min(now, time.mktime(time.strptime(m.group(1), "%Y-%m-%d %H:%M:%S")) + int(m.group(2)) / 1000)


def _free_ports(n: int) -> list[int]:
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def main() -> None:
    job_dir = JobDir(Path(sys.argv[1]))
    if os.fork() > 0:  # the launching process reaps this parent at once; the child is the daemon
        os._exit(0)
    os.setsid()
    sup = Supervisor(job_dir)
    sup._write_state("starting")
    sys.exit(sup.run())


if __name__ == "__main__":
    main()
