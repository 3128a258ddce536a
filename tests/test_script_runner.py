"""The script runner on its own (one rank, no launcher): how it runs a script, what it reports from
the optimizer-step hook, and fault commands fired from outside; and the fault-command fields it adds."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from eksft_nb.control import FaultCommand, parse_fault, submit
from eksft_nb.errors import ControlError
from eksft_nb.events import read_all
from eksft_nb.jobdir import JobDir
from eksft_nb.spec import JobSpec

SCRIPTS = Path(__file__).parent / "scripts"
REPO = Path(__file__).resolve().parents[1]


def start(tmp_path: Path, steps: int, wait: float,
          workdir: Path | None = None) -> tuple[JobDir, subprocess.Popen]:
    jd = JobDir(tmp_path / "job")
    jd.create(JobSpec(name="runner", script=str(SCRIPTS / "introspect.py"),
                      workdir=str(workdir) if workdir else None))
    env = {**os.environ, "EKSFT_JOB_DIR": str(jd.path), "PYTHONPATH": str(REPO), "RANK": "0",
           "WORLD_SIZE": "1"}
    env.pop("FT_RANK_MONITOR_IPC_SOCKET", None)
    proc = subprocess.Popen([sys.executable, "-m", "eksft_nb.runtime.script", str(SCRIPTS / "introspect.py"),
                             str(steps), str(wait)], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    return jd, proc


def test_a_script_runs_as_python_would_run_it_and_its_optimizer_steps_are_counted_once(
    tmp_path: Path) -> None:
    (tmp_path / "wd").mkdir()
    jd, proc = start(tmp_path, steps=5, wait=0, workdir=tmp_path / "wd")
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    seen = json.loads(out.splitlines()[0])
    script = str(SCRIPTS / "introspect.py")
    assert seen == {"argv": [script, "5", "0"], "file": script, "name": "__main__", "path0": str(SCRIPTS),
                    "cwd": str(tmp_path / "wd")}
    evs = read_all(jd.events_path)
    steps = [e for e in evs if e.kind == "step"]
    assert [e["step"] for e in steps] == [1, 2, 3, 4, 5]                 # two optimizers, one count
    assert all(e["loss"] is None and e["tokens"] is None and e["step_time"] > 0 for e in steps)
    [end] = [e for e in evs if e.kind == "rank_end"]
    assert end["final_step"] == 5 and end["exit_code"] == 0


@pytest.mark.parametrize("command, at_step", [(FaultCommand("exception", rank=0), None),
                                              (FaultCommand("exception", rank=0, step=3), 3)])
def test_an_exception_fires_in_the_main_thread_now_or_at_an_optimizer_step(
    tmp_path: Path, command: FaultCommand,
                                                                           at_step: int | None) -> None:
    jd, proc = start(tmp_path, steps=5 if at_step else 0, wait=120)
    if at_step is None:
        proc.stdout.readline()   # the script runs: "now" lands in its own code
    submit(jd.pending, command)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 1
    evs = read_all(jd.events_path)
    [fault] = [e for e in evs if e.kind == "fault"]
    assert (fault["fault"], fault["target_rank"], fault["at_step"]) == ("exception", 0, at_step)
    [error] = [e for e in evs if e.kind == "rank_error"]
    assert error["origin"] == "fault" and error["error"].startswith("InjectedFault: injected "
                                                                    "exception on rank 0")
    if at_step:
        assert max(e["step"] for e in evs if e.kind == "step") == at_step - 1   # before the step it targets
    else:
        assert "main thread got InjectedFault" in out                      # raised where the script was
    assert (jd.fired / command.id).exists()


def test_a_fault_after_a_delay_waits_for_it(tmp_path: Path) -> None:
    jd, proc = start(tmp_path, steps=0, wait=120)
    command = FaultCommand("sigkill", rank=0, after=3.0)
    submit(jd.pending, command)
    proc.communicate(timeout=120)
    assert proc.returncode == -9
    [fault] = [e for e in read_all(jd.events_path) if e.kind == "fault"]
    assert fault.t >= command.queued_at + 3.0


def test_after_is_validated_and_parsed() -> None:
    parsed = parse_fault("hang:0@45s")
    assert (parsed.fault, parsed.rank, parsed.step, parsed.after) == ("hang", 0, None, 45.0)
    assert parse_fault("sigkill:1@30").step == 30
    for bad, problem in ((FaultCommand("hang", after=-1), "field after is -1: it must be seconds"),
                         (FaultCommand("hang", after=True), "field after is True"),
                         (FaultCommand("hang", step=5, after=3), "at a step or after a time, not both")):
        with pytest.raises(ControlError, match=problem):
            bad.validate(2, 1)
    with pytest.raises(ControlError, match="cannot parse fault"):
        parse_fault("hang:0@soon")
    assert FaultCommand.from_json(FaultCommand("hang", rank=0,
                                               after=2.5).to_json()).when == "2.5s after it was queued"


def test_a_scripts_restarts_count_as_stuck_only_when_no_step_ran_between_them() -> None:
    """A script's own checkpoints are not seen: restarts with steps between them are progress."""
    from eksft_nb.events import make
    from eksft_nb.incidents import Incident, Incidents
    from eksft_nb.monitor import JobMonitor

    mon = JobMonitor()
    incidents = Incidents(mon, lambda kind, **data: None, 0.0, patience=3, steps_expected=False)
    for n in range(1, 5):   # four restarts, each after some steps: never stuck
        incidents.open(Incident("injob", "injected sigkill on rank 1", 1, float(n), float(n), 0))
        mon.update([make("step", "j", 0, t=n + 0.5, step=1, loss=None, tokens=None, step_time=0.1)])
        incidents.close(n + 0.4)
    assert incidents.give_up is None
    for n in range(5, 8):   # three in a row without a step: a crash loop
        incidents.open(Incident("injob", "rank 0 exited with code 1", 0, float(n), float(n), 0))
        incidents.close(n + 0.4)
    assert incidents.give_up and "failed before the script took a step" in incidents.give_up
