"""User scripts under the same launcher, unmodified: ones that know nothing of eksft-nb (plain DDP,
FSDP2), ones written against NVRx (heartbeat API with a helper module beside it, sections API, their
own inprocess.Wrapper), and one that uses the session helpers."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

import eksft_nb
from eksft_nb.dashboard import Dashboard
import nvrx_releases as releases
from jobs import cli, events, job_dir, run_job, story, wait_for

pytestmark = pytest.mark.slow
SCRIPTS = Path(__file__).parent / "scripts"
# scripts of our own run with --no-inprocess (that is the built-in trainer's tier) and a short heartbeat
# timeout
FAST = ["--no-inprocess", "--heartbeat-timeout", "8"]


@pytest.fixture
def newest_nvrx(monkeypatch: pytest.MonkeyPatch) -> None:
    """Scripts written against NVRx's API run on the newest release (the full NVRx matrix, see
    nvrx_releases); the others on the environment's own."""
    releases.use(releases.NEWEST, monkeypatch)


def steps_after(name: str, t: float) -> list[Any]:
    return [e for e in events(name, "step") if e.t > t]


# long enough that the job still runs when the hang is injected after the sigkill's recovery, on a
# starved machine too (the CLI's start-up alone can take seconds there)
STEPS = 150


def launched(name: str, script: str, args: str, *extra: str) -> Any:
    """Launch ``script`` unmodified from the CLI; the job, once it has taken its first steps."""
    proc = cli("run", "--name", name, "--script", str(SCRIPTS / script), "--script-args", args, *FAST, *extra,
               "--detach")
    assert proc.returncode == 0, proc.stderr
    said = proc.stdout
    assert "its own loop" in said and "100 steps" not in said and "checkpoints" not in said, said
    return eksft_nb.attach(name)


def break_twice(name: str, job: Any, dash: Dashboard | None = None) -> dict:
    """Kill rank 1 of a script's job at an optimizer step through the dashboard's inject (``dash``, or one
    made here), hang rank 0 from the CLI once it has recovered, and follow the job to its end."""
    wait_for("the first steps", lambda: events(name, "step")[2:])
    dash = dash or Dashboard(job, live=False)
    at = events(name, "step")[-1]["step"] + 10
    dash.inject("sigkill", rank=1, step=at)
    assert dash.message.value and f"queued sigkill for rank 1 of {name} (at step {at})" in dash.message.value
    [recovered] = wait_for("the recovery from the sigkill", lambda: events(name, "restart"))
    wait_for("a step after the recovery", lambda: steps_after(name, recovered.t))
    hang = cli("inject", name, "hang", "--rank", "0")
    assert hang.returncode == 0 and hang.stdout.startswith("fired hang on rank 0"), hang.stdout + hang.stderr
    assert job.wait(400) == "succeeded"
    summary = json.loads(cli("summary", name, "--json").stdout)
    faults = [(e["fault"], e["target_rank"], e["at_step"]) for e in events(name, "fault")]
    assert faults[0] == ("sigkill", 1, at) and faults[1][:2] == ("hang", 0), faults
    causes = [(r["level"], r["blame_rank"], r["cause"].split(":")[0]) for r in summary["restart_events"]]
    assert causes == [("injob", 1, "injected sigkill on rank 1"), ("injob", 0, "hang")], story(name)
    steps = events(name, "step")
    assert all(e["loss"] is None and e["tokens"] is None and e["step_time"] > 0 for e in steps)
    assert summary["total_steps"] is None and summary["steps_done"] >= at - 1
    logs = "\n".join(p.read_text() for p in sorted((job_dir(name) / "logs").glob("launcher-*.log")))
    at_hb = logs.find("Did not get initial heartbeat")
    assert at_hb < 0, logs[max(0, at_hb - 3000):at_hb + 300]
    return summary


def test_plain_ddp_steps_and_faults_without_a_line_of_eksft() -> None:
    break_twice("ddp", launched("ddp", "ddp.py", f"--steps {STEPS} --sleep 0.1"))


def test_nvrx_heartbeats_script_with_a_module_beside_it_keeps_its_own_connection(tmp_path: Path,
                                                                                 newest_nvrx: None) -> None:
    break_twice("hb", launched("hb", "heartbeats.py", f"--steps {STEPS} --sleep 0.1 --ckpt {tmp_path}"))
    starts = [e for e in events("hb", "rank_start")]
    assert {e["injob_restart"] for e in starts} == {0, 1, 2}
    state = __import__("torch").load(tmp_path / "state.pt", weights_only=False)
    timeouts = next(iter(state["ft"].values()))  # computed by the script and saved with its checkpoint
    assert state["step"] == STEPS and timeouts["heartbeat"]["were_calculated"]
    logs = cli("logs", "hb").stdout
    assert "starting at step 0" in logs and any(f"starting at step {n}" in logs for n in range(10, STEPS, 10))


