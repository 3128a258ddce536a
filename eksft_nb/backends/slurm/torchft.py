"""A torchft job (``--engine torchft``) on Slurm: its sbatch script, and the runner of its replica groups.

The batch script runs on the allocation's first node. The watcher (:mod:`.allocation`) records the job's
start and end as for an NVRx job; its step is this module's runner (``python -m
eksft_nb.backends.slurm.torchft JOB_DIR FIRST_NODE``), which starts the Lighthouse there and one job step
per replica group (``srun --relative=G``: group G on the allocation's node G). A group whose step fails is
started again alone (up to ``max_job_restarts`` times per group) and heals from a peer, while the others
train on; the job is never requeued (the surviving groups hold its state). The runner records the group's
loss and its heal as the local supervisor does (:mod:`eksft_nb.engines.torchft.losses`).

Ports (see :mod:`eksft_nb.engines.torchft.hosts`): the Lighthouse binds the first node's address on
``--slurm-port``; a group's store, manager and checkpoint servers bind free ports on the address its node's
host name resolves to; none binds every interface.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from ...engines.torchft import hosts, lighthouse
from ...engines.torchft.losses import LostGroups, fault_time
from ...engines.torchft.plan import TRAINER_MODULE, job_env
from ...engines.torchft.trainer import LAST_STEP_ENV, RESTART_ENV
from ...events import EventTail, EventWriter
from ...jobdir import JobDir
from ...monitor import JobMonitor
from ...runtime.quiet import quiet_env
from ...shellquote import export, word
from ...spec import JobSpec
from .render import WATCHER, directives, job_dir, new_job_uid, uid_line

RUNNER = "eksft_nb.backends.slurm.torchft"
POLL_S = 0.2


def render(spec: JobSpec, job_uid: str | None = None) -> str:
    """The sbatch script; ``job_uid`` is the launch's (a new one when not given)."""
    jd, port = job_dir(spec), spec.slurm.port
    env = job_env(spec, job_dir=str(jd.path), lighthouse="", host="", store_port=hosts.ANY_PORT)
    for per_node in ("TORCHFT_LIGHTHOUSE", hosts.HOST_ENV, "MASTER_ADDR", "EKSFT_JOB_ATTEMPT"):   # set below
        del env[per_node]
    env = quiet_env(env)
    heads = [d.replace("--requeue", "--no-requeue") for d in directives(spec)]
    lines = ["#!/bin/bash", *heads,
             f"# eksft-nb job {spec.name} (spec {spec.digest()}), engine torchft: its folder {jd.path} is "
             "on the shared disk",
             "set -u",
             "# the environment of every replica group",
             *(export(k, v) for k, v in env.items()),
             'export EKSFT_JOB_ATTEMPT="${SLURM_RESTART_COUNT:-0}"',
             uid_line(job_uid or new_job_uid()),
             "# the Lighthouse is on the allocation's first node (this script runs there), port "
             f"{port}",
             'FIRST_NODE=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1)',
             f'export TORCHFT_LIGHTHOUSE="http://$FIRST_NODE:{port}"',
             "# the watcher records the job's start and end; its step starts the Lighthouse and one job step",
             "# per replica group, and starts a lost group again alone",
             f"python -m {WATCHER} {word(str(jd.path))} -- python -m {RUNNER} "
             f'{word(str(jd.path))} "$FIRST_NODE"',
             'exit "$?"']
    return "\n".join(lines) + "\n"


def gave_up(spec: JobSpec, code: int) -> str:
    """Why the job failed when the runner's step ended ``code``: it restarted lost groups alone until it
    gave up."""
    return (f"a replica group was lost more often than max_job_restarts={spec.ft.max_job_restarts} allows, "
            f"or the Lighthouse ended (exit {code}; see `logs --debug`)")


def group_step(spec: JobSpec, group: int, restart: int, log: Path) -> list[str]:
    """Replica group ``group``'s job step, on the allocation's node ``group``; its servers on the address
    that node's host name resolves to. The trainer leads a process group of its own, which the step's shell
    ends with it: a child it leaves behind (a checkpoint writer) would hold the step's output open, and
    Slurm would end the step only 60 s later (measured), too late for the group to heal from a peer."""
    inner = (f'export {hosts.HOST_ENV}="{hosts.rendered("slurm")}" MASTER_ADDR="{hosts.rendered("slurm")}"; '
             f'setsid -w "$0" -m {TRAINER_MODULE} & wait "$!"; rc=$?; kill -KILL -- "-$!" 2>/dev/null; '
             'exit "$rc"')
    return ["srun", "--nodes=1", "--ntasks=1", f"--relative={group}", f"--job-name={spec.name}-g{group}",
            f"--output={log}", "bash", "-c", inner, sys.executable]


