"""SIGTERM as a drain: save, commit, then stop, instead of losing the work since the last commit.

A node drain, a Kueue preemption or the end of a Capacity Block sends SIGTERM (to ft_launcher, which
passes it to its ranks and waits ``--term-timeout`` before SIGKILL; the kubelet waits the pod's
``terminationGracePeriodSeconds``; both are the grace period of :mod:`eksft_nb.timeouts`). The
handler only records the request: the built-in trainer learns at its next step boundary whether any
rank has one (in the all-reduce it makes there anyway), so every rank saves the same step, commits
it and ends with a ``drain`` event.

ft_launcher also sends SIGTERM to stop its workers for an in-job restart, and then a rank may never
reach that step boundary: it hangs (the fault that caused the restart) or waits in a collective on a
peer that is gone. So a rank whose drain is not agreed within its patience (a few step times) dies of
the signal as it would have without a handler. A watcher thread counts that patience from the moment
the signal arrives (Python's wakeup fd), since a main thread stuck in C runs no Python handler. A rank
whose training function has failed (an in-process restart waiting on a lost peer, say) reaches no step
boundary before it re-enters: it dies of the signal at once, not after its patience, which would
outlast ft_launcher's stop timeout (a hot spare's takeover waited for that).

A drained rank exits 0 (a non-zero exit would make ft_launcher restart the worker group), so
ft_launcher exits 0 as well ("All ranks exited gracefully"). What runs around ft_launcher on a cluster
(an EKS pod's entry, a Slurm step) gives each rank a folder in :data:`MARK_ENV`; every rank that
drained writes its mark there (:meth:`Drain.drained`), and the wrapper, finding a mark for each of
its ranks (:func:`marks`), ends with :data:`DRAIN_EXIT` instead of 0: the workload is then recreated
or requeued and resumes from the drain's save, never reported as having succeeded.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

PATIENCE_FLOOR = 15.0   # seconds a SIGTERMed rank waits at least for its drain to be agreed
PATIENCE_STEPS = 3      # ... and at least this many of its recent step times
# The exit code of a node (pod, launcher step) whose ranks drained: stopped by the cluster, its work saved,
# to be recreated or requeued, not counted as a failure. 138 (128 + SIGUSR1) is the one code Kubeflow's
# training operator retries as the user's own under restartPolicy ExitCode, so it serves the PyTorchJob
# as well as a Job's or JobSet's podFailurePolicy (which matches any code) and Slurm's requeue
DRAIN_EXIT = 138
MARK_ENV = "EKSFT_DRAIN_MARK"   # the folder a rank that drained writes its mark in (see marks)


class Drain:
    """The SIGTERM handler of a rank process (install it from the main thread)."""

    def __init__(self, patience_floor: float = PATIENCE_FLOOR) -> None:
        self.requested_at: float | None = None
        self.patience_floor = patience_floor
        self.step_s = 0.0                 # the rank's recent step time (the trainer keeps it current)
        self._agreed = threading.Event()  # every rank saves the same step now: no dying of the signal
        self._off_loop = threading.Event()  # the training function failed: no step boundary will come

    @property
    def patience(self) -> float:
        return max(self.patience_floor, PATIENCE_STEPS * self.step_s)

    def install(self) -> Drain:
        signal.signal(signal.SIGTERM, self._on_signal)
        read, write = os.pipe()
        os.set_blocking(write, False)
        signal.set_wakeup_fd(write, warn_on_full_buffer=False)
        os.register_at_fork(after_in_child=_forget_wakeup)   # a forked writer's signals are its own
        threading.Thread(target=self._watch, args=(read,), name="eksft-drain", daemon=True).start()
        return self

    def _on_signal(self, signum: int, frame: Any) -> None:
        if self.requested_at is None:
            self.requested_at = time.time()

    def _watch(self, read: int) -> None:
        while signal.SIGTERM not in os.read(read, 64):
            pass
        deadline = time.monotonic() + self.patience
        while not self._agreed.wait(0.1):
            if self._off_loop.is_set() or time.monotonic() >= deadline:
                self.die()
                return

    def left_loop(self) -> None:
        """The training function failed: a SIGTERM, now or until it is entered again, cannot be drained."""
        self._off_loop.set()

    def entered_loop(self) -> None:
        self._off_loop.clear()

    def agree(self) -> None:
        """Every rank drains at this step boundary: the save may take the whole grace period."""
        self._agreed.set()

    def drained(self, step: int, committed: bool) -> None:
        """This rank saved ``step`` and stops: its mark for the process around ft_launcher (if any gave it a
        folder), written last, once the save is committed or known not to be."""
        folder = os.environ.get(MARK_ENV)
        if not folder:
            return
        mark = {"rank": int(os.environ.get("RANK", "0")), "step": step, "committed": committed,
                "t": time.time()}
        path = Path(folder, f"rank-{mark['rank']}.json")
        try:
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps(mark))
            os.replace(tmp, path)
        except OSError:   # the wrapper then ends as ft_launcher did: the drain event still says what happened
            pass

    @property
    def requested(self) -> bool:
        return self.requested_at is not None

    def is_handler(self) -> bool:
        return signal.getsignal(signal.SIGTERM) == self._on_signal

    def die_if_requested(self) -> None:
        """End the process by SIGTERM's default action if a drain was asked for (it cannot finish)."""
        if self.requested:
            self.die()

    @staticmethod
    def die() -> None:
        """SIGTERM's default action, now, from any thread: Python's handler is replaced in C (only the main
        thread may call ``signal.signal``, and it may be stuck where no Python handler runs)."""
        libc = ctypes.CDLL(None, use_errno=True)
        libc.signal.argtypes, libc.signal.restype = [ctypes.c_int, ctypes.c_void_p], ctypes.c_void_p
        libc.signal(signal.SIGTERM, None)   # SIG_DFL
        os.kill(os.getpid(), signal.SIGTERM)


def _forget_wakeup() -> None:
    try:
        signal.set_wakeup_fd(-1)
    except ValueError:   # forked from a thread other than the main one: nothing was set there
        pass


def marks(folder: str | Path) -> list[dict[str, Any]]:
    """The marks of the ranks that drained, written in ``folder`` (see :meth:`Drain.drained`); a mark that
    does not read as one is left out."""
    out = []
    for path in sorted(Path(folder).glob("rank-*.json")):
        try:
            mark = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(mark, dict) and type(mark.get("step")) is int \
                and isinstance(mark.get("committed"), bool):
            out.append(mark)
    return out
