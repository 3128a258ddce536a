"""The dashboard's widget logic, without a browser or a kernel.

Jobs here are real job folders whose events are written with the real schema (no processes run),
so the dashboard reads them exactly as it reads a live job; one slow test drives a real job.
"""

from __future__ import annotations

import html
import json
import re
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from ipywidgets.widgets.widget import _remove_buffers

import eksft_nb
from eksft_nb.checkpoint_folders import COMMIT, step_dir
from eksft_nb.dashboard import Dashboard
from eksft_nb.dashboard.series import Series, Throttle, thin_indices
from eksft_nb.events import EventWriter, make
from eksft_nb.goodput import compute
from eksft_nb.jobdir import JobDir, atomic_write
from eksft_nb.spec import JobSpec
from jobs import wait_for

T0 = 1_800_000_000.0
MESSAGES = ("_py2js_update", "_py2js_restyle", "_py2js_relayout", "_py2js_addTraces", "_py2js_deleteTraces")


class FakeJob:
    """A job folder and an event writer; no process runs."""

    def __init__(self, name: str, steps: int = 100, **spec: Any) -> None:
        self.spec = JobSpec().replace(name=name, steps=steps, **spec).validate()
        self.dir = JobDir.for_name(name)
        self.dir.create(self.spec)
        self.out = EventWriter(self.dir.events_path, name)
        self.t = T0
        self.emit("job_start", spec_digest="x", world_size=2, steps=steps, backend="local", host="h", pid=1)

    def emit(self, kind: str, rank: int | None = None, dt: float = 0.0, **data: Any) -> None:
        self.t += dt
        self.out.write(make(kind, self.dir.name, rank, t=self.t, **data))

    def steps(self, first: int, last: int, step_time: float = 0.1, **over: Any) -> None:
        for s in range(first, last + 1):
            st = over.get(s, step_time)
            self.emit("step", rank=0, dt=st, step=s, loss=5.0 - s / 1000, tokens=1024, step_time=st)

    def save(self, step: int, blocked: float, background: float) -> None:
        self.emit("checkpoint", rank=0, phase="begin", step=step, mode="async")
        self.emit("checkpoint", rank=0, dt=blocked, phase="staged", step=step, blocked_s=blocked, bytes=100)
        self.emit("checkpoint", rank=0, dt=background, phase="committed", step=step, blocked_s=blocked,
                  background_s=background, bytes=100, path=str(step_dir(self.dir.path / "ckpt", step)))

    def restart(self, level: str, cause: str, downtime: float, resumed: int, lost: int) -> None:
        self.emit("fault", rank=1, fault="sigkill", id="f1", target_rank=1, at_step=resumed + lost + 1)
        t = self.t
        self.emit("failure", dt=0.5, level=level, cause=cause, blame_rank=1, fault_time=t,
                  detected_at=t + 0.5)
        phases = {"detection": 0.5, "teardown": 0.5, "reformation": max(0.0, downtime - 2.0), "restore": 0.75,
                  "first_step": 0.25}
        self.emit("restart", dt=downtime - 0.5, level=level, cause=cause, blame_rank=1, fault_time=t,
                  detection_s=0.5, downtime_s=downtime, rolled_back_steps=lost, resumed_step=resumed,
                  phases=phases)

    def end(self, state: str = "succeeded") -> None:
        """What the supervisor does at the end: the event, and its state file."""
        self.emit("job_end", dt=0.1, state=state, reason="all steps done", final_step=self.spec.steps)
        atomic_write(self.dir.supervisor_path, json.dumps({"state": state, "reason": "all steps done"}))

    def commit_on_disk(self, step: int, content: bytes = b"x", sha: str | None = None) -> None:
        import hashlib

        d = step_dir(self.dir.path / "ckpt", step)
        d.mkdir(parents=True)
        (d / "shard.distcp").write_bytes(content)
        files = {"shard.distcp": {"size": len(content), "sha256": sha or hashlib.sha256(content).hexdigest()}}
        (d / COMMIT).write_text(json.dumps({"step": step, "world_size": 2, "bytes": len(content), "time": T0,
                                            "files": files}))

    def handle(self) -> eksft_nb.Job:
        return eksft_nb.attach(self.dir.name)


def traces(dash: Dashboard, name: str) -> dict[str, Any]:
    """The figure's traces of one series by part ("tail", "history0", ...; the first trace of each)."""
    return {t.meta: t for t in dash.figure.widget.data if t.name == name}


