"""GPU health: NVML readings recorded in tests/data/nvml (XID 79, a double-bit ECC error, thermal
throttling) replayed through the real sampler, and its events through the real monitor, dashboard
figure, Prometheus collector and incident tracker. No process runs; nothing needs a GPU."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import CollectorRegistry

import eksft_nb
from eksft_nb.dashboard import Dashboard
from eksft_nb.events import EventTail, EventWriter, decode, make, read_all
from eksft_nb.gpuhealth import sampler as gpuhealth
from eksft_nb.gpuhealth.readings import GpuReadingError, parse_entry
from eksft_nb.gpuhealth.sampler import GpuSampler, read_gpus
from nvml_replay import Replay, record
from eksft_nb.incidents import Incidents
from eksft_nb.jobdir import JobDir
from eksft_nb.metrics import JobsCollector
from eksft_nb.monitor import JobMonitor
from eksft_nb.spec import JobSpec

DATA = Path(__file__).parent / "data" / "nvml"
HEALTHY, FAULTY = DATA / "node0-healthy.json", DATA / "node1-xid79-ecc-thermal.json"
LOST_UUID = "GPU-e8b4d217-0a6c-4f93-95d2-71c3a8e05b9f"     # node 1, GPU 1 (XID 79)
ECC_UUID = "GPU-3c91f0aa-7d24-4b6e-8a13-c5e9b2f47d60"      # node 1, GPU 0 (double-bit ECC)


class Run:
    """A job folder whose ranks' events are written as ranks write them, two nodes' GPU samplers on
    replayed recordings, and the supervisor's side: monitor and incidents fed one event at a time."""

    def __init__(self, name: str) -> None:
        self.spec = JobSpec().replace(name=name, steps=20).validate()
        self.dir = JobDir.for_name(name)
        self.dir.create(self.spec)
        path = self.dir.events_path
        self.ranks = {r: EventWriter(path, name, r) for r in range(4)}
        self.supervisor = EventWriter(path, name)
        self.supervisor.emit("job_start", spec_digest="x", world_size=4, steps=20, backend="local", host="h",
                             pid=1)
        self.samplers = [GpuSampler(Replay.load(rec), self.ranks[2 * node].emit, node, f"ip-10-0-0-{node}")
                         for node, rec in enumerate((HEALTHY, FAULTY))]
        self.mon, self.tail = JobMonitor(), EventTail(path)
        self.incidents = Incidents(self.mon, self.supervisor.emit, time.time())
        self.step = 0

    def pump(self) -> None:
        for e in self.tail.read():
            self.mon.update([e])
            self.incidents.observe(e)

    def start_ranks(self, injob: int = 0) -> None:
        for r, out in self.ranks.items():
            out.emit("rank_start", pid=100 + r, host="h", job_attempt=0, injob_restart=injob,
                     inprocess_iteration=0,
                     world_size=4, start_step=self.step)
        self.pump()

    def steps(self, n: int) -> None:
        for _ in range(n):
            self.step += 1
            self.ranks[0].emit("step", step=self.step, loss=1.0, tokens=64, step_time=0.001)
        self.pump()

    def sample(self) -> None:
        """One sampling period of both nodes: readings, then the events NVML delivers."""
        for s in self.samplers:
            s.tick()
            s.drain(20)
        self.pump()


def scrape(*names: str) -> dict[tuple[str, tuple], float]:
    registry = CollectorRegistry()
    registry.register(JobsCollector(lambda: [eksft_nb.attach(n) for n in names]))
    text = generate_latest(registry).decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def dcgm(name: str, gpu: int, uuid: str, node: int, job: str) -> tuple[str, tuple]:
    return name, (("Hostname", f"ip-10-0-0-{node}"), ("UUID", uuid), ("gpu", str(gpu)), ("job", job))


