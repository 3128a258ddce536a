"""The watcher inside a Slurm allocation: what the local supervisor records, for a job Slurm runs.

``python -m eksft_nb.backends.slurm.allocation JOB_DIR -- srun ...`` is the batch shell (the script execs
it, on the allocation's first node), with the job's spec on its stdin. It records the job's start once (a
requeued run finds it), runs the ``srun`` step that starts one ``ft_launcher`` per node, and turns what
the launchers log and the ranks write into the same ``failure``/``restart`` events as locally
(:class:`Incidents`, the supervisor's launcher-log parser). When the step ends it records the job's end,
or requeues the job (``scontrol requeue``: its next run resumes from the newest committed checkpoint):

- a node's launcher was lost and job restarts are left (``max_job_restarts``): a job-level restart, off
  the node that failed where the partition has others;
- the ranks drained (SIGTERM to the steps: ``scancel --signal=TERM``, a preemption's grace period, or
  this watcher's own before the time limit: Slurm's ``--signal=B:USR1`` warns it alone): the drain's save
  is committed, the job is requeued without counting against ``max_job_restarts``, and a job that stopped
  short of its last step is never recorded as succeeded.

Its exit status is 0 only for a job that succeeded. It never starts or kills ranks itself: Slurm owns the
processes (``scancel`` signals them all).
"""

from __future__ import annotations

import dataclasses
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from ... import nvrx
from ...errors import EksftError
from ...events import EventTail, EventWriter
from ...incidents import ANY_NODE, NODE_FAULT_WINDOW_S, Incidents
from ...jobdir import JobDir
from ...launcher import Ports, control_argv, worker_index
from ...monitor import JobMonitor
from ...nvrx_cycles import CycleRecord, read_cycle_records
from ...preflight.doctor import refusal
from ...spec import MAX_SPEC_BYTES, JobSpec
from ...states import ACTIVE, JobState, RestartLevel
from ...timeouts import NODE_GPUS_ENV, derive, resolved
from ..launcher_log import LauncherLine, parse_launcher_line
from . import cluster, engine_parts, gpus
from .carried import take_carried
from .notices import WAITING, Networks, Waiting, grace_warnings
from .render import DRAIN_SIGNAL, REQUEUE_EXIT, STOP_MARK, efa_on, grace_s

POLL_S = 0.2
CONTROL_MODULE = "nvidia_resiliency_ext.fault_tolerance.control_plane"   # nvrx-control (NVRx 0.6+)
_LOG = re.compile(r"launcher-(\d+)-(\d+)\.log$")
# srun's word on a task that did not exit on its own (the node failed, or its launcher was killed: "Killed")
_NODE_LOST = re.compile(r"srun: error: (?:Node failure on ([\w.-]+)|([\w.-]+): task \d+: (?!Exited)(\w+))")