def joined_history(dash: Dashboard, name: str, attr: str) -> np.ndarray:
    """One attribute of a joined series' history chunks in time order (each chunk's first point,
    a repeat of the chunk before's last, once)."""
    chunks = sorted((t for t in dash.figure.widget.data if t.name == name and t.meta != "tail" and len(t.x)),
                    key=lambda t: t.x[0])
    return np.concatenate([np.asarray(getattr(t, attr))[1 if i else 0:] for i,
                           t in enumerate(chunks)] or [[]])


def said(dash: Dashboard) -> str:
    """The dashboard's message line as text."""
    return html.unescape(re.sub(r"<[^>]*>", "", dash.message.value))


def record(dash: Dashboard) -> list[tuple[str, dict[str, Any]]]:
    sent: list[tuple[str, dict[str, Any]]] = []
    dash.figure.widget.observe(lambda c: sent.append((c.name, c.new)) if c.new else None,
                               names=list(MESSAGES))
    return sent


def test_history_is_drawn_at_once_then_each_update_sends_only_the_new_tail() -> None:
    job = FakeJob("history")
    job.steps(1, 30)
    job.save(10, blocked=0.02, background=0.3)
    job.save(20, blocked=0.03, background=0.25)
    job.restart("injob", "injected sigkill on rank 1", downtime=6.4, resumed=20, lost=10)
    job.steps(21, 50)
    dash = Dashboard(job.handle(), live=False)

    tok = traces(dash, "tokens/s")
    plotted = [int(s) for s in joined_history(dash, "tokens/s",
                                              "customdata")] + [int(s) for s in tok["tail"].customdata]
    assert plotted == list(range(1, 31)) + [21] + list(range(21, 51))  # the rollback is a break in the line
    y = np.concatenate([joined_history(dash, "tokens/s", "y"), tok["tail"].y])
    assert np.isnan(y[30]) and not np.isnan(np.delete(y, 30)).any()
    assert abs(y[0] - 1024 / 0.1) < 1

    blocked, background = (traces(dash, n)["tail"] for n in ("blocked", "background"))
    assert list(blocked.customdata) == [10, 20] and list(background.customdata) == [10, 20]
    assert np.allclose(blocked.y, [0.02, 0.03]) and np.allclose(background.y, [0.3, 0.25])
    r = traces(dash, "restarts")["tail"]
    assert list(r.y) == ["in-job"] and np.allclose(r.error_x.array, [6.4])
    assert r.text[0] == "injected sigkill on rank 1 · 6.4s down"
    assert "in-job restart" in r.hovertext[0] and "10 steps rolled back" in r.hovertext[0]
    assert ("phases: detection 0.50s, teardown 0.50s, reformation 4.40s, restore 0.75s, first step 0.25s"
            in r.hovertext[0])
    assert list(traces(dash, "faults")["tail"].text) == ["sigkill rank 1"]

    sent = record(dash)
    job.steps(51, 55)
    assert dash.update() is False
    assert [name for name, _ in sent] == ["_py2js_update"]     # one message per refresh
    msg = sent[0][1]
    tails = [i for i,
             t in enumerate(dash.figure.widget.data) if t.meta == "tail" and t.name in ("tokens/s", "loss")]
    assert sorted(msg["style_traces"]) == tails                  # only the tails of the two step series
    assert all(len(v) == 66 for v in msg["style_data"]["x"])     # 61 points so far + 5 new: no history sent
    sent.clear()
    dash.update()
    assert sent == []                                            # nothing new, nothing sent


