"""The Jupyter server extension (``eksft_nb.lab``), driven over HTTP in a real Jupyter server.

One server (enabled by the shipped ``jupyter-config`` file, as an install enables it) and one real
job, launched from a terminal, are shared by the checks: every route needs the token, a cookie-
authenticated POST needs XSRF, a bad request gets the CLI's own line and changes nothing, the job
shows on the stream within 2 s, a sigkill injected through the API comes back as a ``restart``
event (and in the dashboard figure), and a stop through the API leaves no process of the job.
"""

from __future__ import annotations

import asyncio
import html
import http.client
import http.cookiejar
import json
import os
import re
import secrets
import shutil
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from conftest import REPO
from eksft_nb.errors import EksftError
from eksft_nb.jobdir import JobDir, jobs_root
from eksft_nb.lab.manager import JobsManager
from jobs import cli, events, stop_server, wait_for

JOB = "lab-job"
ROUTES = [("GET", "jobs"), ("POST", "jobs"), ("POST", "rm"), ("POST", "check"), ("GET", f"jobs/{JOB}"),
          ("POST", f"jobs/{JOB}/inject"), ("GET", f"jobs/{JOB}/settings"), ("POST", f"jobs/{JOB}/settings"),
          ("POST", f"jobs/{JOB}/stop"), ("POST", f"jobs/{JOB}/resume"), ("GET", f"jobs/{JOB}/checkpoints"),
          ("GET", f"jobs/{JOB}/summary"), ("GET", f"jobs/{JOB}/logs"), ("GET", f"jobs/{JOB}/figure"),
          ("GET", f"jobs/{JOB}/whatif"), ("GET", "stream")]


# ---- the manager's folds, on job folders written with the real event schema (no process runs) ----

def test_the_manager_folds_each_job_once_for_every_client(tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    from test_dashboard import FakeJob

    monkeypatch.setenv("EKSFT_HOME", str(tmp_path))
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "none"))
    old, live = FakeJob("old", steps=5), FakeJob("live")
    old.steps(1, 5)
    old.restart("injob", "injected sigkill on rank 1", downtime=2.0, resumed=3, lost=1)
    old.end()
    live.steps(1, 3)
    manager = JobsManager()
    assert manager.rows()["backends"] == {"local": {"ok": True}}      # no kubeconfig: no EKS listing

    changed, news = manager.tick(quiet=True)      # what was there before anyone listened is history
    assert changed and news == []
    rows = manager.rows()["jobs"]
    assert [(r["name"], r["state"], r["step"], r["restarts"]["injob"]) for r in rows] == [
        ("old", "succeeded", 5, 1), ("live", "starting", 3, 0)]
    assert manager.tick() == (False, [])          # nothing new: nothing to send
    assert manager.folds["old"].done              # an ended job is folded one more time, then left alone

    old.steps(6, 7)
    live.restart("inprocess", "injected exception on rank 1", downtime=1.5, resumed=2, lost=1)
    changed, news = manager.tick()
    assert changed and [(k, d["job"], d["level"]) for k, d in news] == [("failure", "live", "inprocess"),
                                                                          ("restart", "live", "inprocess")]
    assert news[1][1]["resumed_step"] == 2 and news[1][1]["downtime_s"] == 1.5
    assert manager.folds["old"].row["step"] == 5

    new = FakeJob("new")                          # a job that appears while clients listen: all of it is news
    new.restart("job", "the launcher died", downtime=4.0, resumed=0, lost=0)
    changed, news = manager.tick()
    assert changed and [(k, d["job"]) for k, d in news] == [("failure", "new"), ("restart", "new")]
    assert [r["name"] for r in manager.rows()["jobs"]] == ["old", "live", "new"]
    shutil.rmtree(new.dir.path)
    odd = tmp_path / "jobs" / "odd"
    odd.mkdir()
    (odd / "spec.json").write_text('{"name": "odd", "stepz": 3}')   # listed with its problem, as by `list`
    assert manager.tick()[0] and [r["name"] for r in manager.rows()["jobs"]] == ["old", "live", "odd"]
    assert "unknown spec field 'stepz'" in manager.rows()["jobs"][-1]["detail"]

    # the dashboard's figure, from the same fold, by the widget's own code
    figure = json.loads(asyncio.run(manager.figure("old")))
    traces = {(t["name"], t["meta"]): t for t in figure["data"]}
    assert traces[("restarts", "tail")]["text"] == ["injected sigkill on rank 1 · 2.0s down"]
    assert traces[("faults", "tail")]["text"] == ["sigkill rank 1"]
    with pytest.raises(EksftError, match="no job named 'nope'"):
        asyncio.run(manager.figure("nope"))
    manager.close()


