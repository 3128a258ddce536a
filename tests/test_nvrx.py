"""NVRx releases: version detection, what each can do, the launch line each gets, and reading the
logs and records that NVRx 0.4.1, 0.6 and 0.7 write (lines and records below are copied from real runs)."""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import nvrx_releases as releases
from eksft_nb import nvrx
from eksft_nb.backends.base import quiet_lines
from eksft_nb.backends.launcher_log import parse_launcher_line
from eksft_nb.dashboard.figure import restart_hover
from eksft_nb.errors import JobError
from eksft_nb.events import Event, make
from eksft_nb.launcher import Ports, control_argv, launcher_argv, rank_env
from eksft_nb.monitor import JobMonitor
from eksft_nb.nvrx_cycles import MAX_TEXT, current_records, parse_cycle_record, read_cycle_records
from eksft_nb.spec import JobSpec


def test_what_each_release_can_do() -> None:
    old, v6, v7 = nvrx.NVRx("0.4.1"), nvrx.NVRx("0.6.0"), nvrx.NVRx("0.7.0")
    assert (old.inprocess, v6.inprocess, v7.inprocess) == ("available", "deprecated", "deprecated")
    assert nvrx.NVRx("0.9.0", inprocess_module=False).inprocess == "missing"
    assert (old.rendezvous, v6.rendezvous, v7.rendezvous) == ("legacy", "barrier", "barrier only")
    assert not old.cycle_records and v6.cycle_records
    assert not old.progress_termination and v6.progress_termination
    assert (old.spares, nvrx.NVRx("0.5.0").spares, v6.spares, v7.spares) == ("handover", None, "standby",
                                                                             "standby")
    assert old.inprocess_note() is None
    assert "deprecates in-process restart" in v6.inprocess_note()
    assert "in-job" in nvrx.NVRx("0.9.0", inprocess_module=False).inprocess_note()


@pytest.mark.parametrize("text, release",
                         [("0.4.1", (0, 4, 1)), ("0.6.0", (0, 6, 0)), ("0.7.0rc1", (0, 7, 0)),
                                           ("0.5.0+cu13", (0, 5, 0)), ("1", (1, 0, 0)), ("dev", (0, 0, 0))])
def test_versions_parse(text: str, release: tuple[int, int, int]) -> None:
    assert nvrx.parse_version(text) == release


def test_the_installed_release_is_the_one_python_imports() -> None:
    here = nvrx.installed()
    assert here is not None and here.version == importlib.metadata.version("nvidia-resiliency-ext")
    code = ("from eksft_nb import nvrx; import nvidia_resiliency_ext as m; "
            "print(nvrx.installed().describe(), m.__file__)")
    env = releases.env(releases.NEWEST)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith(f"NVRx {releases.NEWEST} (restart tiers: in-process (deprecated), in-job, "
                                 "job; barrier only rendezvous)")
    assert str(releases.folder(releases.NEWEST)) in out.stdout


def test_an_unsupported_or_missing_nvrx_is_refused_in_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(nvrx, "installed", lambda: nvrx.NVRx("0.3.0"))
    with pytest.raises(JobError, match=r"NVRx 0.3.0 is older than 0.4.1") as e:
        nvrx.require()
    assert "pip install" in e.value.fix
    monkeypatch.setattr(nvrx, "installed", lambda: None)
    with pytest.raises(JobError, match="not installed"):
        nvrx.require()


def test_the_launch_line_adds_release_flags_only_when_the_release_is_known() -> None:
    spec = JobSpec(name="j").validate()
    args = dict(node_rank=0, rdzv_host="h", ports=Ports.from_base(29500), rdzv_id="r")
    common = launcher_argv(spec, **args)  # what an EKS pod gets: its image's NVRx is not known here
    assert not [a for a in common if "cycle-info" in a or "no-progress" in a]
    assert launcher_argv(spec, **args, nvrx=nvrx.NVRx("0.4.1"), cycle_dir="/x") == common
    v6 = launcher_argv(spec, **args, nvrx=nvrx.NVRx("0.6.0"), cycle_dir="/x")
    assert v6[-2:] == common[-2:] and set(v6) - set(common) == {"--ft-max-no-progress-cycles=0",
                                                                 "--ft-cycle-info-dir=/x"}
    ports = Ports.from_base(29500)
    assert "EKSFT_WRAPPER_PORT" in rank_env(spec, ports=ports, job_attempt=0, nvrx=nvrx.NVRx("0.6.0"))
    gone = nvrx.NVRx("0.9.0", inprocess_module=False)
    assert "EKSFT_WRAPPER_PORT" not in rank_env(spec, ports=ports, job_attempt=0, nvrx=gone)


