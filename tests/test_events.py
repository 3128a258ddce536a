"""The event schema: validation on emit, tolerant decoding, incremental tailing."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from eksft_nb.events import (LOG_PREFIX, RESTART_PHASES, SCHEMA_VERSION, Event, EventTail, EventWriter,
                             SchemaError, decode,
                             make)
from eksft_nb.incidents import Incident, Incidents
from eksft_nb.monitor import JobMonitor
from eksft_nb.states import RestartLevel


def test_emit_validates_required_fields_and_enums() -> None:
    with pytest.raises(SchemaError, match="step event lacks 'loss'"):
        make("step", "j", 0, step=1, tokens=10, step_time=0.1)
    with pytest.raises(SchemaError, match="restart.level"):
        make("restart", "j", None, level="reboot", cause="x", blame_rank=None, fault_time=0.0,
             detection_s=0.0,
             downtime_s=0.0, rolled_back_steps=0, resumed_step=0)
    with pytest.raises(SchemaError, match="unknown event kind"):
        make("stepp", "j", 0)


def test_the_in_process_wrappers_cost_is_a_phase_and_seconds() -> None:
    mon = JobMonitor()
    mon.update([make("inprocess_wrapper", "j", 1, t=5.0, phase="setup", seconds=0.4)])
    assert mon.wrapper == [{"t": 5.0, "rank": 1, "phase": "setup", "seconds": 0.4}]
    for phase, seconds in (("teardown", 0.4), ("exit", -1.0), ("exit", math.inf)):
        with pytest.raises(SchemaError, match="inprocess_wrapper"):
            make("inprocess_wrapper", "j", 0, phase=phase, seconds=seconds)


def test_round_trip_through_a_log_line_with_a_pod_prefix() -> None:
    event = make("step", "job-a", 3, step=7, loss=1.5, tokens=512, step_time=0.25)
    line = f"2026-11-29T10:00:00Z {LOG_PREFIX}{event.to_json()}"
    back = decode(line)
    assert back is not None and back.kind == "step" and back.rank == 3 and back["step"] == 7
    assert back.v == SCHEMA_VERSION
    assert decode("[rank0]: some user print") is None
    assert decode("{not json") is None


def test_readers_accept_unknown_kinds_and_extra_fields() -> None:
    line = json.dumps({"v": SCHEMA_VERSION + 1, "t": 1.0, "kind": "future_kind", "job": "j", "rank": None,
                       "x": 1})
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


RESTART = {"level": "inprocess", "cause": "x", "blame_rank": 0, "fault_time": 1.0, "detection_s": 0.1,
           "downtime_s": 1.0, "rolled_back_steps": 0, "resumed_step": 10}
JSON_VALUES = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
                           lambda inner: (st.lists(inner, max_size=3)
                                          | st.dictionaries(st.text(max_size=12), inner, max_size=3)),
                           max_leaves=8)


SHORT_WRITE = """
import os, resource, signal, sys
from eksft_nb.events import EventWriter