def test_a_100k_step_job_stays_within_its_point_budget() -> None:
    job = FakeJob("long", steps=100_000, **{"checkpoint.every": 100})
    lines = []
    t = T0
    for s in range(1, 100_001):
        st = 5.0 if s == 5_000 else 0.1                           # one slow step: a dip in throughput
        t += st
        lines.append(make("step", "long", 0, t=t, step=s, loss=1.0, tokens=1000, step_time=st).to_json())
    with open(job.dir.events_path, "a") as f:
        f.write("\n".join(lines) + "\n")
    dash = Dashboard(job.handle(), live=False, tail=500, budget=3000)
    tok = traces(dash, "tokens/s")
    hist, tail = [int(s) for s in joined_history(dash, "tokens/s",
                                                 "customdata")], [int(s) for s in tok["tail"].customdata]
    assert len(hist) <= 3000 and len(tail) <= 501
    assert hist[0] == 1 and tail[-1] == 100_000
    assert tail == list(range(tail[0], 100_001)) and len(tail) >= 2      # recent steps: all of them
    assert hist == sorted(hist)                                          # thinning keeps the order
    # the dip survives
    assert 5_000 in hist and min(joined_history(dash, "tokens/s", "y")) == pytest.approx(200)
    state, _, buffers = _remove_buffers(dash.figure.widget.get_state())
    del state["_esm"]                                                    # the plotly bundle: fixed size
    assert len(json.dumps(state)) + sum(len(b) for b in buffers) < 400_000  # what a saved notebook holds

    sent = record(dash)
    for s in range(100_001, 100_601):                                   # enough to fold the tail in
        t += 0.1
        job.out.write(make("step", "long", 0, t=t, step=s, loss=1.0, tokens=1000, step_time=0.1))
    dash.update()
    (name, msg), = sent
    assert name == "_py2js_update"
    sizes = [len(v) for v in msg["style_data"]["x"]]
    # a fold re-sends the tail and at most two history chunks of each line, never the whole history
    assert max(sizes) <= 501 and sum(sizes) <= 2 * 3 * 501
    assert len(joined_history(dash, "tokens/s", "x")) <= 3000


def test_series_thins_old_history_and_keeps_recent_points() -> None:
    s = Series(("x", "y"), key=("y",), tail=50, budget=400, join=True)
    for i in range(20_000):
        s.append(float(i), -1.0 if i == 123 else float(i % 7))
    xs = s.history["x"] + s.tail["x"][1:]
    assert len(s.history["x"]) <= 400 and len(s.tail["x"]) <= 51 and s.appended == 20_000
    assert xs == sorted(xs) and xs[0] == 0.0 and xs[-1] == 19_999.0
    assert -1.0 in s.history["y"]                                        # an old extreme survives
    recent = [x for x in xs if x >= 19_900]
    assert recent == [float(i) for i in range(19_900, 20_000)]           # recent history is exact
    assert s.tail["x"][0] == s.history["x"][-1]                          # joined: no gap between the traces
    assert thin_indices(10, 20) == list(range(10))
    assert thin_indices(100, 10)[0] == 0 and thin_indices(100, 10)[-1] == 99


def test_throttle_spaces_actions_by_the_interval() -> None:
    now = [100.0]
    th = Throttle(0.5, clock=lambda: now[0])
    assert th.delay() == 0.0
    th.mark()
    assert th.delay() == pytest.approx(0.5)
    now[0] += 0.2
    assert th.delay() == pytest.approx(0.3)
    now[0] += 1.0
    assert th.delay() == 0.0


def test_live_updates_are_throttled_and_stop_when_the_job_ends() -> None:
    job = FakeJob("live", steps=100_000)
    dash = Dashboard(job.handle(), interval=0.25)
    stop = threading.Event()

    def produce() -> None:
        s = 0
        while not stop.is_set():
            s += 1
            job.steps(s, s, step_time=0.005)
            time.sleep(0.005)

    writer = threading.Thread(target=produce)
    start, before = time.monotonic(), dash.updates
    writer.start()
    time.sleep(2.0)
    stop.set()
    writer.join()
    elapsed, updates = time.monotonic() - start, dash.updates - before
    # a few per second, however fast events come
    assert 1 <= updates <= elapsed / 0.25 + 2, updates
    job.end()
    dash._thread.join(10)
    assert not dash._thread.is_alive()
    assert dash.header.state == "succeeded" and dash.controls.inject.disabled
    mon = dash.job.monitor
    plotted = sum(len(t.x) for t in dash.figure.widget.data if t.name == "tokens/s")
    assert plotted >= len(mon.steps)                                      # every step reached the plot


