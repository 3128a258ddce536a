"""What a rank process has at hand: telemetry, NVRx heartbeats, fault commands, a progress beacon.

The built-in trainer uses it, and so can a user script::

    from eksft_nb.runtime import session
    s = session()                      # reads the launcher's and eksft's environment
    for step in range(1, steps + 1):
        s.step_begin(step)             # fires due fault commands, opens the "step" section
        loss = train_one_step()
        s.step_end(step, loss=loss.item(), tokens=n_tokens, step_time=dt)   # heartbeat + event

One :class:`Session` lives for the whole rank process (across in-process restarts). Run under the
script runner (:mod:`eksft_nb.runtime.script`), a script that never calls ``step_begin`` still gets
steps, heartbeats and faults from its optimizer steps.
"""

from __future__ import annotations

import functools
import json
import math
import os
import socket
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..control import CommandInbox, FaultCommand, reject
from ..errors import ControlError, JobError
from ..events import EventWriter
from ..gpuhealth.sampler import start as start_gpu_health
from ..jobdir import JobDir
from ..nvrx_cycles import current_records
from ..rank_errors import raised_at
from ..spec import JobSpec
from ..timeouts import derive, resolved
from .faults import fire_due


class InjectedFault(RuntimeError):
    """The exception raised by the ``exception`` fault."""


@dataclass(frozen=True)
class RankInfo:
    rank: int
    local_rank: int
    world_size: int
    node: int
    injob_restart: int
    job_attempt: int

    @classmethod
    def from_env(cls) -> RankInfo:
        env = os.environ
        def number(key: str, default: int) -> int:  # unset or empty (an absent pod annotation): the default
            return int(env.get(key) or default)

        return cls(rank=number("RANK", 0), local_rank=number("LOCAL_RANK", 0),
                   world_size=number("WORLD_SIZE", 1),
                   node=number("GROUP_RANK", 0), injob_restart=number("TORCHELASTIC_RESTART_COUNT", 0),
                   job_attempt=number("EKSFT_JOB_ATTEMPT", 0))


