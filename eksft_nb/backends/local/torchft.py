"""The local supervisor of a torchft job (``--engine torchft``): the Lighthouse on loopback, and each
replica group's processes (one per rank, :mod:`.torchft_group`: a group of N ranks trains as torchft HSDP,
and is the unit that is lost and restarted). The clusters' torchft parts are beside it:
:mod:`eksft_nb.backends.eks.torchft`, :mod:`eksft_nb.backends.slurm.torchft`.

It keeps :class:`.supervisor.Supervisor`'s lifecycle (keeper, events, stop, the job's end) and replaces
what differs: there is no ft_launcher, and a lost group is restarted alone while the others train on. Its
``failure`` and ``restart`` events (level ``job``: the supervisor recovered it) say what the job lost
(:mod:`eksft_nb.engines.torchft.losses`, shared with the clusters' backends).

A group restarted alone is forked from a zygote (:mod:`eksft_nb.runtime.zygote`) started for its next
restart once every group is set up: a fresh process's imports were most of a rejoin, and under load longer
than the peer's remaining steps (a group of one rank; HSDP's groups of N restart cold so far). When every
step is done while a group still rejoins, it is ended and said.

A group is lost when one of its processes ends, or when it hangs: a rank's progress beacon shows it inside
a step, not waiting for its peers, and unchanged for :func:`hang_after_s` (torchft's heartbeats go on from a
thread, so the Lighthouse keeps a hung group in the quorum and the others would wait for it). When every
group is lost (or the others were restarted and have not healed yet), no peer holds the job's state: the
job restarts as a whole (a new attempt) and every group loads the newest committed checkpoint, through
the incident of the job-level tier.
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

import psutil

from ... import loopback, procs
from ...engines.torchft import lighthouse
from ...engines.torchft.losses import LostGroups, fault_time
from ...engines.torchft.outcome import outcome
from ...engines.torchft.plan import group_argv, group_env, store_port
from ...engines.torchft.script import REFUSED_EXIT, refusal
from ...incidents import Incident
from ...jobdir import JobDir
from ...launcher import WARM_SHIM
from ...runtime.quiet import quiet_env
from ...runtime.warm_shim import SOCKET_ENV as WARM_SOCKET
from ...runtime.warm_shim import ZYGOTE_ENV as WARM_ZYGOTE
from ...states import JobState, RestartLevel
from .supervisor import POLL_S, Supervisor
from .torchft_group import Group

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
        # the groups lost, until each heals
        self.losses = LostGroups(self.events.emit, self.say, self.spec.nproc_per_node)
        self.beacons: dict[int, tuple[tuple, float]] = {}  # rank -> (its beacon's progress, when first seen)
        self.set_up: set[int] = set()  # the groups whose current process has reported its rank_start

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

    def _tag(self, group: int, restart: int) -> str:
        return f"g{group}.{self.attempt}.{restart}"

    def _warm_next(self) -> None:
        """Once every group is set up and none is rejoining, start each group's zygote for its next restart
        (:mod:`eksft_nb.runtime.zygote`: torch and the runtime imported ahead, off any start-up's CPU): a
        group restarted alone is then forked from it instead of importing anew, which under load took
        most of its rejoin (bench/README.md, "torchft: a killed group's rejoin")."""
        if self.spec.nproc_per_node > 1 or self.losses.open or len(self.set_up) < len(self.nodes):
            return
        for node in self.nodes:
            tag = self._tag(node.index, self.group_restarts.get(node.index, 0) + 1)
            if tag not in self.zygotes:
                self._start_zygote(tag)

    def _start_group(self, group: int, last_step: int = 0, fresh: bool = True) -> Group:
        """Start replica group ``group``'s processes, one per rank: ``fresh`` with the others (it loads the
        job's checkpoint), else alone (it heals from a peer), forked from its warm zygote when one is up."""
        restart = self.group_restarts.get(group, 0)
        tag = self._tag(group, restart)
        zygote = self.zygotes.get(tag) if not fresh else None
        # its socket's path (the zygote runs: nothing is started)
        sock = self._start_zygote(tag) if zygote is not None and zygote.poll() is None else None
        port = store_port(self.spec, lambda: loopback.free_ports(1)[0])
        log = self.jd.logs / f"group-{group}-{self.attempt}.{restart}.log"   # every rank's output
        argv = group_argv(self.spec)
        ranks: list[subprocess.Popen] = []
        for local in range(self.spec.nproc_per_node):
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
                        store_port=port,   # the group's store, which its rank 0 hosts
                        restart=0 if fresh else restart,
                        last_step=last_step,
                        local_rank=local,
                    ),
                    "EKSFT_JOB_ATTEMPT": str(self.attempt),  # > 0: every group was lost, the job restarts
                    **({WARM_SOCKET: sock, WARM_ZYGOTE: str(self.zygotes[tag].pid)} if sock else {}),
                }
            )
            # the shim hands the command to the zygote (or, refused, runs it cold: said in the group's log);
            # rank 0 leads the group's process group, the others join it (within the supervisor's session:
            # a process cannot join a group of another session)
            command = [argv[0], "-S", WARM_SHIM, *argv[1:]] if sock else argv
            ranks.append(self._spawn(command, env, log, ranks[0].pid if ranks else 0))
        lead = ranks[0]
        self.events.emit("launch", attempt=restart, node=group, pid=lead.pid, pgid=lead.pid)
        return Group(group, log, tag, procs.identity(lead.pid), popen=lead, others=ranks[1:])

    def _spawn(self, argv: list[str], env: dict[str, str], log: Path,
               pgid: int | None = None) -> subprocess.Popen:
        """A process of the job in its own session (signalled as a group), or in process group ``pgid``
        (0: a new one it leads); its output appended to ``log``."""
        with open(log, "ab") as out:
            return subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, cwd=self.jd.path,
                                    start_new_session=pgid is None, process_group=pgid)

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
            if done and self.losses.open and all(c is not None or n.index in self.losses.open
                                          for n, c in zip(self.nodes, codes)):
                self._end_rejoins()   # training is over: a group still rejoining has nothing left to join
                codes = [n.poll() for n in self.nodes]
            if all(c is not None for c in codes) and (done or all(c == 0 for c in codes)):
                self._pump()
                return outcome(self.spec, self.mon)
            if not done and any(c not in (None, 0) for c in codes):
                time.sleep(SETTLE_S)  # one fault may end several groups: see them all before acting
                codes = [n.poll() for n in self.nodes]
            if not done and self._stateless(codes):
                if (ended := self._restart_job(codes)) is not None:
                    return ended
                continue
            hung = {} if done else self._hung()
            self._warm_next()
            for i, (node, code) in enumerate(zip(self.nodes, codes)):
                if done or (code in (None, 0) and node.index not in hung):
                    continue
                cause, since = hung.get(node.index) or (self._lost(node, code), None)
                if self.group_restarts.get(node.index, 0) >= self.spec.ft.max_job_restarts:
                    return JobState.FAILED, (
                        f"{cause}; no restarts left for it (max_job_restarts={self.spec.ft.max_job_restarts})"
                    )
                self.nodes[i] = self._restart_group(node, cause, since)
            time.sleep(POLL_S)

    def _stateless(self, codes: list[int | None]) -> bool:
        """Whether no group holds the job's state: each was lost, or restarted and not healed yet (it
        has none of its own, and would find no peer to heal from), and one was lost just now."""
        return any(c not in (None, 0) for c in codes) and all(
            c not in (None, 0) or n.index in self.losses.open for n, c in zip(self.nodes, codes))

    def _lost(self, node: Group, code: int) -> str:
        """Why a group that ended is lost: its rank's exit (which rank, where a group has several)."""
        size = self.spec.nproc_per_node
        which = "" if size == 1 else f" {node.lost_rank(size)}"
        return f"replica group {node.index}'s rank{which} was {_how(code)}"

    def _hung(self) -> dict[int, tuple[str, float]]:
        """The running groups that hang (see the module's docstring): the cause, and since when."""
        now, hung = time.time(), {}
        limit = hang_after_s(self.losses.typical_step_s())
        size = self.spec.nproc_per_node
        for node in self.nodes:
            for rank in node.ranks(size):
                try:
                    b = json.loads((self.jd.progress / f"rank-{rank}.json").read_text())
                    mine = b["pid"] in node.pids or self._forked_for(node, b["pid"])
                    progress = (int(b["step_entered"]), int(b["step_done"]), bool(b["in_collective"]))
                except (OSError, ValueError, KeyError, TypeError):
                    continue
                if not mine or node.poll() is not None:
                    continue
                seen = self.beacons.get(rank)
                if seen is None or seen[0] != progress:
                    self.beacons[rank] = (progress, now)
                    continue
                entered, done, waiting = progress
                if entered > done and not waiting and now - seen[1] > limit and node.index not in hung:
                    which = "" if size == 1 else f" (its rank {rank})"
                    hung[node.index] = (
                        f"replica group {node.index} hung{which}: no progress in step {entered} for "
                        f"{now - seen[1]:.0f} s (limit {limit:.0f} s), not waiting for its peers",
                        seen[1],
                    )
        return hung

    def _forked_for(self, node: Group, pid: int) -> bool:
        """Whether ``pid`` is the rank a warm zygote forked for ``node`` (its start-up environment, the
        zygote's, carries the node's mark)."""
        try:
            env = psutil.Process(pid).environ()
        except (psutil.Error, OSError):
            return False
        return env.get(procs.JOB_UID_ENV) == self.job_uid and env.get(procs.NODE_MARK) == node.tag

    def _restart_group(self, node: Group, cause: str, since: float | None = None) -> Group:
        """A group was lost (its process died, or hung ``since`` then and is ended here): the survivors
        train on, and it restarts and heals from a peer."""
        detected, group = time.time(), node.index
        self._pump()
        procs.kill_marked(self.job_uid, node.tag)  # every process of the group (it may hang), what it left
        node.wait()
        for rank in node.ranks(self.spec.nproc_per_node):
            self.beacons.pop(rank, None)
        self.set_up.discard(group)
        self.losses.lost(group, cause, self._fault_time(node, detected, since), detected, self.mon.last_step)
        self.group_restarts[group] = self.group_restarts.get(group, 0) + 1
        self.say(
            f"{cause} at step {self.mon.last_step}: the other groups train on; restarting it "
            f"({self.group_restarts[group]} of {self.spec.ft.max_job_restarts})"
        )
        return self._start_group(group, last_step=self.mon.last_step, fresh=False)

    def _end_rejoins(self) -> None:
        """Every step is committed while lost groups still rejoin: end them (left alone, each would find
        no peer once set up, and fail), and say how far each got."""
        self._pump()   # a heal read now takes its group off the list
        now = time.time()
        for node in self.nodes:
            lost = self.losses.open.pop(node.index, None)
            if lost is None or node.poll() is not None:
                continue
            procs.kill_marked(self.job_uid, node.tag)
            node.wait()
            started = node.identity.get("started") or lost.detected
            where = ("set up, not yet healed from a peer" if node.index in self.set_up
                     else "still setting up (imports, model, its manager; no rank_start yet)")
            message = (f"replica group {node.index} was still rejoining when the job ended: lost "
                       f"{now - lost.fault_time:.1f} s before ({lost.cause}, at step "
                       f"{lost.last_step}), its new process started {now - started:.1f} s before and was "
                       f"{where}; the steps since its loss trained without its batches")
            self.events.emit("warning", what="rejoining", message=message)
            self.say(message)

    def _fault_time(self, node: Group, detected: float, since: float | None = None) -> float:
        """An injected fault on the group (one of its ranks, or the group as a node) dates its loss; else
        when it last made progress (``since``: a hang), else the moment it was seen lost."""
        return fault_time(self.mon.faults, node.index, node.identity.get("started") or 0.0, detected, since,
                          ranks=node.ranks(self.spec.nproc_per_node))

    def _restart_job(self, codes: list[int | None]) -> tuple[JobState, str] | None:
        """Every group was lost: no peer holds the job's state. Restart them all (a new attempt): each
        loads the newest committed checkpoint. The incident closes at the first step after it."""
        detected = time.time()
        self._pump()
        for node in self.nodes:
            procs.kill_marked(self.job_uid, node.tag)
            node.wait()
        for tag, zygote in list(self.zygotes.items()):   # for this attempt's restarts: the next starts cold
            zygote.kill()
            zygote.wait()
            del self.zygotes[tag]
        lost = ", ".join(f"group {n.index} {_how(c) if c is not None else 'restarting, not healed'}"
                         for n, c in zip(self.nodes, codes))
        cause = f"every replica group was lost ({lost}): no peer holds the job's state"
        # groups lost one after the other (a restarted one found no peer): dated by the first loss still open
        fault_time = min([self._fault_time(n, detected) for n in self.nodes] +
                         [loss.fault_time for loss in self.losses.open.values()])
        self.losses.clear()  # their own incidents end with the job's
        self.beacons.clear()
        self.set_up.clear()
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
        if e.kind == "rank_start" and e.rank is not None:
            self.set_up.add(e.rank // self.spec.nproc_per_node)
        elif e.kind == "step_discarded":
            group = e.rank // self.spec.nproc_per_node   # a group's rank 0 reports for it
            self.say(f"replica group {group} threw step {e['step']} away: {e['reason']}")

    def _kill_everything(self, keep_standby: bool = False) -> None:
        super()._kill_everything(keep_standby)
        for node in self.nodes:
            node.wait()   # the groups' other ranks (ended with the marked processes above)
        if self.lighthouse is not None:
            self.lighthouse.wait()  # ended with the job's marked processes above


def _how(code: int) -> str:
    if code < 0 and -code in signal.Signals._value2member_map_:
        return f"killed ({signal.Signals(-code).name})"
    return f"ended (exit {code})"


if __name__ == "__main__":  # ``--run JOB_DIR [--adopt]``: exec'd by the local supervisor's entry point
    sys.exit(TorchftSupervisor(JobDir(Path(sys.argv[2])), adopt="--adopt" in sys.argv).run())