def test_xid79_ecc_and_throttling_reach_the_dashboard_the_metrics_and_the_restart_timeline() -> None:
    run = Run("gpu-faults")
    run.start_ranks()
    run.steps(2)
    run.sample()                                      # frame 0: all fine
    run.steps(2)
    # frame 1: node 1 GPU 1 hot and throttled; ECC event on GPU 0
    run.sample()
    mid = scrape(run.dir.name)
    assert mid[dcgm("DCGM_FI_DEV_GPU_TEMP", 1, LOST_UUID, 1, "gpu-faults")] == 92
    assert mid[dcgm("DCGM_FI_DEV_CLOCK_THROTTLE_REASONS", 1, LOST_UUID, 1, "gpu-faults")] == 0x4 | 0x20 | 0x40
    assert mid[dcgm("DCGM_FI_DEV_POWER_USAGE", 1, LOST_UUID, 1, "gpu-faults")] == 271.0
    run.steps(2)
    run.sample()                                      # frame 2: XID 79 on node 1 GPU 1
    xid_t = next(f["t"] for f in run.mon.gpu.faults if f["fault"] == "xid")
    run.incidents.worker_failed(2, 1, time.time())   # rank 2, on that GPU, exits
    run.pump()
    run.sample()                                      # frame 3: the GPU reads as lost
    run.step = 4                                      # the ranks come back from checkpoint 4
    run.start_ranks(injob=1)
    run.steps(2)
    run.pump()                                        # the restart the first step closed

    faults = [(e["node"], e["gpu"], e["fault"], e.get("xid")) for e in read_all(run.dir.events_path)
              if e.kind == "gpu_fault"]
    assert faults == [(1, 1, "throttle", None), (1, 0, "ecc", None), (1, 1, "xid", 79)]   # each onset once

    # the restart names the XID as its cause, from the XID's time
    (restart,) = run.mon.restarts
    assert restart["level"] == "injob" and restart["fault_time"] == xid_t
    assert restart["cause"].startswith(
        "GPU fault on node 1 GPU 1: XID 79 (GPU fell off the bus); then rank 2")

    # the dashboard: XID and ECC markers in the faults lane, the XID beside its restart; a strip per node
    dash = Dashboard(eksft_nb.attach(run.dir.name), live=False)
    dash.update()
    data = {t.name: t for t in dash.figure.widget.data if t.meta == "tail"}
    marks = dict(zip(data["gpu faults"].text, data["gpu faults"].x))
    xid_label = "XID 79 (GPU fell off the bus) · node 1 GPU 1"
    assert set(marks) == {xid_label, "double-bit ECC error (NVML event) · node 1 GPU 0"}
    assert list(data["restarts"].x) == [marks[xid_label]] and "XID 79" in data["restarts"].text[0]
    strip = list(zip(data["gpu"].y, data["gpu"].marker.color))
    red, orange, green = (dashboard_color(s) for s in ("fault", "throttled", "ok"))
    assert {c for y, c in strip if y == "node 0"} == {green}
    node1 = [c for y, c in strip if y == "node 1"]
    assert node1.count(orange) >= 2 and red in node1 and node1[-1] == red   # the GPU stays lost
    hover = [h for h in data["gpu"].hovertext if "node 1" in h and "92 C" in h]
    assert hover and "hardware thermal slowdown" in hover[0]

    # the metrics, under DCGM's names: the last XID, the ECC count; a lost GPU has no readings
    end = scrape(run.dir.name)
    assert end[dcgm("DCGM_FI_DEV_XID_ERRORS", 1, LOST_UUID, 1, "gpu-faults")] == 79
    assert end[dcgm("DCGM_FI_DEV_ECC_DBE_VOL_TOTAL", 0, ECC_UUID, 1, "gpu-faults")] == 1
    assert end[dcgm("DCGM_FI_DEV_ECC_SBE_VOL_TOTAL", 0, ECC_UUID, 1, "gpu-faults")] == 3
    assert dcgm("DCGM_FI_DEV_GPU_TEMP", 1, LOST_UUID, 1, "gpu-faults") not in end
    assert end[("eksft_restarts_total", (("job", "gpu-faults"), ("level", "injob")))] == 1
    assert sum(1 for name, _ in end if name == "DCGM_FI_DEV_GPU_TEMP") == 3


def dashboard_color(status: str) -> str:
    from eksft_nb.dashboard.figure import GPU_STATUS

    return GPU_STATUS[status]


def test_the_sampler_thread_follows_a_recording_and_stops() -> None:
    path = JobDir.for_name("gpu-thread").path
    path.mkdir(parents=True)
    out = EventWriter(path / "events.jsonl", "gpu-thread", 2)
    replay = Replay.load(FAULTY)
    sampler = gpuhealth.start(out.emit, 1, "h1", first=True, interval=0.02, nvml=replay)
    deadline = time.time() + 60
    while replay.frames_done < len(replay.frames) and time.time() < deadline:
        time.sleep(0.05)
    sampler.stop()
    assert not sampler._thread.is_alive()
    evs = read_all(path / "events.jsonl")
    assert [e["xid"] for e in evs if e.kind == "gpu_fault" and e["fault"] == "xid"] == [79]
    assert sum(e.kind == "gpu_health" for e in evs) >= len(replay.frames)


