"""A rank's liveness while it waits: the keepalive that beats for it during a long restore (while the body
runs, within its budget), and a stop of its checkpoint writer that leaves its main thread running Python."""

from __future__ import annotations

import ctypes
import multiprocessing
import threading
import types
from typing import Any

from eksft_nb.runtime.checkpoint.writer import AsyncWriter
from eksft_nb.runtime.keepalive import keepalive


def test_it_beats_while_the_body_runs_and_never_after() -> None:
    beats, enough = [], threading.Event()

    def beat() -> None:
        beats.append(threading.current_thread().name)
        if len(beats) >= 3:
            enough.set()

    with keepalive(beat, budget=600, interval=0.01):
        assert enough.wait(60), "no beats while the body ran"
    seen = len(beats)
    assert set(beats) == {"eksft-keepalive"}   # from its own thread: the body is free to block
    threading.Event().wait(0.1)                # ten intervals later
    assert len(beats) == seen                  # the thread was joined: no beat after the body


def test_it_stops_beating_at_its_budget_and_says_so() -> None:
    beats, overrun = [], []
    said = threading.Event()

    def on_overrun(budget: float) -> None:
        overrun.append(budget)
        said.set()

    with keepalive(lambda: beats.append(1), budget=0.2, interval=0.01, on_overrun=on_overrun):
        assert said.wait(60), "the budget ran out without a word"
        at_overrun = len(beats)
    assert overrun == [0.2] and at_overrun > 0 and len(beats) == at_overrun   # a hang is a hang again


def test_a_beat_that_fails_ends_the_beats_not_the_body() -> None:
    calls, failed = [], threading.Event()

    def beat() -> None:
        calls.append(1)
        failed.set()
        raise ConnectionError("the rank monitor is gone")

    with keepalive(beat, budget=600, interval=0.01):
        assert failed.wait(60)
    assert calls == [1]


def _slow_writer(queue: Any, told: Any, release: Any) -> None:
    """A writer process that ends only once told to and then released (as one still writing ends late)."""
    assert queue.get() == "DONE"
    told.set()
    release.wait(60)


def test_a_writer_slow_to_stop_leaves_the_main_thread_running_python() -> None:
    """NVRx's progress watchdog is a pending call, which only the main thread runs, between bytecodes: a
    stop blocked in one join for the writer's end (up to 5 s) read as a hang to the in-process soft timeout
    (4 s on CPUs), and a drain was restarted. Here the writer ends only once a pending call ran meanwhile;
    a stop that never let it run kills the writer at its timeout instead."""
    ctx = multiprocessing.get_context("fork")
    queue, told, release, ran = ctx.Queue(), ctx.Event(), ctx.Event(), threading.Event()
    process = ctx.Process(target=_slow_writer, args=(queue, told, release))
    process.start()
    writer = AsyncWriter()
    writer.caller = types.SimpleNamespace(process=process, queue=queue)

    @ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p)
    def pending(_: Any) -> int:
        ran.set()
        return 0

    def watchdog() -> None:   # as NVRx's, once the main thread waits in stop()
        told.wait(60)
        ctypes.pythonapi.Py_AddPendingCall(pending, None)
        if ran.wait(4):
            release.set()

    thread = threading.Thread(target=watchdog)
    thread.start()
    writer.stop()
    thread.join()
    assert ran.is_set() and process.exitcode == 0, process.exitcode