_ACCEPTS = """
import sys
from nvidia_resiliency_ext.fault_tolerance.launcher import get_args_parser
args, unknown = get_args_parser().parse_known_args(sys.argv[1:])
assert not unknown, unknown
print(args.ft_max_no_progress_cycles if hasattr(args, "ft_max_no_progress_cycles") else "-")
"""


_CONTROL_ACCEPTS = """
import sys
from nvidia_resiliency_ext.fault_tolerance.control_plane import get_args_parser
print(get_args_parser().parse_args(sys.argv[1:]).nnodes)
"""


@pytest.mark.parametrize("release", [*releases.SMOKE, releases.NEWEST])
def test_each_release_accepts_its_launch_line(release: str, tmp_path: Path) -> None:
    """ft_launcher's own argument parser takes every flag eksft gives that release, hot spares' included;
    and, where spares are NVRx's standby nodes (0.6+), nvrx-control's parser takes its line."""
    env = releases.env(release)
    which = nvrx.NVRx(releases.version(release))
    spec = JobSpec(name="j", nnodes=2, spare_nodes=1).replace(**{"ft.step_timeout": 30.0}).validate()
    argv = launcher_argv(spec, node_rank=0, rdzv_host="127.0.0.1", ports=Ports.from_base(29500), rdzv_id="r",
                         log_dir=str(tmp_path), nvrx=which, cycle_dir=str(tmp_path / "nvrx"),
                         store_elsewhere=True)
    out = subprocess.run([sys.executable, "-c", _ACCEPTS, *argv[1:]], env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split()[-1] == ("0" if which.progress_termination else "-")
    if which.spares != "standby":
        return
    control = control_argv(spec, rdzv_host="127.0.0.1", ports=Ports.from_base(29500), rdzv_id="r",
                           cycle_dir=str(tmp_path / "nvrx"), cycle_job="j")
    out = subprocess.run([sys.executable, "-c", _CONTROL_ACCEPTS, *control[1:]], env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.split()[-1] == "2:3", out.stderr[-2000:]


# ---- ft_launcher's log, both formats ---------------------------------------------------------

LINES_041 = {
    "[2026-11-30 18:59:04,962] [ERROR] [ft_launcher13498@vm] failed (exitcode: -15) local_rank: 0 "
    "(pid: 13562) "
    "of binary: /work/main/.venv/bin/python": ("worker_failed", -15, 0, 13562),
    "[2026-11-30 19:12:13,616] [WARNING] [RankMonServer22715@vm:1] Did not get subsequent heartbeat. "
    "Waited 6.00 seconds.": ("hang",),
    "[2026-11-30 19:12:13,616] [WARNING] [RankMonServer22715@vm:1] FT timeout elapsed.": ("hang",),
    "[2026-11-30 19:12:14,623] [INFO] [ft_launcher22696@vm] [default] Worker group FAILED. 3/3 "
    "attempts left; "
    "will restart worker group": ("restarting", (3, 3)),
}
LINES_060 = {
    "E1130 19:02:39.339000 16112 torch/distributed/elastic/multiprocessing/api.py:1002] failed "
    "(exitcode: -9) "
    "local_rank: 1 (pid: 16120) of binary: /work/main/.venv/bin/python": ("worker_failed", -9, 1, 16120),
    "2026-11-30 18:53:09,023 [WARNING] [vm] [workload:?(1) infra:?(?)] rank_monitor_server.py:487 [Cycle 0] "
    "Did not get initial heartbeat. Waited 120.00 seconds.": ("hang",),
    "2026-11-30 19:12:39,949 [WARNING] [vm] [workload:?(1) infra:?(?)] rank_monitor_server.py:497 [Cycle 0] "
    "Did not get subsequent heartbeat. Waited 6.00 seconds.": ("hang",),
    "2026-11-30 19:02:39,339 [INFO] [vm] [workload:?(?) infra:?(?)] launcher.py:561 [default] Worker group "
    "UNHEALTHY. 3/3 attempts left; will restart worker group": ("restarting", (3, 3)),
    "2026-11-30 18:53:09,995 [INFO] [vm] [workload:?(?) infra:?(?)] launcher.py:561 [default] Worker group "
    "FAILED. 2/3 attempts left; will restart worker group": ("restarting", (2, 3)),
}


LINES_070 = {
    "E1204 14:45:33.545000 29218 .venv/lib/python3.11/site-packages/torch/distributed/elastic/"
    "multiprocessing/api.py:1002] failed (exitcode: -9) local_rank: 0 (pid: 29498) of binary: "
    "/work/wt/nvrx07/.venv/bin/python":
        ("worker_failed", -9, 0, 29498),
    "2026-12-04 14:45:33,546 [INFO] [vm] [workload:?(?) infra:?(?)] launcher.py:636 [default] Worker group "
    "FAILED. 3/3 attempts left; will restart worker group": ("restarting", (3, 3)),
    "2026-12-04 14:42:39,352 [WARNING] [vm] [workload:?(0) infra:?(?)] rank_monitor_server.py:497 [Cycle 0] "
    "Did not get subsequent heartbeat. Waited 15.00 seconds.": ("hang",),
}


@pytest.mark.parametrize("line, want", [*LINES_041.items(), *LINES_060.items(), *LINES_070.items()])
def test_launcher_lines_of_every_release_are_read(line: str, want: tuple) -> None:
    now = time.mktime((2026, 12, 5, 0, 0, 0, 0, 0, -1))
    seen = parse_launcher_line(line, now=now)
    assert seen is not None and seen.kind == want[0]
    if seen.kind == "worker_failed":
        assert (seen.exitcode, seen.local_rank, seen.pid) == want[1:]
    if seen.kind == "restarting":
        assert seen.left == want[1]
    # the launcher's own timestamp, not the time the supervisor read the line
    logged = time.localtime(seen.at)
    assert (logged.tm_year, logged.tm_mon) == (2026, 12 if line in LINES_070 else 11) and seen.at < now


@pytest.mark.parametrize("line", [
    "2026-11-30 18:51:06,934 [INFO] [vm] [workload:?(?) infra:?(?)] profiling.py:90   - Cycle: 0 Event: "
    "rendezvous_completed Node: localhost_5514_0 Rank: None Time: 2026-11-30 18:51:06.934 UTC",
    "2026-12-04 14:45:35,724 [INFO] [vm] [workload:?(?) infra:?(?)] ft_rendezvous_barrier.py:2752 Assigned "
    "active rank 0 (round=1)",
    "[2026-11-30 18:56:18,853] [INFO] [ft_launcher10346@vm] The node 'localhost_10346_0' has "
    "joined round 0 of "
    "the rendezvous 'ks-0-7d72af' as rank 0 in a world of size 1.",
    "[rank0]: step 12 done",
])
def test_other_lines_are_not_events(line: str) -> None:
    assert parse_launcher_line(line) is None


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=300))
def test_no_line_breaks_the_reader(line: str) -> None:
    seen = parse_launcher_line(line)
    assert seen is None or seen.kind in ("hang", "worker_failed", "restarting", "error")
    assert seen is None or len(seen.detail) <= 300