def test_a_restarted_server_lists_ended_jobs_from_the_rows_their_folders_keep(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """GET /eksft/jobs is the manager's folds after a tick: an ended job is folded by the first server
    that lists it, and by no later one (its row is kept in its folder), a running one incrementally."""
    from job_history import done_and_live

    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "none"))
    _, live, folded = done_and_live(tmp_path, monkeypatch)
    first = JobsManager()
    listed = asyncio.run(first.listing())
    assert [(r["name"], r["state"], r["step"]) for r in listed["jobs"]] == [("done", "succeeded", 5),
                                                                           ("live", "starting", 3)]
    assert listed["backends"] == {"local": {"ok": True}}
    asyncio.run(first.listing())
    assert first.folds["done"].done and (JobDir.for_name("done").path / "row.json").is_file()
    first.close()
    folded.clear()
    again = JobsManager()                     # the server restarted: the ended job is not folded again
    assert asyncio.run(again.listing()) == listed and set(folded) == {"live"}
    live.steps(4, 4)
    assert [r["step"] for r in asyncio.run(again.listing())["jobs"]] == [5, 4]
    again.close()


# ---- a real Jupyter server ---------------------------------------------------------------------

class Server:
    def __init__(self, url: str, token: str, home: Path) -> None:
        self.url, self.token, self.home = url, token, home

    def request(self, method: str, path: str, body: Any = None, token: str | None = "",
                headers: dict[str, str] | None = None, opener: Any = None) -> tuple[int, Any]:
        """(status, parsed JSON body) of ``/eksft/PATH``; ``token=None`` sends none."""
        data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
        req = urllib.request.Request(f"{self.url}/eksft/{path}", data=data if method == "POST" else None,
                                     method=method, headers=dict(headers or {}))
        if token is not None:
            req.add_header("Authorization", f"token {token or self.token}")
        try:
            with (opener or urllib.request.build_opener()).open(req, timeout=120) as r:
                status, text = r.status, r.read(2_000_000 if path != "stream" else 0)
        except urllib.error.HTTPError as e:
            status, text = e.code, e.read()
        try:
            return status, json.loads(text) if text else None
        except ValueError:
            return status, text


class Stream:
    """A client of ``/eksft/stream``: a thread records every event with its arrival time."""

    def __init__(self, server: Server) -> None:
        host, port = server.url.removeprefix("http://").split(":")
        self.conn = http.client.HTTPConnection(host, int(port), timeout=600)
        self.conn.request("GET", "/eksft/stream", headers={"Authorization": f"token {server.token}"})
        self.response = self.conn.getresponse()
        assert self.response.status == 200 and self.response.getheader("Content-Type") == "text/event-stream"
        self.events: list[tuple[float, str, Any]] = []
        self.comments = 0
        self.cond = threading.Condition()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        kind = None
        try:
            while line := self.response.readline().decode():
                line = line.rstrip("\n")
                if line.startswith("event: "):
                    kind = line[7:]
                elif line.startswith("data: "):
                    with self.cond:
                        self.events.append((time.monotonic(), kind, json.loads(line[6:])))
                        self.cond.notify_all()
                elif line.startswith(":"):
                    self.comments += 1
        except (OSError, ValueError, AttributeError):   # closed by close()
            pass

    def wait(self, what: str, match: Callable[[str, Any], bool], timeout: float) -> tuple[float, Any]:
        """The first event (arrival time, data) that ``match``es, waiting up to ``timeout`` seconds."""
        with self.cond:
            found = self.cond.wait_for(lambda: next(((t, d) for t, k, d in self.events if match(k, d)), None),
                                       timeout)
        if found is None:
            raise AssertionError(f"no {what} on the stream after {timeout:.0f}s; got "
                                 f"{[k for _, k, _ in self.events]}")
        return found

    def close(self) -> None:
        self.conn.close()


def row(data: dict[str, Any], name: str) -> dict[str, Any] | None:
    return next((r for r in data["jobs"] if r["name"] == name), None)