signal.signal(signal.SIGXFSZ, signal.SIG_IGN)   # past the file size limit: a short write, then EFBIG
path = sys.argv[1]
w = EventWriter(path, "torn", rank=0)
w.emit("step", step=1, loss=1.0, tokens=8, step_time=0.1)
soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
resource.setrlimit(resource.RLIMIT_FSIZE, (os.path.getsize(path) + 20, hard))
w.emit("step", step=2, loss=1.0, tokens=8, step_time=0.1)   # 20 bytes of it fit
resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
w.emit("step", step=3, loss=1.0, tokens=8, step_time=0.1)
w.close()
"""


def test_a_short_write_leaves_no_half_line_that_swallows_the_next_record(tmp_path: Path) -> None:
    """A write the file system cuts short (a full disk, a size limit) loses that record only, and
    leaves none of it: the writer cuts off what got through, and the next records (the record of what
    was lost, then the next step) are read whole."""
    import subprocess
    import sys

    script, path = tmp_path / "short.py", tmp_path / "events.jsonl"
    script.write_text(SHORT_WRITE)
    done = subprocess.run([sys.executable, str(script), str(path)], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    lines = path.read_bytes().splitlines(keepends=True)
    assert len(lines) == 3 and all(line.endswith(b"\n") and decode(line.decode()) for line in lines), lines
    events = EventTail(path).read()
    assert [(e.kind, e.get("step")) for e in events] == [("step", 1), ("events_lost", None), ("step", 3)]
    assert events[1]["count"] == 1 and events[1]["kinds"] == {"step": 1}


def test_an_append_never_waits_for_good_on_a_stopped_lock_holder(tmp_path: Path) -> None:
    """A writer stopped (SIGSTOP) while it holds the events file's lock: the others append without it
    after a moment instead of blocking behind it (a supervisor blocked there would stop beating)."""
    import os
    import subprocess
    import sys
    import threading

    path = tmp_path / "events.jsonl"
    path.touch()
    holder = subprocess.Popen([sys.executable, "-c", "import fcntl, os, signal, sys\n"
                               "fd = os.open(sys.argv[1], os.O_WRONLY)\n"
                               "fcntl.flock(fd, fcntl.LOCK_EX)\n"
                               "os.kill(os.getpid(), signal.SIGSTOP)", str(path)])
    try:
        assert os.WIFSTOPPED(os.waitpid(holder.pid, os.WUNTRACED)[1])   # stopped, the lock held
        writer = EventWriter(path, "j", rank=0)
        append = threading.Thread(target=writer.emit, args=("step",),
                                  kwargs={"step": 1, "loss": 1.0, "tokens": 8, "step_time": 0.1}, daemon=True)
        append.start()
        append.join(60)   # the holder never lets go: an append that waits for it never returns
        assert not append.is_alive()
        assert [e["step"] for e in EventTail(path).read()] == [1]
    finally:
        holder.kill()
        holder.wait()


def test_a_record_behind_a_torn_line_is_still_read(tmp_path: Path) -> None:
    """Another writer (a rank) appended its record right after a torn one: that record survives."""
    whole = make("step", "j", 1, step=4, loss=2.0, tokens=8, step_time=0.1).to_json()
    torn = make("step", "j", 0, step=4, loss=2.0, tokens=8, step_time=0.1).to_json()[:30]
    path = tmp_path / "events.jsonl"
    path.write_text(torn + whole + "\n" + whole + "\n")
    assert [(e.rank, e["step"]) for e in EventTail(path).read()] == [(1, 4), (1, 4)]
    assert decode(torn + torn + whole).rank == 1 and decode(torn) is None


@settings(max_examples=200, deadline=None)
@given(phases=st.dictionaries(st.sampled_from([*RESTART_PHASES, "load", ""]), JSON_VALUES,
                              max_size=6) | JSON_VALUES)
def test_a_restart_events_phases_are_refused_in_one_line_unless_known_and_finite(phases: object) -> None:
    """A line anyone could write: a phases field is either phase -> finite seconds >= 0, or the line is no
    event; an emitter gets one line saying what is wrong."""
    line = json.dumps({"v": 1, "t": 5.0, "kind": "restart", "job": "j", "rank": None, **RESTART,
                       "phases": phases})
    event = decode(line)
    good = isinstance(phases, dict) and all(
        name in RESTART_PHASES and type(s) in (int, float) and 0 <= s < float("inf") for name,
        s in phases.items())
    assert (event is not None) == good
    if good:
        assert event["phases"] == phases
    else:
        with pytest.raises(SchemaError) as refused:
            make("restart", "j", None, **RESTART, phases=phases)
        assert "\n" not in str(refused.value) and "restart.phases" in str(refused.value)


def test_a_restart_without_phases_still_reads() -> None:
    """Streams written before restarts had phases stay readable (the field is optional, same version)."""
    event = decode(json.dumps({"v": 1, "t": 5.0, "kind": "restart", "job": "j", "rank": None, **RESTART}))
    assert event is not None and event.get("phases") is None
    start = {"v": 1, "t": 5.0, "kind": "rank_start", "job": "j", "rank": 0, "pid": 1, "host": "h",
             "job_attempt": 0,
             "injob_restart": 0, "inprocess_iteration": 1, "world_size": 2, "start_step": 10, "t_enter": 4.0}
    assert decode(json.dumps(start)) is not None   # written before rank_start had t_group
    assert decode(json.dumps({**start, "t_group": "4.5"})) is None   # the incident tracker computes with it


marks = st.none() | st.floats(0.0, 100.0)


@settings(max_examples=200, deadline=None)
@given(fault=st.floats(0.0, 100.0), detected=st.floats(0.0, 100.0), entered=marks, grouped=marks,
       restored=marks,
       end=st.floats(0.0, 100.0))
def test_restart_phases_split_the_downtime_whatever_marks_are_known(fault: float, detected: float, entered,
                                                                    grouped, restored, end: float) -> None:
    """Marks from ranks' clocks and interleaved logs can be missing or out of order: the phases are still
    all there, never negative, and add up to the downtime the restart event states."""
    incident = Incident(RestartLevel.INPROCESS, "x", None, fault, detected, 0, entered=entered,
                        grouped=grouped,
                        restored=restored)
    phases = incident.phases(end)
    assert list(phases) == list(RESTART_PHASES)
    assert all(s >= 0 for s in phases.values())
    assert sum(phases.values()) == pytest.approx(max(0.0, end - fault), abs=1e-3)
    make("restart", "j", None, **RESTART, phases=phases)   # valid as emitted


def test_an_inprocess_restart_says_where_its_checkpoint_came_from() -> None:
    """An in-process restart restores before its rank_start opens the incident: the restart event
    still names the resume's source."""
    def start(rank: int, iteration: int, t: float, step: int) -> Event:
        return make("rank_start", "j", rank, t, pid=100 + rank, host="h", job_attempt=0, injob_restart=0,
                    inprocess_iteration=iteration, world_size=2, start_step=step)

    stream = [start(0, 0, 1.0, 0), start(1, 0, 1.0, 0),
              make("step", "j", 0, 2.0, step=1, loss=1.0, tokens=1, step_time=0.1),
              make("fault", "j", 0, 3.0, fault="exception", id="a", target_rank=0, at_step=2),
              make("rank_error", "j", 0, 3.01, error="boom", step=2, origin="fault"),
              make("resume", "j", 0, 3.3, step=1, path="p", load_s=0.1, skipped=[], source="memory"),
              start(0, 1, 3.4, 1), start(1, 1, 3.4, 1),
              make("step", "j", 0, 3.6, step=2, loss=1.0, tokens=1, step_time=0.1)]
    emitted: list[tuple[str, dict]] = []
    mon = JobMonitor()
    incidents = Incidents(mon, lambda kind, **data: emitted.append((kind, data)), 0.0)
    for e in stream:
        mon.update([e])
        incidents.observe(e)
    assert [(d["level"], d.get("restored_from")) for kind,
            d in emitted if kind == "restart"] == [("inprocess", "memory")]


