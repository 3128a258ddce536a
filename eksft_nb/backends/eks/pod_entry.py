"""The trainer container's main process: ft_launcher's parent, which ends as the pod's ranks did.

``python -m eksft_nb.backends.eks.inpod launch ft_launcher ARGS...`` starts the pod's zygote first when
the spec keeps warm ranks (:mod:`eksft_nb.runtime.zygote`), then ft_launcher, and stays around it:

- SIGTERM from the kubelet (a node drain, Karpenter's consolidation, a node group update, node
  auto-repair, a HyperPod node replacement, a Kueue suspend) goes on to ft_launcher, which passes it to
  its ranks: they agree on a step, save, commit and exit 0 (:mod:`eksft_nb.runtime.drain`), and so does
  ft_launcher ("All ranks exited gracefully").
- Each rank that drained leaves a mark in a folder this process gives it. Once every rank of the pod has,
  ft_launcher gets :data:`EXIT_GRACE_S` to exit on its own, then SIGTERM, then :data:`KILL_GRACE_S`, then
  SIGKILL (its own processes with it). A launcher whose peer left on SIGTERM waits in torchelastic's exit
  barrier for it (300 s), holding the node, and SIGTERM cannot end that wait: the store client restarts
  its poll after the signal, and Python's handler would run only once the wait returned. Nothing is lost
  by the kill: every rank of the job has saved, committed and exited by then (a mark is written after the
  drain's barrier).
- The exit code: :data:`~eksft_nb.runtime.drain.DRAIN_EXIT` when every rank of the pod drained, or when
  the pod was sent SIGTERM and ft_launcher then ended (the cluster stopped it: a preemption, not the
  job's failure; the built-in trainer's ranks that finished their last step exit 0 still); else
  ft_launcher's own. The workload's failure policy recreates a drained pod without charging a retry,
  and a job stopped short of its last step never ends Complete.
- A drain is recorded in the job folder (``drains/<job uid>-N``): the pods of the next incarnation count
  it into ``EKSFT_JOB_ATTEMPT``, so their ranks restart (from this launch's newest checkpoint, the drain's,
  whatever ``--resume`` named) rather than start.
- A pod of that next incarnation starts ft_launcher only once every pod of the one before has said it
  ended (each leaves a mark there as it exits), or the kubelet's grace period for them is over: the
  workload replaces each drained pod as soon as it is gone, and a replacement started beside a pod still
  in its drain's exit barrier would join the old rendezvous, whose store then vanishes under it (a failure
  charged to its index's retries).
- ft_launcher runs with the flags only this image's NVRx takes (its cycle records go into the job folder,
  for the restart timeline), which the render, not knowing the image's release, leaves out.
- On an EFA pod, what NCCL will load as its network plugin is checked first (:func:`.efa.nccl_plugin`):
  a plugin NCCL cannot load fails the pod (a configuration error) instead of training over TCP.
- The pod's termination message (``/dev/termination-log``, what ``status`` shows) says how it ended.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil

from ... import nvrx
from ...jobdir import atomic_write
from ...launcher import ZYGOTE_MODULE, warm_worker, worker_index
from ...procs import JOB_UID_ENV
from ...runtime.drain import DRAIN_EXIT, MARK_ENV, marks
from ...runtime.warm_shim import SOCKET_ENV, ZYGOTE_ENV
from ...spec import JobSpec
from . import efa, failures, names
from .failures import CONFIG_ERROR

EXIT_GRACE_S = 5.0        # after every rank of the pod drained, ft_launcher's time to exit on its own
KILL_GRACE_S = 5.0        # ... and then after SIGTERM, before SIGKILL (its exit barrier cannot hear SIGTERM)
POLL_S = 0.2
IGNORED_ENV = "EKSFT_IGNORED_FAILURES"   # its index's failures the Job did not count (drains, disruptions)
TERMINATION_ENV = "EKSFT_TERMINATION_LOG"   # where the kubelet reads the message (set only where it moved)
TERMINATION_LOG = "/dev/termination-log"


def termination_message(text: str) -> None:
    """Say why the container ended where the kubelet reads it (its termination message, at most 4 KiB);
    nothing where there is no such file (outside a pod)."""
    path = Path(os.environ.get(TERMINATION_ENV) or TERMINATION_LOG)
    try:
        if path.exists() or os.environ.get(TERMINATION_ENV):
            path.write_text(text[-4000:])
    except OSError:
        pass


def _die_with(parent: int) -> None:
    """In a child: SIGKILL when this process ends (the kernel's parent-death signal)."""
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)   # PR_SET_PDEATHSIG
    if os.getppid() != parent:
        os._exit(1)


