"""The command layer: JSON-ready models from real jobs, the CLI's refusals before anything is written."""

from __future__ import annotations

import argparse
import ast
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

import eksft_nb
from eksft_nb import commands
from eksft_nb import procs, row_cache
from eksft_nb.arguments import ARGS, BOTH, CLI, MAGIC
from eksft_nb.control import FAULTS
from eksft_nb.errors import ControlError, JobError, SpecError
from eksft_nb.fault_registry import REGISTRY
from eksft_nb.jobdir import JobDir, atomic_write, jobs_root
from eksft_nb.spec import JobSpec, spec_options
from eksft_nb.states import ENDED, FaultKind, FaultScope, JobState, RestartLevel
from jobs import marked_process, wait_for

ROW_KEYS = {"name", "backend", "state", "step", "total_steps", "restarts", "goodput", "last_checkpoint",
            "script",
            "ended", "detail", "started_at", "ended_at", "waiting_since"}


def test_states_are_their_strings() -> None:
    assert JobState.LOST == "lost" and json.dumps(
        {"s": JobState.LOST}) == '{"s": "lost"}' and f"{JobState.LOST}" == "lost"
    assert ENDED == {JobState.SUCCEEDED, JobState.FAILED, JobState.STOPPED, JobState.LOST}
    assert [s for s in JobState if s.ended] == sorted(ENDED, key=list(JobState).index)
    assert [level.value for level in RestartLevel] == ["inprocess", "injob", "job"]
    assert {k: (REGISTRY[FaultKind(k)].scope, REGISTRY[FaultKind(k)].description) for k in FAULTS} == FAULTS
    assert {d.scope for d in REGISTRY.values()} == set(FaultScope) and list(REGISTRY) == list(FaultKind)


def test_spec_from_options_reads_text_and_json_values_and_refuses_like_the_cli() -> None:
    spec = commands.spec_from_options({"steps": "40", "ft.inprocess": False, "script_args": ["--lr", "1"],
                                       "checkpoint.dir": "none"})
    assert (spec.steps, spec.ft.inprocess, spec.script_args,
            spec.checkpoint.dir) == (40, False, ["--lr", "1"], None)
    with pytest.raises(SpecError, match="--steps expects int, got 'many'"):
        commands.spec_from_options({"steps": "many"})
    with pytest.raises(SpecError, match="steps must be an integer, got True"):
        commands.spec_from_options({"steps": True})
    with pytest.raises(SpecError, match="unknown spec field 'stepz': did you mean steps"):
        commands.spec_from_options({"stepz": 3})


def test_refusals_change_nothing() -> None:
    before = sorted(jobs_root().glob("*")) if jobs_root().exists() else []
    for call, error, text in [
        (lambda: commands.status("no-such-job"), JobError, "no job named 'no-such-job'"),
        (lambda: commands.inject("no-such-job", "sigkill"), JobError, "no job named 'no-such-job'"),
        (lambda: commands.launch(JobSpec(name="bad"), ["explode:0@3"]), ControlError,
         "unknown fault 'explode'"),
        (lambda: commands.launch(JobSpec(name="bad"), ["hang:5@3"]), ControlError, "rank 5 is out of range"),
        (lambda: commands.launch(JobSpec(name="Bad_Name")), SpecError, "invalid job name"),
        (lambda: commands.list_jobs("gke"), SpecError, "unknown backend 'gke'"),
    ]:
        with pytest.raises(error, match=text):
            call()
    assert (sorted(jobs_root().glob("*")) if jobs_root().exists() else []) == before


