"""The quickstart in a real JupyterLab, driven by headless Chromium (Playwright).

Runs the notebook, then checks in the page: steps arrive in the plot; Resume-from-here on an older
checkpoint starts a job whose first step is that checkpoint's step + 1; a click on Inject with
``sigkill`` in that job's dashboard produces a restart marker while the step count keeps rising.
Screenshots go to the test's folder (and to ``docs/dashboard.png`` with EKSFT_SCREENSHOT_TO_DOCS=1).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import pytest

from conftest import REPO
from jobs import wait_for

CHROMIUM = Path("/usr/lib/chromium/chromium")
FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking",
         "--disable-component-update", "--disable-sync"]

pytestmark = [pytest.mark.browser, pytest.mark.slow,
              pytest.mark.skipif(not CHROMIUM.exists(), reason="Chromium is not installed (make chromium)")]


# in-page readers: the figure's traces by name, inside one job's dashboard
TRACES_JS = """([job, name]) => {
  const plot = document.querySelector(`.eksft-job-${job} .js-plotly-plot`);
  if (!plot || !plot.data) return null;
  return plot.data.filter(t => t.name === name).map(t => ({x: Array.from(t.x || []), y: Array.from(t.y || []),
                                                         customdata: Array.from(t.customdata || [])}));
}"""
KERNEL_IDLE_JS = ("() => { const w = window.jupyterapp && window.jupyterapp.shell.currentWidget;"
                  " const k = w && w.sessionContext && w.sessionContext.session && "
                  "w.sessionContext.session.kernel;"
                  " return !!k && k.status === 'idle'; }")


def test_quickstart_in_jupyterlab(lab: dict[str, Any]) -> None:
    from playwright.sync_api import sync_playwright

    shots = lab["dir"]
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=str(CHROMIUM), headless=True, args=FLAGS)
        page = browser.new_page(viewport={"width": 1280, "height": 2000})  # tall: a whole dashboard in view
        page.goto(f"{lab['url']}/lab/tree/01_quickstart.ipynb?token={lab['token']}")
        page.wait_for_function(KERNEL_IDLE_JS, timeout=90_000, polling=500)
        # not awaited
        page.evaluate("() => { window.jupyterapp.commands.execute('notebook:run-all-cells'); }")

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
        assert steps_plotted("quickstart")[-1] == 400
        dash.scroll_into_view_if_needed()
        dash.screenshot(path=str(shots / "quickstart-dashboard.png"))

        # Resume-from-here on an older checkpoint: a new job whose first step is that step + 1
        resume_buttons = dash.locator(".eksft-ckpt-table .eksft-resume")
        classes = resume_buttons.evaluate_all("bs => bs.filter(b => b.offsetParent !== null).map(b => "
                                              "b.className)")
        steps = sorted(int(c.split("eksft-resume-")[1].split()[0]) for c in classes)
        assert len(steps) >= 3, steps
        older = steps[0]
        dash.locator(f".eksft-resume-{older}").click()
        child_name = f"quickstart-from-{older}"
        child = page.locator(f".eksft-resumed .eksft-job-{child_name}")
        child.wait_for(timeout=60_000)
        assert f"launched {child_name}, resuming from quickstart step {older}" in \
            dash.locator(".eksft-message").first.inner_text()   # the command layer's line, as the CLI says it
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