def _start_zygote() -> subprocess.Popen[bytes]:
    """The pod's zygote, listening before the first worker looks for it (see :mod:`.inpod`'s ``launch``)."""
    # a private folder (0700): no other user of the pod's node or network namespace can bind or reach it
    name = os.path.join(tempfile.mkdtemp(prefix="eksft-warm-"), "zygote.sock")
    me = os.getpid()
    zygote = subprocess.Popen([sys.executable, "-m", ZYGOTE_MODULE, name], stdin=subprocess.DEVNULL,
                              preexec_fn=lambda: _die_with(me))
    deadline = time.monotonic() + 30.0
    # its socket appears once it listens (a fraction of a second); one that cannot start leaves the ranks
    # cold, as the shim then says
    while zygote.poll() is None and time.monotonic() < deadline and not os.path.exists(name):
        time.sleep(0.01)
    os.environ[SOCKET_ENV], os.environ[ZYGOTE_ENV] = name, str(zygote.pid)
    return zygote


class Drains:
    """This launch's drains, recorded in the job folder on the shared volume."""

    def __init__(self, job_dir: str | None, job_uid: str | None) -> None:
        self.folder = Path(job_dir) / "drains" if job_dir else None
        self.uid = job_uid or "unknown"
        self.before = self._count()

    def _count(self) -> int:
        if self.folder is None or not self.folder.is_dir():
            return 0
        return sum(1 for p in self.folder.glob(f"{self.uid}-*.json"))

    def record(self, what: dict[str, Any]) -> None:
        """The drain this incarnation ended in: one record whichever of its pods writes it (the same name)."""
        if self.folder is None:
            return
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            atomic_write(self.folder / f"{self.uid}-{self.before + 1}.json", json.dumps(what))
        except OSError as e:
            print(f"eksft: warning: cannot record the drain in {self.folder} ({e.strerror}): the next "
                  "incarnation starts as --resume says", file=sys.stderr, flush=True)

    def _gone(self, folder: Path, incarnation: int, node: str) -> Path:
        return folder / f"{self.uid}-{incarnation}.gone-{node}"

    def gone(self, node: str | None) -> None:
        """This pod of this incarnation ended: its ft_launcher and ranks are gone."""
        if node is None or self.folder is None:
            return
        with contextlib.suppress(OSError):
            self.folder.mkdir(parents=True, exist_ok=True)
            self._gone(self.folder, self.before, node).touch()

    def wait_for_previous(self, pods: int, limit_s: float, stopping: list[float]) -> list[str]:
        """Wait until every pod of the incarnation before this one has ended (after a drain: see above),
        at most ``limit_s`` and not once this pod is ``stopping``; returns the pods that had not said so."""
        if self.before == 0 or self.folder is None:
            return []
        marks = [(str(n), self._gone(self.folder, self.before - 1, str(n))) for n in range(pods)]
        deadline = time.monotonic() + limit_s
        while (left := [n for n, m in marks if not m.exists()]) \
                and time.monotonic() < deadline and not stopping:
            time.sleep(POLL_S)
        return [] if stopping else left


def attempt(drains: Drains) -> int:
    """This pod's incarnation: its index's failures (counted and not) or its JobSet's restarts, and the
    drains before it."""
    def number(key: str) -> int:
        value = os.environ.get(key, "")
        return int(value) if value.isdigit() else 0

    return number("EKSFT_JOB_ATTEMPT") + number(IGNORED_ENV) + drains.before