def test_an_unreadable_job_folder_is_listed_with_its_problem(tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EKSFT_HOME", str(tmp_path))
    for name, text in (("torn", '{"name": "torn", "steps": '), ("odd", '{"name": "odd", "stepz": 3}')):
        (jobs_root() / name).mkdir(parents=True)
        (jobs_root() / name / "spec.json").write_text(text)
    rows = {r["name"]: r for r in commands.list_jobs()}
    assert set(rows) == {"torn", "odd"} and json.loads(json.dumps(rows)) == rows
    assert "unknown spec field 'stepz'" in rows["odd"]["detail"] and rows["torn"]["detail"]
    with pytest.raises(SpecError, match="unknown spec field 'stepz'"):
        commands.status("odd")


@pytest.mark.slow
def test_operations_on_real_jobs(finished_job: str) -> None:
    done = commands.status(finished_job)
    assert set(done) == ROW_KEYS and json.loads(json.dumps(done)) == done
    assert (done["state"], done["ended"], done["step"], done["total_steps"]) == ("succeeded", True, 12, 12)
    assert done["restarts"] == {"inprocess": 0, "injob": 0, "job": 0} and 0 < done["goodput"] <= 1
    committed = [c["step"] for c in commands.checkpoints(finished_job) if c["state"] == "committed"]
    # the save due at 10 is deferred while the one at 5 is still being written (a busy machine): 10, 11 or
    # none
    assert committed[0] == 5 and committed[-1] == 12 == done["last_checkpoint"], committed
    older = committed[-2]
    assert commands.summary(finished_job)["steps_done"] == 12
    assert "step" in commands.logs(finished_job, lines=50)
    with pytest.raises(JobError, match=r"has already ended \(succeeded\)"):
        commands.inject(finished_job, "hang", rank=1)

    with pytest.raises(JobError, match="no committed checkpoint at step 7"):
        commands.resume(finished_job, step=7)

    row = commands.resume(finished_job, step=older, new_name="cmd-live", steps=100000)
    assert (row["name"], row["total_steps"], row["ended"]) == ("cmd-live", 100000, False)
    try:
        assert wait_for("a step of the resumed job", lambda: commands.status("cmd-live")["step"] > older)
        assert "cmd-live" in [r["name"] for r in commands.list_jobs()]
        with pytest.raises(ControlError, match="rank 7 is out of range"):
            commands.inject("cmd-live", "sigkill", rank=7)
        result = commands.inject("cmd-live", "slow-rank", rank=1, params={"delay": 0.01, "duration": 2},
                                 wait=120)
        assert result["fired"] and result["target"] == "rank 1" and result["when"] == "now"
        assert result["step"] > older
        assert result["message"].startswith("fired slow-rank on rank 1 of cmd-live")
        assert result["id"] in result["message"]
    finally:
        stopped = commands.stop("cmd-live")
    assert (stopped["state"], stopped["ended"], stopped["step"] > older) == ("stopped", True, True)
    assert procs.marked(JobDir.for_name("cmd-live").supervisor()["job_uid"]) == []


# ---- one argument table ---------------------------------------------------------------------------

def _options(parser: argparse.ArgumentParser) -> set[str]:
    return {s for a in parser._actions for s in a.option_strings} | {a.dest for a in parser._actions
                                                                    if not a.option_strings}


def _verbs(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    return next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices


def test_the_cli_and_the_magics_take_the_same_options_from_one_table() -> None:
    from eksft_nb import cli, dispatch, magics

    fronts = {CLI: _verbs(cli.build_parser()),
              MAGIC: {**_verbs(magics._line_parser()), "run": magics._cell_parser()}}
    spec_flags = {o.flag for o in spec_options()}
    only_cli = set()
    for verb in ARGS.values():
        for front in verb.fronts:
            parser = fronts[front][verb.name if verb.name == "run" else verb.name_in(front)]
            taken = _options(parser)
            assert {n for a in verb.args_in(front)
                    for n in (a.flags or [a.kwargs.get("dest", a.names[0])])} <= taken
            if verb.name == "run":
                assert spec_flags <= taken, spec_flags - taken
        if verb.fronts == BOTH:
            only_cli |= {(verb.name, f) for a in verb.args_in(CLI) for f in a.flags} - \
                {(verb.name, f) for a in verb.args_in(MAGIC) for f in a.flags}
    # a notebook never blocks on a job, so "return at once" and "print the final summary" are the CLI's alone
    assert only_cli == {("run", "--detach"), ("run", "--json"), ("resume", "--detach")}
    assert {v.name for v in ARGS.values() if v.fronts != BOTH} == {"metrics"}   # a server: a terminal's
    for verb in ARGS.values():
        if MAGIC in verb.fronts and verb.name != "run":
            assert f"%ftrain {verb.name_in(MAGIC)}" in magics.LINE_USAGE
    assert set(dispatch.HANDLERS) == set(ARGS)   # both front ends go through the one dispatch


def test_the_package_imports_have_no_cycle() -> None:
    package = Path(eksft_nb.__file__).parent
    modules = {".".join(p.relative_to(package.parent).with_suffix("").parts).removesuffix(".__init__"): p
               for p in package.rglob("*.py")}

    def imported(name: str, path: Path) -> set[str]:
        here = name if path.name == "__init__.py" else name.rpartition(".")[0]
        out = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                out |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = here
                for _ in range(node.level - 1):
                    base = base.rpartition(".")[0]
                base = (f"{base}.{node.module}" if node.level and node.module
                        else base if node.level else node.module)
                out |= {f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names}
        return {m for m in out if m in modules and m != name}

    graph = {name: imported(name, path) for name, path in modules.items()}
    done: set[str] = set()

    def visit(name: str, stack: list[str]) -> None:
        if name in stack:
            raise AssertionError("import cycle: " + " -> ".join(stack[stack.index(name):] + [name]))
        if name not in done:
            for dep in sorted(graph[name]):
                visit(dep, [*stack, name])
            done.add(name)

    for name in sorted(graph):
        visit(name, [])
    assert "eksft_nb.job" in graph["eksft_nb.dashboard.dashboard"]   # the graph is read, not empty
    # the ranks' code sits below the backends that launch it: it never imports one
    upward = sorted((name, dep) for name, deps in graph.items() for dep in deps
                    if name.startswith("eksft_nb.runtime") and dep.startswith("eksft_nb.backends"))
    assert not upward, f"runtime imports a backend: {upward}"
    assert "eksft_nb.procs" in graph["eksft_nb.runtime.session"]   # lazy imports inside functions count


# ---- listing many jobs, and the rm of many ------------------------------------------------------

@contextmanager
def supervised(name: str, **record: Any) -> Iterator[None]:
    """A process standing in for a job's supervisor (marked as the job's, its identity recorded in
    ``supervisor.json`` with ``record``), so the local backend sees the job run, for as long as it lives."""
    uid = f"{name}-uid"
    head = marked_process(uid)
    try:
        atomic_write(JobDir.for_name(name).supervisor_path,
                     json.dumps({"state": "running", "job_uid": uid, "supervisor": procs.identity(head.pid),
                                 **record}))
        yield
    finally:
        head.kill()
        head.wait()


def test_a_listing_folds_an_ended_job_once_then_reads_the_row_its_folder_keeps(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from job_history import done_and_live
    from test_dashboard import T0

    done, _, folded = done_and_live(tmp_path, monkeypatch)
    first = {r["name"]: r for r in commands.list_jobs()}
    assert set(folded) == {"done", "live"} and set(first["done"]) == ROW_KEYS
    assert (first["done"]["state"], first["done"]["step"], first["done"]["ended"]) == ("succeeded", 5, True)
    assert first["done"]["started_at"] == T0 and first["done"]["ended_at"] == done.t   # its job_end's time
    assert first["live"]["ended_at"] is None and first["live"]["waiting_since"] is None

    folded.clear()
    assert {r["name"]: r for r in commands.list_jobs()} == first   # the same rows, and the ended one's ...
    assert set(folded) == {"live"}                                 # ... events were not read again
    assert commands.status("done") == first["done"]                # what `status` folds is what was kept

    kept = JobDir.for_name("done").path / row_cache.FILE
    record = json.loads(kept.read_text())
    for forged in ({**record, "row": {**record["row"], "step": "many"}},       # a field of another type
                   {**record, "row": {**record["row"], "goodput": 1e400}},     # not a finite number
                   {**record, "row": {**record["row"], "state": "running"}},   # not an end
                   {**record, "key": [0, 0, 0, 0]}):                            # another folder's files
        kept.write_text(json.dumps(forged).replace("Infinity", "1e400"))
        folded.clear()
        assert {r["name"]: r for r in commands.list_jobs()}["done"] == first["done"] and "done" in folded
    done.emit("warning", rank=0, what="late", message="a record after the end")   # the events changed
    folded.clear()
    assert "done" in {r["name"] for r in commands.list_jobs()} and "done" in folded


def test_a_recovering_job_says_what_it_waits_for_and_since_when(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    from eksft_nb import reasons
    from test_dashboard import FakeJob

    monkeypatch.setenv("EKSFT_HOME", str(tmp_path))
    job = FakeJob("waits")
    job.steps(1, 3)
    detected = job.t + 0.25
    job.emit("failure", dt=0.5, level="injob", cause="hang: no heartbeat from rank 1", blame_rank=1,
             fault_time=job.t, detected_at=detected)
    with supervised("waits"):
        row = commands.status("waits")
        assert (row["state"], row["waiting_since"]) == ("recovering", detected), row
        assert row["detail"] == "restarting (in-job) after: hang: no heartbeat from rank 1"
        assert reasons.line(row, now=detected + 192) == (
            f"waiting 3 min 12 s (since {time.strftime('%H:%M:%S', time.localtime(detected))}): "
            "restarting (in-job) after: hang: no heartbeat from rank 1")
        job.steps(4, 4)                                          # its ranks are back: no wait to say
        row = commands.status("waits")
        assert (row["state"], row["waiting_since"], row["detail"]) == ("running", None, "")


def test_rm_of_many_removes_each_ended_job_and_says_each_refusal(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    from test_dashboard import FakeJob

    monkeypatch.setenv("EKSFT_HOME", str(tmp_path))
    for name in ("old-1", "old-2", "source"):
        FakeJob(name).end()
    FakeJob("runs")
    FakeJob("resumed", resume=str(JobDir.for_name("source").path / "ckpt"))
    with supervised("runs"), supervised("resumed"):
        said = commands.remove_jobs([(n, "local") for n in ("old-1", "runs", "source", "nope", "old-2")])
    assert [(r["name"], r["removed"]) for r in said] == [("old-1", True), ("runs", False), ("source", False),
                                                         ("nope", False), ("old-2", True)]
    assert said[0]["message"] == "removed old-1"
    assert said[1]["message"] == "job 'runs' is still running: stop it first: `python -m eksft_nb stop runs`"
    assert said[2]["message"].startswith("job 'resumed' (running) resumes from ") and \
        "in job 'source''s folder" in said[2]["message"] and "stop resumed" in said[2]["message"]
    assert said[3]["message"].startswith("no job named 'nope'")
    assert sorted(p.name for p in jobs_root().iterdir()) == ["resumed", "runs", "source"]
    # the CLI: a line each, and a refusal's exit code; --finished takes every ended job (those whose
    # supervisor is gone are lost now)
    FakeJob("old-3").end()
    env = {**os.environ, "EKSFT_HOME": str(tmp_path)}
    out = subprocess.run([sys.executable, "-m", "eksft_nb", "rm", "old-3", "nope"], capture_output=True,
                         text=True, env=env, timeout=120)
    assert (out.returncode, out.stdout) == (2, "removed old-3\n") and \
        out.stderr.startswith("eksft: error: no job named 'nope'"), out
    out = subprocess.run([sys.executable, "-m", "eksft_nb", "rm", "--finished"], capture_output=True,
                         text=True, env=env, timeout=120)
    assert out.returncode == 0 and sorted(out.stdout.splitlines()) == [
        "removed resumed", "removed runs", "removed source"], out
    assert not any(jobs_root().iterdir())