def test_nvrx_sections_script_as_a_notebook_cell_gets_its_sections_and_takes_the_dashboards_faults(
        ip: Any, monkeypatch: pytest.MonkeyPatch, newest_nvrx: None) -> None:
    """The sections script as a notebook cell (its code the cell's, importing a module beside the notebook),
    broken from the cell's own live dashboard: its steps are the optimizer's, its sections the spec's."""
    monkeypatch.chdir(SCRIPTS)  # the notebook's folder: a cell imports the modules beside it
    ip.run_cell(f"%%ftrain --name sections {' '.join(FAST)} --script-args '--steps {STEPS} --sleep 0.1' "
                f"--section-timeouts init:60,step:20\n{(SCRIPTS / 'sections.py').read_text()}")
    dash = ip.shown[-1]
    assert dash.header.total is None and "(optimizer steps)" in dash.header._step.value
    break_twice("sections", dash.job, dash)
    dash._thread.join(30)
    plotted = [s for t in dash.figure.widget.data if t.name == "tokens/s" for s in t.customdata]
    assert plotted and dash.figure.widget.layout.annotations[0].text == "throughput (steps/s)"
    assert list((job_dir("sections") / "logs").glob("launcher-*.log"))  # ft_launcher ran, with the spec's
    spec = eksft_nb.attach("sections").spec                               # section timeouts
    assert spec.ft.sections() == {"init": 60.0, "step": 20.0}


def test_a_users_own_inprocess_wrapper_restarts_in_place_and_is_recorded(newest_nvrx: None) -> None:
    launched = cli("run", "--name", "wrapped", "--script", str(SCRIPTS / "wrapped.py"), "--script-args",
                   "120 0.1",
                   "--no-inprocess", "--heartbeat-timeout", "20", "--detach")
    assert launched.returncode == 0, launched.stderr
    job = eksft_nb.attach("wrapped")
    wait_for("the first steps", lambda: events("wrapped", "step")[2:])
    Dashboard(job, live=False).inject("exception", rank=1, step=events("wrapped", "step")[-1]["step"] + 10)
    restarts = wait_for("the in-process restart", lambda: events("wrapped", "restart"),
                        explain=lambda: story("wrapped"))
    assert len(restarts) == 1, ([r.data for r in restarts], story("wrapped"))
    [restart] = restarts
    assert (restart["level"], restart["blame_rank"]) == ("inprocess", 1), restart.data
    assert restart["cause"].startswith("injected exception on rank 1")
    iterations = {(e.rank, e["inprocess_iteration"]) for e in events("wrapped", "rank_start")}
    assert {(0, 1), (1, 1)} <= iterations
    wait_for("a step after the restart", lambda: steps_after("wrapped", restart.t))
    kill = cli("inject", "wrapped", "sigkill", "--rank", "1")
    assert kill.returncode == 0 and kill.stdout.startswith("fired sigkill on rank 1"), kill.stdout
    second = wait_for("the recovery from the sigkill", lambda: events("wrapped", "restart")[1:])[0]
    wait_for("a step after it", lambda: steps_after("wrapped", second.t))
    # SIGSTOP: no in-process recovery for a stopped rank
    hang = cli("inject", "wrapped", "hang", "--rank", "0")
    assert hang.returncode == 0 and hang.stdout.startswith("fired hang on rank 0"), hang.stdout
    assert job.wait(400) == "succeeded"
    levels = [(r["level"], r["blame_rank"]) for r in job.refresh().restarts]
    assert levels == [("inprocess", 1), ("injob", 1), ("injob", 0)], story("wrapped")


def test_fsdp2_script_runs_where_it_was_launched_from_with_its_args(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "fsdp2-out").mkdir()
    monkeypatch.chdir(tmp_path)  # the script writes fsdp2-out/loss.txt relative to its working directory
    summary = run_job("fsdp2", "--script", str(SCRIPTS / "fsdp2.py"), "--script-args", "12 0.05", *FAST,
                      "--fault", "exception:1@2s")
    assert summary["state"] == "succeeded", summary
    assert float((tmp_path / "fsdp2-out" / "loss.txt").read_text()) > 0
    [restart] = summary["restart_events"]
    assert restart["blame_rank"] == 1 and restart["cause"].startswith("injected exception on rank 1")
    [fault] = events("fsdp2", "fault")
    assert fault.rank == 1 and fault["fault"] == "exception"
    [error] = [e for e in events("fsdp2", "rank_error") if e["origin"] == "fault"]
    assert error.rank == 1 and "InjectedFault: injected exception on rank 1" in error["error"]