def test_library_noise_of_both_releases_is_hidden_but_the_users_lines_are_not() -> None:
    log = [
        "[2026-11-30 18:56:18,596] [INFO] [ft_launcher10346@vm] Using nproc_per_node=2.",
        "2026-11-30 19:02:30,141 [ERROR] [vm] [workload:0(0) infra:?(?)] health_check.py:169 NVML Error: "
        "NVML Shared Library Not Found",
        "Traceback (most recent call last):",
        '  File "/venv/lib/python3.11/site-packages/pynvml.py", line 3190, in _LoadNvmlLibrary',
        '    nvmlLib = CDLL("libnvidia-ml.so.1")',
        "              ^^^^^^^^^^^^^^^^^^^^^^^^^",
        "OSError: libnvidia-ml.so.1: cannot open shared object file: No such file or directory",
        "",
        "During handling of the above exception, another exception occurred:",
        "pynvml.NVMLError_LibraryNotFound: NVML Shared Library Not Found",
        "loss went down",
        "[rank1]: injected exception on rank 1 at step 12",
    ]
    assert quiet_lines(log) == ["loss went down", "[rank1]: injected exception on rank 1 at step 12"]


# ---- NVRx's per-cycle records (0.6+) -----------------------------------------------------------

RECORD = {  # cycle_info..0.0 as NVRx 0.6.0 wrote it (a launcher hosting the store: no job id outside Slurm)
    "cycle_start_time": "2026-11-30T19:02:26.298283Z", "cycle_end_time": "2026-11-30T19:02:41.420399Z",
    "active_nodes": "localhost", "generation": "1", "active_ranks": "0", "job_id": "", "attempt_index": 0,
    "cycle_number": 0, "cycle_log_file": "", "standby_nodes": "",
}
RECORD_07 = {  # cycle_info.sp1.0.1 as NVRx 0.7.0's nvrx-control wrote it (--ft-cycle-info-job-id sp1)
    "job_id": "sp1", "cycle_number": 1, "cycle_start_time": "2026-12-04T14:45:35.626198Z",
    "cycle_end_time": "2026-12-04T14:45:48.637719Z", "active_nodes": "node[1,3]", "generation": "1",
    "active_ranks": "0-1", "attempt_index": 0, "cycle_log_file": "", "standby_nodes": "node2",
}


