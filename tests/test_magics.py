"""``%%ftrain`` and ``%ftrain`` in a real IPython shell (no kernel, no browser)."""

from __future__ import annotations

import shlex
import time
from pathlib import Path
from typing import Any

import pytest
from IPython.core.error import UsageError

import eksft_nb
from jobs import wait_for
from eksft_nb import magics
from eksft_nb.dashboard import Dashboard
from eksft_nb.dashboard.figure import LEVEL_LANE
from eksft_nb.jobdir import jobs_root
from eksft_nb.spec import spec_options

# values that differ from the defaults and are valid on their own
SAMPLES = {"name": "opt-test", "backend": "eks", "resume": "none", "model.preset": "tiny",
           "model.vocab": "64", "model.d_model": "256",
           "model.n_heads": "8", "checkpoint.dir": "/tmp/ckpts", "script": "/tmp/train.py",
           "script_args": "--depth 2 --tag x", "ft.soft_timeout": "3", "ft.hard_timeout": "9",
           "ft.section_timeouts": "init:60,eval:30",
           "ft.heartbeat_timeout": "20", "eks.k8s_version": "1.32", "eks.namespace": "ml",
           "eks.image": "repo/img:1",
           "eks.gpus_per_node": "4", "eks.instance_type": "p5.48xlarge", "eks.storage_size": "100Gi",
           "eks.shm_size": "1Gi", "eks.cpu": "4", "eks.memory": "8Gi", "eks.topology": "required:2",
           "slurm.mem": "1800G", "slurm.container_mounts": "/data:/data,/models:/models",
           "slurm.container_env": "NCCL_DEBUG,HF_HOME"}
IMAGE = "--container-image nvcr.io#nvidia/pytorch:25.01-py3"
# options that only mean something beside another
REQUIRES = {"eks.priority": "--queue team-a", "eks.topology": "--queue team-a",
            "slurm.container_mounts": IMAGE, "slurm.container_env": IMAGE}


def current(ip: Any) -> eksft_nb.Job | None:
    return ip.magics_manager.registry["FtrainMagics"].job


def jobs() -> set[str]:
    root = jobs_root()
    return {p.name for p in root.iterdir()} if root.is_dir() else set()


def test_help_lists_every_spec_option(ip: Any, capsys: pytest.CaptureFixture[str]) -> None:
    ip.run_cell("%%ftrain --help")
    text = capsys.readouterr().out
    for opt in spec_options():
        assert opt.flag in text and opt.help.split(" (")[0][:40] in " ".join(text.split())
    for extra in ("--fault", "--dry-run", "--spec"):
        assert extra in text
    ip.run_cell("%ftrain --help")
    usage = capsys.readouterr().out
    for command in ("list", "attach NAME", "stop", "inject", "ckpts", "resume", "logs", "summary"):
        assert f"%ftrain {command}" in usage


@pytest.mark.parametrize("opt", spec_options(), ids=lambda o: o.flag)
def test_every_option_sets_its_spec_field(opt: Any) -> None:
    if opt.type is bool:
        line, want = (f"--no-{opt.flag[2:]}" if opt.default else opt.flag), not opt.default
    else:
        raw = SAMPLES.get(opt.path) or (next(c for c in opt.choices if c != opt.default) if opt.choices else
                                        str((opt.default or 0) + 1) if opt.type in (int, float) else "x-1")
        line, want = f"{opt.flag} {shlex.quote(raw)}", shlex.split(raw) if opt.type is list else opt.type(raw)
    spec, faults, dry = magics.parse_cell(f"{line} {REQUIRES.get(opt.path, '')}", "")
    value: Any = spec
    for part in opt.path.split("."):
        value = getattr(value, part)
    assert value == want and value != opt.default and faults == [] and dry is False


