"""The watcher inside a Slurm allocation: what the local supervisor records, for a job Slurm runs.

``python -m eksft_nb.backends.slurm.allocation JOB_DIR -- srun ...`` runs on the allocation's first
node (the batch script execs it). It records the job's start once (a requeued run finds it), runs
the ``srun`` step that starts one ``ft_launcher`` per node, and turns what the launchers log and
the ranks write into the same ``failure``/``restart`` events as locally (:class:`Incidents`, the
supervisor's launcher-log parser). When the step ends it records the job's end, or, when a node's
launcher was lost and job restarts are left, the failure, and exits with ``REQUEUE_EXIT``: the batch
script requeues the job, whose next run resumes from the newest committed checkpoint.

It never starts or kills ranks itself: Slurm owns the processes (``scancel`` signals them all).
"""

from __future__ import annotations

import dataclasses
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from ... import nvrx
from ...events import EventTail, EventWriter
from ...incidents import ANY_NODE, Incidents
from ...jobdir import JobDir
from ...monitor import JobMonitor
from ...states import JobState
from ...timeouts import resolved
from ..launcher_log import LauncherLine, parse_launcher_line
from . import cluster, engine_parts
from .render import REQUEUE_EXIT, STOP_MARK

POLL_S = 0.2
_LOG = re.compile(r"launcher-(\d+)-(\d+)\.log$")