def test_without_nvml_it_says_so_once_and_starts_nothing(tmp_path: Path) -> None:
    nvml, why = gpuhealth.load_nvml()
    if nvml is not None:
        pytest.skip("this machine has NVML and a GPU")
    sent: list[dict[str, Any]] = []
    threads = threading.active_count()
    assert gpuhealth.start(lambda kind, **data: sent.append(data), 0, "h", first=True) is None
    assert gpuhealth.start(lambda kind, **data: sent.append(data), 0, "h", first=False) is None   # a restart
    assert threading.active_count() == threads
    assert len(sent) == 1 and sent[0]["gpus"] == [] and sent[0]["note"] == f"no GPU health: {why}"
    mon = JobMonitor()
    mon.update([make("gpu_health", "j", 0, **sent[0])])
    assert [s["status"] for s in mon.gpu.samples] == ["none"] and not mon.gpu.faults


def test_malformed_recordings_are_refused_in_one_line(tmp_path: Path) -> None:
    good = json.loads(FAULTY.read_text())
    cases = {"not json": "{", "a list": [], "wrong format": {**good, "format": "x"},
             "no frames": {**good, "frames": []},
             "event on a missing GPU": {**good,
                                        "frames": [{"gpus": [{}], "events": [{"gpu": 3, "type": "xid"}]}]},
             "frames of different sizes": {**good, "frames": [good["frames"][0], {"gpus": [], "events": []}]}}
    for what, content in cases.items():
        path = tmp_path / "rec.json"
        path.write_text(content if isinstance(content, str) else json.dumps(content))
        with pytest.raises(GpuReadingError) as err:
            Replay.load(path)
        assert "\n" not in str(err.value) and str(path) in str(err.value), what


def test_untrusted_readings_are_refused_once_and_the_others_kept() -> None:
    frame = json.loads(HEALTHY.read_text())["frames"][0]
    frame["gpus"][0]["temperature"] = "hot"
    said: list[str] = []
    out = read_gpus(Replay([frame]), [0, 1], said.append, {})
    assert [r["gpu"] for r in out] == [1] and len(said) == 1
    assert said[0] == ("GPU 0: NVML's temperature reading 'hot' is not an integer in [0, 200): "
                       "check the driver "
                       "(nvidia-smi); this reading is skipped")


readings = st.one_of(st.none(), st.booleans(), st.integers(-5, 2**65), st.floats(allow_nan=True),
                     st.text(max_size=5),
                     st.fixed_dictionaries({"nvml_error": st.integers(0, 20)}))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.fixed_dictionaries({}, optional={k: readings for k in (
    "uuid", "temperature", "power_mw", "throttle", "ecc_sbe", "ecc_dbe")}), min_size=1, max_size=3))
def test_any_recorded_reading_is_sampled_or_refused_and_the_events_fold(gpus: list[dict[str, Any]]) -> None:
    """Whatever NVML answers, the sampler emits only events the schema accepts, and they fold."""
    sent: list[Any] = []
    sampler = GpuSampler(Replay([{"gpus": gpus, "events": []}]), lambda kind,
                         **d: sent.append(make(kind, "j", 0, **d)),
                         0, "h")
    sampler._refused = lambda line: None
    sampler.tick()
    sampler.tick()
    mon = JobMonitor()
    mon.update(decode(e.to_json()) for e in sent)
    assert mon.gpu.samples


@settings(max_examples=150, deadline=None)
@given(st.lists(st.dictionaries(st.sampled_from(["gpu", "uuid", "lost", "xid", "temp_c", "power_w",
                                                 "throttle",
                                                 "ecc_sbe", "ecc_dbe"]),
                                st.one_of(st.none(), st.booleans(), st.integers(-3, 2**66), st.floats(),
                                          st.text(max_size=4))),
                max_size=4))
def test_health_events_read_back_are_checked_entry_by_entry(entries: list[dict[str, Any]]) -> None:
    line = json.dumps({"v": 1, "t": 1.0, "kind": "gpu_health", "job": "j", "rank": 0, "node": 0, "host": "h",
                       "gpus": entries})
    mon = JobMonitor()
    mon.update([decode(line)])
    kept = mon.gpu.nodes.get(0, {}).get("gpus", {})
    assert all(parse_entry(e) is not None for e in kept.values())
    assert len(kept) <= sum(parse_entry(e) is not None for e in entries)


def test_the_recorder_writes_what_the_replayer_answers(tmp_path: Path) -> None:
    """Recording a replay gives back the recording: readings, lost GPUs and XID/ECC events alike."""
    frames = json.loads(FAULTY.read_text())["frames"]
    path = record(tmp_path / "again.json", frames=len(frames), interval=0.01, nvml=Replay.load(FAULTY))
    assert json.loads(path.read_text())["frames"] == frames