@pytest.mark.parametrize("line, problem, fix", [
    ("--stepz 5", "%%ftrain does not understand '--stepz'", "did you mean --steps?"),
    ("--steps ten", "--steps expects int, got 'ten'", "write e.g. --steps 100"),
    ("--ckpt-mode fast", "--ckpt-mode must be one of async, sync", "use --ckpt-mode"),
    ("--name Bad_Name", "invalid job name 'Bad_Name'", "use e.g. --name bad-name"),
    ("--keep-last 1", "checkpoint.keep_last must be an integer >= 2", "use e.g. --keep-last 2"),
    ("--fault boom:1@3", "unknown fault 'boom'", "Faults: exception"),
    ("--fault sigkill:7@3", "rank 7 is out of range for a job of 2 ranks", "use --rank between 0 and 1"),
    ("--steps", "argument --steps: expected one argument", "%%ftrain --help lists every option"),
    ("--spec /no/such.yaml", "spec file /no/such.yaml does not exist", "check the path"),
])
def test_a_mistake_is_one_message_and_launches_nothing(ip: Any, capsys: pytest.CaptureFixture[str], line: str,
                                                      problem: str, fix: str) -> None:
    before = jobs()
    result = ip.run_cell(f"%%ftrain --model tiny {line}")
    err = capsys.readouterr().err
    # IPython shows it without a traceback
    assert type(result.error_in_exec) is UsageError
    assert err.startswith("UsageError: ") and problem in err and fix in err, err
    assert "Traceback" not in err and len(err.strip().splitlines()) <= 3
    assert jobs() == before and ip.shown == [] and current(ip) is None


def test_an_empty_cell_runs_the_trainer_and_code_runs_as_the_script(
        ip: Any, capsys: pytest.CaptureFixture[str]) -> None:
    # no body at all: IPython alone refuses it
    ip.run_cell("%%ftrain --dry-run --name dry --model tiny")
    out = capsys.readouterr().out
    assert "eksft_nb.runtime.trainer_main" in out and "eksft_nb.runtime.script" not in out
    body = "import sys\nprint('my own training loop', sys.argv[1:])\n"
    ip.run_cell(f"%%ftrain --dry-run --name dry --script-args '--lr 1'\n{body}")
    out = capsys.readouterr().out
    script = Path(next(w for w in out.split() if w.endswith(".py")))
    assert "eksft_nb.runtime.script" in out and script.read_text() == body
    assert magics.save_script(body) == script                            # the same code, the same file
    result = ip.run_cell(f"%%ftrain --dry-run --script {script}\n{body}")
    assert type(result.error_in_exec) is UsageError
    assert "--script names a script too" in capsys.readouterr().err
    assert "dry" not in jobs()