@pytest.fixture(scope="module")
def server(eksft_home: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """``jupyter server`` with the extension, and an unreachable cluster in its kubeconfig."""
    tmp = tmp_path_factory.mktemp("lab")
    kubeconfig = tmp / "kubeconfig"
    kubeconfig.write_text(json.dumps({
        "apiVersion": "v1", "kind": "Config", "current-context": "gone",
        "clusters": [{"name": "gone", "cluster": {"server": "https://127.0.0.1:9"}}],
        "contexts": [{"name": "gone", "context": {"cluster": "gone", "user": "u", "namespace": "default"}}],
        "users": [{"name": "u", "user": {"token": "x"}}]}))
    with jupyter_server(tmp, {**os.environ, "KUBECONFIG": str(kubeconfig)}) as srv:
        yield srv


@contextmanager
def jupyter_server(tmp: Path, env: dict[str, str]) -> Iterator[Server]:
    """``jupyter server`` in ``env`` with the extension enabled by the shipped config file, a token and
    its own Jupyter folders under ``tmp``; stopped on exit."""
    conf = tmp / "config" / "jupyter_server_config.d"
    conf.mkdir(parents=True)
    shutil.copy(REPO / "jupyter-config" / "jupyter_server_config.d" / "eksft_nb.json", conf)
    (tmp / "root").mkdir()
    token = secrets.token_hex(16)
    env = {**env, "JUPYTER_CONFIG_DIR": str(tmp / "config"), "JUPYTER_RUNTIME_DIR": str(tmp / "runtime"),
           "JUPYTER_DATA_DIR": str(tmp / "data")}
    log = open(tmp / "server.log", "wb")
    proc = subprocess.Popen(
        [str(Path(sys.executable).parent / "jupyter"), "server", "--no-browser", "--allow-root",
         "--ip=127.0.0.1",
         "--port=0", f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={tmp / 'root'}"],
        env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        def started() -> str | None:
            assert proc.poll() is None, (tmp / "server.log").read_text()[-3000:]
            for info in (tmp / "runtime").glob("jpserver-*.json"):
                try:
                    return json.loads(info.read_text())["url"].rstrip("/")
                except ValueError:
                    return None
            return None

        url = wait_for("the Jupyter server", started, timeout=90)
        srv = Server(url, token, tmp)
        def answers() -> bool:
            try:   # its runtime file may come before it listens
                return srv.request("GET", "jobs")[0] == 200
            except urllib.error.URLError:
                return False

        wait_for("the server to answer", answers, timeout=60)
        yield srv
    finally:
        stop_server(proc, log)


def test_every_route_needs_the_token(server: Server) -> None:
    for method, path in ROUTES:
        for token in (None, "wrong"):
            status, _ = server.request(method, path, {} if method == "POST" else None, token=token)
            assert status == 403, (method, path, token, status)
    assert not (jobs_root() / JOB).exists()


def test_a_cookie_post_needs_xsrf(server: Server) -> None:
    """A browser session (a login cookie) may POST only with the XSRF token, as on /api/."""
    jar = http.cookiejar.CookieJar()
    opener = urllib.request.build_opener(urllib.request.HTTPCookieProcessor(jar))
    opener.open(f"{server.url}/login", timeout=60).read()
    xsrf = next(c.value for c in jar if c.name == "_xsrf")
    login = urllib.parse.urlencode({"_xsrf": xsrf, "password": server.token}).encode()
    opener.open(urllib.request.Request(f"{server.url}/login", data=login), timeout=60).read()
    assert any(c.name.startswith("username-") for c in jar)
    assert server.request("GET", "jobs", token=None, opener=opener)[0] == 200
    status, body = server.request("POST", "jobs/no-such-job/stop", {}, token=None, opener=opener)
    assert status == 403 and "_xsrf" in body["message"]
    status, body = server.request("POST", "jobs/no-such-job/stop", {}, token=None, opener=opener,
                                  headers={"X-XSRFToken": xsrf})
    assert status == 404 and body["problem"].startswith("no job named 'no-such-job'")


def test_the_launch_forms_spec_is_pre_flighted_and_a_contradiction_refused(server: Server) -> None:
    """POST check: every timeout acting on the spec and each contradiction; POST jobs refuses one that
    guarantees failure with the same line, and launches nothing."""
    spec = {"name": "pf-lab", "device": "cpu", "model.preset": "gpt-1b", "checkpoint.storage_mbps": "75"}
    status, body = server.request("POST", "check", {"spec": spec})
    assert status == 200 and body["job"] == "pf-lab" and any(r["name"] == "heartbeat" for r in body["rows"])
    [refusal] = [f for f in body["findings"] if f["refuse"]]
    assert refusal["problem"].startswith("a restore takes ~324 s at 75 MB/s")
    status, body = server.request("POST", "jobs", {"spec": spec})
    assert status == 400 and body["problem"] == refusal["problem"] and body["fix"] == refusal["fix"]
    assert not (jobs_root() / "pf-lab").exists()
    status, body = server.request("POST", "check", {"spec": spec, "from": 3})
    assert status == 400 and body["problem"].startswith("request field from is 3")


def test_a_failing_cluster_never_fails_the_local_list(server: Server) -> None:
    status, body = server.request("GET", "jobs")
    assert status == 200 and body["backends"]["local"] == {"ok": True}
    assert body["backends"]["eks"]["ok"] is False and body["backends"]["eks"]["error"]


def test_the_jobs_list_carries_the_words_the_panel_learns(server: Server) -> None:
    """Fault kinds, restart level labels, the failed ends and the live settings: the panel has no copy."""
    from eksft_nb.lab.wire import JobsReply
    from eksft_nb.settings import LIVE
    from eksft_nb.states import FAILED_ENDS, RestartLevel

    status, body = server.request("GET", "jobs")
    assert status == 200 and set(body) == set(JobsReply.__annotations__), body
    assert body["levels"] == {level.value: level.label for level in RestartLevel}
    assert set(body["failed"]) == set(FAILED_ENDS)
    assert [(s["name"], s["low"], s["help"]) for s in body["settings"]] == \
        [(name, live.low, live.help) for name, live in LIVE.items()]


def test_a_huge_log_line_gets_a_bounded_reply_that_says_it_was_cut(server: Server) -> None:
    """A rank printed one 20 MB line: the logs route answers the end of the log, at most about 1 MB,
    saying what was left out (it read 20 MB and answered them, on the server's loop)."""
    from eksft_nb.spec import JobSpec

    cap = 1 << 20   # eksft_nb.tails.MAX_LOG_BYTES
    jd = JobDir.for_name("big-log")
    jd.create(JobSpec(name="big-log"))
    with open(jd.logs / "launcher-0-0.log", "w") as f:
        f.write("start\n" + "x" * (20 << 20) + "\nthe end\n")
    req = urllib.request.Request(f"{server.url}/eksft/jobs/big-log/logs?debug=true&lines=100000",
                                 headers={"Authorization": f"token {server.token}"})
    with urllib.request.urlopen(req, timeout=300) as r:
        status, raw = r.status, r.read()
    assert status == 200 and len(raw) < cap + 4096, len(raw)
    text = json.loads(raw)["text"]
    assert text.endswith("x\nthe end") and "start" not in text
    note = text.splitlines()[0]
    assert f"launcher-0-0.log: only its last {cap} of 20971535 bytes are shown" in note, text[:300]


def test_a_checkpoint_folder_that_cannot_be_made_is_a_refusal_not_a_server_error(server: Server) -> None:
    status, body = server.request("POST", "jobs", {"spec": {"name": "half-made-rest", "model.preset": "tiny",
                                                            "checkpoint.dir": "/etc/passwd/x"}})
    assert status == 400 and body["problem"].startswith(
        "cannot make the checkpoint folder /etc/passwd/x"), body
    assert not (jobs_root() / "half-made-rest").exists()


def cli_error(*args: str) -> str:
    """The line the CLI prints for a refused command, without its ``eksft: error: `` prefix."""
    proc = cli(*args)
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    return proc.stderr.strip().removeprefix("eksft: error: ")


def on_disk() -> dict[str, float]:
    """Every job's files but what a running job keeps writing (telemetry, logs, checkpoints, beacons)."""
    live = {"events.jsonl", "supervisor.json", "progress", "logs", "ckpt"}
    return {str(p): p.stat().st_mtime for p in jobs_root().rglob("*")
            if p.relative_to(jobs_root()).parts[1:2] != () and p.relative_to(jobs_root()).parts[1] not in live
            and not p.name.startswith(".") and p.is_file()}


@pytest.mark.slow
def test_a_job_from_a_terminal_in_the_api(server: Server) -> None:
    """Launch, stream, refuse, inject, restart, figure, stop: one job through the whole API."""
    stream = Stream(server)
    try:
        stream.wait("the first jobs event", lambda k, d: k == "jobs", 60)
        stream.wait("the cluster's error", lambda k, d: k == "jobs" and d["backends"]["eks"]["ok"] is False
                    and d["backends"]["eks"]["error"] and d["backends"]["local"]["ok"], 60)
        launched = cli("run", "--name", JOB, "--model", "tiny", "--steps", "100000", "--ckpt-every", "10",
                       "--detach")
        returned = time.monotonic()
        assert launched.returncode == 0, launched.stderr
        seen, _ = stream.wait("the launched job", lambda k, d: k == "jobs" and row(d, JOB) is not None, 30)
        print(f"the job showed on the stream {seen - returned:+.2f}s after `run --detach` returned")
        assert seen - returned < 2.0
        stream.wait("its first steps", lambda k, d: k == "jobs" and (row(d, JOB) or {}).get("step", 0) >= 3,
                    180)

        # bad requests: the CLI's line (the CLI runs meanwhile, in parallel), and nothing changes on disk
        before = on_disk()
        refused = [(f"jobs/{JOB}/inject", {"fault": "sigkil"}, ["inject", JOB, "sigkil"]),
                   (f"jobs/{JOB}/inject", {"fault": "hang", "rank": 9},
                    ["inject", JOB, "hang", "--rank", "9"]),
                   (f"jobs/{JOB}/inject", {"fault": "kill-launcher", "rank": 0},
                    ["inject", JOB, "kill-launcher", "--rank", "0"]),
                   (f"jobs/{JOB}/inject", {"fault": "hang", "step": 1},
                    ["inject", JOB, "hang", "--step", "1"]),
                   (f"jobs/{JOB}/inject", {"fault": "slow-rank", "delay": -1.0},
                    ["inject", JOB, "slow-rank", "--delay", "-1"]),
                   (f"jobs/{JOB}/settings", {"values": {"ckpt-mode": "sync"}},
                    ["set", JOB, "ckpt-mode=sync"]),
                   (f"jobs/{JOB}/settings", {"values": {"keep-last": 1}}, ["set", JOB, "keep-last=1"]),
                   ("jobs", {"spec": {"name": "other", "steps": "many"}},
                    ["run", "--name", "other", "--steps", "many"]),
                   ("jobs", {"spec": {"name": "Not_A_Label"}}, ["run", "--name", "Not_A_Label"])]
        with ThreadPoolExecutor(4) as pool:
            lines = pool.map(lambda args: cli_error(*args), [args for _, _, args in refused])
            steps = re.compile(r"step \d+")   # "the job is at step N" moves on between the two
            for (path, body, _), line in zip(refused, lines):
                status, reply = server.request("POST", path, body)
                assert status == 400 and steps.sub("step N",
                                                   reply["error"]) == steps.sub("step N", line), reply
        for body in (b"{", b"[1]", {"fault": "sigkill", "rank": "1"}, {"fault": "sigkill", "colour": 1},
                     {"fault": "sigkill", "after": 1e300}, {"fault": "sigkill", "rank": 10**40}):
            status, reply = server.request("POST", f"jobs/{JOB}/inject", body)
            assert status == 400 and reply["problem"] and "\n" not in reply["error"], (body, reply)
        assert server.request("POST", "jobs/no-such-job/inject", {"fault": "sigkill"})[0] == 404
        # the rm of many: each job's own answer (a running one refused with the CLI's line)
        status, reply = server.request("POST", "rm", {"jobs": [{"name": JOB}, {"name": "no-such-job",
                                                                                "backend": "local"}]})
        assert status == 200 and [(r["name"], r["removed"]) for r in reply["results"]] == [
            (JOB, False), ("no-such-job", False)], reply
        assert reply["results"][0]["message"] == cli_error("rm", JOB), reply
        for body in ({"jobs": "all"}, {"jobs": [{"name": 1}]}, {"jobs": [{"name": "a", "colour": 1}]}, {}):
            status, reply = server.request("POST", "rm", body)
            assert status == 400 and reply["problem"] and "\n" not in reply["error"], (body, reply)
        for body in ({"values": {}}, {"values": {"ckpt-every": 5}, "whatif": True}, {"values": [5]}):
            status, reply = server.request("POST", f"jobs/{JOB}/settings", body)
            assert status == 400 and reply["problem"] and "\n" not in reply["error"], (body, reply)
        assert on_disk() == before, "a refused request changed files on disk"

        # a live setting through the API: every rank takes it at one step, and GET says it is in force
        status, reply = server.request("POST", f"jobs/{JOB}/settings", {"values": {"ckpt-every": 7}})
        assert status == 200 and reply["changes"] == {"ckpt-every": [10, 7]}, reply
        taken = wait_for("both ranks' setting events", lambda: len(events(JOB, "setting")) == 2 and
                         events(JOB, "setting"), timeout=120)
        assert len({e["step"] for e in taken}) == 1 and {e.rank for e in taken} == {0, 1}
        status, reply = server.request("GET", f"jobs/{JOB}/settings")
        assert status == 200 and reply["values"]["ckpt-every"] == 7, reply
        assert reply["step"] == taken[0]["step"], reply

        # a sigkill through the API: a restart on the stream, and in the dashboard's figure
        status, reply = server.request("POST", f"jobs/{JOB}/inject", {"fault": "sigkill", "rank": 1})
        assert status == 200 and (reply["fault"], reply["target"],
                                  reply["when"]) == ("sigkill", "rank 1", "now")
        _, restart = stream.wait("a restart", lambda k, d: k == "restart" and d["job"] == JOB, 180)
        assert restart["level"] in ("injob", "job") and restart["resumed_step"] >= 0, restart
        stream.wait("the restart in the job's row",
                    lambda k,
                    d: k == "jobs" and sum((row(d, JOB) or {"restarts": {}})["restarts"].values()) >= 1, 30)
        status, figure = server.request("GET", f"jobs/{JOB}/figure")
        assert status == 200
        traces = {(t["name"], t["meta"]): t for t in figure["data"]}
        assert traces[("faults", "tail")]["text"] == ["sigkill rank 1"]
        assert traces[("settings", "tail")]["text"] == [f"ckpt-every 10→7 @ step {taken[0]['step']}"]
        assert len(traces[("restarts", "tail")]["text"]) == 1
        assert traces[("tokens/s", "tail")]["x"]

        # stop through the API: nothing of the job runs afterwards
        status, reply = server.request("POST", f"jobs/{JOB}/stop", {})
        assert status == 200 and reply["state"] == "stopped" and reply["ended"] is True, reply
        from eksft_nb import procs

        uid = JobDir.for_name(JOB).supervisor()["job_uid"]
        assert procs.marked(uid) == []
        stream.wait("the stop", lambda k, d: k == "jobs" and (row(d, JOB) or {}).get("state") == "stopped",
                    30)

        # the job view's what-if: the replay of its events as the widget tab shows it (cells and figure)
        from eksft_nb import commands
        from eksft_nb.resilience.whatif_view import view

        status, whatif = server.request("GET", f"jobs/{JOB}/whatif")
        assert status == 200 and {k: v for k, v in whatif.items() if k != "settings"} == \
            json.loads(json.dumps(view(commands.whatif(JOB)))), whatif
        # what the panel's Apply posts: the interval only where its replay gains ETTR, else nothing
        applies = {} if whatif["every"] is None else {"ckpt-every": whatif["every"]}
        assert whatif["settings"] == applies, whatif
        assert re.fullmatch(r"every \d+ steps: \+\d+\.\d points ETTR \(now every 10\)|keep every 10: .+",
                            whatif["line"]), whatif["line"]
        assert [r[0] for r in whatif["rows"]][:2] == ["measured (as run)", "predicted (as run)"]
        assert [t["name"] for t in whatif["figure"]["data"]][0] == "predicted"
        status, reply = server.request("GET", "jobs/no-such-job/whatif")
        # the REST call asks the local backend (the panel names a row's backend; none: local), so the CLI
        # is asked the same: without --backend it searches Slurm too once this session launched a Slurm job
        assert status == 404 and reply["error"] == cli_error("whatif", "no-such-job", "--backend", "local")

        # once stopped, its checkpoints hold still: resume refuses a step that is not one, as the CLI does
        status, reply = server.request("POST", f"jobs/{JOB}/resume", {"step": 7})
        assert status == 400 and reply["error"] == cli_error("resume", JOB, "--step", "7")
    finally:
        stream.close()


def test_the_dashboard_figures_script_is_served_to_a_logged_in_browser_only(server: Server) -> None:
    from eksft_nb import plotly_bundle

    bundle = (plotly_bundle.bundle_dir() / plotly_bundle.BUNDLE).read_bytes()
    url = f"{server.url}/eksft/{plotly_bundle.ROUTE}"
    req = urllib.request.Request(url, headers={"Authorization": f"token {server.token}"})
    with urllib.request.urlopen(req, timeout=120) as r:
        assert r.status == 200 and "javascript" in r.headers["Content-Type"], (r.status, r.headers)
        assert r.read() == bundle
    try:
        with urllib.request.urlopen(url, timeout=120) as r:   # no token: the login page, never the file
            assert r.read() != bundle and "/login" in r.url
    except urllib.error.HTTPError as e:
        assert e.code == 403


def test_every_front_end_says_the_command_layers_line_for_an_inject(
        server: Server, ip: Any, capsys: pytest.CaptureFixture[str]) -> None:
    """The widget, the CLI, the magic and REST, on one job folder (written with the real schema, no
    process runs): a refused inject is the same line everywhere, and so is a queued one."""
    from IPython.core.error import UsageError

    from eksft_nb.dashboard import Dashboard
    from eksft_nb.events import EventWriter, make
    from eksft_nb.job import attach
    from eksft_nb.spec import JobSpec

    name = "every-front"
    jd = JobDir.for_name(name)
    jd.create(JobSpec().replace(name=name, steps=100).validate())
    out = EventWriter(jd.events_path, name)
    out.write(make("job_start", name, None, spec_digest="x", world_size=2, steps=100, backend="local",
                   host="h", pid=1))
    for step in range(1, 6):
        out.write(make("step", name, 0, step=step, loss=1.0, tokens=1, step_time=0.1))
    dash = Dashboard(attach(name), live=False)

    def widget(**kwargs: Any) -> str:
        dash.inject("sigkill", **kwargs)
        return html.unescape(re.sub(r"<[^>]*>", "", dash.message.value))

    def magic(line: str) -> str:
        capsys.readouterr()
        ip.run_line_magic("ftrain", line)
        return capsys.readouterr().out.strip()

    refused = ("step 3 has already passed (the job is at step 5): use --step 6 or later, or omit --step "
               "to inject now")
    status, body = server.request("POST", f"jobs/{name}/inject", {"fault": "sigkill", "rank": 1, "step": 3})
    assert (status, body["error"]) == (400, refused), body
    assert cli_error("inject", name, "sigkill", "--rank", "1", "--step", "3") == refused
    with pytest.raises(UsageError) as raised:
        magic(f"inject {name} sigkill --rank 1 --step 3")
    assert str(raised.value) == refused.replace(": use", "\n  → use")   # the magic's two-line form of it
    assert widget(rank=1, step=3) == refused
    # refused by the one check of a fault command (validation.check_fault), before any backend is asked
    refused = "rank 5 is out of range for a job of 2 ranks: use --rank between 0 and 1"
    status, body = server.request("POST", f"jobs/{name}/inject", {"fault": "sigkill", "rank": 5})
    assert (status, body["error"]) == (400, refused), body
    assert cli_error("inject", name, "sigkill", "--rank", "5") == refused
    with pytest.raises(UsageError) as raised:
        magic(f"inject {name} sigkill --rank 5")
    assert str(raised.value) == refused.replace(": use", "\n  → use")
    assert widget(rank=5) == refused
    assert list(jd.pending.glob("*.json")) == []

    queued = (f"queued sigkill for rank 1 of {name} (at step 50); it shows as fired when the rank fires "
              "it; id ")
    status, body = server.request("POST", f"jobs/{name}/inject", {"fault": "sigkill", "rank": 1, "step": 50})
    said = [body["message"], cli("inject", name, "sigkill", "--rank", "1", "--step", "50").stdout.strip(),
            widget(rank=1, step=50), magic(f"inject {name} sigkill --rank 1 --step 50")]
    ids = {p.stem for p in jd.pending.glob("*.json")}
    assert len(ids) == 4 and [s.startswith(queued) and s.removeprefix(queued) in ids
                              for s in said] == [True] * 4, said
