"""The quickstart in a real JupyterLab, driven by headless Chromium (Playwright).

Runs the notebook, then checks in the page: steps arrive in the plot; Resume-from-here on an older
checkpoint starts a job whose first step is that checkpoint's step + 1; a click on Inject with
``sigkill`` in that job's dashboard produces a restart marker while the step count keeps rising.
Screenshots go to the test's folder (and to ``docs/dashboard.png`` with EKSFT_SCREENSHOT_TO_DOCS=1).
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from conftest import REPO

CHROMIUM = Path("/usr/lib/chromium/chromium")
FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
         "--disable-component-update", "--disable-sync"]

pytestmark = [pytest.mark.browser, pytest.mark.slow,
              pytest.mark.skipif(not CHROMIUM.exists(), reason="Chromium is not installed (make chromium)")]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def lab(tmp_path: Path) -> Iterator[dict[str, Any]]:
    """A fresh JupyterLab server on the quickstart notebook, with its own EKSFT_HOME."""
    root, settings = tmp_path / "root", tmp_path / "settings"
    root.mkdir()
    shutil.copy(REPO / "notebooks" / "01_quickstart.ipynb", root)
    for name, value in (("@jupyterlab/apputils-extension/notification.jupyterlab-settings",
                         {"fetchNews": "false", "checkForUpdates": False}),
                        ("@jupyterlab/notebook-extension/tracker.jupyterlab-settings", {"windowingMode": "none"})):
        (settings / name).parent.mkdir(parents=True, exist_ok=True)
        (settings / name).write_text(json.dumps(value))
    port, token = _free_port(), secrets.token_hex(16)
    env = {**os.environ, "EKSFT_HOME": str(tmp_path / "eksft"), "JUPYTERLAB_SETTINGS_DIR": str(settings),
           "JUPYTERLAB_WORKSPACES_DIR": str(tmp_path / "workspaces"), "JUPYTER_RUNTIME_DIR": str(tmp_path / "runtime"),
           "JUPYTER_CONFIG_DIR": str(tmp_path / "config")}
    log = open(tmp_path / "lab.log", "wb")
    server = subprocess.Popen(
        [str(Path(sys.executable).parent / "jupyter"), "lab", "--no-browser", "--allow-root", "--ip=127.0.0.1",
         f"--port={port}", "--port-retries=0", f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={root}",
         "--LabApp.expose_app_in_browser=True", "--LabApp.news_url=None",
         "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate"],
        env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 60
    while True:
        try:
            urllib.request.urlopen(f"{url}/api/status?token={token}", timeout=2)
            break
        except OSError:
            if server.poll() is not None or time.time() > deadline:
                raise RuntimeError(f"JupyterLab did not start; see {tmp_path / 'lab.log'}") from None
            time.sleep(0.3)
    try:
        yield {"url": url, "token": token, "home": tmp_path / "eksft", "dir": tmp_path}
    finally:
        server.terminate()
        try:
            server.wait(20)
        except subprocess.TimeoutExpired:
            server.kill()
        log.close()
        from eksft_nb.backends.local import LocalBackend

        backend = LocalBackend(tmp_path / "eksft" / "jobs")
        for job in backend.jobs():
            if job.state in ("starting", "running"):
                backend.stop(job.name)


def wait_for(what: str, probe: Callable[[], Any], timeout: float, every: float = 0.5) -> Any:
    deadline = time.time() + timeout
    while True:
        value = probe()
        if value:
            return value
        if time.time() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what} (last: {value!r})")
        time.sleep(every)


# in-page readers: the figure's traces by name, inside one job's dashboard
TRACES_JS = """([job, name]) => {
  const plot = document.querySelector(`.eksft-job-${job} .js-plotly-plot`);
  if (!plot || !plot.data) return null;
  return plot.data.filter(t => t.name === name).map(t => ({x: Array.from(t.x || []), y: Array.from(t.y || []),
                                                         customdata: Array.from(t.customdata || [])}));
}"""
KERNEL_IDLE_JS = ("() => { const w = window.jupyterapp && window.jupyterapp.shell.currentWidget;"
                  " const k = w && w.sessionContext && w.sessionContext.session && w.sessionContext.session.kernel;"
                  " return !!k && k.status === 'idle'; }")


def test_quickstart_in_jupyterlab(lab: dict[str, Any]) -> None:
    from playwright.sync_api import sync_playwright

    shots = lab["dir"]
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=str(CHROMIUM), headless=True, args=FLAGS)
        page = browser.new_page(viewport={"width": 1280, "height": 2000})  # tall: a whole dashboard in view
        page.goto(f"{lab['url']}/lab/tree/01_quickstart.ipynb?token={lab['token']}")
        page.wait_for_function(KERNEL_IDLE_JS, timeout=90_000, polling=500)
        page.evaluate("() => { window.jupyterapp.commands.execute('notebook:run-all-cells'); }")  # not awaited

        def points(job: str, name: str) -> list[dict[str, list[Any]]]:
            return page.evaluate(TRACES_JS, [job, name]) or []

        def steps_plotted(job: str) -> list[int]:
            return sorted(s for t in points(job, "tokens/s") for s in t["customdata"])

        # steps arrive in the plot, and keep arriving
        first = wait_for("steps in the quickstart plot", lambda: len(steps_plotted("quickstart")), 120)
        wait_for("more steps in the plot", lambda: len(steps_plotted("quickstart")) > first, 60)

        # the notebook waits for the job, then prints the summary: both faults were healed
        summary = page.locator(".jp-OutputArea-output", has_text="job quickstart: succeeded")
        summary.wait_for(timeout=300_000)
        page.wait_for_function(KERNEL_IDLE_JS, timeout=60_000, polling=500)
        dash = page.locator(".eksft-job-quickstart")
        restarts = points("quickstart", "restarts")
        lanes = [lane for t in restarts for lane in t["y"]]
        assert "in-process" in lanes and "in-job" in lanes, lanes
        assert steps_plotted("quickstart")[-1] == 200
        dash.scroll_into_view_if_needed()
        dash.screenshot(path=str(shots / "quickstart-dashboard.png"))

        # Resume-from-here on an older checkpoint: a new job whose first step is that step + 1
        resume_buttons = dash.locator(".eksft-ckpt-table .eksft-resume")
        classes = resume_buttons.evaluate_all("bs => bs.filter(b => b.offsetParent !== null).map(b => b.className)")
        steps = sorted(int(c.split("eksft-resume-")[1].split()[0]) for c in classes)
        assert len(steps) >= 3, steps
        older = steps[0]
        dash.locator(f".eksft-resume-{older}").click()
        child_name = f"quickstart-from-{older}"
        child = page.locator(f".eksft-resumed .eksft-job-{child_name}")
        child.wait_for(timeout=60_000)
        assert "starts at step" in dash.locator(".eksft-message").first.inner_text()
        wait_for("steps of the resumed job", lambda: steps_plotted(child_name), 120)
        assert steps_plotted(child_name)[0] == older + 1

        # Inject sigkill into the resumed job: a restart marker appears and the steps keep rising
        child.locator(".eksft-fault select").select_option("sigkill")
        child.locator(".eksft-rank select").select_option("1")
        child.locator(".eksft-when input").fill("now")
        child.locator("button.eksft-inject").click()
        wait_for("the injection to be acknowledged",
                 lambda: "queued sigkill for rank 1" in child.locator(".eksft-message").inner_text(), 30)
        # (other restarts may come first: on a starved machine a slow start can trip the in-process timeout)
        wait_for("an in-job restart marker",
                 lambda: "in-job" in [y for t in points(child_name, "restarts") for y in t["y"]], 120)

        def step_shown() -> int:
            return int(child.locator(".eksft-step b").inner_text())

        at_marker = step_shown()
        wait_for("the step count to keep rising after the restart", lambda: step_shown() > at_marker + 5, 120)
        child.scroll_into_view_if_needed()
        child.screenshot(path=str(shots / "resumed-dashboard.png"))
        browser.close()
    if os.environ.get("EKSFT_SCREENSHOT_TO_DOCS") == "1":
        (REPO / "docs").mkdir(exist_ok=True)
        shutil.copy(shots / "quickstart-dashboard.png", REPO / "docs" / "dashboard.png")