class Session:
    """Per-rank helpers. Create it with :func:`eksft_nb.runtime.session`."""

    def __init__(self, spec: JobSpec, job_dir: Path | None, info: RankInfo) -> None:
        self.spec, self.info = spec, info
        self.job_dir = JobDir(job_dir) if job_dir else None
        self.rank = info.rank
        self.inprocess_iteration = 0
        events_path = self.job_dir.events_path if self.job_dir else None
        self.events = EventWriter(events_path, spec.name, info.rank,
                                  to_stdout=os.environ.get("EKSFT_EVENTS_STDOUT") == "1")
        # EKSFT_INSTRUMENT=0 turns off step events, the beacon, fault polling and heartbeats: only the
        # overhead benchmark uses it, to measure what they cost
        self.instrumented = os.environ.get("EKSFT_INSTRUMENT", "1") != "0"
        live = self.instrumented and self.job_dir is not None
        self.inbox = CommandInbox(self.job_dir.pending, self.job_dir.fired) if live else None
        self.monitor = MonitorLink() if self.instrumented else None
        self.sections = spec.ft.step_timeout is not None
        self.in_setup = False    # the "setup" section is open (see setup_begin)
        self.reports_steps = False    # the step protocol below is in use (else a script runner counts steps)
        self.step_entered = 0
        self.step_done = 0
        self.t_done = time.time()
        self._slow_until, self._slow_delay = 0, 0.0
        self._full_until, self._slow_storage = 0, (0, 0.0)   # the disk-full and slow-storage faults
        self.on_save_failure: list[Any] = []   # callbacks for the save-failure fault
        self._checkpointing: Any = None   # the process's checkpoint writer and buffers (checkpointing())
        self.pending_exception: str | None = None
        self._warned: set[str] = set()
        self.drain: Any = None   # the built-in trainer's SIGTERM handler (see .drain)
        # NVRx's in-process Wrapper around the trainer: when its set-up began, when the wrapped function
        # last returned (what the Wrapper adds to the process is reported: inprocess_wrapper events)
        self.t_wrapper_setup: float | None = None
        self.t_wrapped_return: float | None = None
        self._beacon = _Beacon(self) if live else None
        # one GPU health sampler per node, with its own events writer (it writes from its own thread)
        self._gpu = self._gpu_events = None
        if live and info.local_rank == 0:
            self._gpu_events = EventWriter(events_path, spec.name, info.rank, to_stdout=self.events.to_stdout)
            self._gpu = start_gpu_health(self._gpu_events.emit, info.node, os.environ.get("NODE_NAME") or
                                         socket.gethostname(),
                                         first=not (info.job_attempt or info.injob_restart))

    @property
    def restarting(self) -> bool:
        """Whether this incarnation follows a failure (at any level): it must resume, whatever
        ``spec.resume`` says."""
        return self.info.injob_restart > 0 or self.info.job_attempt > 0 or self.inprocess_iteration > 0

    def checkpoint_dir(self) -> Path:
        if self.spec.checkpoint.dir:
            return Path(self.spec.checkpoint.dir).expanduser()
        if self.job_dir is None:
            raise JobError("no checkpoint folder",
                           "set checkpoint.dir in the spec, or run under eksft (EKSFT_JOB_DIR)")
        return self.job_dir.path / "ckpt"

    def checkpointing(self) -> Any:
        """This rank process's :class:`~eksft_nb.runtime.checkpoint.CheckpointProcess`: the async writer
        and the staging buffers, which outlive the managers of in-process restarts."""
        from .checkpoint import CheckpointProcess

        if self._checkpointing is None:
            self._checkpointing = CheckpointProcess()
        return self._checkpointing

    def checkpoints(self, group: Any = None, atomic: Any = None, keepalive: Any = None) -> Any:
        """A :class:`~eksft_nb.runtime.checkpoint.CheckpointManager` for this job (folder, interval,
        mode and retention from the spec). ``group``: a gloo process group for checkpoint
        collectives (default: a new one over all ranks). Rank 0 reports for the collective saves."""

        import torch.distributed as dist

        from .checkpoint import CheckpointManager

        if group is None:
            group = dist.new_group(backend="gloo", timeout=self.checkpoint_group_timeout())
        c = self.spec.checkpoint
        manager = CheckpointManager(self.checkpoint_dir(), rank=dist.get_rank(),
                                    world_size=dist.get_world_size(),
                                    group=group, every=c.every, mode=c.mode, keep_last=c.keep_last,
                                    emit=self._checkpoint_emit, atomic=atomic,
                                    keepalive=keepalive or self.heartbeat,
                                    storage_fault=self.storage_fault, process=self.checkpointing())
        self.on_save_failure = [lambda: setattr(manager, "fail_next_write", True)]
        return manager

    def checkpoint_group_timeout(self) -> Any:
        """How long a checkpoint collective waits for its peers: long enough for their reads of a restore."""
        import datetime

        return datetime.timedelta(seconds=derive(self.spec).checkpoint_group.seconds)

    def _checkpoint_emit(self, kind: str, **data: Any) -> None:
        if self.rank == 0 or data.get("phase") in ("failed", "rejected"):
            self.emit(kind, **data)

    # -- telemetry --
    def emit(self, kind: str, **data: Any) -> None:
        self.events.emit(kind, **data)

    def warn(self, what: str, message: str) -> None:
        """One line the CLI and the dashboard show as a warning (once per ``what`` per rank process)."""
        if what not in self._warned:
            self._warned.add(what)
            self.emit("warning", what=what, message=message)

    def rank_start(self, start_step: int, t_enter: float | None = None, **extra: Any) -> None:
        """Report that this rank is ready to train from ``start_step``. ``t_enter``: when this
        incarnation began (process start, or re-entry after an in-process restart), so recovery
        time can be split into relaunch and set-up."""
        self.step_done = self.step_entered = start_step
        self.emit("rank_start", pid=os.getpid(), host=socket.gethostname(), job_attempt=self.info.job_attempt,
                  injob_restart=self.info.injob_restart, inprocess_iteration=self.inprocess_iteration,
                  world_size=self.info.world_size, start_step=start_step,
                  t_enter=t_enter if t_enter is not None else _process_start(), **extra)
        if self.inprocess_iteration == 0:
            self.relay_nvrx_cycles()

    def relay_nvrx_cycles(self) -> None:
        """In a pod nothing else of eksft reads the job folder: rank 0 relays NVRx's record of its cycle
        and of the one before (see ``nvrx_cycles.current_records``), when it starts and when it ends (its
        cycle's record may be written just after its start)."""
        if self.rank == 0 and self.events.to_stdout:
            for record in current_records(os.environ.get("NVRX_CURRENT_CYCLE_INFO")):
                self.emit("nvrx_cycle", attempt=self.info.job_attempt, **record.fields())

    def rank_error(self, e: BaseException, fatal: bool = False) -> None:
        """Report the exception this rank is failing with (see :func:`error_text`), and whose it is (see
        :func:`error_origin`); ``fatal``: no restart can help, the supervisor ends the job with it."""
        self.emit("rank_error", error=error_text(e)[:500], step=self.step_entered or None,
                  origin=error_origin(e), waiting=raised_in_collective(e), where=raised_at(e),
                  **({"fatal": str(e)[:500]} if fatal else {}))

    def heartbeat(self) -> None:
        if self.monitor is not None:
            self._to_monitor(self.monitor.beat)

    def section(self, name: str, open_: bool) -> None:
        if self.monitor is not None:
            self._to_monitor(lambda: self.monitor.section(name, open_))

    def _to_monitor(self, send: Any) -> None:
        """Tell ft_launcher's rank monitor; once a drain is asked for, a monitor that is gone is no error:
        a scheduler that signals every process of the job (Slurm's ``scancel --signal``, a preemption's
        grace period) ends the monitor with the same SIGTERM, and the rank still saves and stops."""
        try:
            send()
        except Exception:
            if self.drain is None or not self.drain.requested:
                raise

    def setup_begin(self) -> None:
        """The built-in trainer (re-)enters: close what an interrupted incarnation left open and open
        "setup", which covers start-up, the restore and the first step (NCCL forms its communicators
        in the first collective: minutes at scale), when the spec bounds it."""
        if self.spec.ft.setup_timeout is None or self.monitor is None:
            return
        self.monitor.end_all()
        self.section("setup", True)
        self.in_setup = True

    # -- the step protocol --
    def step_begin(self, step: int) -> None:
        self.reports_steps = True
        self.step_entered = step
        if self.sections and not self.in_setup:   # first: a fault fired now is inside the step
            self.section("step", True)
        fire_due(self, step)
        self.lingering_faults(step)

    def step_end(self, step: int, loss: float, tokens: int, step_time: float,
                 report: bool | None = None) -> None:
        """``report``: whether this rank emits the ``step`` event (default: rank 0; a torchft group reports
        its steps itself, see ``eksft_nb.engines.torchft.steps``)."""
        if self.in_setup:
            self.section("setup", False)
            self.in_setup = False
        elif self.sections:
            self.section("step", False)
        self.heartbeat()
        self.step_done, self.t_done = step, time.time()
        if (self.rank == 0 if report is None else report) and self.instrumented:
            self.emit("step", step=step, loss=float(loss), tokens=int(tokens), step_time=float(step_time))

    # -- faults --
    def commands(self) -> list[FaultCommand]:
        """The pending commands that pass every check. One that does not (a hand-written or foreign
        file) is set aside once, with the reason, and never fired (see :func:`~eksft_nb.control.reject`)."""
        valid = []
        for cmd in self.inbox.poll():
            try:
                valid.append(cmd.validate(self.info.world_size, self.spec.nnodes))
            except ControlError as e:
                self.inbox.rejected[cmd.id] = str(e)
        for cid, why in self.inbox.rejected.items():
            if reject(self.inbox.pending, self.inbox.fired, cid, why):
                self.emit("command_rejected", id=cid, reason=why)
        self.inbox.rejected.clear()
        return valid

    def lingering_faults(self, step: int) -> None:
        """Faults that last for steps, at the start of ``step``: slow-rank sleeps; disk-full ends."""
        if self._full_until and step >= self._full_until:  # the disk has room again
            self._full_until = 0
            self.events.divert(None)
        if step < self._slow_until:
            time.sleep(self._slow_delay)

    def storage_fault(self) -> tuple[str, float] | None:
        """The storage fault in force at the current step: ("full", 0), ("slow", delay) or None."""
        if self.step_entered < self._full_until:
            return ("full", 0.0)
        if self.step_entered < self._slow_storage[0]:
            return ("slow", self._slow_storage[1])
        return None

    def raise_pending(self, *_signal: Any) -> None:
        """Raise the injected exception (also the :data:`~.faults.FAULT_SIGNAL` handler, in the main
        thread)."""
        message, self.pending_exception = self.pending_exception, None
        if message:
            raise InjectedFault(message)

    def close(self) -> None:
        self.relay_nvrx_cycles()
        if self._beacon is not None:
            self._beacon.stop()
        if self._gpu is not None:
            self._gpu.stop()
        if self._gpu_events is not None:
            self._gpu_events.close()
        if self.monitor is not None:
            self._to_monitor(self.monitor.close)
        self.events.close()


