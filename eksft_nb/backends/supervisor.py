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
from ..launch import Ports, launcher_argv, rank_env
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
class Incident:
    """A failure being recovered from: opened at detection, closed by the first step after it."""

    level: str
    cause: str
    blame_rank: int | None
    fault_time: float
    detected_at: float
    last_step: int
    opened_in: tuple[int, int, int]       # (job attempt, in-job restart, in-process iteration)
    resumed_step: int | None = None


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
        self.incident: Incident | None = None
        self.incarnation = (0, 0, 0)
        self.recent_faults: list[dict[str, Any]] = []   # rank faults since the last step
        self.recent_errors: list[dict[str, Any]] = []   # rank errors since the last step
        self.stuck_at: list[int | None] = []             # newest committed step at each failure
        self.give_up: str | None = None
        self.stop_requested = False
        self.t_start = time.time()
        self.last_alive = self.t_start
        self.folder_inode = os.stat(self.jd.path).st_ino

    # ---- lifecycle ----------------------------------------------------------------------
    def run(self) -> int:
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGINT, self._on_signal)
        self.say(f"supervising job {self.spec.name} ({self.spec.world_size} ranks, {self.spec.steps} steps)")
        self.events.emit("job_start", spec_digest=self.spec.digest(), world_size=self.spec.world_size,
                         steps=self.spec.steps, backend="local", host=socket.gethostname(), pid=os.getpid())
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
        for node in range(self.spec.nnodes):
            argv = launcher_argv(self.spec, node_rank=node, rdzv_host="127.0.0.1", ports=ports, run_id=run_id)
            argv[0] = str(Path(sys.executable).with_name("ft_launcher"))
            tag = f"{self.attempt}.{node}"
            env = quiet_env({**os.environ,
                             **rank_env(self.spec, ports=ports, job_attempt=self.attempt, job_dir=str(self.jd.path)),
                             procs.JOB_MARK: self.job_uid, procs.NODE_MARK: tag})
            log = self.jd.logs / f"launcher-{self.attempt}-{node}.log"
            with open(log, "ab") as out:
                popen = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         cwd=self.jd.path, start_new_session=True)
            self.nodes.append(Node(node, popen, log, tag))
            self.events.emit("launch", attempt=self.attempt, node=node, pid=popen.pid, pgid=popen.pid)
        self.say(f"attempt {self.attempt}: started ft_launcher on {len(self.nodes)} node(s), "
                 f"pids {', '.join(str(n.pid) for n in self.nodes)}")
        self._write_state("running")

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
            if self.give_up:
                return "failed", self.give_up
            codes = [n.popen.poll() for n in self.nodes]
            if all(c == 0 for c in codes):
                self._pump()
                if self.mon.digest is not None or self.mon.last_step >= self.spec.steps:
                    return "succeeded", f"all {self.spec.steps} steps done"
                if self.spec.script:  # a user script's own loop decides when it is done; ft_launcher says it was
                    return "succeeded", "the script exited 0 on every rank"
                return "failed", "the launchers exited before training finished (see `logs --debug`)"
            dead = [(n, c) for n, c in zip(self.nodes, codes) if c not in (None, 0)]
            if dead:
                return self._node_died(*dead[0])
            time.sleep(POLL_S)

    def _node_died(self, node: Node, code: int) -> tuple[str, str] | None:
        detected = time.time()
        if code < 0:
            cause = f"ft_launcher on node {node.index} was killed ({signal.Signals(-code).name})"
        else:
            cause = (f"ft_launcher on node {node.index} gave up (exit {code}) after "
                     f"{self.spec.ft.max_injob_restarts} in-job restarts")
        self.say(cause)
        kill = next((f for f in reversed(self.mon.faults) if f["fault"] == "kill-launcher"), None)
        fault_time = kill["t"] if kill and detected - kill["t"] < 60 else self._last_progress_time()
        self._kill_everything()
        self._pump()
        self._open(Incident("job", cause, None, fault_time, detected, self.mon.last_step,
                            self.incarnation), force=True)
        if self.give_up:
            return "failed", self.give_up
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
        elif e.kind == "resume":
            skipped = "".join(f"; skipped step {x['step']} ({x['reason']})" for x in e["skipped"])
            self.say(f"resuming from checkpoint step {e['step']} (loaded in {e['load_s']:.1f}s){skipped}")
        if e.kind == "fault" and e["target_rank"] is not None:
            self.recent_faults.append({"t": e.t, "fault": e["fault"], "rank": e["target_rank"]})
        elif e.kind == "rank_error":
            self.recent_errors.append({"t": e.t, "rank": e.rank, "origin": e["origin"], "error": e["error"],
                                       "waiting": e.get("waiting", False)})
        elif e.kind == "rank_start":
            inc = (e["job_attempt"], e["injob_restart"], e["inprocess_iteration"])
            if inc > self.incarnation:
                if inc[:2] == self.incarnation[:2] and self.incident is None:
                    self._open_inprocess(e.t)
                elif self.incident is None:
                    self._open(Incident("injob", self._cause_from_ranks("the worker group was restarted"),
                                        self._blame_from_ranks(), self._fault_time(), e.t, self.mon.last_step,
                                        self.incarnation))
                self.incarnation = inc
            self.last_alive = max(self.last_alive, e.t)
            if self.incident is not None and e.rank == 0:
                self.incident.resumed_step = e["start_step"]
                if self.spec.script and not len(self.mon.steps) and inc > self.incident.opened_in:
                    self._close(e.t)  # a script that reports no steps has recovered once it runs again
        elif e.kind == "step":
            if self.incident is not None and e.t > self.incident.detected_at:
                self._close(e.t - e["step_time"])
            self.recent_faults.clear()
            self.recent_errors.clear()

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
            if self.incident is None and (_FT_TIMEOUT.search(line) or _WORKER_FAILED.search(line)):
                self._read_events()  # a rank may have reported the fault just before it died
            if _FT_TIMEOUT.search(line) and self.incident is None:
                blame = self._blame_from_beacons()
                self._open(Incident("injob", f"hang: no heartbeat from rank {blame} for "
                                    f"{self.spec.ft.heartbeat_timeout:g}s (ft_launcher timeout)" if blame is not None
                                    else "hang detected by ft_launcher's heartbeat timeout",
                                    blame, self._fault_time(), _logged_at(line), self.mon.last_step, self.incarnation))
            elif m := _WORKER_FAILED.search(line):
                code, local_rank, pid = int(m.group(1)), int(m.group(2)), int(m.group(3))
                if self.incident is None:
                    rank = self._rank_of_pid(pid, node.index * self.spec.nproc_per_node + local_rank)
                    self._open(Incident("injob", self._cause_from_exit(rank, code), self._blame(rank),
                                        self._fault_time(), _logged_at(line), self.mon.last_step, self.incarnation))
            elif m := _ATTEMPTS.search(line):
                self.say(f"ft_launcher restarts the worker group ({m.group(2)}/{m.group(3)} in-job restarts left)")

    # ---- incidents --------------------------------------------------------------------------
    def _open_inprocess(self, t: float) -> None:
        errors = self.recent_errors
        detected = max((x["t"] for x in errors), default=t)
        self._open(Incident("inprocess", self._cause_from_ranks("the wrapped training function was restarted"),
                            self._blame_from_ranks(), self._fault_time(), detected, self.mon.last_step,
                            self.incarnation))

    def _open(self, incident: Incident, force: bool = False) -> None:
        if self.incident is not None and not force:
            return
        self.incident = incident
        committed = self.mon.last_committed
        self.stuck_at.append(committed.step if committed else None)
        self.events.emit("failure", level=incident.level, cause=incident.cause, blame_rank=incident.blame_rank,
                         fault_time=incident.fault_time, detected_at=incident.detected_at)
        who = f" (blamed: rank {incident.blame_rank})" if incident.blame_rank is not None else ""
        self.say(f"{incident.level} failure at step {incident.last_step}: {incident.cause}{who}")
        n = self.spec.ft.progress_patience
        if len(self.stuck_at) >= n and len(set(self.stuck_at[-n:])) == 1:
            where = f"checkpoint step {self.stuck_at[-1]}" if self.stuck_at[-1] is not None else "the start"
            self.give_up = (f"no progress: {n} restarts in a row resumed from {where} and failed before a newer "
                            f"checkpoint was committed (last cause: {incident.cause})")

    def _close(self, first_step_start: float) -> None:
        i, self.incident = self.incident, None
        resumed = i.resumed_step if i.resumed_step is not None else 0
        self.events.emit("restart", level=i.level, cause=i.cause, blame_rank=i.blame_rank, fault_time=i.fault_time,
                         detection_s=max(0.0, i.detected_at - i.fault_time),
                         downtime_s=max(0.0, first_step_start - i.fault_time),
                         rolled_back_steps=max(0, i.last_step - resumed), resumed_step=resumed)
        self.say(f"recovered ({i.level}): resumed from step {resumed}, "
                 f"{first_step_start - i.fault_time:.1f}s after the fault")

    def _fault_time(self) -> float:
        if self.recent_faults:
            return self.recent_faults[0]["t"]
        return self._last_progress_time()

    def _last_progress_time(self) -> float:
        """The last moment the job was known to be fine: its last step, or (before any step of this
        incarnation) the last rank start or recovery."""
        return max([self.t_start, self.last_alive, *self.mon.steps.t[-1:]])

    def _cause_from_ranks(self, fallback: str) -> str:
        if self.recent_faults:
            f = self.recent_faults[0]
            return f"injected {f['fault']} on rank {f['rank']}"
        own = [x for x in self.recent_errors if x["origin"] in ("fault", "exception")]
        if own:
            return f"rank {own[0]['rank']} raised {own[0]['error'][:160]}"
        hung = [x for x in self.recent_errors if x["origin"] == "interrupted" and not x["waiting"]]
        if hung:
            return f"rank {hung[0]['rank']} stopped making progress (in-process soft timeout)"
        return fallback

    def _blame_from_ranks(self) -> int | None:
        if self.recent_faults:
            return self.recent_faults[0]["rank"]
        for pick in (lambda x: x["origin"] in ("fault", "exception"),
                     lambda x: x["origin"] == "interrupted" and not x["waiting"]):
            found = [x["rank"] for x in self.recent_errors if pick(x)]
            if found:
                return found[0]
        return None

    def _blame(self, exited: int) -> int:
        """A rank's process failed: blame the target of an injected fault, else that rank."""
        return self.recent_faults[0]["rank"] if self.recent_faults else exited

    def _blame_from_beacons(self) -> int | None:
        """The rank that is not waiting for its peers inside a collective (else the least advanced)."""
        injected = self._blame_from_ranks()
        if injected is not None:
            return injected
        beacons = []
        for p in self.jd.progress.glob("rank-*.json"):
            try:
                beacons.append(json.loads(p.read_text()))
            except (ValueError, OSError):
                continue
        if not beacons:
            return None
        not_waiting = [b for b in beacons if not b.get("in_collective")]
        pool = not_waiting or beacons
        return min(pool, key=lambda b: (b.get("step_done", 0), b.get("t_done", 0)))["rank"]

    def _cause_from_exit(self, rank: int, code: int) -> str:
        if self.recent_faults:
            f = self.recent_faults[0]
            return f"injected {f['fault']} on rank {f['rank']}"
        if code < 0:
            return f"rank {rank} died ({signal.Signals(-code).name})"
        errors = [x for x in self.recent_errors if x["rank"] == rank]
        detail = f": {errors[0]['error'][:160]}" if errors else ""
        return f"rank {rank} exited with code {code}{detail}"

    def _rank_of_pid(self, pid: int, fallback: int) -> int:
        return next((r for r, p in self.mon.rank_pids.items() if p == pid), fallback)

    # ---- processes ----------------------------------------------------------------------------
    def _kill_everything(self) -> None:
        """End every process of this job attempt: launchers (and their groups), ranks, and what
        escaped the groups (NVRx's double-forked monitors, checkpoint writers)."""
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
        procs.kill_marked(self.job_uid)

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