class Watcher:
    def __init__(self, jd: JobDir, srun: list[str]) -> None:
        self.jd, self.srun = jd, srun
        self.spec = resolved(jd.spec())   # the timeouts its launchers run with (GPU ones where it has GPUs)
        self.attempt = int(os.environ.get("SLURM_RESTART_COUNT") or 0)
        self.job_id = os.environ.get("SLURM_JOB_ID", "")
        self.events = EventWriter(jd.events_path, self.spec.name, rank=None)
        self.tail = EventTail(jd.events_path)
        self.mon = JobMonitor()
        self.incidents = Incidents(self.mon, self.events.emit, time.time(),
                                   patience=self.spec.ft.progress_patience,
                                   steps_expected=not self.spec.script)
        self.offsets: dict[Path, int] = {}
        self.ranks_started: dict[int, float] = {}
        self.t_launch = time.time()
        self.signalled = False                   # SIGTERM: the allocation ends (scancel, a requeue)
        self.warned_at: float | None = None      # Slurm's warning: the time limit is a grace period away
        self.drain_sent = False
        self.drained: dict[str, Any] | None = None   # this run's drain event
        self.job_failures = self.drains = 0      # of the runs before, from their events
        self.lost_node: str | None = None        # the node srun said failed
        self.node_failure_said: str | None = None   # srun's "Node failure on NODE"
        self.launcher_killed: str | None = None   # srun's "NODE: task N: Killed": its ft_launcher was lost
        # the step is one ft_launcher per node (torchft's runner starts a lost group again itself)
        self.ft_launchers = engine_parts.of(self.spec).gave_up is None
        self.nodelist = os.environ.get("SLURM_JOB_NODELIST", "")
        self.node_lost = False                   # Slurm said a node of the allocation failed
        self.networks = Networks(efa_on(self.spec) and self._gpu_run())
        self.net_failure: str | None = None
        endpoint = next((a.split("=", 1)[1] for a in srun if a.startswith("--rdzv-endpoint=")), "")
        self.waiting = Waiting(jd.path / WAITING, self.attempt, endpoint) if endpoint else None
        self.nvrx = nvrx.installed()   # the nodes' (one environment for the allocation's nodes)
        self.control: subprocess.Popen | None = None   # nvrx-control, the store host of NVRx's standby spares
        self.cycle_dir = jd.logs / "nvrx" / f"attempt-{self.attempt}"   # NVRx 0.6+'s cycle records
        self.cycles_seen: dict[int, CycleRecord] = {}

    # ---- the run ---------------------------------------------------------------------------------
    def run(self) -> int:
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGINT, self._on_signal)
        signal.signal(getattr(signal, f"SIG{DRAIN_SIGNAL}"), self._on_warning)
        backlog = self.tail.read()   # a requeued run: what the runs before it recorded
        emit, self.incidents.emit = self.incidents.emit, lambda *_, **__: None   # recorded already
        for e in backlog:
            self.mon.update([e])
            if e.kind in ("failure", "restart"):
                self.incidents.restore(e)
            self.incidents.observe(e)
        self.incidents.emit = emit
        self.job_failures = sum(e.kind == "failure" and e["level"] == RestartLevel.JOB for e in backlog)
        self.drains = sum(e.kind == "drain" for e in backlog)
        found = gpus.count() if NODE_GPUS_ENV in os.environ else None
        if not any(e.kind == "job_start" for e in backlog):
            here = nvrx.installed()
            extra = {"gpus_per_node": self._node_gpus(found), "gpus_from": found.source} if found else {}
            self.events.emit("job_start", spec_digest=self.spec.digest(), world_size=self.spec.world_size,
                             steps=None if self.spec.script else self.spec.steps, backend="slurm",
                             host=socket.gethostname(), pid=os.getpid(), nvrx=here.version if here else None,
                             **extra)
            try:
                limits = grace_warnings(derive(self.spec).grace.seconds,
                                        os.environ.get("SLURM_JOB_PARTITION", ""))
            except EksftError as e:   # what Slurm could not say is no reason not to run the job
                limits = []
                print(f"eksft: could not read the cluster's KillWait and GraceTime: {e}", file=sys.stderr)
            for what, message in limits:
                self.events.emit("warning", what=what, message=message)
        elif self.attempt > 0 and self.incidents.incident is None:
            self._unrecorded_end(backlog[-1].t)
            if self._restarts_used() > self.spec.ft.max_job_restarts:
                return self._end(JobState.FAILED, f"{self.incidents.incident.cause}; no job restarts left "
                                                  f"(max_job_restarts={self.spec.ft.max_job_restarts})")
        if found is not None:
            print(f"eksft: {self._node_gpus(found)} GPUs per node ({found.source}): the "
                  f"{'GPU' if self._gpu_run() else 'CPU'} timeouts and environment", file=sys.stderr)
            if (refused := self._gpu_refusal(found)) is not None:
                return self._end(JobState.FAILED, refused)
        # doctor's gate (the node's NVRx, torch, torchft, GPUs), in the watcher: a script submitted by hand
        # has its spec only once the watcher made the job folder, and the reason becomes the job's
        if (refused := refusal(self.spec)) is not None:
            node = os.environ.get("SLURMD_NODENAME") or socket.gethostname()
            print(f"eksft: error: {refused}", file=sys.stderr)
            return self._end(JobState.FAILED, f"doctor on {node}: {refused}")
        if self.waiting is not None and (why := self.waiting.start()) is not None:
            self._warn("rendezvous", f"the launchers wait for the rendezvous at {self.waiting.endpoint}, but "
                                     f"{why}: they give up after their join timeout")
        if self.attempt > 0:   # this run is the open incident's job restart
            self.incidents.group_restarted(ANY_NODE, self.t_launch)
        return self._supervise()

    def _supervise(self) -> int:
        self.srun = self._with_release_flags(self.srun)
        if self.spec.spare_nodes:
            self._start_control()
        step = subprocess.Popen(self.srun, stdin=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                errors="replace")
        reader = threading.Thread(target=self._srun_errors, args=(step,), daemon=True)
        reader.start()
        while step.poll() is None and not self.incidents.give_up and self.net_failure is None:
            self._pump()
            if self.warned_at is not None and not self.drain_sent:
                self._drain()
            time.sleep(POLL_S)
        if step.poll() is None:   # gave up: end the step (Slurm ends its processes on every node)
            step.terminate()
        code = step.wait()
        self._end_control()
        reader.join(timeout=5)
        self._pump()
        if self.waiting is not None:
            self.waiting.end()
        return self._settle(code)

    def _settle(self, code: int) -> int:
        """Record the end, or requeue the job: its exit status."""
        outcome = self._outcome(code)
        if outcome is None:   # Slurm ends the allocation: it requeues the job (--requeue) or ends it
            return 1
        if isinstance(outcome, tuple):
            return self._end(*outcome)
        if not self.job_id:
            return self._end(JobState.FAILED, f"{outcome} (and no $SLURM_JOB_ID to requeue: sbatch runs it)")
        job = self._job()
        try:
            cluster.requeue(self.job_id)
        except EksftError as e:
            if self.node_lost:   # Slurm's own requeue of a lost node's job got there first
                return 1
            if self.drained is not None:
                return self._end(JobState.STOPPED, f"{self._drained_text()}; Slurm would not requeue the job "
                                                   f"({e.problem}): resume it from that checkpoint")
            return self._end(JobState.FAILED, f"{outcome}; Slurm would not requeue the job ({e.problem})")
        self._keep_off(job)
        return REQUEUE_EXIT

    def _end(self, state: JobState, reason: str) -> int:
        self.incidents.end(time.time())
        if state == JobState.FAILED:
            reason = self.incidents.named(reason)
        self.events.emit("job_end", state=state, reason=reason, final_step=self.mon.last_step,
                         digest=self.mon.digest, restarts=self.mon.restarts_by_level())
        if self.waiting is not None:
            self.waiting.end()
        return 0 if state == JobState.SUCCEEDED else 1

    def _with_release_flags(self, srun: list[str]) -> list[str]:
        """The step's command with the flags only this NVRx takes (the nodes' and the batch host's are one
        environment), which a render for any node cannot know: the cycle records' folder, progress cut-off."""
        at = worker_index(srun)
        flags = self.nvrx.launcher_flags(str(self.cycle_dir)) if self.nvrx is not None else []
        return srun if at is None else [*srun[:at], *flags, *srun[at:]]

    def _start_control(self) -> None:
        """NVRx's nvrx-control on this node (the allocation's first): the store host of the rendezvous the
        launchers join (their line says ``is_host=false``), at the endpoint and id their line names, writing
        the cycle records. Its own session: Slurm's signals to the step do not reach it; it ends with the
        rendezvous (or :meth:`_end_control`)."""
        given = dict(a[2:].split("=", 1) for a in self.srun
                     if a.startswith(("--rdzv-endpoint=", "--rdzv-id=")))
        host, _, port = given.get("rdzv-endpoint", "").rpartition(":")
        if not host or not port.isdigit() or "rdzv-id" not in given:
            return
        argv = control_argv(self.spec, rdzv_host=host, ports=Ports.from_base(int(port)),
                            rdzv_id=given["rdzv-id"], cycle_dir=str(self.cycle_dir),
                            cycle_job=os.environ.get("SLURM_JOB_ID") or self.spec.name)
        with open(self.jd.logs / f"nvrx-control-{self.attempt}.log", "ab") as out:
            self.control = subprocess.Popen([sys.executable, "-m", CONTROL_MODULE, *argv[1:]], stdout=out,
                                            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                            start_new_session=True)

    def _end_control(self) -> None:
        if self.control is None:
            return
        self.control.terminate()   # it saves nothing: the rendezvous ends with the step
        try:
            self.control.wait(10)
        except subprocess.TimeoutExpired:
            self.control.kill()
            self.control.wait()

    def _read_cycle_records(self) -> None:
        """NVRx's record of each worker-group cycle (0.6+) as ``nvrx_cycle`` events, as the local supervisor
        folds them: written by the store host into the shared job folder."""
        if self.nvrx is None or not self.nvrx.cycle_records:
            return
        for record in read_cycle_records(self.cycle_dir):
            if self.cycles_seen.get(record.cycle) != record:
                self.cycles_seen[record.cycle] = record
                self.events.emit("nvrx_cycle", attempt=self.attempt, **record.fields())

    # ---- drains ----------------------------------------------------------------------------------
    def _drain(self) -> None:
        """Slurm's warning (``--signal=B:USR1``): the time limit is a grace period away. SIGTERM to every
        process of the steps, as a preemption's grace does: the ranks agree on a step, save and commit it,
        and stop; the watcher then requeues the job."""
        self.drain_sent = True
        limit = f"the time limit ({self.spec.slurm.time})" if self.spec.slurm.time else "the time limit"
        self._warn("slurm-time-limit", f"Slurm's warning: {limit} is at most {grace_s(self.spec)} s away; "
                                       "draining (save, then requeue)")
        try:
            cluster.signal_steps(self.job_id, "TERM")
        except EksftError as e:
            print(f"eksft: could not drain the ranks before the time limit: {e}", file=sys.stderr)

    def _drained_text(self) -> str:
        d = self.drained or {}
        saved = "saved and committed" if d.get("committed") else "its save not committed"
        why = ("Slurm's warning before the time limit" if self.drain_sent
               else "SIGTERM to the job's steps: scancel --signal, or a preemption's grace period")
        return f"drained at step {d.get('step')} ({saved}) on {why}"

    def _restarts_used(self) -> int:
        """Job restarts that count against ``max_job_restarts``: failures, not drains."""
        return self.job_failures - self.drains

    # ---- the outcome -----------------------------------------------------------------------------
    def _outcome(self, code: int) -> tuple[JobState, str] | str | None:
        """The job's end, why it is requeued (a job-level restart, a drain), or None: Slurm decides (it
        ended the allocation)."""
        if self.jd.path.joinpath(STOP_MARK).exists():
            return JobState.STOPPED, "stopped by the user"
        if self.net_failure is not None:
            return JobState.FAILED, self.net_failure
        finished = self.mon.digest is not None or (not self.spec.script
                                                   and self.mon.last_step >= self.spec.steps)
        lost = self.signalled or self.drained is not None or self.launcher_killed is not None
        job = self._job() if lost else None
        if lost and not finished and job is None and self.job_id:
            time.sleep(1)   # a busy controller: ask once more before deciding on no word from Slurm
            job = self._job()
        if lost and not finished and (failed := self._node_failure(job)) is not None:
            return self._node_lost(failed, job)
        if self.drained is not None and not finished:
            if job is not None and job.slurm_state == "CANCELLED":   # scancel: the ranks saved in KillWait
                d = self.drained
                saved = "saved and committed" if d.get("committed") else "its save not committed"
                return JobState.STOPPED, ("cancelled by Slurm from outside eksft (scancel); the ranks "
                                          f"drained at step {d.get('step')} first ({saved}): resume it from "
                                          "that checkpoint")
            if job is not None and job.state not in ACTIVE:
                return JobState.STOPPED, (f"{self._drained_text()}; Slurm ended the job ({job.slurm_state}): "
                                          "resume it from that checkpoint")
            cause = f"{self._drained_text()}: requeued, it resumes from that save"
            asked = self.warned_at or self.drained["t"]
            self.incidents.node_failed(cause, asked, ended_at=asked)
            # Slurm requeued it itself (a preemption's requeue): a second requeue would be refused
            return None if job is not None and job.restarts > self.attempt else cause
        if self.signalled:
            if job is None or job.slurm_state == "CANCELLED":
                return JobState.STOPPED, ("cancelled by Slurm from outside eksft (scancel): resume it from "
                                          "its last checkpoint")
            if job.slurm_state in ("TIMEOUT", "DEADLINE"):
                return JobState.FAILED, (f"Slurm's time limit ended the job at step {self.mon.last_step} "
                                         f"before its drain was committed (the warning comes "
                                         f"{derive(self.spec).grace.seconds:g} s before it): raise --time")
            # a node failed, a preemption: Slurm requeues the job (--requeue) or ends it; either way it is
            # no end this run can record (a requeued run would find it)
            why = f", {job.reason}" if job.reason not in ("", "None") else ""
            cause = f"Slurm ended the allocation (a node failed or a preemption; job {job.slurm_state}{why})"
            self.incidents.node_failed(cause, time.time())
            return None
        if self.incidents.give_up:
            return JobState.FAILED, self.incidents.give_up
        if finished and (code == 0 or self.spec.spare_nodes):
            # with hot spares a lost node's launcher sets the step's exit status; a spare finished its work
            return JobState.SUCCEEDED, ("the script exited 0 on every rank" if self.spec.script
                                        else f"all {self.spec.steps} steps done")
        if code == 0:
            return JobState.FAILED, (f"the launchers exited at step {self.mon.last_step} of "
                                     f"{self.spec.steps} before training finished (see `logs --debug`)")
        how = (signal.Signals(-code).name if code < 0 and -code in signal.Signals._value2member_map_
               else f"exit {code}")
        cause = f"the srun step of the launchers ended ({how}): a node's ft_launcher was lost or gave up"
        if (gave_up := engine_parts.of(self.spec).gave_up) is not None:   # its runner restarted lost nodes
            return JobState.FAILED, gave_up(self.spec, code)
        self.incidents.node_failed(cause, time.time())
        self.job_failures += 1
        if self.incidents.give_up:
            return JobState.FAILED, self.incidents.give_up
        if self._restarts_used() > self.spec.ft.max_job_restarts:
            return JobState.FAILED, (f"{cause}; no job restarts left "
                                     f"(max_job_restarts={self.spec.ft.max_job_restarts})")
        return cause

    def _node_failure(self, job: cluster.SlurmJob | None) -> str | None:
        """What Slurm says of a node of the allocation that failed (the job's state, the nodes' states,
        srun's word), or None. A lost node's step is cancelled with SIGTERM, as a drain's and a scancel's
        are, and the ranks drain on it: which signal came first says nothing, Slurm's record does. A
        launcher srun saw killed is a lost node too, though Slurm neither marks the node nor requeues the
        job (only :attr:`node_lost` says Slurm did)."""
        if job is not None and job.slurm_state == "CANCELLED":
            return None   # scancel: the user's stop
        if job is not None and (job.slurm_state == "NODE_FAIL" or job.reason in ("NodeDown", "NODE_FAIL")):
            self.node_lost = True
            return f"Slurm: job {job.slurm_state}, {job.reason}"
        try:
            down = cluster.lost_nodes(self.nodelist)
        except EksftError as e:
            print(f"eksft: {e}", file=sys.stderr)
            down = []
        if down:
            self.lost_node, self.node_lost = self.lost_node or down[0], True
            return f"Slurm holds node {','.join(down)} down"
        if self.node_failure_said is not None:
            self.node_lost = True
            return f"srun: node failure on {self.node_failure_said}"
        if self.launcher_killed is not None:
            return f"srun: the ft_launcher on {self.launcher_killed} was killed"
        return None

    def _node_lost(self, failed: str, job: cluster.SlurmJob | None) -> tuple[JobState, str] | str | None:
        """A node failure is a job restart (a requeue that resumes from the newest committed checkpoint),
        whether or not the ranks drained on the step's SIGTERM."""
        cause = f"a node of the allocation failed ({failed})"
        at = self.drained["t"] if self.drained is not None else time.time()
        self.incidents.node_failed(cause, at, ended_at=at)
        self.job_failures += 1
        if self._restarts_used() > self.spec.ft.max_job_restarts:
            return JobState.FAILED, (f"{cause}; no job restarts left "
                                     f"(max_job_restarts={self.spec.ft.max_job_restarts})")
        requeued = job is not None and (job.restarts > self.attempt or job.state == JobState.STARTING)
        if requeued or self.signalled:   # Slurm ends the allocation and requeues the job (--requeue)
            return None
        return cause

    def _keep_off(self, job: cluster.SlurmJob | None) -> None:
        """A requeue after a lost node runs elsewhere where the partition has nodes enough without it
        (Slurm takes the change only while the job is pending: right after the requeue)."""
        node = self.lost_node
        if node is None or job is None or (self.drained is not None and not self.node_lost
                                           and self.launcher_killed is None):
            return
        try:
            excluded = sorted({*cluster.hostnames(job.excluded), node}) if job.excluded else [node]
            total = cluster.partition(job.partition).get("TotalNodes", "")
        except EksftError as e:
            print(f"eksft: node {node} failed; not kept off the requeued run: {e}", file=sys.stderr)
            return
        if not total.isdigit() or int(total) - len(excluded) < self.spec.nnodes:
            print(f"eksft: node {node} failed; not kept off the requeued run: partition {job.partition} has "
                  f"no {self.spec.nnodes} nodes without it", file=sys.stderr)
            return
        try:
            cluster.exclude(self.job_id, excluded)
            print(f"eksft: node {node} failed; the requeued run is kept off {','.join(excluded)}",
                  file=sys.stderr)
        except EksftError as e:
            print(f"eksft: node {node} failed; could not keep the requeued run off it: {e}", file=sys.stderr)

    def _job(self) -> cluster.SlurmJob | None:
        """Slurm's record of this job; None where it has none or does not answer."""
        try:
            return cluster.show_job(self.job_id) if self.job_id else None
        except EksftError as e:
            print(f"eksft: {e}", file=sys.stderr)
            return None

    # ---- the start ---------------------------------------------------------------------------------
    def _gpu_run(self) -> bool:
        return derive(self.spec).gpu

    @staticmethod
    def _node_gpus(found: gpus.NodeGpus) -> int:
        """The count the batch shell exported (its launch line and every rank's timeouts follow it)."""
        exported = os.environ.get(NODE_GPUS_ENV, "")
        return int(exported) if exported.isdigit() else found.count

    def _gpu_refusal(self, found: gpus.NodeGpus) -> str | None:
        """A node whose GPUs the job cannot run with, counted there (a job without ``--gres``)."""
        if found.problem:
            return found.problem
        n, ranks = self._node_gpus(found), self.spec.nproc_per_node
        if n and ranks > n:
            return (f"{ranks} ranks per node but the node has {n} GPUs ({found.source}): one GPU per rank; "
                    f"use --nproc-per-node {n}, or a partition (--constraint) whose nodes have {ranks}")
        if not n and self.spec.device == "cuda":
            return f"--device cuda but the node has no GPU ({found.source}): use --device auto, or GPU nodes"
        return None

    def _unrecorded_end(self, last_seen: float) -> None:
        """A requeued run whose previous run recorded no failure: the watcher died with the allocation's
        first node (or someone requeued the job from outside eksft). The job-level incident it could not
        record is recorded now, from the last event that run left."""
        cause = (f"the run before attempt {self.attempt} ended without a word from its watcher: the "
                 "allocation's first node was lost (or the job was requeued from outside eksft), and Slurm "
                 "requeued the job")
        self.incidents.node_failed(cause, time.time(), ended_at=last_seen)
        self.job_failures += 1

    # ---- signals and what the step says -------------------------------------------------------
    def _on_signal(self, signum: int, frame: Any) -> None:
        self.signalled = True

    def _on_warning(self, signum: int, frame: Any) -> None:
        if self.warned_at is None:
            self.warned_at = time.time()

    def _warn(self, what: str, message: str) -> None:
        self.events.emit("warning", what=what, message=message)
        print(f"eksft: {message}", file=sys.stderr)

    def _srun_errors(self, step: subprocess.Popen) -> None:
        """srun's own lines, passed on to the batch log; the first node it says failed is kept. A task
        Killed while the job was neither signalled nor draining is a lost launcher; after SIGTERM, Slurm
        kills a launcher that outlives ``KillWait`` itself."""
        for line in step.stderr or ():
            sys.stderr.write(line)
            if self.lost_node is None and (m := _NODE_LOST.search(line)):
                self.lost_node = m.group(1) or m.group(2)
                self.node_failure_said = m.group(1)
                stopping = self.signalled or self.warned_at is not None or self.drained is not None
                if m.group(3) == "Killed" and self.ft_launchers and not stopping:
                    self.launcher_killed = m.group(2)

    def _pump(self) -> None:
        """The ranks' new events and the launchers' new log lines, folded in by time (as the supervisor
        does), and NVRx's cycle records."""
        self._read_cycle_records()
        events = self.tail.read()
        lines = sorted(((seen.at, node, seen) for node, seen in self._launcher_lines()), key=lambda x: x[0])
        for e in events:
            while lines and e.rank is not None and lines[0][0] <= e.t:
                self._on_line(*lines.pop(0)[1:])
            self.mon.update([e])
            if e.kind == "rank_start" and e.t >= self.t_launch:
                self.ranks_started[e.rank] = e.t
                if self.waiting is not None:
                    self.waiting.end()
            elif e.kind == "drain" and e.t >= self.t_launch:
                self.drained = {"t": e.t, **e.data}
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
            node = int(m.group(2))
            for text in chunk[: end + 1].decode(errors="replace").splitlines():
                self._on_text(node, text)
                seen = parse_launcher_line(text)
                if seen is not None:
                    out.append((node, seen))
        return out

    def _on_text(self, node: int, text: str) -> None:
        """A node's line that is no launcher event: a note of its shell, the network NCCL took."""
        if not self.ranks_started and self.waiting is not None and (why := self.waiting.note(text)):
            self._warn("rendezvous", f"the launchers wait for the rendezvous at {self.waiting.endpoint}, but "
                                     f"{why}: they give up after their join timeout")
        said = self.networks.line(node, text)
        if said is not None:
            kind, why = said
            if kind == "failure":
                self.net_failure = why
            else:
                self._warn("nccl-socket", why)

    def _on_line(self, node: int, seen: LauncherLine) -> None:
        node_fault = any(f.get("node") is not None and f["t"] >= self.t_launch
                         and 0 <= seen.at - f["t"] < NODE_FAULT_WINDOW_S for f in self.mon.faults)
        step_lost = node_fault or self.node_failure_said is not None or self.launcher_killed is not None
        if step_lost and not self.spec.spare_nodes:
            # a lost node ends the step: what the other launchers say as it ends (their ranks' lost peer, a
            # group restart, Slurm's SIGTERM) is that one incident's, which the step's end records
            return
        if seen.kind in ("restarting", "error"):
            self.incidents.launcher_line(node, seen)
            return
        if self.signalled or self.warned_at is not None or self.drained is not None:
            return
        if len(self.ranks_started) == self.spec.world_size and min(self.ranks_started.values()) > seen.at:
            return   # every rank started again since: an incident already accounted for
        if (seen.kind == "worker_failed" and seen.exitcode == -signal.SIGTERM
                and not any(f["fault"] == "sigterm" for f in self.incidents.recent_faults)):
            # Slurm ending the step (a lost node's peers, scancel) terminates the ranks: not an in-job failure
            return
        if seen.kind == "worker_failed" and self.spec.spare_nodes and node_fault:
            # the survivors of a node lost on purpose restart in-job, and NVRx's standby node joins them
            # (their ranks' exits are that one incident's)
            if self.incidents.incident is None:
                self.incidents.node_failed("its ft_launcher was lost; a hot spare took its place", seen.at,
                                           level=RestartLevel.INJOB)
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
    jd = JobDir(Path(argv[0]))
    if (refused := take_carried(jd, sys.stdin, MAX_SPEC_BYTES, JobSpec)) is not None:
        print(f"eksft: {refused}", file=sys.stderr)
        return 1
    return Watcher(jd, argv[2:]).run()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
