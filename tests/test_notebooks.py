"""Every tutorial notebook runs end to end (nbclient, a real kernel, real jobs), and does what it teaches."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import nbformat
import pytest

import eksft_nb
from notebook_runs import NOTEBOOKS, executed, saved

pytestmark = pytest.mark.slow


def text(nb: Any) -> str:
    """Everything the code cells printed or returned, as text."""
    parts = []
    for cell in nb.cells:
        for o in cell.get("outputs", []):
            parts.append(o.get("text") or o.get("data", {}).get("text/plain", ""))
    return "\n".join(parts)


def dashboards(nb: Any) -> list[str]:
    """Model ids of the widget views the notebook displayed."""
    return [o["data"]["application/vnd.jupyter.widget-view+json"]["model_id"] for c in nb.cells
            for o in c.get("outputs", []) if "application/vnd.jupyter.widget-view+json" in o.get("data", {})]


def check_quickstart(nb: Any) -> None:
    job = eksft_nb.attach("quickstart")
    s = job.summary()
    assert s["state"] == "succeeded" and s["steps_done"] == 400
    levels = [r["level"] for r in s["restart_events"]]
    assert "inprocess" in levels and "injob" in levels                   # the exception, then the killed rank
    assert {("exception", 0, 50),
            ("sigkill", 1, 120)} <= {(f["fault"], f["rank"], f["step"]) for f in job.monitor.faults}
    assert "job quickstart: succeeded (all 400 steps done)" in text(nb)
    assert len(dashboards(nb)) == 1


def check_overlap(nb: Any) -> None:
    from statistics import median

    blocked = {}
    for name in ("overlap-async", "overlap-sync"):
        job = eksft_nb.attach(name)
        assert job.state == "succeeded"
        blocked[name] = median(c.blocked_s for c in job.refresh().checkpoints.values() if c.state
                               == "committed")
    assert blocked["overlap-async"] < blocked["overlap-sync"]
    assert "an async save blocks training" in text(nb) and len(dashboards(nb)) == 2


def check_resume(nb: Any) -> None:
    from eksft_nb.backends.local import LocalBackend

    out = text(nb)
    assert "cannot be used: checksum mismatch" in out
    (name,) = [j.name for j in LocalBackend().jobs() if j.name.startswith("resume-demo-from-")]
    step = int(name.rsplit("-", 1)[1])
    resumed = eksft_nb.attach(name).refresh()
    assert resumed.state == "succeeded" and resumed.steps.step[0] == step + 1 and resumed.last_step == 60
    assert f"{name}: steps {step + 1} to 60" in out
    assert resumed.digest == eksft_nb.attach("resume-demo").refresh().digest  # nothing lost by going back


def check_lab(nb: Any) -> None:
    out = text(nb)
    for case in ("lab-sigkill", "lab-exception"):
        assert eksft_nb.attach(case).state == "succeeded"
    assert "resilience test of lab: PASSED" in out and "2 cases, 0 failed" in out
    assert "recommended:" in out and "cannot estimate: the in-process recovery" in out
    # the recommendation, applied live: both ranks took it at one step, and the job saved by it
    live = eksft_nb.attach("lab-live").refresh()
    from eksft_nb import commands

    every = commands.whatif("lab-sigkill")["recommendation"]["young_daly"]
    assert live.state == "succeeded" and list(live.settings) == [1], live.settings
    change = live.settings[1]
    assert change["changes"] == {"ckpt-every": [1000, every]}
    assert change["ranks"] == {0: change["step"], 1: change["step"]}
    assert f"lab-live: ckpt-every 1000 -> {every}, taken by all 2 ranks at step {change['step']}" in out
    later = sorted(s for s, c in live.checkpoints.items() if c.state == "committed" and s > change["step"])
    assert later and all(s % every == 0 or s == 100 for s in later), later


def check_slurm(nb: Any) -> None:
    """Both faults healed at their levels on the two Slurm nodes, and the resumed job went on from step 60."""
    from eksft_nb.events import read_all

    shared = saved("06_slurm").parent / "slurm" / "shared"
    out = text(nb)
    assert "#SBATCH --nodes=2" in out and "job slurm-demo: succeeded (all 60 steps done)" in out
    events = read_all(shared / "slurm-demo" / "events.jsonl")
    assert [e["level"] for e in events if e.kind == "restart"] == ["injob", "inprocess"]
    assert sorted({e.rank for e in events if e.kind == "rank_start"}) == [0, 1]
    assert "job slurm-demo-from-60: succeeded (all 80 steps done)" in out
    resumed = read_all(shared / "slurm-demo-from-60" / "events.jsonl")
    assert {e["step"] for e in resumed if e.kind == "resume"} == {60}


def check_engines(nb: Any) -> None:
    """Each engine ran the plan to its end; what the comparison says of each agrees with the job's events."""
    from eksft_nb.events import read_all
    from eksft_nb.jobdir import JobDir, jobs_root

    result = json.loads((saved("07_engines").parent / "engines.json").read_text())
    kinds = [f.split("@")[0].split(":")[0] for f in result["plan"]["faults"]]
    engines = result["engines"]
    assert list(engines) == ["nvrx", "torchft", "torchrun"] and "sigkill" in kinds
    for e in engines.values():
        assert e["state"] == "succeeded" and e["steps_done"] == result["plan"]["steps"], e
        fired = [r["fault"] for r in e["faults"]]
        assert 0 < e["ettr"] < 1
        assert e["ettr"] == pytest.approx(e["terms"]["productive"] / e["wall_s"], abs=1e-4)
        for r in e["faults"]:   # every fault healed, its phases adding up to its recovery
            assert r["level"] is not None and r["recovery_s"] > 0, (e["label"], r)
            assert sum(r["phases"].values()) == pytest.approx(r["recovery_s"], abs=0.01)
        # every fault fired: a killed torchft group, forked from its zygote, is back in seconds, so a fault
        # due on its rank fires (once it is back, if due while it was away)
        assert fired == kinds, e["faults"]
    tft = engines["torchft"]
    levels = {key: {r["fault"]: r["level"] for r in e["faults"]} for key, e in engines.items()}
    assert levels["nvrx"] == {"sigkill": "injob", "exception": "inprocess"}, levels
    assert set(levels["torchrun"].values()) == {"job"}, levels   # resubmitted
    assert engines["nvrx"]["steps_lost"] > 0 and engines["nvrx"]["skipped_batches"] == 0
    # torchft: the killed group healed from its peer, nothing rolled back, the batches it missed counted
    kill = next(r for r in tft["faults"] if r["fault"] == "sigkill")
    assert kill["steps_lost"] == 0 and tft["steps_lost"] == 0
    assert kill["restored_from"] == "peer" and kill["skipped_batches"] > 0, kill
    # no step ran twice (none rolled back); a step one group's batch short of both groups' skipped one batch
    steps = [e for e in read_all(JobDir(jobs_root() / tft["job"]).events_path) if e.kind == "step"]
    assert [e["step"] for e in steps] == sorted({e["step"] for e in steps})
    assert tft["skipped_batches"] == sum(e["tokens"] < max(x["tokens"] for x in steps) for e in steps) > 0
    assert tft["samples_skipped"] == tft["skipped_batches"] * result["batch"] and tft["terms"]["skipped"] > 0
    baseline = read_all(jobs_root().parent / "baseline" / engines["torchrun"]["job"] / "events.jsonl")
    assert [e["level"] for e in baseline if e.kind == "restart"] == ["job"] * len(kinds)
    figures = [o for c in nb.cells for o in c.get("outputs", []) if "application/vnd.plotly.v1+json" in
               o.get("data", {})]
    assert len(figures) == 1 and "engines side by side" in json.dumps(figures[0]["data"])


