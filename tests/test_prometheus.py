"""The Grafana dashboard: its JSON against Grafana's dashboard model, and every panel's PromQL against
a real Prometheus (Debian's ``prometheus``; ``make prometheus`` installs it) scraping the exporter
while a job runs with a fault."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import threading
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from jobs import free_port

REPO = Path(__file__).resolve().parents[1]
DASHBOARD = REPO / "deploy" / "grafana" / "eksft-nb.json"
PROMETHEUS = shutil.which("prometheus")

# What the test checks of Grafana's (classic) dashboard JSON model, as Grafana 11/12 export it and read
# it on import (docs: "Dashboard JSON model"): the top-level fields, panels with a known core type, a
# grid position inside the 24 columns, a Prometheus datasource reference and targets with unique refIds;
# rows hold their panels when collapsed; template variables with a name, a type and (queries) a datasource.
DATASOURCE = {"type": "object", "required": ["type", "uid"],
              "properties": {"type": {"const": "prometheus"}, "uid": {"const": "${datasource}"}}}
GRID = {"type": "object", "required": ["h", "w", "x", "y"], "additionalProperties": False,
        "properties": {"h": {"type": "integer", "minimum": 1},
                       "w": {"type": "integer", "minimum": 1, "maximum": 24},
                       "x": {"type": "integer", "minimum": 0, "maximum": 23},
                       "y": {"type": "integer", "minimum": 0}}}
PANEL = {"type": "object",
         "required": ["type", "id", "title", "gridPos", "datasource", "targets", "fieldConfig", "options"],
         "properties": {
             "type": {"enum": ["timeseries", "stat", "gauge", "bargauge", "table", "state-timeline",
                               "status-history",
                               "barchart", "piechart", "text", "heatmap", "histogram"]},
             "id": {"type": "integer", "minimum": 1}, "title": {"type": "string", "minLength": 1},
             "description": {"type": "string"}, "gridPos": GRID, "datasource": DATASOURCE,
             "fieldConfig": {"type": "object", "required": ["defaults", "overrides"],
                             "properties": {"defaults": {"type": "object"}, "overrides": {"type": "array"}}},
             "options": {"type": "object"},
             "targets": {"type": "array", "minItems": 1, "items": {
                 "type": "object", "required": ["refId", "expr", "datasource"],
                 "properties": {"refId": {"type": "string", "pattern": "^[A-Z]$"},
                                "expr": {"type": "string", "minLength": 1}, "datasource": DATASOURCE,
                                "legendFormat": {"type": "string"}, "instant": {"type": "boolean"},
                                "range": {"type": "boolean"}}}}}}
ROW = {"type": "object", "required": ["type", "id", "title", "gridPos", "collapsed", "panels"],
       "properties": {"type": {"const": "row"}, "id": {"type": "integer", "minimum": 1},
                      "title": {"type": "string"},
                      "gridPos": GRID, "collapsed": {"type": "boolean"},
                      "panels": {"type": "array", "items": PANEL}}}
VARIABLE = {"type": "object", "required": ["name", "type", "current", "hide", "options"],
            "properties": {"name": {"type": "string", "pattern": r"^\w+$"},
                           "type": {"enum": ["query", "datasource", "custom", "constant", "interval",
                                             "textbox", "adhoc"]},
                           "hide": {"enum": [0, 1, 2]}},
            "if": {"properties": {"type": {"const": "query"}}},
            "then": {"required": ["datasource", "query", "definition", "refresh"],
                     "properties": {"datasource": DATASOURCE, "refresh": {"enum": [1, 2]}}}}
MODEL = {"type": "object",
         "required": ["title", "uid", "schemaVersion", "panels", "templating", "time", "annotations",
                      "editable",
                      "refresh", "tags", "timezone", "version", "graphTooltip"],
         "properties": {
             "id": {"type": "null"},   # an imported dashboard gets its id from the Grafana it lands in
             "uid": {"type": "string", "pattern": "^[a-zA-Z0-9_-]{1,40}$"},
             "title": {"type": "string", "minLength": 1},
             "schemaVersion": {"type": "integer", "minimum": 39, "maximum": 42},   # Grafana 11.0 .. 12.x
             "editable": {"type": "boolean"}, "graphTooltip": {"enum": [0, 1, 2]}, "tags": {"type": "array"},
             "timezone": {"type": "string"}, "version": {"type": "integer"}, "refresh": {"type": "string"},
             "time": {"type": "object", "required": ["from", "to"]},
             "annotations": {"type": "object", "required": ["list"]},
             "templating": {"type": "object", "required": ["list"],
                            "properties": {"list": {"type": "array", "items": VARIABLE}}},
             "panels": {"type": "array", "minItems": 1,
                        "items": {"if": {"properties": {"type": {"const": "row"}}},
                                                                  "then": ROW, "else": PANEL}}}}


def dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def all_panels(dash: dict[str, Any]) -> list[dict[str, Any]]:
    """Every panel with queries, those inside collapsed rows included."""
    out = []
    for p in dash["panels"]:
        out += p["panels"] if p["type"] == "row" else [p]
    return out


def test_the_dashboard_matches_grafanas_dashboard_model() -> None:
    dash = dashboard()
    jsonschema.Draft202012Validator(MODEL).validate(dash)
    every = dash["panels"] + [q for p in dash["panels"] if p["type"] == "row" for q in p["panels"]]
    ids = [p["id"] for p in every]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    cells: dict[tuple[int, int], str] = {}
    for p in every:   # inside the 24 columns, and no two panels on one cell
        g = p["gridPos"]
        assert g["x"] + g["w"] <= 24, p["title"]
        for cell in ((x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])):
            assert cell not in cells, f"{p['title']!r} overlaps {cells[cell]!r}"
            cells[cell] = p["title"]
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"][
        "query"] == "prometheus"
    assert variables["job"]["type"] == "query" and "eksft_" in variables["job"]["definition"]
    for p in all_panels(dash):
        assert len({t["refId"] for t in p["targets"]}) == len(p["targets"]), p["title"]
        for t in p["targets"]:
            used = set(re.findall(r"\$\{?(\w+)", t["expr"]))
            assert used <= set(variables), f"{p['title']!r} uses undefined variables {used - set(variables)}"


def get(url: str) -> Any:
    return json.loads(urllib.request.urlopen(url, timeout=10).read())


class Prometheus:
    """The real server, on a free port with its own config and storage (never the package's service)."""

    def __init__(self, folder: Path, target: str, scrape_configs: list[dict[str, Any]] | None = None) -> None:
        self.port = free_port()
        config = folder / "prometheus.yml"
        config.write_text(json.dumps({   # YAML is a superset of JSON
            "global": {"scrape_interval": "1s", "scrape_timeout": "1s", "evaluation_interval": "1s"},
            "scrape_configs": scrape_configs or [{"job_name": "eksft", "honor_labels": True,
                                                  "static_configs": [{"targets": [target]}]}]}))
        self.proc = subprocess.Popen([PROMETHEUS, f"--config.file={config}",
                                      f"--storage.tsdb.path={folder / 'data'}",
                                      f"--web.listen-address=127.0.0.1:{self.port}", "--log.level=warn"],
                                     stdout=subprocess.DEVNULL, stderr=open(folder / "prometheus.log", "w"))

    def query(self, expr: str, at: float | None = None) -> list[dict[str, Any]]:
        params = {"query": expr, **({"time": f"{at:.3f}"} if at is not None else {})}
        answer = get(f"http://127.0.0.1:{self.port}/api/v1/query?{urllib.parse.urlencode(params)}")
        assert answer["status"] == "success", answer
        return answer["data"]["result"]

    def ready(self) -> bool:
        try:
            return urllib.request.urlopen(f"http://127.0.0.1:{self.port}/-/ready", timeout=5).status == 200
        except OSError:
            return False

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(30)


def series(result: list[dict[str, Any]]) -> dict[tuple[tuple[str, str], ...], float]:
    return {tuple(sorted(r["metric"].items())): float(r["value"][1]) for r in result}


@pytest.mark.slow
@pytest.mark.skipif(PROMETHEUS is None,
                    reason="the prometheus binary is not installed (`make prometheus` installs "
                                               "Debian's package)")
def test_every_panel_answers_with_the_jobs_values_from_a_real_prometheus(tmp_path: Path) -> None:
    from jobs import cli, wait_for

    from eksft_nb.goodput import compute
    from eksft_nb.job import attach

    name = "prom"
    launched = cli("run", "--name", name, "--model", "tiny", "--steps", "200", "--ckpt-every", "10", "--seed",
                   "0",
                   "--detach")
    assert launched.returncode == 0, launched.stderr
    port = free_port()
    exporter = subprocess.Popen([sys.executable, "-m", "eksft_nb", "metrics", name, "--port", str(port)],
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    prom = Prometheus(tmp_path, f"127.0.0.1:{port}")
    try:
        wait_for("prometheus to be ready", prom.ready, timeout=60)
        job = attach(name)
        # the fault goes in once a scrape has seen the job train with no restart (not at a fixed step:
        # warm ranks can reach any step before the first scrape)
        wait_for("a scrape of the job training", lambda: series(prom.query(
            f'max by (job) (eksft_step{{job="{name}"}})')).get((("job", name),), 0.0) >= 1, timeout=120)
        injected = cli("inject", name, "sigkill", "--rank", "1")
        assert injected.returncode == 0, injected.stderr
        # ended, and nothing of it still runs (the end is recorded a moment before the last exit)
        wait_for("the job to end", lambda: job.state.ended, timeout=300)
        wait_for("a scrape after the job's end",
                 lambda: series(prom.query(f'max by (job) (eksft_running{{job="{name}"}})')) == {
                     (("job", name),): 0.0}, timeout=60)
        at = time.time()
        # the scrapes covered the job while it ran, and its restart as it happened
        assert series(prom.query(f'max by (job) (max_over_time(eksft_running{{job="{name}"}}[10m]))',
                                 at)) == {(("job", name),): 1.0}
        before = prom.query('min by (job, level) '
                            f'(min_over_time(eksft_restarts_total{{job="{name}",level="injob"}}[10m]))', at)
        assert series(before) == {(("job", name), ("level", "injob")): 0.0}

        mon = job.refresh()
        summary = job.summary()
        gp = compute(mon)
        assert summary["state"] == "succeeded" and summary["restarts"] == {
            "inprocess": 0, "injob": 1, "job": 0}
        j = (("job", name),)
        times = mon.steps.step_time[-20:]
        expected: dict[str, dict[tuple[tuple[str, str], ...], float]] = {
            "Running": {j: 0.0},
            "Step": {j: 200.0},
            "Loss": {j: mon.steps.loss[-1]},
            "Throughput (tokens/s)": {j: mon.steps.throughput()[0]},
            "Steps per second": {j: len(times) / sum(times)},
            "Goodput": {j: gp.goodput},
            "Where the time went": {(("category", c), *j): s for c, s in gp.seconds().items()},
            "Restarts by level": {(*j, ("level", level)): n for level, n in summary["restarts"].items()},
            "Restarts by cause": {(("cause", "sigkill"), *j, ("level", "injob")): 1.0},
            "Restart downtime": {j: sum(r["downtime_s"] for r in summary["restart_events"])},
            "Checkpoint stall": {j: mon.checkpoint_stall_s},
            "Newest checkpoint": {j: 200.0},
            "Newest checkpoint age": {j: at - mon.last_committed.t_done},
            # no DCGM exporter here: the GPU rows are empty, and say nothing wrong
            "XID errors": {}, "Uncorrectable remapped rows": {}, "GPU temperature": {}, "GPU power": {},
            "SM clock": {},
        }
        panels = all_panels(dashboard())
        assert sorted(p["title"] for p in panels) == sorted(expected), "a panel this test does not check"
        for p in panels:
            for t in p["targets"]:
                expr = t["expr"].replace("$job", name).replace("$node", ".*")
                got = series(prom.query(expr, at))
                want = expected[p["title"]]
                assert set(got) == set(want), (p["title"], expr, got)
                for key, value in want.items():
                    assert got[key] == pytest.approx(value, rel=1e-9, abs=1e-3), (p["title"], key)
    finally:
        prom.stop()
        exporter.terminate()
        exporter.wait(10)


# dcgm-exporter's default counters (etc/default-counters.csv) in both release 3.3.9-3.6.1 and 4.5.3-4.8.2 (the
# newest): what a stock install exports. Not in it, e.g.: DCGM_FI_DEV_ECC_DBE_VOL_TOTAL,
# _CLOCK_THROTTLE_REASONS; DCGM_FI_PROF_GR_ENGINE_ACTIVE and the other profiling fields only from 4.0.
DCGM_DEFAULTS = {f"DCGM_FI_DEV_{n}" for n in (
    "SM_CLOCK", "MEM_CLOCK", "MEMORY_TEMP", "GPU_TEMP", "POWER_USAGE", "TOTAL_ENERGY_CONSUMPTION",
    "PCIE_REPLAY_COUNTER",
    "GPU_UTIL", "MEM_COPY_UTIL", "ENC_UTIL", "DEC_UTIL", "XID_ERRORS", "FB_FREE", "FB_USED",
    "NVLINK_BANDWIDTH_TOTAL",
    "VGPU_LICENSE_STATUS", "UNCORRECTABLE_REMAPPED_ROWS", "CORRECTABLE_REMAPPED_ROWS", "ROW_REMAP_FAILURE")}


class Exposition(threading.Thread):
    """Fixed Prometheus text on loopback, one page per path: stand-ins for exporters."""

    def __init__(self, pages: dict[str, str]) -> None:
        import http.server

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                body = pages.get(self.path, "").encode()
                self.send_response(200 if self.path in pages else 404)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.address = f"127.0.0.1:{self.server.server_address[1]}"
        super().__init__(daemon=True, name="exposition")
        self.start()

    def run(self) -> None:
        self.server.serve_forever(poll_interval=0.1)

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def gpu_panels() -> list[dict[str, Any]]:
    return [p for p in all_panels(dashboard()) if "DCGM_FI_" in p["targets"][0]["expr"]]


def test_gpu_panels_use_only_dcgm_exporters_default_counters() -> None:
    assert len(gpu_panels()) == 5
    for p in gpu_panels():
        for t in p["targets"]:
            assert set(re.findall(r"DCGM_FI_\w+", t["expr"])) <= DCGM_DEFAULTS, (p["title"], t["expr"])


@pytest.mark.skipif(PROMETHEUS is None,
                    reason="the prometheus binary is not installed (`make prometheus` installs "
                                               "Debian's package)")
def test_gpu_panels_show_only_the_jobs_nodes_from_a_real_prometheus(tmp_path: Path) -> None:
    """dcgm-exporter runs on every GPU node; a panel shows the nodes of the chosen job only: an EKS job's
    pods carry their node as ``Hostname`` (the PodMonitor's relabeling, here a static target label), a
    local job's own GPU-health series name theirs."""
    from jobs import wait_for

    dcgm = "".join(f'{m}{{gpu="{g}",UUID="GPU-{h}-{g}",Hostname="{h}"}} {v + g}\n'
                   for m in sorted(DCGM_DEFAULTS) for h, v in (("node-a", 10), ("node-b", 50), ("node-c", 90))
                   for g in (0, 1))
    pages = {"/dcgm": dcgm,
             "/eks-pod": 'eksft_running{job="llm"} 1\n',   # the EKS job's pod on node-a
             "/local": 'eksft_running{job="here"} '
             '1\nDCGM_FI_DEV_XID_ERRORS{gpu="0",UUID="GPU-x",Hostname="node-b",'
                       'job="here"} 0\n'}
    exposition = Exposition(pages)
    prom = Prometheus(tmp_path, "", [
        {"job_name": "nvidia-dcgm-exporter", "metrics_path": "/dcgm",
         "static_configs": [{"targets": [exposition.address]}]},
        {"job_name": "eksft-eks", "honor_labels": True, "metrics_path": "/eks-pod",
         "static_configs": [{"targets": [exposition.address], "labels": {"Hostname": "node-a"}}]},
        {"job_name": "eksft-local", "honor_labels": True, "metrics_path": "/local",
         "static_configs": [{"targets": [exposition.address]}]}])
    try:
        wait_for("prometheus to be ready", prom.ready, timeout=60)
        wait_for("a scrape of every target", lambda: len(prom.query("up == 1")) == 3, timeout=60)
        for job, node, base in (("llm", "node-a", 10), ("here", "node-b", 50)):
            for p in gpu_panels():
                expr = p["targets"][0]["expr"].replace("$job", job).replace("$node", ".*")
                got = series(prom.query(expr))
                assert got == {(("Hostname", node),
                                ("gpu", str(g))): float(base + g) for g in (0, 1)}, (p["title"], got)
    finally:
        prom.stop()
        exposition.stop()


def test_restart_causes_become_few_label_values() -> None:
    from eksft_nb.control import FAULTS
    from eksft_nb.metrics import cause_class

    # the sentences the incidents write (incidents.py), classed by the fault that caused them
    for kind in FAULTS:
        assert cause_class(f"injected {kind} on rank 1") == kind
        assert cause_class(f"injected {kind} on node 0: ft_launcher on node 0 was killed (SIGKILL)") == kind
    assert cause_class("hang: no heartbeat from rank 0 for 10s (ft_launcher timeout)") == "hang"
    assert cause_class("rank 1 raised RuntimeError: boom") == "exception"
    assert cause_class("rank 0 died (SIGSEGV)") == "killed"
    assert cause_class("ft_launcher on node 1 gave up (exit 1) after 3 restarts") == "exit"
    assert cause_class("the worker group was restarted") == "other"