def launch(argv: list[str]) -> int:
    """Run the launch line ``argv`` (``ft_launcher ... -m eksft_nb.runtime.MODULE ...``) as described
    above; returns the container's exit code."""
    at = worker_index(argv)
    if at is None:
        message = ("eksft: error: `launch` takes a launch line (ft_launcher ... -m eksft_nb.runtime.MODULE "
                   "...): render the pod again with this eksft-nb")
        print(message, file=sys.stderr)
        termination_message(message)
        return CONFIG_ERROR
    stopping: list[float] = []   # the kubelet's SIGTERM (only recorded here: passed on by _wait)
    signal.signal(signal.SIGTERM, lambda signum, frame: stopping.append(time.monotonic()))
    spec_path = os.environ.get("EKSFT_SPEC")
    spec = JobSpec.load(Path(spec_path)) if spec_path else None
    drains = Drains(os.environ.get("EKSFT_JOB_DIR"), os.environ.get(JOB_UID_ENV))
    node = next((a.split("=", 1)[1] for a in argv[:at] if a.startswith("--node-rank=")), None)
    try:
        return _launch(argv, at, spec, drains, stopping)
    finally:
        drains.gone(node)


def _launch(argv: list[str], at: int, spec: JobSpec | None, drains: Drains, stopping: list[float]) -> int:
    env = dict(os.environ)
    env["EKSFT_JOB_ATTEMPT"] = str(attempt(drains))
    env[MARK_ENV] = tempfile.mkdtemp(prefix="eksft-drain-")
    if env.get("FI_PROVIDER") == "efa":   # what NCCL will load, here where the GPU libraries are
        fix, problem = efa.check_in_child(env)
        if problem:
            message = f"this pod has EFA devices, but {problem} (NCCL would use TCP sockets)"
            print(f"eksft: error: {message}", file=sys.stderr)
            termination_message(message)
            return CONFIG_ERROR
        for key, value in fix.items():
            print(f"eksft: {key}={value}: the image's aws-ofi-nccl installs only that name", file=sys.stderr)
        env.update(fix)
    zygote = None
    worker: list[str] = []   # ft_launcher's worker: the warm shim, or the launch line's own
    if spec is None or spec.ft.warm_ranks:   # without a spec (a Slurm step, a test): warm, as it was rendered
        zygote = _start_zygote()
        env[SOCKET_ENV], env[ZYGOTE_ENV] = os.environ[SOCKET_ENV], os.environ[ZYGOTE_ENV]
        worker = warm_worker(sys.executable)
    # NVRx's cycle records, one folder per incarnation as on the other backends: NVRx names them by Slurm's
    # restart count (0 in a pod), so a later incarnation's would replace an earlier one's
    cycle_dir = Path(env["EKSFT_JOB_DIR"]) / "logs" / "nvrx" / f"attempt-{env['EKSFT_JOB_ATTEMPT']}" \
        if env.get("EKSFT_JOB_DIR") else None
    argv = [*argv[:at], *_release_flags(argv, cycle_dir), *worker, *argv[at:]]
    if spec is not None:
        limit = failures.termination_grace_s(spec)
        if late := drains.wait_for_previous(names.pods(spec), limit, stopping):
            print(f"eksft: warning: pod(s) {', '.join(late)} of the incarnation before this one had not said "
                  f"they ended {limit} s after it drained (their node may be gone): starting anyway",
                  file=sys.stderr, flush=True)
    if stopping:   # stopped before its ranks started: nothing to save, and not the job's failure
        if zygote is not None:
            zygote.kill()
        return _outcome(0, [], 0, True, True, drains)
    me = os.getpid()
    try:
        launcher = subprocess.Popen(argv, env=env, preexec_fn=lambda: _die_with(me))
    except OSError as e:
        message = f"eksft: error: cannot run {argv[0]} ({e.strerror}): the image needs it on PATH"
        print(message, file=sys.stderr)
        termination_message(message)
        return CONFIG_ERROR
    ranks = spec.nproc_per_node if spec is not None else 0
    code = _wait(launcher, env[MARK_ENV], ranks, stopping)
    if zygote is not None:
        zygote.kill()
    return _outcome(code, marks(env[MARK_ENV]), ranks, bool(stopping), bool(spec and spec.script), drains)