class Runner:
    def __init__(self, jd: JobDir, first_node: str) -> None:
        self.jd, self.spec, self.first = jd, jd.spec(), first_node
        self.restarts: dict[int, int] = {}
        self.mon, self.tail = JobMonitor(), EventTail(jd.events_path)
        self.losses = LostGroups(EventWriter(jd.events_path, self.spec.name, rank=None).emit,
                                 lambda text: print(f"eksft: {text}", file=sys.stderr))
        self.started: dict[int, float] = {}   # group -> when its latest step was started
        self.procs: list[subprocess.Popen[Any]] = []

    def run(self) -> int:
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))   # the watcher gave up: end everything
        try:
            argv = lighthouse.argv(self.spec.slurm.port, hosts.resolve(self.first))
            with open(self.jd.logs / "lighthouse.log", "ab") as log:
                # in the job's folder: its gateway reads the job's secret there, and reports refused peers
                lh = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                      cwd=self.jd.path)
            self.procs.append(lh)
            groups = {g: self._start(g) for g in range(self.spec.nnodes)}
            while groups:
                self._pump()
                if lh.poll() is not None:   # its last line says why (one that cannot be private here)
                    print(f"eksft: torchft's Lighthouse ended (exit {lh.returncode}: "
                          f"{last_line(self.jd.logs / 'lighthouse.log')})", file=sys.stderr)
                    return 1
                for g, step in list(groups.items()):
                    code = step.poll()
                    if code is None:
                        continue
                    if code == 0:
                        del groups[g]
                    elif self.restarts.get(g, 0) >= self.spec.ft.max_job_restarts:
                        print(f"eksft: replica group {g}'s step failed (exit {code}); no restarts left "
                              f"(max_job_restarts={self.spec.ft.max_job_restarts})", file=sys.stderr)
                        return 1
                    else:
                        self._lost(g, code)
                        self.restarts[g] = self.restarts.get(g, 0) + 1
                        groups[g] = self._start(g)
                        print(f"eksft: replica group {g}'s step failed (exit {code}); started it again alone "
                              f"({self.restarts[g]} of {self.spec.ft.max_job_restarts})", file=sys.stderr)
                time.sleep(POLL_S)
            self._pump()
            return 0
        finally:
            for proc in self.procs:
                if proc.poll() is None:
                    proc.terminate()
            for proc in self.procs:
                proc.wait()

    def _pump(self) -> None:
        """The job's new events: the steps and heals that close a lost group's incident."""
        for e in self.tail.read():
            self.mon.update([e])
            self.losses.observe(e)

    def _lost(self, group: int, code: int) -> None:
        """Group ``group``'s step ended with ``code``: its ``failure`` (dated by an injected fault on it,
        else now), before it is started again."""
        detected = time.time()
        self._pump()
        when = fault_time(self.mon.faults, group, self.started.get(group, 0.0), detected)
        self.losses.lost(group, f"replica group {group}'s job step ended (exit {code})", when, detected,
                         self.mon.last_step)

    def _start(self, group: int) -> subprocess.Popen[Any]:
        self._pump()
        self.started[group] = time.time()
        restart = self.restarts.get(group, 0)
        env = {**os.environ, "RANK": str(group), "GROUP_RANK": str(group), "REPLICA_GROUP_ID": str(group),
               RESTART_ENV: str(restart), LAST_STEP_ENV: str(self.mon.last_step if restart else 0)}
        log = self.jd.logs / f"group-{group}-{restart}.log"
        step = subprocess.Popen(group_step(self.spec, group, restart, log), env=env, stdin=subprocess.DEVNULL)
        self.procs.append(step)
        return step


def last_line(log: Path) -> str:
    """A log's last line (of its last 4 KiB), or where to look."""
    try:
        with open(log, "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - 4096))
            lines = f.read().decode(errors="replace").strip().splitlines()
    except OSError:
        lines = []
    return lines[-1][:300] if lines else "see logs/lighthouse.log"


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(f"usage: python -m {RUNNER} JOB_DIR FIRST_NODE", file=sys.stderr)
        return 2
    return Runner(JobDir(Path(argv[0])), argv[1]).run()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