# of the whole job: the job folder's file server (Lustre's MDS on EKS) sees no more
BEACON_WRITES_PER_SECOND = 64


def beacon_interval(world_size: int, heartbeat_timeout: float | None) -> float:
    """Seconds between a rank's progress beacons: 1 s up to 64 ranks, then longer with the world so the
    job writes ~64 beacons a second (16 s each at 1,024 ranks), but at most half the heartbeat timeout,
    so the beacons a hang is blamed from were written after it began."""
    return max(1.0, min(world_size / BEACON_WRITES_PER_SECOND, (heartbeat_timeout or math.inf) / 2))


class _Beacon(threading.Thread):
    """Writes ``progress/rank-<r>.json`` at once and then every :func:`beacon_interval`: the last step
    entered and done, and whether the main thread is waiting inside torch.distributed (so a hang can
    be blamed on the rank that is *not* waiting for its peers), and its pid (for ``signal``)."""

    def __init__(self, session: Session) -> None:
        super().__init__(daemon=True, name="eksft-beacon")
        self.session = session
        self.path = session.job_dir.progress / f"rank-{session.rank}.json"
        self.main = threading.main_thread().ident
        # who wrote it, exactly (the pod's `signal` checks it: a rank forked by a zygote shows the
        # zygote's environment, and pids repeat across pods that share the folder)
        from ..procs import start_ticks

        self.host, self.start_ticks = socket.gethostname(), start_ticks()
        self._halt = threading.Event()
        self.interval = beacon_interval(session.info.world_size, session.spec.ft.heartbeat_timeout)
        self.start()

    def run(self) -> None:
        while True:
            self._write()
            if self._halt.wait(self.interval):
                return

    def _write(self) -> None:
        s = self.session
        frame = sys._current_frames().get(self.main)
        where, waiting = "", False
        if frame is not None:
            where = f"{Path(frame.f_code.co_filename).name}:{frame.f_lineno} {frame.f_code.co_name}"
            peers = _peer_code()
            f = frame
            while f is not None:
                name = f.f_code.co_filename.replace("\\", "/")
                if "/torch/distributed/" in name or any(name.startswith(p) for p in peers):
                    waiting = True
                    break
                f = f.f_back
        record = {"rank": s.rank, "pid": os.getpid(), "host": self.host, "start_ticks": self.start_ticks,
                  "t": time.time(), "step_entered": s.step_entered, "step_done": s.step_done,
                  "t_done": s.t_done, "where": where, "in_collective": waiting,
                  "inprocess_iteration": s.inprocess_iteration, "injob_restart": s.info.injob_restart}
        tmp = self.path.with_suffix(".tmp")
        try:
            tmp.write_text(json.dumps(record))
            os.replace(tmp, self.path)
        except OSError:
            pass

    def stop(self) -> None:
        self._halt.set()


