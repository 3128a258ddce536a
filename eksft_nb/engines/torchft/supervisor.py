"""The local supervisor of a torchft job: the Lighthouse on loopback, and one process per replica group.

It keeps :class:`~eksft_nb.backends.local.supervisor.Supervisor`'s lifecycle (keeper, events, stop,
the job's end) and replaces what differs: there is no ft_launcher, and a lost group is restarted alone
while the others train on. Its ``failure`` and ``restart`` events (level ``job``: the supervisor
recovered it) say what the job lost (:mod:`.losses`, shared with the clusters' backends).

A group is lost when its process ends, or when it hangs: its progress beacon shows it inside a step,
not waiting for its peers, and unchanged for :func:`hang_after_s` (torchft's heartbeats go on from a
thread, so the Lighthouse keeps a hung group in the quorum and the others would wait for it). When every
group is lost, no peer holds the job's state: the job restarts as a whole (a new attempt) and every
group loads the newest committed checkpoint, through the incident of the job-level tier.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from ... import loopback, procs
from ...jobdir import JobDir
from ...backends.local.supervisor import POLL_S, Node, Supervisor
from ...runtime.quiet import quiet_env
from ...incidents import Incident
from ...states import JobState, RestartLevel
from . import lighthouse
from .losses import LostGroups, fault_time
from .plan import group_argv, group_env
from .script import REFUSED_EXIT, refusal

HANG_MIN_S = 8.0  # a group is hung after no progress for this long at least (a restarted one's start aside)
HANG_STEPS = 5  # ... or for this many typical steps, if longer
SETTLE_S = 0.5  # a group found dead: how long to look again for others dying of the same fault


def hang_after_s(typical_step_s: float) -> float:
    """How long a group may show no progress inside a step before it counts as hung."""
    return max(HANG_MIN_S, HANG_STEPS * typical_step_s)


class TorchftSupervisor(Supervisor):
    def __post_init__(self) -> None:
        super().__post_init__()
        self.lighthouse: subprocess.Popen | None = None
        self.lighthouse_port = 0
        self.group_restarts: dict[int, int] = {}
        self.losses = LostGroups(self.events.emit, self.say)  # the groups lost, until each heals
        self.beacons: dict[int, tuple[tuple, float]] = {}  # group -> (its beacon's progress, when first seen)

    def _adopt(self) -> tuple[JobState, str] | None:
        """A supervisor that died took the Lighthouse's port with it, which a restarted group needs: end
        the job, said, rather than adopt groups that could not be restarted."""
        self.say(f"supervisor {self.jd.supervisor().get('pid')} is gone; a torchft job cannot be adopted yet")
        return JobState.FAILED, "the supervisor died, and a torchft job cannot be adopted yet: run it again"

    def _launch(self) -> None:
        self.lighthouse_port = loopback.free_ports(1)[0]
        env = quiet_env({**os.environ, procs.JOB_UID_ENV: self.job_uid, procs.NODE_MARK: "lighthouse"})
        self.lighthouse = self._spawn(lighthouse.argv(self.lighthouse_port), env,
                                      self.jd.logs / "lighthouse.log")
        self.t_launch = time.time()
        self.nodes = [self._start_group(g) for g in range(self.spec.nnodes)]
        self.say(
            f"torchft: Lighthouse on 127.0.0.1:{self.lighthouse_port} (pid {self.lighthouse.pid}), "
            f"{len(self.nodes)} replica groups, pids {', '.join(str(n.pid) for n in self.nodes)}"
        )
        self._write_state(JobState.RUNNING)

    def _start_group(self, group: int, last_step: int = 0, fresh: bool = True) -> Node:
        """Start replica group ``group``'s process: ``fresh`` with the others (it loads the job's
        checkpoint), else alone (it heals from a peer)."""
        restart = self.group_restarts.get(group, 0)
        tag = f"g{group}.{self.attempt}.{restart}"
        env = quiet_env(
            {
                **os.environ,
                procs.JOB_UID_ENV: self.job_uid,
                procs.NODE_MARK: tag,
                **group_env(
                    self.spec,
                    group,
                    job_dir=str(self.jd.path),
                    lighthouse_port=self.lighthouse_port,
                    store_port=loopback.free_ports(1)[0],
                    restart=0 if fresh else restart,
                    last_step=last_step,
                ),
                "EKSFT_JOB_ATTEMPT": str(self.attempt),  # > 0: every group was lost, the job restarts
            }
        )
        log = self.jd.logs / f"group-{group}-{self.attempt}.{restart}.log"
        popen = self._spawn(group_argv(self.spec), env, log)
        self.events.emit("launch", attempt=restart, node=group, pid=popen.pid, pgid=popen.pid)
        return Node(group, log, tag, procs.identity(popen.pid), popen=popen)

    def _spawn(self, argv: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
        """A process of the job in its own session (signalled as a group), its output appended to ``log``."""
        with open(log, "ab") as out:
            return subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, cwd=self.jd.path, start_new_session=True)

    def _watch(self) -> tuple[JobState, str] | None:
        while True:
            if (ended := self._read_and_check("the replica groups")) is not None:
                return ended
            if self.lighthouse is not None and (code := self.lighthouse.poll()) is not None:
                return JobState.FAILED, f"torchft's Lighthouse ended (exit {code}; see logs/lighthouse.log)"
            if self.incidents.give_up:
                return JobState.FAILED, self.incidents.give_up
            codes = [n.poll() for n in self.nodes]
            if REFUSED_EXIT in codes:  # a script torchft cannot run (said in one line): restarts can't help
                self._pump()
                refused = self.nodes[codes.index(REFUSED_EXIT)].index
                return JobState.FAILED, refusal(self.mon.rank_errors, refused)
            # a user's script's own loop decides when it is done
            done = not self.spec.script and self.mon.last_step >= self.spec.steps
            if all(c is not None for c in codes) and (done or all(c == 0 for c in codes)):
                self._pump()
                if self.spec.script:
                    return JobState.SUCCEEDED, "the script exited 0 in every replica group"
                if self.mon.last_step >= self.spec.steps:
                    return JobState.SUCCEEDED, f"all {self.spec.steps} steps done"
                return (
                    JobState.FAILED,
                    "the replica groups exited before training finished (see `logs --debug`)",
                )
            if not done and any(c not in (None, 0) for c in codes):
                time.sleep(SETTLE_S)  # one fault may end several groups: see them all before acting
                codes = [n.poll() for n in self.nodes]
            if not done and all(c not in (None, 0) for c in codes):
                if (ended := self._restart_job(codes)) is not None:
                    return ended
                continue
            hung = {} if done else self._hung()
            for i, (node, code) in enumerate(zip(self.nodes, codes)):
                if done or (code in (None, 0) and node.index not in hung):
                    continue
                cause, since = hung.get(node.index) or (f"replica group {node.index}'s rank was {_how(code)}",
                                                        None)
                if self.group_restarts.get(node.index, 0) >= self.spec.ft.max_job_restarts:
                    return JobState.FAILED, (
                        f"{cause}; no restarts left for it (max_job_restarts={self.spec.ft.max_job_restarts})"
                    )
                self.nodes[i] = self._restart_group(node, cause, since)
            time.sleep(POLL_S)

    def _hung(self) -> dict[int, tuple[str, float]]:
        """The running groups that hang (see the module's docstring): the cause, and since when."""
        now, hung = time.time(), {}
        limit = hang_after_s(self.losses.typical_step_s())
        for node in self.nodes:
            try:
                b = json.loads((self.jd.progress / f"rank-{node.index}.json").read_text())
                mine = b["pid"] == node.pid
                progress = (int(b["step_entered"]), int(b["step_done"]), bool(b["in_collective"]))
            except (OSError, ValueError, KeyError, TypeError):
                continue
            if not mine or node.poll() is not None:
                continue
            seen = self.beacons.get(node.index)
            if seen is None or seen[0] != progress:
                self.beacons[node.index] = (progress, now)
                continue
            entered, done, waiting = progress
            if entered > done and not waiting and now - seen[1] > limit:
                hung[node.index] = (
                    f"replica group {node.index} hung: no progress in step {entered} for "
                    f"{now - seen[1]:.0f} s (limit {limit:.0f} s), not waiting for its peers",
                    seen[1],
                )
        return hung

    def _restart_group(self, node: Node, cause: str, since: float | None = None) -> Node:
        """A group was lost (its process died, or hung ``since`` then and is ended here): the survivors
        train on, and it restarts and heals from a peer."""
        detected, group = time.time(), node.index
        self._pump()
        procs.kill_marked(self.job_uid, node.tag)  # every process of the group (it may hang), what it left
        if node.popen is not None:
            node.popen.wait()
        self.beacons.pop(group, None)
        self.losses.lost(group, cause, self._fault_time(node, detected, since), detected, self.mon.last_step)
        self.group_restarts[group] = self.group_restarts.get(group, 0) + 1
        self.say(
            f"{cause} at step {self.mon.last_step}: the other groups train on; restarting it "
            f"({self.group_restarts[group]} of {self.spec.ft.max_job_restarts})"
        )
        return self._start_group(group, last_step=self.mon.last_step, fresh=False)

    def _fault_time(self, node: Node, detected: float, since: float | None = None) -> float:
        """An injected fault on the group (its rank, or the group as a node) dates its loss; else when it
        last made progress (``since``: a hang), else the moment it was seen lost."""
        return fault_time(self.mon.faults, node.index, node.identity.get("started") or 0.0, detected, since)

    def _restart_job(self, codes: list[int | None]) -> tuple[JobState, str] | None:
        """Every group was lost: no peer holds the job's state. Restart them all (a new attempt): each
        loads the newest committed checkpoint. The incident closes at the first step after it."""
        detected = time.time()
        self._pump()
        for node in self.nodes:
            procs.kill_marked(self.job_uid, node.tag)
        lost = ", ".join(f"group {n.index} {_how(c)}" for n, c in zip(self.nodes, codes))
        cause = f"every replica group was lost ({lost}): no peer holds the job's state"
        # groups lost one after the other (a restarted one found no peer): dated by the first loss still open
        fault_time = min([self._fault_time(n, detected) for n in self.nodes] +
                         [loss.fault_time for loss in self.losses.open.values()])
        self.losses.clear()  # their own incidents end with the job's
        self.beacons.clear()
        self.incidents.open(
            Incident(RestartLevel.JOB, cause, None, fault_time, detected, self.mon.last_step), force=True
        )
        if self.incidents.give_up:
            return JobState.FAILED, self.incidents.give_up
        if self.attempt >= self.spec.ft.max_job_restarts:
            return JobState.FAILED, (
                f"{cause}; no job restarts left (max_job_restarts={self.spec.ft.max_job_restarts})"
            )
        self.attempt += 1
        newest = self.mon.last_committed
        # the groups' resume events say which checkpoint loaded (an older one if the newest is refused)
        where = f"the newest that loads (step {newest.step} is the newest committed)" if newest else (
            "step 0: no checkpoint was committed")
        self.say(f"{cause}; restarting every group, each loading {where} (job restart {self.attempt} of "
                 f"{self.spec.ft.max_job_restarts})")
        self.t_launch = time.time()
        self.nodes = [self._start_group(g) for g in range(self.spec.nnodes)]
        self._write_state(JobState.RUNNING)
        return None

    def _on_event(self, e: Any) -> None:
        super()._on_event(e)
        self.losses.observe(e)
        if e.kind == "step_discarded":
            self.say(f"replica group {e.rank} threw step {e['step']} away: {e['reason']}")

    def _kill_everything(self, keep_standby: bool = False) -> None:
        super()._kill_everything(keep_standby)
        if self.lighthouse is not None:
            self.lighthouse.wait()  # ended with the job's marked processes above


def _how(code: int) -> str:
    if code < 0 and -code in signal.Signals._value2member_map_:
        return f"killed ({signal.Signals(-code).name})"
    return f"ended (exit {code})"


if __name__ == "__main__":  # ``--run JOB_DIR [--adopt]``: exec'd by the local supervisor's entry point
    sys.exit(TorchftSupervisor(JobDir(Path(sys.argv[2])), adopt="--adopt" in sys.argv).run())
