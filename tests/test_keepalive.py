"""The keepalive that beats for a rank during a long restore: while the body runs, within its budget."""

from __future__ import annotations

import threading

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
