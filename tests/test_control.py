"""Fault commands as untrusted input: what a rank does with command files it cannot fire, what the
in-pod ``inject`` accepts, and generated commands (JSON and the ``--fault`` compact form) that are
either accepted as valid or refused with one ControlError line."""

from __future__ import annotations

import json
import string
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from eksft_nb.control import FAULTS, FaultCommand, parse_fault, submit
from eksft_nb.errors import ControlError
from eksft_nb.fault_registry import REGISTRY
from eksft_nb.events import read_all
from eksft_nb.jobdir import JobDir
from eksft_nb.runtime.session import RankInfo, Session
from eksft_nb.spec import JobSpec
from eksft_nb.states import FaultKind

SPEC = JobSpec(name="cmds", nnodes=2, nproc_per_node=2, steps=10)
BAD = {
    "list-fault": '{"fault": ["x"]}',
    "slow-text": '{"fault": "slow-rank", "rank": 0, "params": {"delay": "fast", "duration": "long"}, "id": '
    '"slow-text"}',
    "bool-rank": '{"fault": "sigkill", "rank": true, "id": "bool-rank"}',
    "far-rank": '{"fault": "sigkill", "rank": 7, "id": "far-rank"}',
    "no-id": '{"fault": "exception"}',
    "not-json": '{"fault": "sig',
    "array": "[1, 2]",
    "wrong-id": '{"fault": "exception", "id": "someone-else"}',
    "binary": "\udcff\udcfe",
}


def rank_session(job_dir: Path, rank: int = 0, injob: int = 0) -> Session:
    info = RankInfo(rank=rank, local_rank=rank % 2, world_size=4, node=rank // 2, injob_restart=injob,
                    job_attempt=0)
    return Session(SPEC, job_dir, info)


@pytest.fixture
def job_dir(tmp_path: Path) -> JobDir:
    jd = JobDir(tmp_path / "cmds")
    jd.create(SPEC)
    for cid, text in BAD.items():
        (jd.pending / f"{cid}.json").write_bytes(text.encode(errors="surrogateescape"))
    return jd


def test_bad_command_files_are_set_aside_once_and_never_crash_a_rank(job_dir: JobDir) -> None:
    good = FaultCommand("slow-rank", rank=1, params={"delay": 0.01, "duration": 2})
    submit(job_dir.pending, good)
    ranks = [rank_session(job_dir.path, r) for r in range(4)]
    try:
        for step in (1, 2, 3):
            for s in ranks:
                s.step_begin(step)   # never raises, whatever the folder holds
        # a restart: new rank processes read the same folder; nothing is read again or fired again
        for s in ranks:
            s.close()
        ranks = [rank_session(job_dir.path, r, injob=1) for r in range(4)]
        for s in ranks:
            s.step_begin(1)
    finally:
        for s in ranks:
            s.close()
    assert [p.name for p in job_dir.pending.iterdir()] == [f"{good.id}.json"]   # the fired one stays, marked
    rejected = job_dir.path / "control" / "rejected"
    assert sorted(p.stem for p in rejected.glob("*.json")) == sorted(BAD)
    events = read_all(job_dir.events_path)
    reasons = {e["id"]: e["reason"] for e in events if e.kind == "command_rejected"}
    assert sorted(reasons) == sorted(BAD)
    assert len([e for e in events if e.kind == "command_rejected"]) == len(BAD)
    assert reasons["list-fault"] == "fault command field fault is ['x']: it must be a fault name (a string)"
    assert reasons[
        "slow-text"] == "slow-rank parameter delay is 'fast': use seconds per step, > 0 and <= 3600"
    assert reasons["far-rank"] == "rank 7 is out of range for a job of 4 ranks: use --rank between 0 and 3"
    assert (rejected / "far-rank.reason").read_text().startswith("rank 7 is out of range")
    assert [(e["fault"], e.rank) for e in events if e.kind == "fault"] == [("slow-rank", 1)]


def test_the_in_pod_inject_checks_like_the_ranks(job_dir: JobDir, monkeypatch: pytest.MonkeyPatch,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    from eksft_nb.backends.eks import inpod

    monkeypatch.setenv("EKSFT_SPEC", str(job_dir.spec_path))
    monkeypatch.setenv("EKSFT_JOB_DIR", str(job_dir.path))
    before = sorted(p.name for p in job_dir.pending.iterdir())
    for text in ('{"fault": "sigkill", "rank": 9}', '{"fault": ["x"]}', "{",
                 '{"fault": "hang", "id": "../../x"}',
                 '{"fault": "slow-rank", "params": {"delay": -1}}'):
        assert inpod.main(["inject", text]) == 2
        err = capsys.readouterr().err
        assert err.startswith("eksft: error: ") and err.count("\n") == 1, err
    assert inpod.main(["inject"]) == inpod.main(["signal", "x", "KILL"]) == 2
    assert sorted(p.name for p in job_dir.pending.iterdir()) == before   # nothing was queued
    assert inpod.main(["inject", '{"fault": "sigkill", "rank": 3, "id": "ok1"}']) == 0
    assert (job_dir.pending / "ok1.json").is_file()


# ---- generated commands ---------------------------------------------------------------------------

json_values = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
                           lambda inner: (st.lists(inner, max_size=3)
                                          | st.dictionaries(st.text(max_size=6), inner, max_size=3)),
                           max_leaves=8)