def test_cycle_records_are_read_from_the_folder_nvrx_writes(tmp_path: Path) -> None:
    (tmp_path / "cycle_info..0.0").write_text(json.dumps(RECORD, indent=2))
    running = {**RECORD, "cycle_number": 1, "cycle_start_time": "2026-11-30T19:02:41.420449Z",
               "cycle_end_time": ""}
    (tmp_path / "cycle_info..0.1").write_text(json.dumps(running))
    (tmp_path / "cycle_info..current").symlink_to("cycle_info..0.1")
    (tmp_path / "cycle_info..0.2.tmp").write_text("{")  # a write in progress
    (tmp_path / "cycle_info..0.3").write_text('{"cycle_number": -1, "cycle_start_time": "x"}')
    (tmp_path / "cycle_info..0.4").write_text(json.dumps({**RECORD, "cycle_number": 5}))   # not its name's
    (tmp_path / "cycle_info..0.6").symlink_to("/etc/hostname")   # a link is never followed
    os.mkfifo(tmp_path / "cycle_info..0.7")   # nor a FIFO opened (it would block)
    (tmp_path / "cycle_info..0.8").write_text(json.dumps({**RECORD, "cycle_number": 8}) + " " * 70000)
    records = read_cycle_records(tmp_path)
    assert [(r.cycle, r.end is not None) for r in records] == [(0, True), (1, False)]
    first = records[0]
    assert first.end - first.start == pytest.approx(15.122116) and first.active_ranks == "0"
    assert records[1].start == pytest.approx(first.end, abs=1e-3)
    assert read_cycle_records(tmp_path / "absent") == []


def test_nvrx_control_s_records_name_the_standby_nodes_and_a_shared_folder_is_read_per_job(
        tmp_path: Path) -> None:
    (tmp_path / "cycle_info.sp1.0.1").write_text(json.dumps(RECORD_07, indent=2))
    (tmp_path / "cycle_info.other.0.1").write_text(json.dumps({**RECORD_07, "job_id": "other"}))
    (tmp_path / "cycle_info.sp1.1.0").write_text(json.dumps({**RECORD_07, "attempt_index": 1,
                                                             "cycle_number": 0}))   # a Slurm requeue's
    [one, requeued] = read_cycle_records(tmp_path, job_id="sp1")
    assert (one.attempt, one.cycle, requeued.attempt, requeued.cycle) == (0, 1, 1, 0)
    assert one.fields() == {"cycle": 1, "start": one.start, "end": one.end, "active_nodes": "node[1,3]",
                            "standby_nodes": "node2", "active_ranks": "0-1"}
    assert len(read_cycle_records(tmp_path)) == 3
    make("nvrx_cycle", "sp1", None, attempt=0, **one.fields())   # the event schema takes them
    # a field that is not text, an end before the start, a huge or unprintable node list
    odd = parse_cycle_record(json.dumps({**RECORD_07, "active_nodes": ["x"], "standby_nodes": "a\x1b[2Jb"
                                         + "n" * 5000, "cycle_end_time": "2026-12-04T14:45:35Z"}))
    assert odd.active_nodes == "" and odd.end is None
    assert odd.standby_nodes.startswith("a?[2Jb") and len(odd.standby_nodes) == MAX_TEXT + 3


def test_a_rank_reads_its_cycle_and_the_one_before_through_the_link_nvrx_gives_it(tmp_path: Path) -> None:
    """NVRX_CURRENT_CYCLE_INFO names ``cycle_info.<job>.current``: read, never followed, so a link set to
    anything but a record beside it (another file, another folder) gives nothing."""
    for cycle in (0, 1):
        (tmp_path / f"cycle_info.sp1.0.{cycle}").write_text(json.dumps({**RECORD_07, "cycle_number": cycle}))
    link = tmp_path / "cycle_info.sp1.current"
    link.symlink_to("cycle_info.sp1.0.1")
    assert [r.cycle for r in current_records(str(link))] == [0, 1]
    for elsewhere in ("/etc/hostname", "../cycle_info.sp1.0.1", "cycle_info.other.0.1", "spec.json"):
        link.unlink()
        link.symlink_to(elsewhere)
        assert current_records(str(link)) == [], elsewhere
    assert current_records(None) == [] and current_records(str(tmp_path / "absent")) == []


