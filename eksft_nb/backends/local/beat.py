"""The supervisor's heartbeat, heard by its keeper: a supervisor that stops beating is as good as dead.

A supervisor stopped (SIGSTOP, a debugger) or stuck in a write that never returns (a hung network
filesystem) does not die, so a keeper that only waited for its death would leave the job unsupervised
for good. The keeper hands its supervisor the write end of a pipe (:data:`BEAT_FD_ENV` names it); the
supervisor's loop writes a byte to it every :data:`BEAT_EVERY_S` (:class:`Heart`), and a keeper that
hears nothing for :data:`SILENCE_S` kills it by identity and starts a successor that adopts the job
(:class:`Pulse`). A pipe, not a file: it needs no room on a full disk, and the keeper hears it even
while the job folder's filesystem hangs.
"""

from __future__ import annotations

import os
import select
import subprocess
import time

BEAT_FD_ENV = "EKSFT_BEAT_FD"
BEAT_EVERY_S = 1.0
SILENCE_S = 10.0   # no beat for this long (the first one: START_S from the start): the supervisor is dead
START_S = 60.0     # a supervisor's start-up, imports included, on a busy machine


class Heart:
    """The supervisor's side: :meth:`beat` from its loop (cheap: it writes at most every BEAT_EVERY_S)."""

    def __init__(self) -> None:
        self.fd: int | None = None
        self.last = 0.0
        value = os.environ.pop(BEAT_FD_ENV, "")   # its own: the processes it starts hear nothing of it
        if value.isdigit():
            try:
                os.set_blocking(int(value), False)  # never wait on a keeper that does not read
                self.fd = int(value)
            except OSError:
                pass   # not an open descriptor: run without a keeper that listens

    def beat(self) -> None:
        now = time.monotonic()
        if self.fd is None or now - self.last < BEAT_EVERY_S:
            return
        self.last = now
        try:
            os.write(self.fd, b".")
        except BlockingIOError:
            pass   # the pipe is full: the keeper has beats enough to read
        except OSError:   # the keeper is gone: a later client adopts the job (see LocalBackend.state)
            os.close(self.fd)
            self.fd = None


class Pulse:
    """The keeper's side: a pipe per supervisor; :meth:`wait` returns when it exits or goes silent."""

    def __init__(self) -> None:
        self.read, self.write = os.pipe()

    def env(self) -> dict[str, str]:
        return {BEAT_FD_ENV: str(self.write)}

    def started(self) -> None:
        """The supervisor has its copy of the write end: the keeper's is closed, so the pipe ends with it."""
        os.close(self.write)

    def wait(self, child: subprocess.Popen) -> int | None:
        """Wait until ``child`` exits (its exit status) or has been silent too long (None)."""
        heard, silence, listening = time.monotonic(), START_S, True
        try:
            while child.poll() is None:
                if listening and select.select([self.read], [], [], BEAT_EVERY_S)[0]:
                    data = os.read(self.read, 4096)
                    if data:
                        heard, silence = time.monotonic(), SILENCE_S
                    listening = bool(data)   # closed: the supervisor is exiting (silence still counts)
                elif not listening:
                    time.sleep(0.1)
                if time.monotonic() - heard > silence:
                    return None
            return child.returncode
        finally:
            os.close(self.read)
