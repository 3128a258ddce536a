"""The baseline for recovery: the same trainer under plain ``torchrun`` (no ft_launcher, no in-process
restart, no supervisor), resubmitted from its last checkpoint after every fault, as a batch
scheduler would do at best: the moment ``torchrun`` exits, leftovers are killed and the job is
started again with ``EKSFT_JOB_ATTEMPT`` bumped, so it resumes from its newest committed checkpoint.
"""

from __future__ import annotations

import subprocess
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from eksft_nb import procs
from eksft_nb.control import FaultCommand, submit
from eksft_nb.jobdir import JobDir
from eksft_nb.launcher import TRAINER_MODULE
from eksft_nb.spec import JobSpec

from .common import PY, REPO, rank_env


@dataclass
class PlainTorchrunJob:
    """One baseline job: a job folder (made with ``JobDir.create``) run by successive torchrun attempts.

    :meth:`start` runs the attempts in a thread; faults go in through the job folder, as for eksft."""

    jd: JobDir
    spec: JobSpec
    uid: str = field(default_factory=lambda: uuid.uuid4().hex[:16])
    exits: list[float] = field(default_factory=list)  # when each failed attempt's torchrun exited
    state: str = "pending"
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    @classmethod
    def create(cls, root: Path, spec: JobSpec) -> PlainTorchrunJob:
        spec = spec.replace(**{"ft.inprocess": False})
        jd = JobDir(root / spec.name)
        jd.create(spec)
        return cls(jd, spec)

    def inject(self, fault: str, rank: int | None = None) -> None:
        """Fire ``fault`` at the next step (``kill-launcher`` kills torchrun: the node's launcher)."""
        submit(self.jd.pending,
               FaultCommand(fault, rank=rank).validate(self.spec.world_size, self.spec.nnodes))

    def start(self, timeout: float) -> None:
        self._thread = threading.Thread(target=self._run, args=(timeout,), daemon=True)
        self._thread.start()

    def stop(self) -> str:
        """End the current attempt and return the final state."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        return self.state

    def _run(self, timeout: float) -> None:
        deadline = time.time() + timeout
        attempt = 0
        self.state = "running"
        while self.state == "running":
            proc = self._launch(attempt)
            while proc.poll() is None and time.time() < deadline and not self._stop.is_set():
                time.sleep(0.05)
            ended = time.time()
            self._cleanup(proc)
            if self._stop.is_set():
                self.state = "stopped"
            elif proc.returncode == 0:
                self.state = "succeeded"
            elif time.time() >= deadline:
                self.state = "failed"
            else:  # the "scheduler" resubmits at once
                self.exits.append(ended)
                attempt += 1

    def _launch(self, attempt: int) -> subprocess.Popen:
        cmd = [PY, "-m", "torch.distributed.run", "--standalone",
               f"--nproc-per-node={self.spec.nproc_per_node}",
               "--max-restarts=0", f"--log-dir={self.jd.logs / f'torchrun-{attempt}'}", "-m", TRAINER_MODULE]
        env = rank_env(EKSFT_JOB=self.spec.name, EKSFT_JOB_DIR=str(self.jd.path),
                       EKSFT_JOB_ATTEMPT=str(attempt), **{procs.JOB_UID_ENV: self.uid})
        with open(self.jd.logs / f"torchrun-{attempt}.log", "ab") as log:
            return subprocess.Popen(cmd, env=env, cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, start_new_session=True)

    def _cleanup(self, proc: subprocess.Popen) -> None:
        """End torchrun's group and whatever escaped it (ranks run in their own sessions, writers too)."""
        if proc.poll() is None:  # our child, not yet reaped: its pid cannot belong to anyone else
            proc.kill()
            proc.wait()
        procs.kill_marked(self.uid)