_JSONISH = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=30),
                        lambda kids: st.lists(kids,
                                              max_size=4) | st.dictionaries(
                                                  st.text(max_size=20), kids, max_size=6),
                        max_leaves=20)
_FIELD = st.one_of(_JSONISH, st.sampled_from(["", "0", "12", "-1", "99999999999", "2026-12-04T14:45:35Z",
                                                "2026-12-04T14:45:35", "9999-12-31T23:59:59Z", "0001-01-01"]))


@settings(max_examples=150, deadline=None)
@given(st.one_of(st.text(max_size=400), _JSONISH.map(json.dumps),
                 st.dictionaries(st.sampled_from(sorted(RECORD)), _FIELD, max_size=10).map(json.dumps)))
def test_no_record_breaks_the_reader(text: str) -> None:
    record = parse_cycle_record(text)
    assert record is None or (record.cycle >= 0 and record.attempt >= 0 and isinstance(record.start, float))
    if record is not None:
        assert record.end is None or record.end >= record.start
        assert all(isinstance(v, str) and len(v) <= MAX_TEXT + 3 for v in (
            record.job_id, record.active_nodes, record.standby_nodes, record.active_ranks))


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.one_of(st.from_regex(r"cycle_info\.[a-z]{0,3}\.[0-9]{1,3}\.[0-9]{1,3}",
                                                   fullmatch=True), st.text(min_size=1, max_size=20)),
                          st.one_of(st.text(max_size=200), st.dictionaries(st.sampled_from(sorted(RECORD)),
                                                                           _FIELD).map(json.dumps))),
                max_size=8))
def test_no_folder_of_records_breaks_the_reader(files: list[tuple[str, str]]) -> None:
    """Whatever a folder holds (names and contents a process on a shared disk chose), the reader returns
    records whose names agree with them, in order, and never raises."""
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        for name, text in files:
            if "/" in name or "\0" in name or name in (".", ".."):
                continue
            try:
                (Path(d) / name).write_text(text, errors="replace")
            except OSError:
                continue
        records = read_cycle_records(Path(d))
    keys = [(r.attempt, r.cycle, r.job_id) for r in records]
    assert keys == sorted(set(keys))


def test_the_restart_timeline_names_the_cycle_nvrx_began() -> None:
    def restart(level: str, fault_time: float, t: float) -> Event:
        return make("restart", "j", None, t=t, level=level, cause="c", blame_rank=1, fault_time=fault_time,
                    detection_s=0.5, downtime_s=t - fault_time, rolled_back_steps=0, resumed_step=10)

    def cycle(attempt: int, number: int, start: float, end: float | None = None, **nodes: str) -> Event:
        return make("nvrx_cycle", "j", None, t=start + 0.1, attempt=attempt, cycle=number, start=start,
                    end=end, **nodes)

    mon = JobMonitor()
    mon.update([cycle(0, 0, 100.0), restart("inprocess", 110.0, 114.0), cycle(0, 0, 100.0, 121.0),
                cycle(0, 1, 121.0, active_nodes="n[1,3]", standby_nodes="<b>n2</b>", active_ranks=""),
                restart("injob", 120.0, 130.0), cycle(1, 0, 141.0),
                restart("job", 140.0, 150.0),
                restart("injob", 160.0, 170.0), cycle(1, 1, 165.0)])   # its record read after it (a pod's)
    assert [r.get("nvrx_cycle") for r in mon.restarts] == [None, 1, 0, 1]
    assert "NVRx cycle 1" in restart_hover(mon.restarts[1]) and "NVRx" not in restart_hover(mon.restarts[0])
    # the nodes NVRx's record names (a spare that waited through the cycle), as text, never markup
    assert mon.restarts[1]["nvrx_nodes"] == {"active_nodes": "n[1,3]", "standby_nodes": "<b>n2</b>"}
    assert "active nodes: n[1,3]<br>standby nodes: &lt;b&gt;n2&lt;/b&gt;" in restart_hover(mon.restarts[1])