def test_a_cell_is_validated_once(ip: Any, capsys: pytest.CaptureFixture[str],
                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """The command layer checks the spec, the backend's refusals and each fault once; the backend asserts."""
    from eksft_nb.backends.local import LocalBackend
    from eksft_nb.control import FaultCommand
    from eksft_nb.spec import JobSpec

    calls: list[str] = []
    for cls, method in ((JobSpec, "validate"), (FaultCommand, "validate"), (LocalBackend, "check")):
        real = getattr(cls, method)
        monkeypatch.setattr(cls, method, lambda self, *a, _real=real, _name=f"{cls.__name__}.{method}", **kw:
                            calls.append(_name) or _real(self, *a, **kw))
    result = ip.run_cell("%%ftrain --dry-run --name once --model tiny --fault sigkill:1@5 --fault hang:0@7\n"
                         "print('a loop')\n")
    assert result.error_in_exec is None and "eksft_nb.runtime.script" in capsys.readouterr().out
    assert sorted(calls) == ["FaultCommand.validate"] * 2 + ["JobSpec.validate", "LocalBackend.check"]
    assert "once" not in jobs()


@pytest.mark.parametrize("line, message", [
    ("%ftrain bogus", "invalid choice: 'bogus'"),
    ("%ftrain stop", "no job yet in this notebook"),
    ("%ftrain inject --rnk 1 sigkill", "did you mean --rank?"),
    ("%ftrain attach no-such-job", "no job named 'no-such-job'"),
    ("%ftrain inject a b c", "inject takes [NAME] FAULT"),
])
def test_line_magic_mistakes(ip: Any, capsys: pytest.CaptureFixture[str], line: str, message: str) -> None:
    result = ip.run_cell(line)
    err = capsys.readouterr().err
    assert type(result.error_in_exec) is UsageError and message in err and "Traceback" not in err


@pytest.mark.slow
def test_launch_break_resume_stop_and_reattach_with_magics(ip: Any,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    t0 = time.monotonic()
    ip.run_cell("%%ftrain --name mg --steps 60 --model tiny --ckpt-every 10 --keep-last 10")
    # returns at once, the job runs detached
    assert time.monotonic() - t0 < 30
    (dash,) = ip.shown
    assert isinstance(dash, Dashboard) and dash.job.name == "mg" and current(ip).name == "mg"
    ip.run_cell("%ftrain inject exception --rank 0 --step 15")
    assert "queued exception for rank 0 of mg (at step 15)" in capsys.readouterr().out
    ip.run_cell("%ftrain list")
    assert "mg" in capsys.readouterr().out
    assert eksft_nb.attach("mg").wait(300) == "succeeded"
    ip.run_cell("%ftrain summary")
    summary = capsys.readouterr().out
    assert "job mg: succeeded" in summary and "injected exception on rank 0" in summary
    ip.run_cell("%ftrain ckpts")
    assert "step      30  committed" in capsys.readouterr().out
    ip.run_cell("%ftrain logs -n 50")
    assert "fault injected: exception on rank 0 at step 15" in capsys.readouterr().out

    ip.run_cell("%ftrain resume --step 30")
    resumed = ip.shown[-1]
    assert resumed.job.name == "mg-from-30" and current(ip).name == "mg-from-30"
    steps = wait_for("the resumed job's first steps", lambda: resumed.job.monitor.steps.step[:1])
    assert steps == [31]
    ip.run_cell("%ftrain stop")
    assert "stopped mg-from-30; nothing of it keeps running" in capsys.readouterr().out
    assert eksft_nb.attach("mg-from-30").state == "stopped"

    # a kernel restart: a new shell state, the same job folder: the whole history comes back
    ip.magics_manager.registry["FtrainMagics"].job = None
    ip.run_cell("%ftrain attach mg")
    again = ip.shown[-1]
    mon = eksft_nb.attach("mg").refresh()
    steps = mon.steps.step
    plotted = [int(s) for t in again.figure.widget.data if t.name == "tokens/s" for s in t.customdata]
    breaks = sum(b != a + 1 for a, b in zip(steps, steps[1:]))            # one line break per rollback
    assert len(plotted) == len(steps) + breaks and set(plotted) == set(steps)
    lanes = [lane for t in again.figure.widget.data if t.name == "restarts" for lane in t.y]
    assert lanes == [LEVEL_LANE[r["level"]] for r in mon.restarts] and "in-process" in lanes
    assert again.ended and again.header.state == "succeeded"


PLAIN_SCRIPT = """\
import os, sys, time
import torch
import torch.distributed as dist

dist.init_process_group("gloo")
rank = dist.get_rank()
for _ in range(5):
    t = torch.tensor([rank + 1.0])
    dist.all_reduce(t)
    time.sleep(0.1)
print(f"hello from rank {rank}: sum {t.item():.0f}", flush=True)
if rank == 1 and os.environ["TORCHELASTIC_RESTART_COUNT"] == "0":
    sys.exit(3)
dist.destroy_process_group()
"""

SESSION_SCRIPT = """\
import time
from eksft_nb.runtime import session

s = session()
for step in range(1, 31):
    s.step_begin(step)
    t = time.perf_counter()
    time.sleep(0.05)
    s.step_end(step, loss=1.0 / step, tokens=100, step_time=time.perf_counter() - t)
"""


@pytest.mark.slow
def test_a_script_that_knows_nothing_of_eksft_still_shows_its_restart_exit_code_and_output(ip: Any) -> None:
    ip.run_cell(f"%%ftrain --name plain --steps 1\n{PLAIN_SCRIPT}")
    job = current(ip)
    assert job.wait(300) == "succeeded"
    mon = job.refresh()
    assert [r["level"] for r in mon.restarts] == ["injob"]
    assert any(e["rank"] == 1 and e["error"] == "exit code 3" for e in mon.rank_errors)
    logs = job.logs(500)
    assert "hello from rank 0: sum 3" in logs and "hello from rank 1: sum 3" in logs


@pytest.mark.slow
def test_a_script_with_the_session_helpers_reports_steps_and_takes_faults(ip: Any) -> None:
    ip.run_cell(f"%%ftrain --name helped --steps 30 --fault exception:0@10\n{SESSION_SCRIPT}")
    dash = ip.shown[-1]
    job = current(ip)
    assert job.wait(300) == "succeeded"
    dash._thread.join(30)
    mon = job.refresh()
    assert mon.restarts and mon.restarts[0]["cause"].startswith("injected exception on rank 0")
    # restarted from the start: no checkpoints
    assert mon.last_step == 30 and mon.steps.step.count(5) == 2
    assert dash.header.step == 30 and "in-job" in [y for t in dash.figure.widget.data if t.name == "restarts"
                                                   for y in t.y]