def test_a_script_with_the_helpers_gets_telemetry_faults_and_checkpoints() -> None:
    summary = run_job("aware", "--script", str(SCRIPTS / "aware.py"), "--steps", "40", "--ckpt-mode", "sync",
                      "--no-inprocess", "--fault", "sigkill:1@25")
    assert summary["state"] == "succeeded", summary
    assert summary["steps_done"] == 40
    [restart] = summary["restart_events"]
    assert restart["level"] == "injob" and restart["blame_rank"] == 1 and restart["resumed_step"] == 20
    committed = [e["step"] for e in events("aware", "checkpoint") if e["phase"] == "committed"]
    assert {10, 20, 30, 40} <= set(committed)
    losses = [e["loss"] for e in events("aware", "step")]
    assert losses[-1] < losses[0]
    # counted once per execution, not twice
    assert [e["step"] for e in events("aware", "step")].count(21) == 2


def test_a_script_that_knows_nothing_of_eksft_still_shows_restarts_exit_codes_and_logs() -> None:
    summary = run_job("unaware", "--script", str(SCRIPTS / "unaware.py"), "--no-inprocess")
    assert summary["state"] == "succeeded", summary
    [restart] = summary["restart_events"]
    assert restart["level"] == "injob" and restart["blame_rank"] == 1
    assert restart["cause"] == "rank 1 failed: exit code 3"
    starts = events("unaware", "rank_start")
    assert {(e.rank, e["injob_restart"]) for e in starts} == {(0, 0), (1, 0), (0, 1), (1, 1)}
    logs = cli("logs", "unaware").stdout
    assert "rank 1: giving up with exit code 3" in logs and "attempt 1 done, x=" in logs


NVRX_EXAMPLES = os.environ.get("EKSFT_NVRX_EXAMPLES")


@pytest.mark.skipif(not NVRX_EXAMPLES,
                    reason="set EKSFT_NVRX_EXAMPLES to the examples/ folder of NVRx 0.7.0's repository "
                    "(not in its wheel, not shipped here)")
@pytest.mark.parametrize("script, args, extra", [
    ("fault_tolerance/train_ddp_heartbeats_api.py",
     "--device cpu --hidden 64 --train_dataset_size 8000 --val_dataset_size 200 --epochs 3 --batch 8 "
     "--output_dir out",
     []),
    ("fault_tolerance/train_ddp_sections_api.py",
     "--device cpu --hidden 64 --train_dataset_size 8000 --val_dataset_size 200 --epochs 3 --batch 8 "
     "--output_dir out",
     ["--section-timeouts", "init:60,step:30,checkpoint:60"]),
    ("inprocess/basic_example.py", "--device cpu --total-iterations 3000 --fault-prob 0 --path out", []),
], ids=["heartbeats", "sections", "inprocess"])
def test_nvrx_own_examples_run_unmodified_and_recover(script: str, args: str, extra: list[str],
                                                      tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                      newest_nvrx: None) -> None:
    (tmp_path / "out").mkdir()
    monkeypatch.chdir(tmp_path)
    name = "nvrx-" + Path(script).stem.replace("_", "-")
    break_twice(name, launched(name, str(Path(NVRX_EXAMPLES) / script), args, *extra))


def test_a_script_that_finished_while_its_supervisor_was_replaced_is_not_run_again() -> None:
    # the successor adopts a launcher it did not start (no exit status): the ranks' own ends say the
    # script finished, whatever the spec's --steps (the built-in trainer's) says
    proc = cli("run", "--name", "adopted-end", "--script", str(SCRIPTS / "ddp.py"), "--script-args",
               "--steps 30 --sleep 0.1", *FAST, "--fault", "kill-supervisor@25", "--json")
    summary = json.loads(proc.stdout[proc.stdout.index("{"):])
    assert summary["state"] == "succeeded" and summary["restart_events"] == [], story("adopted-end")
    assert [e["at_step"] for e in events("adopted-end", "fault")] == [25]
    assert "adopted the job" in (job_dir("adopted-end") / "logs" / "supervisor.log").read_text()
    assert len(events("adopted-end", "launch")) == 1, story("adopted-end")
    assert len(events("adopted-end", "step")) == 30, story("adopted-end")