def _release_flags(argv: list[str], cycle_dir: Path | None) -> list[str]:
    """The flags only this image's NVRx takes (see ``NVRx.launcher_flags``: its cycle records go into
    ``cycle_dir``, relayed by rank 0, see ``Session.rank_start``), unless the launch line has them (a
    Slurm node's: its watcher added them). The render cannot add them: the image's NVRx is known only here."""
    found = nvrx.installed()
    if found is None or any(a.startswith(("--ft-cycle-info-dir", "--ft-max-no-progress-cycles"))
                            for a in argv):
        return []
    return found.launcher_flags(str(cycle_dir) if cycle_dir else None)


def _wait(launcher: subprocess.Popen[bytes], folder: str, ranks: int, stopping: list[float]) -> int:
    """ft_launcher's exit code. The kubelet's SIGTERM is passed on to it once; so is one of our own once
    every rank here drained and it has not exited within :data:`EXIT_GRACE_S`, and SIGKILL (to it and its
    processes) :data:`KILL_GRACE_S` later: it waits in the exit barrier for a peer that left, and no SIGTERM
    ends that wait."""
    drained_at, signalled = None, False
    while (code := launcher.poll()) is None:
        if drained_at is None and ranks and len(marks(folder)) >= ranks:
            drained_at = time.monotonic()
        since = -1.0 if drained_at is None else time.monotonic() - drained_at
        if not signalled and (stopping or since > EXIT_GRACE_S):
            launcher.send_signal(signal.SIGTERM)
            signalled = True
        if since > EXIT_GRACE_S + KILL_GRACE_S:
            _kill_tree(launcher)
            print(f"eksft: ft_launcher had not exited {since:.0f} s after every rank of this pod drained (it "
                  "waits in its exit barrier for a peer that left): ended it with SIGKILL", file=sys.stderr,
                  flush=True)
            return launcher.wait()
        time.sleep(POLL_S)
    return code


def _kill_tree(launcher: subprocess.Popen[bytes]) -> None:
    """SIGKILL to ft_launcher and every process under it (its rank monitors would outlive it)."""
    try:
        under = psutil.Process(launcher.pid).children(recursive=True)
    except psutil.Error:
        under = []
    launcher.kill()
    for proc in under:
        with contextlib.suppress(psutil.Error):
            proc.kill()
    launcher.wait()


def _outcome(code: int, drained: list[dict[str, Any]], ranks: int, sigterm: bool, script: bool,
             drains: Drains) -> int:
    """The container's exit code and termination message (see the module's docstring)."""
    if ranks and len(drained) >= ranks:
        step = max(m["step"] for m in drained)
        committed = all(m["committed"] for m in drained)
        saved = "saved and committed" if committed else "its save could NOT be committed"
        drains.record({"step": step, "committed": committed, "t": time.time(), "sigterm": sigterm})
        termination_message(f"drained on SIGTERM at step {step} ({saved}): the workload recreates the pod, "
                            "which resumes from that save")
        return DRAIN_EXIT
    if sigterm and (code != 0 or script):
        drains.record({"step": None, "committed": False, "t": time.time(), "sigterm": True})
        launcher = f" (ft_launcher exit {code})" if code else ""
        termination_message(f"stopped by the cluster (SIGTERM) before its ranks could drain{launcher}: the "
                            "workload recreates the pod, which resumes from the newest checkpoint")
        return DRAIN_EXIT
    if code < 0:   # ft_launcher died of a signal: say so as a shell would
        return 128 - code
    return code