def test_a_gpu_found_lost_after_the_failure_is_named_as_its_cause() -> None:
    """XID 79 can take the sampling rank down with it: the restarted node's sampler finds the GPU
    lost, and the open incident's restart names it (its failure event, published before, could not)."""
    run = Run("gpu-late")
    run.samplers = [GpuSampler(Replay(json.loads(FAULTY.read_text())["frames"][3:]), run.ranks[2].emit, 1,
                               "n1")]
    run.start_ranks()
    run.steps(3)
    run.incidents.worker_failed(2, -9, time.time())
    run.pump()
    run.sample()
    run.step = 2
    run.start_ranks(injob=1)
    run.steps(1)
    run.pump()                                        # the restart the first step closed
    (failure,), (restart,) = run.mon.failures, run.mon.restarts
    assert failure["cause"] == "rank 2 died (SIGKILL)"
    assert restart["cause"] == ("GPU fault on node 1 GPU 1: XID 79 (GPU fell off the bus): NVML says the "
                                "GPU is lost; "
                                "then rank 2 died (SIGKILL)")
    assert restart["fault_time"] == failure["fault_time"]   # found after the failure: not when it happened


def test_pods_name_their_node_as_dcgm_exporter_does() -> None:
    """On EKS the health events' host (the metrics' Hostname) is the node's name, not the pod's."""
    from eksft_nb.backends.eks.render import pod_template

    spec = JobSpec().replace(name="gpu-pod", backend="eks").validate()
    env = {e["name"]: e for e in pod_template(spec)["spec"]["containers"][0]["env"]}
    assert env["NODE_NAME"]["valueFrom"] == {"fieldRef": {"fieldPath": "spec.nodeName"}}


def test_a_long_job_keeps_recent_samples_and_old_status_changes_only() -> None:
    """Days of a many-node job's readings: the fold stays bounded, a reader that keeps up misses
    nothing, and a late one still sees every change of status (here node 1's throttle long ago)."""
    mon, seen, got = JobMonitor(), 0, []
    mon.gpu.recent = 50
    reading = {"gpu": 0, "uuid": LOST_UUID, "temp_c": 60, "power_w": 300.0, "throttle": 0, "ecc_sbe": 0,
               "ecc_dbe": 0, "lost": False}
    for i in range(1000):
        node = i % 4
        # HW slowdown, for a while
        gpus = [dict(reading, throttle=0x8 if (node == 1 and 40 <= i < 60) else 0)]
        mon.update([make("gpu_health", "long", node * 8, t=float(i), node=node, host=f"n{node}", gpus=gpus)])
        if i % 7 == 0:
            got += mon.gpu.since(seen)
            seen = mon.gpu.n_samples
    got += mon.gpu.since(seen)
    assert [g["seq"] for g in got] == list(range(1000)) and mon.gpu.n_samples == 1000
    assert len(mon.gpu.samples) <= 50 * 5 // 4 + 8
    old = [(g["t"], g["status"]) for g in mon.gpu.samples if g["node"] == 1 and g["t"] < 900]
    assert old == [(1.0, "ok"), (41.0, "throttled"), (61.0, "ok")]


def test_a_many_node_strip_stays_light() -> None:
    """32 nodes of 8 GPUs: each strip point's hover is one line per node, and the strip's parts
    are short, so a live update that re-sends them stays small."""
    from eksft_nb.dashboard.figure import TrainingFigure

    mon, fig = JobMonitor(), TrainingFigure()
    mon.update([make("job_start", "big", None, t=1.0, spec_digest="x", world_size=1024, steps=10,
                     backend="eks",
                     host="h", pid=1)])
    gpus = [{"gpu": g, "uuid": LOST_UUID, "temp_c": 60 + g, "power_w": 650.0, "throttle": 0, "ecc_sbe": g,
             "ecc_dbe": 0, "lost": False} for g in range(8)]
    for i in range(40):
        mon.update([make("gpu_health", "big", 32 * n, t=10.0 * i + n / 100, node=n, host=f"ip-{n}", gpus=gpus)
                    for n in range(32)])
    fig.ingest(mon)
    strip = [t for t in fig.figure().data if t.name == "gpu"]
    assert sum(len(t.x) for t in strip) > 500 and max(len(t.x) for t in strip) <= 101
    hover = strip[-1].hovertext[-1]
    assert hover == "<b>node 31 (ip-31): ok</b><br>8 GPUs: 60-67 C, 650 W, ECC 28/0 (single/double)"
