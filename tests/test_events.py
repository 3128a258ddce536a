"""The event schema: validation on emit, tolerant decoding, incremental tailing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from eksft_nb.events import LOG_PREFIX, SCHEMA_VERSION, EventTail, EventWriter, SchemaError, decode, make


def test_emit_validates_required_fields_and_enums() -> None:
    with pytest.raises(SchemaError, match="step event lacks 'loss'"):
        make("step", "j", 0, step=1, tokens=10, step_time=0.1)
    with pytest.raises(SchemaError, match="restart.level"):
        make("restart", "j", None, level="reboot", cause="x", blame_rank=None, fault_time=0.0, detection_s=0.0,
             downtime_s=0.0, rolled_back_steps=0, resumed_step=0)
    with pytest.raises(SchemaError, match="unknown event kind"):
        make("stepp", "j", 0)


def test_round_trip_through_a_log_line_with_a_pod_prefix() -> None:
    event = make("step", "job-a", 3, step=7, loss=1.5, tokens=512, step_time=0.25)
    line = f"2026-11-29T10:00:00Z {LOG_PREFIX}{event.to_json()}"
    back = decode(line)
    assert back is not None and back.kind == "step" and back.rank == 3 and back["step"] == 7
    assert back.v == SCHEMA_VERSION
    assert decode("[rank0]: some user print") is None
    assert decode("{not json") is None


def test_readers_accept_unknown_kinds_and_extra_fields() -> None:
    line = json.dumps({"v": SCHEMA_VERSION + 1, "t": 1.0, "kind": "future_kind", "job": "j", "rank": None, "x": 1})
    event = decode(line)
    assert event is not None and event.kind == "future_kind" and event["x"] == 1


def test_tail_returns_only_complete_new_lines(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    writer = EventWriter(path, "j", rank=0)
    tail = EventTail(path)
    assert tail.read() == []
    writer.emit("step", step=1, loss=2.0, tokens=8, step_time=0.1)
    with open(path, "a") as f:
        f.write('{"v":1,"t":2.0,"kind":"step"')  # a line still being written
    assert [e["step"] for e in tail.read()] == [1]
    with open(path, "a") as f:
        f.write(',"job":"j","rank":0,"step":2,"loss":1.0,"tokens":8,"step_time":0.1}\n')
    assert [e["step"] for e in tail.read()] == [2]
    assert tail.read() == []
    assert (path.stat().st_mode & 0o777) == 0o600
