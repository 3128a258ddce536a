"""The pre-flight: `check` (every timeout acting on a job, each contradiction in one line, run refusing what
guarantees failure), `doctor` (what an environment has, supports and refuses; the gate of a pod's prepare
step), the NVRx sections the timeouts derive, what pip gives per platform, and the incidents that count
every restart and name the ranks' own error. Tables and crafted inputs: no job runs here."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from eksft_nb import commands, nvrx
from eksft_nb.backends.launcher_log import parse_launcher_line
from eksft_nb.errors import SpecError
from eksft_nb.events import make
from eksft_nb.incidents import ANY_NODE, Incidents
from eksft_nb.launcher import Ports, launcher_argv
from eksft_nb.monitor import JobMonitor
from eksft_nb.preflight import platforms
from eksft_nb.preflight.check import check, measured
from eksft_nb.preflight.doctor import diagnose
from eksft_nb.preflight.environment import Environment
from eksft_nb.preflight.sections import read_ft_config, script_sections
from eksft_nb.rank_errors import fix_for
from eksft_nb.spec import JobSpec
from eksft_nb.timeouts import derive

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = REPO / "tests" / "scripts"
P5 = {
    "backend": "eks",
    "nnodes": 4,
    "nproc_per_node": 8,
    "eks.instance_type": "p5.48xlarge",
    "eks.efa_per_node": 32,
    "model.preset": "gpt-8b",
    "eks.image": "registry/eksft:1",
    "eks.queue": "team-a",
}
GPT8 = {"backend": "eks", "eks.image": "registry/eksft:1", "eks.queue": "q", "model.preset": "gpt-8b"}
CPU_1B = {"device": "cpu", "model.preset": "gpt-1b", "checkpoint.storage_mbps": 75.0}  # 12 GB


def spec_of(**fields: Any) -> JobSpec:
    return JobSpec(name="pf").replace(**fields).validate()


def lines(spec: JobSpec, **kwargs: Any) -> list[tuple[bool, str]]:
    return [(f.refuse, f"{f.problem} → {f.fix}") for f in check(spec, slurm_config=None, **kwargs).findings]


def literal_script(tmp_path: Path) -> str:
    path = tmp_path / "train.py"
    path.write_text("ft.start_section('init')\nft.end_section('init')\nclient.start_section(\"step\")\n")
    return str(path)


# ---- check: a clean spec, and each contradiction with its line ---------------------------------------


def test_a_laptop_and_p5_have_no_contradiction() -> None:
    assert lines(spec_of()) == []
    report = check(spec_of(**P5), slurm_config=None)
    assert report.findings == [] and report.gpu
    rows = {r["name"]: r for r in report.rows}
    assert rows["section step"]["seconds"] == 60 and rows["out of section"]["seconds"] == 90
    assert (
        rows["a restore"]["seconds"] == pytest.approx(600, rel=0.01)
        and rows["pod grace period"]["seconds"] == 690
    )
    assert (
        rows["Kueue waitForPodsReady"]["seconds"] is None
        and "not read here" in rows["Kueue waitForPodsReady"]["source"]
    )
    assert "no contradictions found" in report.text()


CONTRADICTIONS = [
    # (spec fields, check's keyword arguments, refused?, the line's start)
    (
        CPU_1B,
        {},
        True,
        "a restore takes ~324 s at 75 MB/s but the initial heartbeat and heartbeat timeouts allow "
        "120 + 15 s: every restart would be killed → raise --initial-heartbeat-timeout above 405",
    ),
    (
        {**GPT8, "ft.setup_timeout": 500.0},
        {},
        True,
        "a restore takes ~600 s at 300 MB/s but the setup section allows 500 s: every restart would be "
        "killed",
    ),
    (
        {**GPT8, "ft.checkpoint_timeout": 250.0},
        {},
        True,
        "a save takes ~300 s but the checkpointing section allows 250 s: every save would be killed",
    ),
    (
        {**CPU_1B, "checkpoint.mode": "sync", "ft.initial_heartbeat_timeout": 900.0},
        {},
        True,
        "a sync save takes ~162 s without a heartbeat but the heartbeat timeout is 15 s: every save would "
        "be killed",
    ),
    (
        {**GPT8, "checkpoint.mode": "sync", "ft.soft_timeout": 280.0},
        {},
        True,
        "a sync save takes ~300 s but the in-process soft timeout is 280 s: every save would be interrupted",
    ),
    (
        {**GPT8, "ft.step_timeout": 60.0, "ft.step_time": 75.0},
        {},
        True,
        "a step takes ~75 s (measured) but the step section is 60 s: every step would be killed → raise "
        "--step-timeout above 150",
    ),
    ({}, {"step_time": 20.0}, True, "a step takes ~20 s (measured) but the heartbeat timeout is 15 s"),
    (
        {"script": str(SCRIPTS / "ddp.py"), "ft.out_of_section_timeout": 30.0},
        {},
        True,
        "the script opens no NVRx section, so all of it runs out of section, which is bounded to 30 s",
    ),
    (
        {**GPT8, "ft.setup_timeout": 700.0},
        {},
        False,
        "a restore takes ~600 s at 300 MB/s but the setup section allows 700 s: less than a fifth to spare",
    ),
    (
        {"backend": "slurm", "slurm.shared_dir": "/fsx/x", "slurm.gres": "gpu:8", "model.preset": "gpt-8b"},
        {"slurm_config": {"KillWait": "45 sec"}},
        False,
        "a save takes ~300 s but Slurm sends SIGKILL 45 s after SIGTERM (KillWait, scontrol show config)",
    ),
    (
        {"backend": "eks", "eks.image": "i:1", "nnodes": 2},
        {},
        False,
        "without --queue, one Pending pod makes the others wait 900 s at the rendezvous",
    ),
    ({"ft.max_injob_restarts": 0, "ft.max_job_restarts": 0}, {}, False, "no restarts are allowed"),
    (
        {"backend": "eks", "eks.image": "i:1", "eks.queue": "q", "script": "/app/train.py"},
        {},
        False,
        "the script has no NVRx section timeouts: a hang is found only after the heartbeat timeout (900 s)",
    ),
    (
        {"ft.cfg_path": "/nonexistent/ft.yaml", "ft.step_timeout": 5.0},
        {},
        False,
        "--ft-cfg-path /nonexistent/ft.yaml: it cannot be read here",
    ),
]


@pytest.mark.parametrize("fields, kwargs, refused, line", CONTRADICTIONS)
def test_each_contradiction_is_found_with_its_line(
    fields: dict, kwargs: dict, refused: bool, line: str
) -> None:
    step = kwargs.pop("step_time", None)
    report = check(spec_of(**fields), step_time=step, **{"slurm_config": None, **kwargs})
    found = [(f.refuse, f"{f.problem} → {f.fix}") for f in report.findings]
    assert any(r == refused and text.startswith(line) for r, text in found), found
    assert all("\n" not in text for _, text in found)
    assert line in report.text()


def test_a_scripts_sections_without_a_timeout_by_release(tmp_path: Path) -> None:
    spec = spec_of(script=literal_script(tmp_path), **{"ft.section_timeouts": "step:30"})
    assert script_sections(spec.script) == ["init", "step"]
    [(refused, line)] = lines(spec, release=nvrx.NVRx("0.4.1"))
    assert (
        refused
        and line.startswith(
            "the script opens NVRx section(s) init, which ft_launcher has no timeout "
            "for: NVRx 0.4.1 fails the rank"
        )
        and line.endswith("--section-timeouts init:SECONDS")
    )
    for release in (nvrx.NVRx("0.6.0"), nvrx.NVRx("0.7.0")):
        [(refused, line)] = lines(spec, release=release)
        assert not refused and f"NVRx {release.version} leaves them unbounded" in line and "KeyError" in line
    remote = check(spec.replace(backend="eks", **{"eks.image": "i:1", "eks.queue": "q"}), slurm_config=None)
    assert any("NVRx 0.4.1 fails the rank that opens one; 0.5+ leaves them unbounded" in f.problem
               for f in remote.findings)   # the image's release is not known here
    with_cfg = tmp_path / "ft.yaml"
    with_cfg.write_text(
        "trainer:\n  fault_tolerance:\n    rank_section_timeouts: {init: 20, step: null}\n"
        "    rank_out_of_section_timeout: 30\n"
    )
    assert lines(spec.replace(**{"ft.cfg_path": str(with_cfg)}), release=nvrx.NVRx("0.4.1")) == []
    argv = launcher_argv(
        spec.replace(**{"ft.cfg_path": str(with_cfg)}),
        node_rank=0,
        rdzv_host="h",
        ports=Ports.from_base(29500),
        rdzv_id="r",
    )
    assert f"--ft-cfg-path={with_cfg}" in argv and "--ft-rank-section-timeouts=init:20,step:30" in argv


def test_run_refuses_a_contradiction_that_guarantees_failure_in_one_line() -> None:
    with pytest.raises(SpecError) as refused:
        commands.dry_run(JobSpec(name="pf").replace(**CPU_1B))
    assert str(refused.value).startswith("a restore takes ~324 s at 75 MB/s") and "\n" not in str(
        refused.value
    )
    assert refused.value.fix.startswith("raise --initial-heartbeat-timeout above 405")
    result = commands.check(JobSpec(name="pf").replace(**CPU_1B))
    assert result["findings"][0]["refuse"] and result["message"].startswith("timeouts acting on pf")


@settings(max_examples=50, deadline=None)
@given(st.binary(max_size=400))
def test_no_config_file_breaks_the_reader(tmp_path_factory: Any, raw: bytes) -> None:
    path = tmp_path_factory.mktemp("cfg") / "ft.yaml"
    path.write_bytes(raw)
    cfg = read_ft_config(str(path))
    assert cfg.error is not None or all(v is None or v > 0 for v in cfg.sections.values())


def test_measured_times_come_from_a_jobs_events() -> None:
    mon = JobMonitor()
    t = 100.0
    for step, took in [(1, 9.0), *((s, 0.5) for s in range(2, 40)), (41, 3.0), (40, 7.0)]:  # 40: a restart's
        t += took
        mon.update([make("step", "j", 0, t=t, step=step, loss=1.0, tokens=8, step_time=took)])
    mon.update(
        [
            make("checkpoint", "j", 0, t=t, phase="begin", step=40),
            make("checkpoint", "j", 0, t=t + 12, phase="committed", step=40),
        ]
    )
    # neither the first step nor a restart's first: the median of the rest
    assert measured(mon) == (0.5, 12.0)


# ---- sections in the timeouts and the launch line -------------------------------------------------------


def test_gpu_sections_are_derived_and_cpu_ones_only_asked_for() -> None:
    t = derive(JobSpec().replace(**{"model.preset": "gpt-8b"}), gpu=True)
    assert (
        t.sections() == {"setup": 1800, "step": 60, "checkpointing": 660} and t.out_of_section.seconds == 90
    )
    measured_step = derive(JobSpec().replace(**{"ft.step_time": 30.0}), gpu=True)
    assert measured_step.step.seconds == 150 and "5 x the measured step (30 s)" in measured_step.step.reason
    assert derive(JobSpec(), gpu=False).sections() == {}
    cpu = derive(JobSpec().replace(**{"ft.step_timeout": 5.0}), gpu=False)
    assert cpu.sections() == {"setup": 120, "step": 5, "checkpointing": 61} and cpu.out_of_section is None
    script = derive(JobSpec(script="x.py").replace(**{"ft.section_timeouts": "init:60"}), gpu=True)
    assert script.sections() == {"init": 60} and script.out_of_section is None  # its own only
    argv = launcher_argv(
        JobSpec(backend="eks").replace(**{"model.preset": "gpt-8b"}),
        node_rank=0,
        rdzv_host="h",
        ports=Ports.from_base(29500),
        rdzv_id="r",
    )
    assert "--ft-rank-section-timeouts=setup:1800,step:60,checkpointing:660" in argv
    assert "--ft-rank-out-of-section-timeout=90" in argv


def test_a_timeout_line_says_which_timeout_fired() -> None:
    seen = parse_launcher_line(
        "[2026-12-04 14:49:17,209] [WARNING] [RankMonServer5638@vm:0] Section 'step' has "
        "been open for 3.67 seconds. Timeout is 3.00 seconds."
    )
    assert (seen.kind, seen.detail, seen.timeout_s) == ("hang", "step section", 3.0)
    seen = parse_launcher_line(
        "2026-11-30 19:12:39,949 [WARNING] [vm] [workload:?(1) infra:?(?)] "
        "rank_monitor_server.py:497 [Cycle 0] Did not get subsequent heartbeat. Waited 6.00 seconds."
    )
    assert (seen.detail, seen.timeout_s) == ("subsequent heartbeat", 6.0)
    error = parse_launcher_line(
        "nvidia_resiliency_ext.fault_tolerance.rank_monitor_client.RankMonitorClientError: "
        "RankMonitorClient could not send section update. Exception: Unknown section: init."
    )
    assert error.kind == "error" and error.detail.startswith("RankMonitorClientError: RankMonitorClient")
    assert parse_launcher_line("torch.distributed.elastic.multiprocessing.errors.ChildFailedError: ") is None


# ---- incidents: every restart counted, the ranks' last error named --------------------------------------


def test_a_restart_that_fails_before_its_first_step_is_counted_and_the_next_failure_has_its_own_cause() -> (
    None
):
    mon = JobMonitor()
    emitted: list[tuple[str, dict]] = []

    def emit(kind: str, **data: Any) -> None:
        emitted.append((kind, data))
        mon.update([make(kind, "j", None, t=10.0, **data)])

    incidents = Incidents(mon, emit, 0.0, patience=10, steps_expected=False)
    ev = [
        make("step", "j", 0, t=1.0, step=1, loss=None, tokens=None, step_time=0.1),
        make("fault", "j", 1, t=2.0, fault="sigkill", id="a", target_rank=1, at_step=2),
    ]
    for e in ev:
        mon.update([e])
        incidents.observe(e)
    fail = parse_launcher_line(
        "[2026-12-04 14:52:28,132] [ERROR] [ft_launcher1@vm] failed (exitcode: -9) "
        "local_rank: 1 (pid: 9) of binary: python",
        now=1e12,
    )
    incidents.launcher_line(0, _at(fail, 2.1), rank=1)
    incidents.group_restarted(0, 2.2)
    for e in [
        make(
            "rank_start",
            "j",
            0,
            t=2.5,
            pid=20,
            host="h",
            job_attempt=0,
            injob_restart=1,
            inprocess_iteration=0,
            world_size=2,
            start_step=0,
        ),
        make(
            "rank_error",
            "j",
            0,
            t=2.8,
            error="KeyError: 'init'",
            step=None,
            origin="exception",
            where="nvidia_resiliency_ext/fault_tolerance/timeouts_calc.py:140",
        ),
    ]:
        mon.update([e])
        incidents.observe(e)
    incidents.launcher_line(0, _at(fail, 3.0), rank=0)  # the restarted group fails again
    incidents.launcher_line(1, _at(fail, 3.05), rank=2)  # another node, not yet restarted: the same one
    restarts = [d for k, d in emitted if k == "restart"]
    assert [r["recovered"] for r in restarts] == [False] and restarts[0][
        "cause"
    ] == "injected sigkill on rank 1"
    assert incidents.incident.cause.startswith("rank 0 failed: KeyError: 'init'")
    incidents.group_restarted(ANY_NODE, 4.0)  # a job restart, still before a step
    incidents.end(5.0)
    assert mon.restarts_by_level()["injob"] == 2 and all(r["recovered"] is False for r in mon.restarts)
    reason = incidents.named("ft_launcher on node 0 gave up (exit 1)")
    assert reason.startswith(
        "ft_launcher on node 0 gave up (exit 1); the ranks' last error: rank 0: KeyError: 'init'"
    )
    assert "--section-timeouts init:SECONDS" in reason


def _at(seen: Any, at: float) -> Any:
    import dataclasses

    return dataclasses.replace(seen, at=at)


def test_errors_eksft_knows_get_their_fix() -> None:
    assert "--section-timeouts restore:SECONDS" in fix_for(
        "RankMonitorClientError: ... Unknown section: restore. Does"
    )
    assert (
        fix_for("KeyError: 'step'", "train.py:3") is None
    )  # a script's own KeyError says nothing of sections
    assert "first on PATH" in fix_for("ModuleNotFoundError: No module named 'eksft_nb'")


# ---- doctor ----------------------------------------------------------------------------------------------


def env_of(**changes: Any) -> Environment:
    base = dict(
        python="3.11.7",
        glibc=(2, 36),
        torch="2.13.0",
        cuda=None,
        nccl=None,
        gpus=0,
        nvrx=nvrx.NVRx("0.4.1"),
        torchft="0.2.0",
        libfabric=None,
        efa_plugin=None,
    )
    return Environment(**{**base, **changes})


@pytest.mark.parametrize(
    "changes, fields, line",
    [
        (
            {"nvrx": None},
            {},
            "NVRx (nvidia-resiliency-ext) is not installed where the ranks run, need 0.4.1+ → pip "
            "install 'nvidia-resiliency-ext>=0.4.1,<0.8' (gives 0.4.1 here)",
        ),
        (
            {"nvrx": None, "python": "3.13.1"},
            {},
            "NVRx (nvidia-resiliency-ext) is not installed where the ranks run, "
            "need 0.4.1+ → no NVRx can be installed here (Python 3.13, glibc 2.36)",
        ),
        ({"nvrx": nvrx.NVRx("0.3.0")}, {}, "NVRx 0.3.0 is older than 0.4.1"),
        (
            {"nvrx": nvrx.NVRx("0.5.0")},
            {"nnodes": 2, "spare_nodes": 1},
            "--spare-nodes 1: NVRx 0.5.0's barrier rendezvous",
        ),
        ({"nvrx": nvrx.NVRx("0.7.0")}, {"spare_nodes": 1}, "--spare-nodes 1 with --nnodes 1: NVRx 0.7.0's"),
        (
            {},
            {"backend": "eks", "eks.image": "i:1", "eks.queue": "q"},
            "the spec asks for GPUs but torch sees none here",
        ),
        (   # a Slurm node's GPUs counted there (no --gres) are none of the ranks' business with --device cpu
            {},
            {"backend": "slurm", "slurm.shared_dir": "/fsx", "slurm.gres": "gpu:2", "device": "cpu"},
            None,
        ),
        ({"torchft": None}, {"engine": "torchft", "nproc_per_node": 1}, "--engine torchft needs torchft"),
    ],
)
def test_doctor_refuses_what_the_node_cannot_run(changes: dict, fields: dict, line: str | None) -> None:
    diagnosis = diagnose(spec_of(**fields), on_node=True, env=env_of(**changes))
    refused = [f"{f.problem} → {f.fix}" for f in diagnosis.refusals]
    if line is None:
        assert refused == [], refused
        return
    assert any(r.startswith(line) for r in refused), refused


@pytest.mark.parametrize("version", ["0.4.1", "0.5.0", "0.6.0", "0.7.0"])
@pytest.mark.parametrize("backend", ["local", "eks", "slurm"])
def test_doctor_refuses_the_spares_a_release_cannot_run_as_nvrx_decides(version: str, backend: str,
                                                                         tmp_path: Path) -> None:
    """One place decides what a release cannot run (NVRx.cannot_run): a node's doctor says exactly that
    (0.4's spares run locally only, 0.5's nowhere, 0.6+'s standby nodes everywhere)."""
    fields = {"local": {}, "eks": {"eks.image": "i:1", "eks.queue": "q", "eks.gpus_per_node": 0},
              "slurm": {"slurm.shared_dir": str(tmp_path)}}[backend]
    spec = spec_of(backend=backend, nnodes=2, spare_nodes=1, **fields)
    release = nvrx.NVRx(version)
    said = [f for f in diagnose(spec, on_node=True, env=env_of(nvrx=release)).refusals
            if "spare" in f.problem]
    refused = release.cannot_run(spec)
    assert [(f.problem, f.fix) for f in said] == ([(refused.problem, refused.fix)] if refused else [])
    assert (refused is None) == (version >= "0.6" or (version == "0.4.1" and backend == "local"))


def test_doctor_says_what_each_release_supports_and_warns_of_nccl() -> None:
    old = diagnose(spec_of(), env=env_of()).supports
    assert old["sections"].endswith("fails the rank that opens it") and old["rendezvous"] == "legacy"
    new = diagnose(spec_of(), env=env_of(nvrx=nvrx.NVRx("0.7.0"), python="3.12.3", glibc=(2, 39))).supports
    assert "deprecated since NVRx 0.6" in new["in-process restart"] and new["pip install"].endswith(
        "0.7.0 here (Python 3.12, glibc 2.39)"
    )
    gpu = diagnose(spec_of(), on_node=True, env=env_of(nccl=(2, 28, 5), cuda="12.8", gpus=8))
    assert any("NCCL 2.28.5 crashes NVRx's in-process restart" in f.problem for f in gpu.findings)
    away = diagnose(spec_of(backend="eks", **{"eks.image": "i:1"}), env=env_of(nvrx=None))
    assert not away.refusals and "run the NVRx of their image" in away.findings[0].problem


def test_what_pip_gives_per_platform() -> None:
    table = {
        (py, libc): platforms.resolves(py, libc)
        for py in ((3, 10), (3, 11), (3, 12), (3, 13), (3, 14))
        for libc in ((2, 28), (2, 36), (2, 39))
    }
    assert table == {
        ((3, 10), (2, 28)): None,
        ((3, 10), (2, 36)): "0.4.1",
        ((3, 10), (2, 39)): "0.6.0",
        ((3, 11), (2, 28)): None,
        ((3, 11), (2, 36)): "0.4.1",
        ((3, 11), (2, 39)): "0.6.0",
        ((3, 12), (2, 28)): None,
        ((3, 12), (2, 36)): "0.4.1",
        ((3, 12), (2, 39)): "0.7.0",
        ((3, 13), (2, 28)): None,
        ((3, 13), (2, 36)): None,
        ((3, 13), (2, 39)): None,
        ((3, 14), (2, 28)): None,
        ((3, 14), (2, 36)): None,
        ((3, 14), (2, 39)): "0.7.0",
    }
    assert "Python 3.10-3.12 and 3.14 only" in platforms.said((3, 13), (2, 39))
    assert (
        "need glibc >= 2.31" in platforms.said((3, 11), (2, 28)) and platforms.resolves((3, 11), None) is None
    )


def test_a_pod_whose_nvrx_is_too_old_stops_in_prepare_with_the_line(tmp_path: Path) -> None:
    old = tmp_path / "old" / "nvidia_resiliency_ext-0.3.0.dist-info"
    old.mkdir(parents=True)
    (old / "METADATA").write_text("Metadata-Version: 2.1\nName: nvidia-resiliency-ext\nVersion: 0.3.0\n")
    spec = tmp_path / "spec.json"
    spec.write_text(
        JobSpec(name="pod", backend="eks").replace(**{"eks.gpus_per_node": 0, "eks.image": "i:1"}).to_json()
    )
    env = {
        **os.environ,
        "EKSFT_SPEC": str(spec),
        "EKSFT_JOB_DIR": str(tmp_path / "job"),
        "PYTHONPATH": os.pathsep.join((str(old.parent), str(REPO))),
    }
    done = subprocess.run(
        [sys.executable, "-m", "eksft_nb.backends.eks.inpod", "prepare"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 78, done.stderr  # failures.CONFIG_ERROR: the job fails, it is not retried
    assert done.stderr.strip().startswith(
        "eksft: error: NVRx 0.3.0 is older than 0.4.1 → pip install 'nvidia-resiliency-ext>=0.4.1,<0.8'"
    )
    assert not (tmp_path / "job").exists()  # stopped before it made anything


def test_the_magic_checks_a_spec_and_doctors_this_environment(
    ip: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    from IPython.core.error import UsageError

    ip.run_line_magic("ftrain", "check --device cpu --model gpt-1b --storage-mbps 75")
    out = capsys.readouterr().out
    assert out.startswith("timeouts acting on ftrain (local backend, CPU):")
    assert "refused: a restore takes ~324 s at 75 MB/s" in out
    ip.run_line_magic("ftrain", "doctor --json")
    report = __import__("json").loads(capsys.readouterr().out)
    assert report["environment"]["nvrx"] == nvrx.installed().version and "pip install" in report["supports"]
    with pytest.raises(UsageError, match="did you mean --from"):
        ip.run_line_magic("ftrain", "check --frm job")