def _peer_code() -> tuple[str, ...]:
    """Where, besides torch.distributed, a rank waits for its peers: torchft's package (its quorum, its
    commit vote), once imported."""
    torchft = sys.modules.get("torchft")
    where = getattr(torchft, "__file__", None)
    return (str(Path(where).parent).replace("\\", "/") + "/",) if where else ()


def raised_in_collective(e: BaseException) -> bool:
    """Whether the exception surfaced while this rank was inside torch.distributed (waiting for peers)."""
    tb = e.__traceback__
    while tb is not None:
        if "/torch/distributed/" in tb.tb_frame.f_code.co_filename.replace("\\", "/"):
            return True
        tb = tb.tb_next
    return False


def injected_fault(e: BaseException) -> InjectedFault | None:
    """The injected fault behind ``e``: ``e`` itself, or the one library code caught and raised again as
    its own error (``raise ... from``, or while handling it)."""
    seen: set[int] = set()
    cause: BaseException | None = e
    while cause is not None and id(cause) not in seen:
        if isinstance(cause, InjectedFault):
            return cause
        seen.add(id(cause))
        cause = cause.__cause__ or cause.__context__
    return None


def error_text(e: BaseException) -> str:
    """``Type: message``; an injected fault that library code raised again as its own error reads as the
    fault, the wrapper named (DTensor, for one, appends its sharding propagation to the message)."""
    fault = injected_fault(e)
    if fault is None:
        return f"{type(e).__name__}: {e}"
    return f"InjectedFault: {fault}" + ("" if fault is e else f" (raised again as {type(e).__name__})")


# what an error says when the other end went away first
PEER_GONE = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "Timed out", "timed out")


def error_origin(e: BaseException) -> str:
    """Whose failure it is: this rank's ("fault" injected, "exception" of its own), a peer's ("peer":
    a collective failed because another rank went away or stalled, or the other end of a connection went
    away first: a broken pipe, e.g. to ft_launcher's rank monitor as the group is torn down), or the
    in-process monitor's ("interrupted": this rank or a peer stopped making progress). An injected fault
    that library code caught and raised again as its own error (``raise ... from``, or while handling it)
    is still the fault."""
    if injected_fault(e) is not None:
        return "fault"
    name, text = type(e).__name__, str(e)
    if name == "RankShouldRestart":
        return "interrupted"
    if name in ("DistBackendError", "BrokenPipeError") or any(s in text for s in PEER_GONE):
        return "peer"
    return "exception"