CHECKS: dict[str, Callable[[Any], None]] = {"01_quickstart": check_quickstart,
                                            "02_checkpoint_overlap": check_overlap,
                                             "03_resume": check_resume, "05_resilience_lab": check_lab,
                                             "06_slurm": check_slurm, "07_engines": check_engines}


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs_end_to_end(path: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    nb, _ = executed(path, tmp_path_factory.mktemp("notebooks"))
    errors = [o for c in nb.cells for o in c.get("outputs", []) if o.get("output_type") == "error"]
    assert errors == []
    CHECKS.get(path.stem, lambda nb: None)(nb)


def dashboard_state(state: dict[str, Any], model_id: str) -> int:
    """Bytes of saved widget state behind one displayed dashboard: its model and every model it refers to."""
    seen, todo = set(), [model_id]
    while todo:
        mid = todo.pop()
        if mid in seen or mid not in state:
            continue
        seen.add(mid)
        todo += re.findall(r"IPY_MODEL_([0-9a-f]+)", json.dumps(state[mid]["state"]))
    return sum(len(json.dumps(state[m])) for m in seen)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_saved_with_widget_state_after_a_full_run_is_at_most_2_mb(
        path: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    nb, out = executed(path, tmp_path_factory.mktemp("notebooks"))
    size = out.stat().st_size
    assert size <= 2 * 2**20, f"{path.name} saved with its widget state: {size / 2**20:.1f} MB"
    if not dashboards(nb):
        return
    state = nb.metadata["widgets"]["application/vnd.jupyter.widget-state+json"]["state"]
    for model_id in dashboards(nb):
        one = dashboard_state(state, model_id)
        # a dashboard carries its figure's data and its panels; a figure shown alone (the resilience card's)
        # its data
        least = 1_000 if "_py2js_update" in state[model_id]["state"] else 10_000
        assert least < one <= 2**20, f"a displayed widget's saved state: {one / 2**20:.2f} MB"
    figures = [m for m in state.values() if "_py2js_update" in m["state"]]
    # one figure per view, not per panel: a dashboard's training figure and its what-if plot; a figure shown
    # alone
    alone = [m for m in dashboards(nb) if "_py2js_update" in state[m]["state"]]
    assert len(figures) == len(alone) + 2 * (len(dashboards(nb)) - len(alone))
    assert all(len(f["state"].get("_esm", "")) < 10_000 for f in figures)  # plotly's bundle by reference


def test_committed_notebooks_are_light() -> None:
    for path in NOTEBOOKS:
        assert path.stat().st_size < 100_000, path
        assert "widgets" not in nbformat.read(path, as_version=4).metadata, path  # no saved widget state