class Watcher:
    def __init__(self, jd: JobDir, srun: list[str]) -> None:
        self.jd, self.srun = jd, srun
        self.spec = resolved(jd.spec())   # the timeouts its launchers run with
        self.attempt = int(os.environ.get("SLURM_RESTART_COUNT") or 0)
        self.events = EventWriter(jd.events_path, self.spec.name, rank=None)
        self.tail = EventTail(jd.events_path)
        self.mon = JobMonitor()
        self.incidents = Incidents(self.mon, self.events.emit, time.time(),
                                   patience=self.spec.ft.progress_patience,
                                   steps_expected=not self.spec.script)
        self.offsets: dict[Path, int] = {}
        self.ranks_started: dict[int, float] = {}
        self.t_launch = time.time()
        self.signalled = False

    def run(self) -> int:
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGINT, self._on_signal)
        backlog = self.tail.read()   # a requeued run: what the runs before it recorded
        for e in backlog:
            self.mon.update([e])
            if e.kind in ("failure", "restart"):
                self.incidents.restore(e)
            self.incidents.observe(e)
        if not any(e.kind == "job_start" for e in backlog):
            here = nvrx.installed()
            self.events.emit("job_start", spec_digest=self.spec.digest(), world_size=self.spec.world_size,
                             steps=None if self.spec.script else self.spec.steps, backend="slurm",
                             host=socket.gethostname(), pid=os.getpid(), nvrx=here.version if here else None)
        elif self.attempt > 0 and self.incidents.incident is None:
            self._unrecorded_end(backlog[-1].t)
        if self.attempt > 0:   # this run is the open incident's job restart
            self.incidents.group_restarted(ANY_NODE, self.t_launch)
        step = subprocess.Popen(self.srun, stdin=subprocess.DEVNULL)
        while step.poll() is None and not self.incidents.give_up:
            self._pump()
            time.sleep(POLL_S)
        if step.poll() is None:   # gave up: end the step (Slurm ends its processes on every node)
            step.terminate()
        code = step.wait()
        self._pump()
        state, reason = self._outcome(code)
        if state is None:
            return 0 if self.signalled else REQUEUE_EXIT   # Slurm's requeue, or ours
        self.incidents.end(time.time())
        if state == JobState.FAILED:
            reason = self.incidents.named(reason)
        self.events.emit("job_end", state=state, reason=reason, final_step=self.mon.last_step,
                         digest=self.mon.digest, restarts=self.mon.restarts_by_level())
        return 0 if state == JobState.SUCCEEDED else 1

    def _unrecorded_end(self, last_seen: float) -> None:
        """A requeued run whose previous run recorded no failure: the watcher died with the allocation's
        first node (or someone requeued the job from outside eksft). The job-level incident it could not
        record is recorded now, from the last event that run left."""
        cause = (f"the run before attempt {self.attempt} ended without a word from its watcher: the "
                 "allocation's "
                 "first node was lost (or the job was requeued from outside eksft), and Slurm "
                 "requeued the job")
        self.incidents.node_failed(cause, time.time(), ended_at=last_seen)

    def _outcome(self, code: int) -> tuple[JobState | None, str]:
        """The job's end, or (None, why) for a job-level restart (a requeue)."""
        if self.jd.path.joinpath(STOP_MARK).exists():
            return JobState.STOPPED, "stopped by the user"
        if self.signalled:
            job = cluster.show_job(os.environ.get("SLURM_JOB_ID", ""))
            if job is None or job.slurm_state == "CANCELLED":
                return JobState.STOPPED, ("cancelled by Slurm from outside eksft (scancel): resume "
                                          "it from its "
                                          "last checkpoint")
            # a node failed, a preemption, the time limit: Slurm requeues the job (--requeue) or ends it
            why = f", {job.reason}" if job.reason not in ("", "None") else ""
            cause = ("Slurm ended the allocation (a node failed, a preemption or the time limit; "
                     f"job {job.slurm_state}{why})")
            self.incidents.node_failed(cause, time.time())
            return None, cause
        if self.incidents.give_up:
            return JobState.FAILED, self.incidents.give_up
        if code == 0:
            if self.spec.script:
                return JobState.SUCCEEDED, "the script exited 0 on every rank"
            if self.mon.digest is not None or self.mon.last_step >= self.spec.steps:
                return JobState.SUCCEEDED, f"all {self.spec.steps} steps done"
            return JobState.FAILED, "the launchers exited before training finished (see `logs --debug`)"
        how = (signal.Signals(-code).name if code < 0 and -code in signal.Signals._value2member_map_
               else f"exit {code}")
        cause = f"the srun step of the launchers ended ({how}): a node's ft_launcher was lost or gave up"
        if (gave_up := engine_parts.of(self.spec).gave_up) is not None:   # its runner restarted lost nodes
            return JobState.FAILED, gave_up(self.spec, code)
        self.incidents.node_failed(cause, time.time())
        if self.incidents.give_up:
            return JobState.FAILED, self.incidents.give_up
        if self.attempt >= self.spec.ft.max_job_restarts:
            return JobState.FAILED, (f"{cause}; no job restarts left "
                                     f"(max_job_restarts={self.spec.ft.max_job_restarts})")
        return None, cause

    def _on_signal(self, signum: int, frame: Any) -> None:
        self.signalled = True

    def _pump(self) -> None:
        """The ranks' new events and the launchers' new log lines, folded in by time (as the supervisor
        does)."""
        events = self.tail.read()
        lines = sorted(((seen.at, node, seen) for node, seen in self._launcher_lines()), key=lambda x: x[0])
        for e in events:
            while lines and e.rank is not None and lines[0][0] <= e.t:
                self._on_line(*lines.pop(0)[1:])
            self.mon.update([e])
            if e.kind == "rank_start" and e.t >= self.t_launch:
                self.ranks_started[e.rank] = e.t
            self.incidents.observe(e)
        for _, node, seen in lines:
            self._on_line(node, seen)

    def _launcher_lines(self) -> list[tuple[int, LauncherLine]]:
        out = []
        for log in self.jd.logs.glob(f"launcher-{self.attempt}-*.log"):
            m = _LOG.search(log.name)
            if not m:
                continue
            try:
                with open(log, "rb") as f:
                    f.seek(self.offsets.get(log, 0))
                    chunk = f.read()
            except OSError:
                continue
            end = chunk.rfind(b"\n")
            if end < 0:
                continue
            self.offsets[log] = self.offsets.get(log, 0) + end + 1
            for text in chunk[: end + 1].decode(errors="replace").splitlines():
                seen = parse_launcher_line(text)
                if seen is not None:
                    out.append((int(m.group(2)), seen))
        return out

    def _on_line(self, node: int, seen: LauncherLine) -> None:
        if seen.kind in ("restarting", "error"):
            self.incidents.launcher_line(node, seen)
            return
        if self.signalled:
            return
        if len(self.ranks_started) == self.spec.world_size and min(self.ranks_started.values()) > seen.at:
            return   # every rank started again since: an incident already accounted for
        if (seen.kind == "worker_failed" and seen.exitcode == -signal.SIGTERM
                and not any(f["fault"] == "sigterm" for f in self.incidents.recent_faults)):
            # Slurm ending the step (a lost node's peers, scancel) terminates the ranks: not an in-job failure
            return
        rank = next((r for r, p in self.mon.rank_pids.items() if p == seen.pid),
                    node * self.spec.nproc_per_node + seen.local_rank)
        if seen.kind == "hang" and seen.timeout_s is None:
            seen = dataclasses.replace(seen, timeout_s=self.spec.ft.heartbeat_timeout)
        self.incidents.launcher_line(node, seen, rank)


def main(argv: list[str]) -> int:
    if len(argv) < 3 or argv[1] != "--":
        print("usage: python -m eksft_nb.backends.slurm.allocation JOB_DIR -- srun ...", file=sys.stderr)
        return 2
    return Watcher(JobDir(Path(argv[0])), argv[2:]).run()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