def test_a_fault_that_ends_a_rank_is_the_cause_beside_a_straggler_that_fired_first() -> None:
    """A slow-rank (or a storage fault) lasts while training goes on: a sigkill fired beside it is what ended
    the rank (the EKS replay named the straggler when the two landed at one step)."""
    mon = JobMonitor()
    incidents = Incidents(mon, lambda kind, **data: None, 0.0)
    for e in (make("fault", "j", 0, 3.0, fault="slow-rank", id="a", target_rank=0, at_step=8),
              make("fault", "j", 1, 3.01, fault="sigkill", id="b", target_rank=1, at_step=8)):
        mon.update([e])
        incidents.observe(e)
    assert incidents.cause_from_exit(1, -9) == "injected sigkill on rank 1"
    assert incidents.blame() == 1 and incidents.fault_time() == 3.01
    alone = Incidents(mon, lambda kind, **data: None, 0.0)   # a straggler alone still explains a restart
    alone.observe(make("fault", "j", 0, 3.0, fault="slow-rank", id="a", target_rank=0, at_step=8))
    assert alone.cause_from_ranks("x") == "injected slow-rank on rank 0"


# ---- numbers out of range (issue 34) --------------------------------------------------------------

STEP = {"step": 3, "loss": 1.0, "tokens": 8, "step_time": 0.5}
FAILURE = {"level": "injob", "cause": "x", "blame_rank": 1, "fault_time": 1.8e9, "detected_at": 1.8e9}
OUT_OF_RANGE = [  # kind, fields, the field the reason names
    ("step", {**STEP, "step_time": math.nan}, "step.step_time"),
    ("step", {**STEP, "step_time": -1e9}, "step.step_time"),
    ("step", {**STEP, "step_time": math.inf}, "step.step_time"),
    ("step", {**STEP, "step_time": 1e300}, "step.step_time"),
    ("step", {**STEP, "loss": math.nan}, "step.loss"),
    ("step", {**STEP, "loss": -math.inf}, "step.loss"),
    ("step", {**STEP, "tokens": -5}, "step.tokens"),
    ("step", {**STEP, "step": -1}, "step.step"),
    ("step", {**STEP, "step": 1 << 60}, "step.step"),
    ("failure", {**FAILURE, "fault_time": -1e12}, "failure.fault_time"),
    ("failure", {**FAILURE, "detected_at": math.nan}, "failure.detected_at"),
    ("failure", {**FAILURE, "detected_at": 1e300}, "failure.detected_at"),
    ("restart", {**RESTART, "downtime_s": -1e9}, "restart.downtime_s"),
    ("restart", {**RESTART, "rolled_back_steps": -3}, "restart.rolled_back_steps"),
    ("checkpoint", {"phase": "committed", "step": 4, "blocked_s": math.nan}, "checkpoint.blocked_s"),
    ("checkpoint", {"phase": "committed", "step": 4, "bytes": -1}, "checkpoint.bytes"),
    ("heal", {"from_step": 1, "step": 5, "skipped_batches": -4, "heal_s": 1.0}, "heal.skipped_batches"),
    ("job_end", {"state": "succeeded", "reason": "", "final_step": 5, "restarts": {"injob": -1}},
     "job_end.restarts"),
    ("rank_start", {"pid": 1, "host": "h", "job_attempt": 0, "injob_restart": 0, "inprocess_iteration": 0,
                    "world_size": 2, "start_step": 0, "t_setup": {"model": math.nan}}, "rank_start.t_setup"),
]


