"""The detached job supervisor: the job-level tier of fault tolerance for local jobs.

It runs in its own session (it outlives the notebook kernel or shell that launched it), starts one
``ft_launcher`` per node, and watches two sources: the launchers' logs (in-job restarts, hang
detection) and the job's events (steps, in-process restarts, checkpoints). It relaunches when a
launcher dies, emits the ``failure``/``restart`` events with cause, blamed rank and timings, and
gives up with a reason when restarts stop making progress.

When the supervisor dies. The supervisor runs as the child of a small *keeper* process
(:mod:`.keeper`) that holds the job folder's lock. If the supervisor dies before the job ended
(SIGKILL, a crash, an uncaught error), the keeper starts a successor that *adopts* the job: it finds
the launchers again by identity (pid and start time, and the job's mark, from ``supervisor.json``),
rebuilds what its predecessor knew by replaying the job's events (publishing only the failure/restart
events its predecessor did not, such as an in-job restart while nobody watched), reads the launcher
logs on from the saved offsets, and carries on. A supervisor that stops beating (stopped, or stuck in
a write that never returns) counts as dead: its keeper kills it by identity (see :mod:`.beat`). After
:data:`.keeper.MAX_SUPERVISORS` deaths the keeper ends every process of the job and records why. If the
keeper is gone too, any client that finds the job's processes running without a supervisor
(``LocalBackend.state``) starts a new keeper.

When the disk is full. The job folder's disk full for :data:`FULL_FOR_S` (or any ``OSError`` of the
supervisor's own writes) ends the job with that reason, its launchers stopped: its saves and records
cannot be written. The end is recorded in space reserved for it (see :mod:`.ending`), so the
supervisor ends on purpose, and its keeper starts no successor.

One idea: the supervisor's loop and the state its watch, spare hand-over and adoption share; the ideas
of their own are modules beside it: the processes it starts and ends (:mod:`.launchers`), :mod:`.keeper`,
:mod:`.handover`, :mod:`..launcher_log`.

Run by the keeper as ``python -m eksft_nb.backends.local.supervisor JOB_DIR [--adopt]``, with the job's
mark ``EKSFT_JOB_UID`` in the environment.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import psutil

from ...events import EventTail, EventWriter
from ...jobdir import JobDir, atomic_write
from ... import nvrx
from ...nvrx_cycles import CycleRecord, read_cycle_records
from ...incidents import ANY_NODE, Incidents
from ...monitor import JobMonitor
from ...runtime.keepalive import keepalive
from ...runtime.memcopy import remove_copies
from ...states import JobState, RestartLevel
from ... import procs
from ..launcher_log import LauncherLine, parse_launcher_line
from . import engine_parts
from . import ending
from .beat import Heart
from .handover import HandoverError, expire
from .launchers import UNKNOWN_EXIT, Launchers, Node

POLL_S = 0.2
# what a launcher logs once it trains in a round, not only waits as a spare: NVRx 0.4's legacy rendezvous,
# 0.6+'s barrier rendezvous (a standby node logs it when it takes a lost node's place)
JOINED = ("has joined round", "Assigned active rank")
UNRECORDED = 3         # the supervisor's exit status when the job ended but writing that down failed
FULL = "the job folder's disk is full"
FULL_BELOW = 1 << 20   # bytes free (to users) under which the job folder's disk counts as full
FULL_FOR_S = 5.0       # ... for this long: the job ends (a moment's full disk, a big temporary file, not)
LONG_WORK_S = 600.0    # the most a long piece of work is beaten for (runtime.keepalive): then it is hung


@dataclass
class Supervisor(Launchers):
    jd: JobDir
    adopt: bool = False   # take over the running job of a supervisor that died
    job_uid: str = field(default_factory=lambda: os.environ.get(procs.JOB_UID_ENV) or uuid.uuid4().hex[:16])

    def __post_init__(self) -> None:
        self.spec = self.jd.spec()
        self.events = EventWriter(self.jd.events_path, self.spec.name, rank=None)
        self.tail = EventTail(self.jd.events_path)
        self.mon = JobMonitor()
        self.log = open(self.jd.logs / "supervisor.log", "a", buffering=1)
        self.keeper = self.jd.supervisor().get("keeper")
        self.adoptions = 0
        # while adopting: the failure/restart events already published
        self.replayed: set[tuple] | None = None
        # adopted: launcher-log failures logged before this the events already accounted for
        self.seen_until = 0.0
        self.attempt = 0
        self.nodes: list[Node] = []
        self.standby: dict[int, subprocess.Popen] = {}  # node -> a warm ft_launcher for the next attempt
        # node tag -> its warm-rank zygote (this attempt's, the next's)
        self.zygotes: dict[str, subprocess.Popen] = {}
        self.store: Any = None   # the rendezvous store, when the supervisor hosts it (hot spares)
        self.control: subprocess.Popen | None = None   # nvrx-control, the store host of NVRx's standby spares
        self.rdzv_id = ""         # this attempt's rendezvous id
        self.t_launch = 0.0
        self.ranks_started: dict[int, float] = {}  # rank -> its newest rank_start of the current attempt
        self.ranks_done: set[int] = set()  # ranks whose newest start in the current attempt ended with exit 0
        self.stop_requested = False
        self.t_start = time.time()
        self.incidents = Incidents(self.mon, self._publish, self.t_start, say=self.say,
                                   patience=self.spec.ft.progress_patience,
                                   steps_expected=not self.spec.script)
        self.folder_inode = os.stat(self.jd.path).st_ino
        self.nvrx = nvrx.installed()
        self.cycles_seen: dict[tuple[int, int], CycleRecord] = {}  # (attempt, cycle) -> as last emitted
        self.heart = Heart()
        self.full_since: float | None = None   # since when the job folder's disk is full
        self.room_since: float | None = None   # ... and since when it has room again
        self.fatal: str | None = None   # a rank's error that no restart can help (see the rank_error event)

    # ---- lifecycle ----------------------------------------------------------------------
    def run(self) -> int:
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGINT, self._on_signal)
        self.heart.beat()
        try:
            if self.adopt:
                outcome = self._adopt()  # None: relaunch
            else:
                self._write_state(JobState.STARTING)
                what = f"script {self.spec.script}" if self.spec.script else f"{self.spec.steps} steps"
                self.say(f"supervising job {self.spec.name} ({self.spec.world_size} ranks, {what}) "
                         f"with {self.nvrx.describe() if self.nvrx else 'no NVRx installed'}")
                note = self.nvrx.inprocess_note() if self.nvrx and self.spec.ft.inprocess else None
                if note:
                    self.say(note)
                self.events.emit("job_start", spec_digest=self.spec.digest(), world_size=self.spec.world_size,
                                 steps=None if self.spec.script else self.spec.steps, backend="local",
                                 host=socket.gethostname(), pid=os.getpid(),
                                 nvrx=self.nvrx.version if self.nvrx else None)
                if note and self.nvrx.inprocess == "missing":   # the job runs without the tier it asked for
                    self.events.emit("warning", what="inprocess_missing", message=note)
                self._launch()
                outcome = self._watch()
            while outcome is None:
                self._launch()
                outcome = self._watch()
            state, reason = outcome
            self._pump()
            self.incidents.end(time.time())
            if state == JobState.FAILED:
                reason = self.incidents.named(reason)
        # a full disk, a folder gone read-only: end cleanly rather than orphan the launchers
        except OSError as e:
            state, reason = JobState.FAILED, self._cannot_write(e)
        return self._end(state, reason)

    def _end(self, state: JobState, reason: str) -> int:
        """End every process of the job, record the end (where a full disk cannot stop it, see
        :mod:`.ending`) and clear what the job leaves. Never raises: the keeper must not take an
        end on purpose for a crash and start a successor."""
        try:
            self._kill_everything()
        except OSError:
            procs.kill_marked(self.job_uid, keep=[os.getppid()])
        remove_copies(self.job_uid)  # the ranks' in-memory checkpoint copies end with the job
        recorded = ending.record(self.jd, state, reason, final_step=self.mon.last_step, events=self.events,
                                 say=self.say, state_record=self._state_record(state, reason),
                                 digest=self.mon.digest, restarts=self.mon.restarts_by_level())
        with keepalive(self.heart.beat, budget=LONG_WORK_S):   # removing big folders takes a while
            ending.tidy(self.jd)
        if not recorded:  # nothing of the job runs any more: the keeper starts no successor
            return UNRECORDED
        return 0 if state == JobState.SUCCEEDED else 1

    def _cannot_write(self, e: OSError) -> str:
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            return (f"{FULL}: the supervisor could not write {e.filename or 'there'} ({e.strerror}); "
                    f"{self._fix_room()}")
        return f"the supervisor could not go on: {e}"

    def _fix_room(self) -> str:
        return (f"free space in {self.jd.path.parent}, then resume the job from its last committed "
                f"checkpoint: `python -m eksft_nb resume {self.spec.name}`")

    def _disk_full(self) -> str | None:
        """Why the job ends, once the job folder's disk has been full for :data:`FULL_FOR_S`. Full until
        it has had room for as long: each failed save gives back what it wrote, which the next fills."""
        try:
            st = os.statvfs(self.jd.path)
        except OSError:
            return None
        free, now = st.f_bavail * st.f_frsize, time.monotonic()
        if free < FULL_BELOW:
            self.full_since, self.room_since = self.full_since or now, None
        elif self.full_since is not None:
            self.room_since = self.room_since or now
            if now - self.room_since >= FULL_FOR_S:
                self.full_since = self.room_since = None
        if self.full_since is None or now - self.full_since < FULL_FOR_S:
            return None
        return (f"{FULL} ({free // 1024} KiB free for {now - self.full_since:.0f}s): its checkpoints and "
                f"records cannot be written; {self._fix_room()}")

    def _adopt(self) -> tuple[JobState, str] | None:
        """Take over from a supervisor that died: find its launchers again by identity, rebuild what it
        knew from the job's events, and watch the attempt on. Returns the job outcome, or None to relaunch."""
        record = self.jd.supervisor()
        self.attempt = _int(record.get("attempt"))
        self.t_start = _num(record.get("started"), self.t_start)
        self.adoptions = _int(record.get("adoptions")) + 1
        for entry in record.get("launchers") or []:
            try:
                ident = {"pid": int(entry["pid"]), "started": float(entry["started"]),
                         "ticks": entry.get("ticks")}
                node = Node(int(entry["node"]), Path(entry["log"]), str(entry["tag"]), ident,
                            proc=procs.recorded(ident, self.job_uid), offset=int(entry.get("offset", 0)))
            except (KeyError, TypeError, ValueError):
                continue  # unreadable: that node counts as lost, the job restarts it
            if node.log.parent == self.jd.logs:
                self.nodes.append(node)
        self.t_launch = _num(record.get("t_launch"), self.t_start)
        with keepalive(self.heart.beat, budget=LONG_WORK_S):   # a long job's events take a while
            backlog = self.tail.read()
            self.replayed = {_incident_key(e.kind, e.data) for e in backlog
                             if e.kind in ("failure", "restart")}
            for event in backlog:
                self.mon.update([event])
                self._on_event(event)
        self.replayed = None
        # a failure the launchers logged before the newest rank start restarted ranks the replay has seen
        self.seen_until = max((e.t for e in backlog if e.kind == "rank_start"), default=0.0)
        running = [n for n in self.nodes if n.poll() is None]
        self.say(f"supervisor {record.get('pid')} is gone; supervisor {os.getpid()} adopted the job "
                 f"(attempt {self.attempt}, {len(running)} of {self.spec.nnodes} launcher(s) still running)")
        if self.mon.finished:  # the predecessor died after the job ended
            return self.mon.state, self.mon.reason
        self._write_state(JobState.RUNNING)
        if len(self.nodes) < self.spec.nnodes:
            return self._node_died(None, UNKNOWN_EXIT)
        return self._watch()

    def _publish(self, kind: str, **data: Any) -> None:
        """Publish an incident's event, unless a predecessor already did (while adopting)."""
        if self.replayed is None or _incident_key(kind, data) not in self.replayed:
            self.events.emit(kind, **data)

    def _folder_is_mine(self) -> bool:
        try:
            return os.stat(self.jd.path).st_ino == self.folder_inode
        except FileNotFoundError:
            return False

    def _on_signal(self, signum: int, frame: Any) -> None:
        self.stop_requested = True

    def _read_and_check(self, what: str) -> tuple[JobState, str] | None:
        """A watch loop's first move each poll: fold what the job wrote, then end on a stop the user
        asked for (terminating ``what``); exit at once if the job folder is no longer this job's."""
        self._pump()
        if self.stop_requested:
            self.say(f"stop requested: terminating {what}")
            return JobState.STOPPED, "stopped by the user"
        if not self._folder_is_mine():
            self._kill_everything()
            sys.exit(1)  # the job folder was deleted or replaced: nobody to report to
        if self.fatal is not None:
            return JobState.FAILED, self.fatal
        if (full := self._disk_full()) is not None:
            return JobState.FAILED, full
        return None

    def _watch(self) -> tuple[JobState, str] | None:
        """Poll until the attempt ends. Returns the job outcome, or None to relaunch."""
        while True:
            if (ended := self._read_and_check("the launchers")) is not None:
                return ended
            if self.incidents.give_up:
                return JobState.FAILED, self.incidents.give_up
            codes = [n.poll() for n in self.nodes]
            if all(c == 0 or c == UNKNOWN_EXIT and self._finished() for c in codes):
                self._pump()
                # a user script's own loop decides when it is done; ft_launcher says it was
                if self.spec.script:
                    return JobState.SUCCEEDED, "the script exited 0 on every rank"
                if (d := self.mon.drain) is not None:
                    saved = "saved and committed" if d["committed"] else "its save could NOT be committed"
                    return JobState.STOPPED, (f"drained on SIGTERM at step {d['step']} ({saved}): resume it "
                                              f"with `python -m eksft_nb resume {self.spec.name}`")
                if self.mon.digest is not None or self.mon.last_step >= self.spec.steps:
                    return JobState.SUCCEEDED, f"all {self.spec.steps} steps done"
                return JobState.FAILED, "the launchers exited before training finished (see `logs --debug`)"
            dead = [(n, c) for n, c in zip(self.nodes, codes) if c not in (None, 0)]
            if dead and self._spare_takes_over(*dead[0]):
                continue
            if dead:
                return self._node_died(*dead[0])
            if (not self.standby and self.attempt < self.spec.ft.max_job_restarts
                    and len(self.ranks_started) == self.spec.world_size):
                self._start_standby()
            time.sleep(POLL_S)

    def _finished(self) -> bool:
        """Whether training is done by the events (for launchers whose exit status is unknown): the
        trainer's digest or its last step; a user script, whose step count is its own, once every
        rank of this attempt ended with exit 0."""
        self._pump()
        if self.spec.script:
            return len(self.ranks_done) == self.spec.world_size
        return self.mon.digest is not None or self.mon.last_step >= self.spec.steps

    def _spare_takes_over(self, node: Node, code: int) -> bool:
        """A launcher died but enough others run for a full job: NVRx's rendezvous moves a hot spare
        from its redundancy list into the lost node's place, and the survivors restart their workers
        with it (an in-job restart). Any launcher may be the lost one: the rendezvous store is ours."""
        detected = time.time()
        alive = [n for n in self.nodes if n is not node and n.poll() is None]
        if not self.spec.spare_nodes or code == UNKNOWN_EXIT or len(alive) < self.spec.nnodes:
            return False
        self._pump()
        if node.joined:
            self._hand_spare_over(node)   # first: the spare comes in while the lost node's ranks are ended
        self.nodes.remove(node)
        # a lost node loses its ranks too (they outlive a killed launcher)
        procs.kill_marked(self.job_uid, node.tag)
        how = (signal.Signals(-code).name if code < 0 and -code in signal.Signals._value2member_map_
               else f"exit {code}")
        if not node.joined:
            self.say(f"spare ft_launcher {node.index} ended ({how}); {len(alive) - self.spec.nnodes} "
                     "spare(s) left")
            return True
        cause = f"its ft_launcher (launcher {node.index}) was lost ({how}); a hot spare took its place"
        self.say(f"{cause} ({len(alive) - self.spec.nnodes} spare(s) left)")
        self.incidents.node_failed(cause, detected, level=RestartLevel.INJOB)
        if self.nvrx is not None and self.nvrx.spares == "standby":
            self._restart_survivors()
        return True

    def _restart_survivors(self) -> None:
        """NVRx 0.6+'s standby node takes the lost node's place once the survivors' launchers restart
        their workers: each then opens the rendezvous's next round, which the spare joins, and the store
        host picks the active nodes. Their ranks, blocked on the lost peer (an in-process restart waits
        for it), would only fail at the heartbeat timeout: they are ended now, as any failed worker ends
        ft_launcher's group (an in-job restart restarts every rank anyway)."""
        ranks = set(self.mon.rank_pids.values())
        for proc in procs.marked(self.job_uid):
            if proc.pid in ranks:
                with contextlib.suppress(psutil.Error):
                    proc.kill()

    def _hand_spare_over(self, node: Node) -> None:
        """NVRx's legacy rendezvous (0.4.x) lets the spare in once the lost launcher's keep-alive expires
        (10-15 s): expire it now (see :mod:`.handover`). NVRx 0.5+'s barrier rendezvous has no keep-alive."""
        if self.store is None or self.nvrx is None or self.nvrx.rendezvous != "legacy":
            return
        try:
            marked = expire(self.store, self.rdzv_id, node.pid)
        except HandoverError as e:
            self.say(f"could not hand the spare over at once ({e}): it comes in when NVRx's rendezvous "
                     "expires the lost launcher (10-15 s)")
            return
        if marked:
            self.say(f"handed the spare over: expired launcher {node.index}'s rendezvous keep-alive")

    def _node_died(self, node: Node | None, code: int) -> tuple[JobState, str] | None:
        detected = time.time()
        if node is None:
            cause = "the launchers of the supervisor that died could not be found again"
        elif code == UNKNOWN_EXIT:
            cause = (f"ft_launcher on node {node.index} ended (adopted from a supervisor that died: exit "
                     "status unknown)")
        elif code < 0:
            cause = f"ft_launcher on node {node.index} was killed ({signal.Signals(-code).name})"
        else:
            cause = (f"ft_launcher on node {node.index} gave up (exit {code}) after "
                     f"{self.spec.ft.max_injob_restarts} in-job restarts")
        self.say(cause)
        self._kill_everything(keep_standby=True)
        self._pump()
        self.incidents.node_failed(cause, detected)
        if self.incidents.give_up:
            return JobState.FAILED, self.incidents.give_up
        if self.attempt >= self.spec.ft.max_job_restarts:
            return JobState.FAILED, (f"{cause}; no job restarts left "
                                     f"(max_job_restarts={self.spec.ft.max_job_restarts})")
        self.attempt += 1
        self.say(f"relaunching (job restart {self.attempt} of {self.spec.ft.max_job_restarts})")
        self.incidents.group_restarted(ANY_NODE, time.time())
        return None

    # ---- one poll ---------------------------------------------------------------------------
    def _pump(self) -> None:
        self.heart.beat()
        self._read_events()
        self._read_cycle_records()

    def _read_cycle_records(self) -> None:
        """Fold NVRx's own per-cycle records (0.6+) into the events: one ``nvrx_cycle`` event when a
        worker-group cycle starts and one when NVRx marks it ended, so the restart timeline carries
        NVRx's account of each in-job restart (and the spares that waited) next to eksft's."""
        if self.nvrx is None or not self.nvrx.cycle_records:
            return
        for record in read_cycle_records(self._cycle_dir(self.attempt)):
            key = (self.attempt, record.cycle)
            if self.cycles_seen.get(key) == record:
                continue
            self.cycles_seen[key] = record
            self.events.emit("nvrx_cycle", attempt=self.attempt, **record.fields())

    def _read_events(self) -> None:
        """Fold in the ranks' new events and the launchers' new log lines, by time. The events are
        read first, so every line logged before one of them is read too; folded by time, a warm
        rank's start (a poll or less after the failure that replaced it) never gets ahead of the
        launcher's line about that failure, which opens the incident with its cause."""
        events = self.tail.read()
        lines = sorted(((seen.at, i, node, seen) for node in self.nodes
                        for i, seen in enumerate(self._launcher_lines(node))), key=lambda x: x[:2])
        for event in events:  # one at a time: incidents see the state just before each event
            # this supervisor's own events (rank None) tell when it read, not when the job did something
            while lines and event.rank is not None and lines[0][0] <= event.t:
                self._on_launcher_line(*lines.pop(0)[2:])
            self.mon.update([event])
            self._on_event(event)
        for _, _, node, seen in lines:
            self._on_launcher_line(node, seen)

    def _on_event(self, e: Any) -> None:
        if e.kind == "fault":
            target = (f"rank {e['target_rank']}" if e["target_rank"] is not None else
                      f"node {e['node']}" if e.get("node") is not None else "the job")
            self.say(f"fault injected: {e['fault']} on {target} at step {e['at_step']}")
        elif e.kind == "checkpoint" and e["phase"] in ("failed", "rejected"):
            self.say(f"checkpoint {e['step']} {e['phase']}: {e.get('error') or e.get('reason')}")
        elif e.kind == "rank_start" and e.t >= self.t_launch:
            self.ranks_started[e.rank] = e.t
            self.ranks_done.discard(e.rank)
        elif e.kind == "rank_end" and e.t >= self.t_launch and e.get("exit_code", 0) == 0:
            self.ranks_done.add(e.rank)
        elif e.kind == "rank_error" and e.get("fatal") and self.fatal is None:
            self.fatal = f"rank {e.rank} cannot go on, and no restart can help: {e['fatal']}"
        elif e.kind in ("failure", "restart") and self.replayed is not None:
            self.incidents.restore(e)
        elif e.kind == "resume":
            skipped = "".join(f"; skipped step {x['step']} ({x['reason']})" for x in e["skipped"])
            self.say(f"resuming from checkpoint step {e['step']} (loaded in {e['load_s']:.1f}s){skipped}")
        self.incidents.observe(e)

    def _launcher_lines(self, node: Node) -> list[LauncherLine]:
        """What the node's launcher logged since the last read that the supervisor acts on."""
        try:
            with open(node.log, "rb") as f:
                f.seek(node.offset)
                chunk = f.read()
        except FileNotFoundError:
            return []
        end = chunk.rfind(b"\n")
        if end < 0:
            return []
        node.offset += end + 1
        lines = chunk[: end + 1].decode(errors="replace").splitlines()
        node.joined = node.joined or any(said in line for line in lines for said in JOINED)
        seen = [line for line in map(parse_launcher_line, lines) if line is not None]
        if seen:
            self._write_state(JobState.RUNNING)  # a successor reads on from here, not twice
        return seen

    def _on_launcher_line(self, node: Node, seen: LauncherLine) -> None:
        if seen.kind == "restarting":
            self.say(f"ft_launcher restarts the worker group ({seen.left[0]}/{seen.left[1]} in-job "
                     "restarts left)")
        if seen.kind in ("restarting", "error"):
            self.incidents.launcher_line(node.index, seen)
        elif not self.stop_requested and seen.at > self.seen_until and not self._restarted_since(seen.at):
            if seen.kind == "hang" and seen.timeout_s is None:
                seen = replace(seen, timeout_s=self.spec.ft.heartbeat_timeout)
            rank = next((r for r, p in self.mon.rank_pids.items() if p == seen.pid),
                        node.index * self.spec.nproc_per_node + seen.local_rank)
            self.incidents.launcher_line(node.index, seen, rank,
                                         self._stuck_rank() if seen.kind == "hang" else None)

    def _restarted_since(self, at: float) -> bool:
        """Whether every rank has started again since ``at``: a failure ft_launcher logged then was of
        the ranks they replaced, whose incident is accounted for. Warm ranks recover within a poll or
        two, so that line can be read after their first step closed its incident."""
        return len(self.ranks_started) == self.spec.world_size and min(self.ranks_started.values()) > at

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

    def _write_state(self, state: JobState, reason: str = "") -> None:
        atomic_write(self.jd.supervisor_path, json.dumps(self._state_record(state, reason), indent=1))

    def _state_record(self, state: JobState, reason: str = "") -> dict[str, Any]:
        return {"pid": os.getpid(), "supervisor": procs.identity(os.getpid()), "keeper": self.keeper,
                "job_uid": self.job_uid, "state": state, "reason": reason, "attempt": self.attempt,
                "adoptions": self.adoptions, "started": self.t_start, "t_launch": self.t_launch,
                "updated": time.time(),
                "launchers": [{"node": n.index, **n.identity, "pgid": n.pid, "tag": n.tag,
                               "log": str(n.log),
                               "offset": n.offset} for n in self.nodes]}

    def say(self, message: str) -> None:
        if self.replayed is None:  # while adopting, what the predecessor already narrated is not repeated
            self.log.write(f"{time.strftime('%H:%M:%S')} {message}\n")


def _incident_key(kind: str, data: dict[str, Any]) -> tuple:
    return kind, data.get("level"), data.get("fault_time")


def _int(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else 0


def _num(value: Any, default: float) -> float:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else default


def main() -> None:
    """``python -m eksft_nb.backends.local.supervisor JOB_DIR [--adopt]``, as the keeper runs it; a job whose
    engine has a supervisor of its own (torchft: the Lighthouse, a process per replica group) runs that."""
    jd = JobDir(Path(sys.argv[1]))
    if (own := engine_parts.of(jd.spec()).supervisor) is not None:
        os.execv(sys.executable, [sys.executable, "-m", own, "--run", *sys.argv[1:]])
    sys.exit(Supervisor(jd, adopt="--adopt" in sys.argv).run())


if __name__ == "__main__":
    main()