def test_header_goodput_table_and_log_show_the_job() -> None:
    job = FakeJob("facts", **{"checkpoint.keep_last": 30})
    job.steps(1, 20)
    job.save(10, blocked=0.02, background=0.3)
    job.restart("inprocess", "injected exception on rank 0", downtime=3.0, resumed=10, lost=5)
    job.steps(11, 40)
    job.save(300, blocked=0.05, background=0.2)
    for step in range(10, 310, 10):
        job.commit_on_disk(step)
    log = "\n".join(f"line {i} " + "x" * 500 for i in range(100))
    (job.dir.logs / "supervisor.log").write_text(log)
    dash = Dashboard(job.handle(), live=False, log_lines=40)
    h = dash.header
    assert (h.state, h.step, h.total) == ("starting", 40, 100)  # no supervisor has reported yet
    assert h.restarts == {"inprocess": 1, "injob": 0, "job": 0} and h.last_checkpoint == 300
    assert "in-process 1 · in-job 0 · job 0" in h._facts.value and "step 300" in h._facts.value
    assert dash.goodput.seconds == pytest.approx(compute(dash.job.monitor, now=time.time()).seconds(),
                                                 abs=0.5)

    rows = [s for s in dash.checkpoints._slots if s.step is not None]
    assert [s.step for s in rows] == list(range(300, 100, -10))          # the newest 20, newest first
    assert "and 10 older" in dash.checkpoints._more.value
    assert "blocked 0.050s, background 0.200s" in rows[0].text.value     # timings from the save's events
    assert "blocked" not in rows[1].text.value
    widgets_before = len(eksft_nb.dashboard.parts.w.Widget.widgets)
    for step in range(310, 360, 10):
        job.commit_on_disk(step)
        dash._refresh_checkpoints()
    assert len(eksft_nb.dashboard.parts.w.Widget.widgets) == widgets_before  # rows are reused, not rebuilt

    assert dash.log_tail.text == ""                                       # folded: not read
    dash.log_tail.selected_index = 0
    shown = html.unescape(dash.log_tail._pre.value.split(">", 1)[1].rsplit("<", 1)[0]).splitlines()
    assert len(shown) == 40
    assert shown[0].startswith("[eksft] line 60 ") and shown[-1].startswith("[eksft] line 99 ")
    assert max(len(line) for line in shown) == 300                        # long lines are cut


def test_the_header_is_the_command_layers_row(monkeypatch: pytest.MonkeyPatch) -> None:
    """The header shows the row the CLI's status and the side panel show, made by commands.job_row."""
    from eksft_nb import commands

    job = FakeJob("header-row")
    job.steps(1, 20)
    job.restart("injob", "injected sigkill on rank 1", downtime=2.0, resumed=10, lost=5)
    job.steps(11, 30)
    job.save(20, blocked=0.02, background=0.2)
    rows: list[dict[str, Any]] = []
    real = commands.job_row
    monkeypatch.setattr(commands, "job_row", lambda *a, **kw: rows.append(real(*a, **kw)) or rows[-1])
    h = Dashboard(job.handle(), live=False).header
    row = rows[-1]
    assert (h.state, h.step, h.total, h.restarts, h.last_checkpoint, h.goodput) == (
        row["state"], row["step"], row["total_steps"], row["restarts"], row["last_checkpoint"],
        row["goodput"])
    cli = commands.status("header-row")
    assert (cli["state"], cli["step"], cli["restarts"], cli["last_checkpoint"]) == (
        "starting", 30, {"inprocess": 0, "injob": 1, "job": 0}, 20) == (
        h.state, h.step, h.restarts, h.last_checkpoint)