@pytest.mark.parametrize("kind,fields,named", OUT_OF_RANGE)
def test_a_number_out_of_range_is_refused_per_event_with_its_reason(kind: str, fields: dict,
                                                                   named: str) -> None:
    """A forged events file (or pod log) with NaN, an infinity, a negative or an absurd number: that
    event is no event (the rest of the stream reads), and an emitter is told which field, in one line."""
    with pytest.raises(SchemaError) as refused:
        make(kind, "j", 0, t=1.8e9, **fields)
    assert named in str(refused.value) and "\n" not in str(refused.value), refused.value
    line = json.dumps({"v": 1, "t": 1.8e9, "kind": kind, "job": "j", "rank": 0, **fields}, allow_nan=True)
    assert decode(line) is None and decode(LOG_PREFIX + line, log=True) is None


def test_numbers_in_range_still_read() -> None:
    """A negative loss (a user's), zeros and long but possible durations are events."""
    for kind, fields in (("step", {**STEP, "loss": -3.5, "step_time": 0}),
                         ("step", {**STEP, "step_time": 9e6}),
                         ("restart", {**RESTART, "downtime_s": 86400.0}), ("failure", FAILURE)):
        line = json.dumps({"v": 1, "t": 1.8e9, "kind": kind, "job": "j", "rank": 0, **fields})
        assert decode(line) is not None, line
    for t, rank in ((-1.0, 0), (1e300, 0), (1.8e9, -1)):
        assert decode(json.dumps({"v": 1, "t": t, "kind": "step", "job": "j", "rank": rank, **STEP})) is None


def test_a_pod_log_line_is_an_event_only_where_the_marker_starts_it() -> None:
    """How a pod prints an event: the marker at the start of its own line, or after the timestamp
    Kubernetes adds; a user's line that holds the marker elsewhere, or bare JSON, is the user's."""
    body = make("step", "j", 0, t=1.8e9, **STEP).to_json()
    for line in (LOG_PREFIX + body, f"2026-11-29T10:00:00Z {LOG_PREFIX}{body}",
                 f"2026-11-29T10:00:00.123456789+01:00 {LOG_PREFIX}{body}\r\n"):
        assert decode(line, log=True) is not None, line
    for line in (f"[rank0]: echo {LOG_PREFIX}{body}", f"user says {LOG_PREFIX}{body}",
                 f"  {LOG_PREFIX}{body}", f"2026-11-29T10:00:00Z user {LOG_PREFIX}{body}", body):
        assert decode(line, log=True) is None, line
    assert decode(body) is not None   # an events file's lines are bare JSON


def test_a_forged_events_file_changes_neither_summary_nor_whatif(finished_job: str) -> None:
    """Issue 34: NaN, negative, infinite and absurd numbers appended to a finished job's events (a
    copy of it) made `whatif` end in a traceback and `summary` print nan and 3,922,859 %: each forged
    event is refused, and both answer as for the job itself."""
    import shutil

    from jobs import cli, job_dir

    forged = job_dir(finished_job).parent / "forged-events"
    shutil.copytree(job_dir(finished_job), forged, ignore=shutil.ignore_patterns("ckpt", "warm"))
    spec = json.loads((forged / "spec.json").read_text())
    (forged / "spec.json").write_text(json.dumps({**spec, "name": "forged-events"}))
    lines = (forged / "events.jsonl").read_text().splitlines()
    t = json.loads(lines[-2])["t"]
    bad = [json.dumps({"v": 1, "t": t, "kind": kind, "job": finished_job, "rank": 0, **fields},
                      allow_nan=True) for kind, fields, _ in OUT_OF_RANGE]
    (forged / "events.jsonl").write_text("\n".join(lines[:-1] + bad + lines[-1:]) + "\n")
    for command in (["summary", "--json"], ["whatif", "--json"]):
        mine, theirs = cli(*command, "forged-events"), cli(*command, finished_job)
        assert mine.returncode == 0 and "Traceback" not in mine.stderr, mine.stderr[-2000:]
        assert mine.stdout.replace("forged-events", finished_job) == theirs.stdout, command
    said = cli("summary", "forged-events").stdout
    assert "nan" not in said.replace("forged", "") and "inf" not in said, said
    assert all(0 <= float(w[:-1]) <= 100 for w in said.split() if w.endswith("%")), said
