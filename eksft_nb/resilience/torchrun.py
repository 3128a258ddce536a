"""The baseline the engines are measured against: the built-in trainer under plain ``torchrun`` (no
ft_launcher, no in-process restart, no supervisor), resubmitted from its newest committed checkpoint after
every failure, as a batch scheduler would do at best: the moment ``torchrun`` exits, leftovers are killed
and the job starts again with ``EKSFT_JOB_ATTEMPT`` bumped, so it resumes from that checkpoint.

It reports through the one event schema, as a supervised job does: ``job_start``; per failure a
``failure`` (level ``job``, detected when torchrun exited) and, at the first step after the resubmission, a
``restart`` with its phases (:class:`~eksft_nb.incidents.Incidents`, as the supervisors use it); ``job_end``.
Goodput, the restart timeline and a comparison then read it as they read any job.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from .. import procs
from ..control import FaultCommand, submit
from ..events import EventTail, EventWriter
from ..incidents import Incident, Incidents
from ..jobdir import JobDir
from ..launcher import TRAINER_MODULE
from ..monitor import JobMonitor
from ..runtime.quiet import quiet_env
from ..spec import JobSpec
from ..states import JobState, RestartLevel

POLL_S = 0.05


@dataclass
class PlainTorchrunJob:
    """One baseline job: a job folder (made with ``JobDir.create``) run by successive torchrun attempts.

    :meth:`start` runs the attempts in a thread; faults go in through the job folder, as for eksft."""

    jd: JobDir
    spec: JobSpec
    uid: str = field(default_factory=lambda: uuid.uuid4().hex[:16])
    exits: list[float] = field(default_factory=list)  # when each failed attempt's torchrun exited
    state: str = JobState.STARTING
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    @classmethod
    def create(cls, root: Path, spec: JobSpec) -> PlainTorchrunJob:
        spec = spec.replace(**{"ft.inprocess": False})
        jd = JobDir(root / spec.name)
        jd.create(spec)
        return cls(jd, spec)

    def inject(self, fault: str | FaultCommand, rank: int | None = None) -> None:
        """Fire ``fault`` (a name: at the next step; ``kill-launcher`` kills torchrun, the node's launcher;
        or a command, e.g. at a step)."""
        command = fault if isinstance(fault, FaultCommand) else FaultCommand(fault, rank=rank)
        submit(self.jd.pending, command.validate(self.spec.world_size, self.spec.nnodes))

    def start(self, timeout: float) -> None:
        self._thread = threading.Thread(target=self._run, args=(timeout,), daemon=True)
        self._thread.start()

    def wait(self, timeout: float) -> str:
        """The final state once the attempts have ended (at most ``timeout`` s from now; then it says
        ``running``)."""
        if self._thread is not None:
            self._thread.join(timeout)
        return self.state

    def stop(self) -> str:
        """End the current attempt and return the final state."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        return self.state

    def _run(self, timeout: float) -> None:
        deadline = time.time() + timeout
        attempt = 0
        events = EventWriter(self.jd.events_path, self.spec.name)
        tail, mon = EventTail(self.jd.events_path), JobMonitor()
        incidents = Incidents(mon, events.emit, time.time())

        def fold() -> None:
            for e in tail.read():
                mon.update([e])
                incidents.observe(e)

        events.emit("job_start", spec_digest=self.spec.digest(), world_size=self.spec.world_size,
                    steps=self.spec.steps, backend="torchrun", host=socket.gethostname(), pid=os.getpid())
        self.state, reason = JobState.RUNNING, ""
        while self.state == JobState.RUNNING:
            proc = self._launch(attempt)
            while proc.poll() is None and time.time() < deadline and not self._stop.is_set():
                fold()
                time.sleep(POLL_S)
            ended = time.time()
            self._cleanup(proc)
            fold()
            if self._stop.is_set():
                self.state, reason = JobState.STOPPED, "stopped"
            elif proc.returncode == 0:
                self.state, reason = JobState.SUCCEEDED, f"all {self.spec.steps} steps done"
            elif time.time() >= deadline:
                self.state, reason = JobState.FAILED, f"not done after {timeout:.0f}s"
            else:  # the "scheduler" resubmits at once
                self.exits.append(ended)
                cause = incidents.cause_from_exit(None, proc.returncode)
                incidents.open(Incident(RestartLevel.JOB, f"{cause}; torchrun exited, resubmitted",
                                        incidents.blame(), incidents.fault_time(), ended, mon.last_step))
                attempt += 1
        fold()
        events.emit("job_end", state=self.state, reason=reason, final_step=mon.last_step, digest=mon.digest,
                    restarts=mon.restarts_by_level())
        events.close()

    def _launch(self, attempt: int) -> subprocess.Popen:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc-per-node={self.spec.nproc_per_node}",
               "--max-restarts=0", f"--log-dir={self.jd.logs / f'torchrun-{attempt}'}", "-m", TRAINER_MODULE]
        env = quiet_env({**os.environ, "OMP_NUM_THREADS": str(self.spec.threads_per_rank),
                         "EKSFT_JOB": self.spec.name, "EKSFT_JOB_DIR": str(self.jd.path),
                         "EKSFT_JOB_ATTEMPT": str(attempt), procs.JOB_UID_ENV: self.uid})
        with open(self.jd.logs / f"torchrun-{attempt}.log", "ab") as log:
            return subprocess.Popen(cmd, env=env, cwd=self.jd.path, stdout=log, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, start_new_session=True)

    def _cleanup(self, proc: subprocess.Popen) -> None:
        """End torchrun's group and whatever escaped it (ranks run in their own sessions, writers too)."""
        if proc.poll() is None:  # our child, not yet reaped: its pid cannot belong to anyone else
            proc.kill()
            proc.wait()
        procs.kill_marked(self.uid)