def test_a_failed_jobs_reason_is_said_where_the_user_looks(ip: Any,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    """One line, why it failed and what to do, in CLI status (and the magic's), summary, the list and the
    dashboard's header (red); the lab panel's row is tests/test_lab_extension.py's."""
    from eksft_nb import commands, texts

    reason = ("gave up after 3 in-job restarts: rank 1 raised ModuleNotFoundError: No module named 'mylib' "
              "(the script's own error, at every restart): install mylib where the ranks run, then resume")
    job = FakeJob("broke")
    job.steps(1, 3)
    job.emit("job_end", dt=0.1, state="failed", reason=reason, final_step=3)
    job.dir.write_end("failed", reason)
    atomic_write(job.dir.supervisor_path, json.dumps({"state": "failed", "reason": reason}))
    row = commands.status("broke")
    assert (row["state"], row["detail"]) == ("failed", reason)
    assert texts.format_status(row).endswith(f"  ({reason})")
    assert {r["name"]: r["detail"] for r in commands.list_jobs()}["broke"] == reason
    h = Dashboard(job.handle(), live=False).header
    assert (h.state, h.detail, h.detail_kind) == ("failed", reason, "error")
    assert f"style='color:#d62728'>{html.escape(reason)}</span>" in h._title.value
    capsys.readouterr()
    ip.run_line_magic("ftrain", "status broke")
    assert capsys.readouterr().out.strip() == texts.format_status(row)
    ip.run_line_magic("ftrain", "summary broke")
    assert capsys.readouterr().out.splitlines()[0] == f"job broke: failed ({reason})"


def test_inject_controls_write_the_command_the_job_reads(tmp_path: Path) -> None:
    job = FakeJob("inject")
    job.steps(1, 5)
    dash = Dashboard(job.handle(), live=False)
    c = dash.controls
    c.fault.value, c.target.value, c.when.value = "sigkill", 1, "now"
    c.inject.click()
    (cmd,) = [json.loads(p.read_text()) for p in job.dir.pending.glob("*.json")]
    assert (cmd["fault"], cmd["rank"], cmd["step"]) == ("sigkill", 1, None)
    assert "queued sigkill for rank 1 of inject (now)" in said(dash)

    c.fault.value, c.when.value = "hang", "step 40"
    c.inject.click()
    cmds = {json.loads(p.read_text())["fault"]: json.loads(p.read_text())
            for p in job.dir.pending.glob("*.json")}
    assert (cmds["hang"]["rank"], cmds["hang"]["step"]) == (0, 40)     # choosing a fault resets the target

    c.when.value = "soon"
    c.inject.click()
    assert "cannot read when='soon'" in said(dash) and len(list(job.dir.pending.glob("*.json"))) == 2

    c.when.value = "3"
    c.inject.click()
    assert "step 3 has already passed" in said(dash) and len(list(job.dir.pending.glob("*.json"))) == 2

    c.fault.value, c.when.value = "sigterm", "30s"             # seconds from now
    c.inject.click()
    [later] = [json.loads(p.read_text()) for p in job.dir.pending.glob("*.json")
               if json.loads(p.read_text())["fault"] == "sigterm"]
    assert (later["after"], later["step"]) == (30.0, None) and "(30s after it was queued)" in said(dash)

    c.fault.value = "kill-launcher"
    assert c.target.description == "node" and c.target.options == (("0", 0),)
    c.when.value = "now"
    c.inject.click()
    kill = [json.loads(p.read_text()) for p in job.dir.pending.glob("*.json")
            if json.loads(p.read_text())["fault"] == "kill-launcher"]
    assert kill and kill[0]["rank"] is None and kill[0]["node"] == 0


def test_an_ended_job_takes_no_faults_and_a_bad_checkpoint_is_not_resumed() -> None:
    job = FakeJob("ended", **{"checkpoint.keep_last": 5})
    job.steps(1, 20)
    job.end()
    job.commit_on_disk(10, sha="0" * 64)                                  # its checksum does not match
    dash = Dashboard(job.handle(), live=False)
    assert dash.ended and dash.controls.inject.disabled and dash.stop_button.disabled
    dash.inject("exception", rank=0)
    assert "faults only go to a running job" in said(dash)

    slot = next(s for s in dash.checkpoints._slots if s.step == 10)
    assert slot.button.layout.visibility == "visible" and "eksft-resume-10" in slot.button._dom_classes
    jobs_before = {p.name for p in job.dir.path.parent.iterdir()}
    slot.button.click()
    assert "checkpoint at step 10 cannot be used: checksum mismatch" in said(dash)
    assert dash.resume(30) is None and "no committed checkpoint at step 30" in said(dash)
    assert {p.name for p in job.dir.path.parent.iterdir()} == jobs_before and dash.resumed.children == ()


@pytest.mark.slow
def test_a_real_job_resumed_and_broken_from_its_dashboard() -> None:
    job = eksft_nb.launch(name="dash-real", steps=60, **{"model.preset": "tiny", "checkpoint.every": 10,
                                                         "checkpoint.keep_last": 10})
    dash = Dashboard(job, interval=0.3)
    assert job.wait(300) == "succeeded"
    dash._thread.join(30)
    mon = dash.job.monitor
    assert sorted(int(s) for t in dash.figure.widget.data if t.name == "tokens/s" for s in t.customdata) == \
        sorted(mon.steps.step)
    assert dash.header.step == 60 and dash.header.state == "succeeded"

    older = min(c.step for c in job.checkpoints() if c.state == "committed")
    child = dash.resume(older)
    assert child is not None and dash.resumed.children == (child,), said(dash)
    assert child.header.origin == f"resumed from dash-real step {older}"
    # The dashboard's thread folds events into the monitor, then pushes the figure: wait on what is shown.
    wait_for("the resumed job's first step", lambda: len(child.job.monitor.steps), 120)
    assert child.job.monitor.steps.step[0] == older + 1
    child.controls.fault.value, child.controls.target.value = "sigkill", 1
    child.controls.inject.click()
    assert f"queued sigkill for rank 1 of {child.job.name} (now)" in said(child)
    wait_for("an in-job restart on the resumed job's figure",
             lambda: "in-job" in [lane for t in child.figure.widget.data if t.name == "restarts"
                                  for lane in t.y], 180)
    child.stop_button.click()
    wait_for("the dashboard to say stopped", lambda: "stopped" in said(child), 120)
    assert child.job.wait(30) == "stopped"


def test_the_whatif_tab_shows_the_replay_its_plot_and_the_recommendation_in_one_line() -> None:
    from eksft_nb import commands

    job = FakeJob("wif", steps=40, **{"checkpoint.every": 10})
    job.steps(1, 20)
    job.save(10, blocked=0.2, background=0.3)
    job.save(20, blocked=0.2, background=0.3)
    job.steps(21, 25)
    job.restart("injob", "injected sigkill on rank 1", downtime=3.0, resumed=20, lost=5)
    job.steps(21, 40)
    job.save(30, blocked=0.2, background=0.3)
    job.end()
    dash = Dashboard(job.handle(), live=False)
    tab = dash.whatif
    assert dash.tabs.titles == ("training", "what-if") and dash.tabs.selected_index == 0
    assert tab.recommendation == {} and tab.table.value == "" and not tab.plot.data   # replayed once opened

    dash.tabs.selected_index = 1
    report = commands.whatif("wif")
    rec = report["recommendation"]
    assert rec["young_daly"] and tab.recommendation == {"every": rec["every"], "text": rec["text"]}
    line = html.unescape(re.sub(r"<[^>]*>", "", tab.line.value))
    assert line == f"recommended: {rec['text']}" and f"every {rec['young_daly']} steps" in line
    assert "tau = sqrt(2 C (M + R)) - C" in html.unescape(tab.formula.value)
    cells = [[html.unescape(c) for c in re.findall(r"<td>(.*?)</td>", r)]
             for r in re.findall(r"<tr>(.*?)</tr>", tab.table.value) if "<td>" in r]
    labels = [r["label"] for r in report["rows"]]
    assert [r[0] for r in cells] == ["measured (as run)", "predicted (as run)", *labels]
    assert cells[0][1] == f"{100 * report['measured']['ettr']:.1f}%"
    assert {r["setting"]["ckpt_every"] for r in report["rows"]} >= {5, 10, 20, rec["young_daly"]}
    [predicted] = [t for t in tab.plot.data if t.name == "predicted"]
    shown = sorted((r["setting"]["ckpt_every"], 100 * r["ettr"]) for r in report["rows"] if r["ettr"])
    assert list(predicted.x) == [x for x, _ in shown]
    assert list(predicted.y) == pytest.approx([y for _, y in shown])
    assert any(t.name == rec["text"] for t in tab.plot.data)                # the recommendation, marked
    # Apply: ended job
    assert tab.actions.children == (dash.settings.whatif,) and dash.settings.whatif.disabled


def test_the_whatif_tab_of_a_job_without_failures_says_why_it_recommends_nothing() -> None:
    job = FakeJob("wif-clean", steps=20, **{"checkpoint.every": 10})
    job.steps(1, 20)
    job.save(10, blocked=0.2, background=0.3)
    job.end()
    dash = Dashboard(job.handle(), live=False)
    dash.tabs.selected_index = 1
    assert dash.whatif.recommendation["every"] is None
    assert "no failure observed" in dash.whatif.line.value and "<table" in dash.whatif.table.value


def test_the_static_copy_draws_every_step_and_breaks_the_line_at_a_rollback() -> None:
    import xml.etree.ElementTree as ET

    job = FakeJob("copy")
    job.steps(1, 30)
    job.save(10, blocked=0.02, background=0.3)
    job.restart("injob", "injected sigkill on rank 1", downtime=6.4, resumed=20, lost=10)
    job.steps(21, 50)
    dash = Dashboard(job.handle(), live=False)
    copy = dash.snapshot()
    # well-formed, as an SVG output must be
    ET.fromstring(copy["image/svg+xml"])
    paths = dict(re.findall(r'data-name="([^"]+)" d="([^"]*)"', copy["image/svg+xml"]))
    tok = paths["tokens/s"]
    # every step; a break at the rollback
    assert tok.count("M") + tok.count("L") == 60 and tok.count("M") == 2
    # its marker and downtime; a save
    assert paths["restarts"].count("M") == 2 and paths["blocked"].count("M") == 1
    assert copy["text/plain"].startswith("copy: starting, step 50 (a static copy")