def _process_start() -> float:
    """When this process started (wall clock). From the kernel's tick count since boot: psutil's
    ``create_time`` adds that to the boot time in whole seconds, so it can be up to a second early."""
    from ..procs import start_ticks

    ticks = start_ticks()
    if ticks is None or not hasattr(time, "CLOCK_BOOTTIME"):  # not Linux
        import psutil

        return psutil.Process().create_time()
    return time.time() - (time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK"))


class MonitorLink:
    """This rank's connection to ft_launcher's rank monitor, which serves one client per rank at a time.

    Opened at once under ft_launcher, so the launcher's initial heartbeat timeout covers start-up. A
    user script that opens its own (``RankMonitorClient().init_workload_monitoring()``, after
    :meth:`yield_to_script`) gets the connection: this link closes its own first, so neither waits
    on the other, and from then on leaves sections to the script and sends heartbeats through the
    script's client only until the script sends one itself (a script that uses sections alone still
    needs them, or the launcher's heartbeat timeout would end it).
    """

    def __init__(self) -> None:
        self.client: Any = None
        # one request at a time on the monitor's socket: the keepalive thread beats while the main thread may
        self.lock = threading.Lock()
        self.own = False              # the client is this link's (else the script's, or none)
        self.script_beats = False     # the script sends heartbeats of its own
        self._sending = False
        self.open: list[str] = []     # the sections this link opened and has not closed
        if os.environ.get("FT_RANK_MONITOR_IPC_SOCKET"):
            from nvidia_resiliency_ext.fault_tolerance import RankMonitorClient

            self.client, self.own = RankMonitorClient(), True
            self.client.init_workload_monitoring()

    def beat(self) -> None:
        if self.client is None or self.script_beats or not self.client.is_initialized:
            return
        with self.lock:
            self._sending = True
            try:
                self.client.send_heartbeat()
            finally:
                self._sending = False

    def section(self, name: str, open_: bool) -> None:
        if self.own:
            with self.lock:
                (self.client.start_section if open_ else self.client.end_section)(name)
                if open_:
                    self.open.append(name)
                elif name in self.open:
                    self.open.remove(name)

    def end_all(self) -> None:
        """Close every section this link left open, one by one (NVRx 0.5+'s ``end_all_sections`` sends
        nothing: the client skips a section named None)."""
        for name in reversed(list(self.open)):
            self.section(name, False)

    def yield_to_script(self) -> None:
        """Hand the connection to any rank-monitor client the script initialises (patches NVRx's client)."""
        from nvidia_resiliency_ext.fault_tolerance import RankMonitorClient

        init, beat = RankMonitorClient.init_workload_monitoring, RankMonitorClient.send_heartbeat
        link = self

        @functools.wraps(init)
        def init_workload_monitoring(client: Any, *args: Any, **kwargs: Any) -> Any:
            if client is not link.client:
                if link.own:
                    # a message first: after an in-job restart, the monitor takes a connection closed
                    # without one for a failed restart and refuses the next client's messages
                    link.beat()
                link.close()
                link.client = client
            return init(client, *args, **kwargs)

        @functools.wraps(beat)
        def send_heartbeat(client: Any, *args: Any, **kwargs: Any) -> Any:
            if not link._sending:
                link.script_beats = True
            return beat(client, *args, **kwargs)

        RankMonitorClient.init_workload_monitoring = init_workload_monitoring
        RankMonitorClient.send_heartbeat = send_heartbeat

    def close(self) -> None:
        if self.own:
            self.client.shutdown_workload_monitoring()
        self.own = False


_SESSION: Session | None = None


def session() -> Session:
    """The process-wide session, built from the environment that eksft's launcher sets."""
    global _SESSION
    if _SESSION is None:
        job_dir = os.environ.get("EKSFT_JOB_DIR")
        spec_path = os.environ.get("EKSFT_SPEC") or (str(Path(job_dir) / "spec.json") if job_dir else None)
        # a spec eksft launched has its timeouts filled in; one a script runs without eksft gets them here
        spec = resolved(JobSpec.load(spec_path) if spec_path else JobSpec())
        _SESSION = Session(spec, Path(job_dir) if job_dir else None, RankInfo.from_env())
    return _SESSION