field_values = {
    "fault": st.sampled_from(list(FAULTS)) | st.text(max_size=12) | json_values,
    "rank": st.none() | st.integers(-2, 6) | json_values,
    "step": st.none() | st.integers(-2, 50) | json_values,
    "node": st.integers(-1, 3) | json_values,
    "params": st.fixed_dictionaries({}, optional={"delay": json_values | st.floats(), "duration": json_values,
                                                  "x": json_values}) | json_values,
    "id": st.from_regex(r"[a-z0-9]{1,12}", fullmatch=True) | st.text(max_size=70) | json_values,
}
commands = st.fixed_dictionaries({}, optional={**field_values, "extra": json_values})


@settings(max_examples=300, deadline=None)
@given(commands, st.integers(1, 4), st.integers(1, 3))
def test_generated_commands_are_accepted_whole_or_refused_in_one_line(data: dict, world: int,
                                                                      nnodes: int) -> None:
    text = json.dumps(data, allow_nan=True)
    try:
        cmd = FaultCommand.from_json(text).validate(world, nnodes)
    except ControlError as e:
        assert "\n" not in str(e) and str(e).count(": ") >= 1 and len(str(e)) < 400
        return
    # accepted: every field has the type the ranks rely on, and it round-trips
    assert cmd.fault in FAULTS and (cmd.rank is None) == (cmd.scope != "rank")
    assert cmd.rank is None or (type(cmd.rank) is int and 0 <= cmd.rank < world)
    assert type(cmd.node) is int and 0 <= cmd.node < nnodes
    # exactly the fault's parameters, each in its range (the ranks use them without further checks)
    params = REGISTRY[FaultKind(cmd.fault)].params
    assert set(cmd.params) == set(params)
    assert all(p.check(cmd.params[name]) for name, p in params.items())
    if cmd.fault == "slow-rank":
        assert float(cmd.params["delay"]) > 0 and int(cmd.params["duration"]) >= 1
    assert FaultCommand.from_json(cmd.to_json()).validate(world, nnodes) == cmd


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet=string.ascii_lowercase + string.digits + "-:@ _+.\n\x00é", max_size=24)
       | st.builds("{}:{}@{}".format, st.sampled_from(list(FAULTS)), st.integers(-3, 9), st.integers(-3, 99)))
def test_generated_fault_flags_parse_or_are_refused(text: str) -> None:
    try:
        cmd = parse_fault(text).validate(4, 2)
    except ControlError as e:
        assert "\n" not in str(e).replace(repr(text), "")
        return
    assert cmd.fault in FAULTS and (cmd.step is None or cmd.step >= 1)


@pytest.mark.slow
def test_a_real_job_sets_bad_commands_aside_and_survives_restarts() -> None:
    """Bad command files dropped into a running job's folder: its ranks keep training, through an
    in-job restart (new rank processes read the folder again), and each file is reported once."""
    from eksft_nb.job import attach
    from jobs import BASE, cli, events, job_dir

    started = cli("run", "--name", "bad-cmds", *BASE, "--steps", "40", "--no-inprocess", "--fault",
                  "sigkill:1@20",
                  "--detach")
    assert started.returncode == 0, started.stderr
    pending = job_dir("bad-cmds") / "control" / "pending"
    for cid, text in BAD.items():
        (pending / f".{cid}.tmp").write_bytes(text.encode(errors="surrogateescape"))
        (pending / f".{cid}.tmp").rename(pending / f"{cid}.json")
    assert attach("bad-cmds").wait(timeout=400) == "succeeded", cli("logs", "bad-cmds",
                                                                    "--debug").stdout[-3000:]
    assert sorted(e["id"] for e in events("bad-cmds", "command_rejected")) == sorted(BAD)
    assert [(e["fault"], e["target_rank"]) for e in events("bad-cmds", "fault")] == [("sigkill", 1)]
    assert max(e["step"] for e in events("bad-cmds", "step")) == 40
    assert {e["injob_restart"] for e in events("bad-cmds", "rank_start")} == {0, 1}
    assert sorted(p.stem
                  for p in (job_dir("bad-cmds") / "control" / "rejected").glob("*.json")) == sorted(BAD)
