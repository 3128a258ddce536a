"""``pip install`` of the wheel is the whole install: the CLI, the magic and the JupyterLab panel.

The wheel is built from a clean copy of the source tree (the files git knows, no node_modules) plus the one
build output `make setup` made with the build hook's own function (nbext/build.py: npm ci, then JupyterLab's
builder): the extension, which the hook then packs as it does for a wheel built from the sdist, rather than
building it a second time. It is then installed with its dependencies into a fresh venv (not editable), and
used from there the way a user would: a short job with a fault through the CLI, the magic, both extension
lists, and the jobs panel in a JupyterLab started from it.
pip's downloads are cached in the test's own folder; torch is the one from this machine's local index.
"""

from __future__ import annotations

import importlib
import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path
from typing import Any

import pytest
from packaging.requirements import Requirement

from conftest import REPO, jupyterlab
from nbext.build import build as nbext_build

CHROMIUM = Path("/usr/lib/chromium/chromium")
FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking",
         "--disable-component-update", "--disable-sync"]
TORCH_SPEC = os.environ.get("TORCH_SPEC", "torch==2.13.0")   # the Makefile's: a CPU build this machine has
BUILD_TOOLS = {"jupyter-builder", "hatchling", "hatch-jupyter-builder", "hatch-nodejs-version", "setuptools"}
LABEXT = "share/jupyter/labextensions/eksft-nb-labextension/"
JOB = "wheel-job"

# a build, two installs, a job and a JupyterLab: room beyond the suite's 600 s for a loaded machine
pytestmark = [pytest.mark.slow, pytest.mark.browser, pytest.mark.timeout(1800),
              pytest.mark.skipif(not CHROMIUM.exists(), reason="Chromium is not installed (make chromium)"),
              pytest.mark.skipif(shutil.which("npm") is None, reason="npm is missing (Node.js >= 20.19)")]


def run(cmd: list[Any], cwd: Path, env: dict[str, str], timeout: float = 900) -> subprocess.CompletedProcess:
    proc = subprocess.run([str(c) for c in cmd], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, f"{' '.join(map(str, cmd))} exited {proc.returncode}:\n{proc.stderr[-4000:]}"
    return proc


def plain(proc: subprocess.CompletedProcess) -> str:
    """What a Jupyter list command printed (both streams), without its colours."""
    return re.sub(r"\x1b\[[0-9;]*m", "", proc.stdout + proc.stderr)


def clean_tree(dest: Path) -> Path:
    """The files git tracks or would track (working copies), nothing it ignores: no node_modules, no build."""
    names = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                           capture_output=True, text=True, check=True).stdout.split("\0")
    for name in filter(None, names):
        src = REPO / name
        if src.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / name)
    return dest


def with_built_extension(dest: Path) -> Path:
    """``dest`` with the extension `make setup` built (by the function the wheel's build hook names), which
    the hook's skip-if-exists then packs as it is."""
    hooks = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["hatch"]["build"]["hooks"]
    hook = hooks["jupyter-builder"]
    module, _, name = hook["build-function"].rpartition(".")
    assert getattr(importlib.import_module(module), name) is nbext_build, hook   # the function setup ran
    built = REPO / "eksft_nb" / "labextension"
    assert all((REPO / t).is_file() for t in hook["skip-if-exists"] + hook["ensured-targets"]), \
        f"{built} is not built: run `make setup`"
    shutil.copytree(built, dest / "eksft_nb" / "labextension")
    return dest


def runtime_requirements(wheel: Path) -> list[str]:
    with zipfile.ZipFile(wheel) as z:
        meta = z.read(next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))).decode()
    return [line.split(":", 1)[1].strip() for line in meta.splitlines()
            if line.startswith("Requires-Dist:") and "extra ==" not in line]


def test_the_wheel_is_the_whole_install(tmp_path: Path) -> None:
    # a venv made from the base interpreter, nothing of this one's sys.path or PYTHONPATH leaking in
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    env.update(PIP_CACHE_DIR=str(tmp_path / "pip-cache"), PIP_DISABLE_PIP_VERSION_CHECK="1",
               EKSFT_HOME=str(tmp_path / "eksft"), JUPYTER_CONFIG_DIR=str(tmp_path / "jupyter-config"),
               JUPYTER_DATA_DIR=str(tmp_path / "jupyter-data"), JUPYTER_RUNTIME_DIR=str(tmp_path / "runtime"))
    src = with_built_extension(clean_tree(tmp_path / "src"))
    run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", tmp_path / "dist", src],
        tmp_path, env)
    (wheel,) = (tmp_path / "dist").glob("eksft_nb-*.whl")
    version = json.loads((REPO / "nbext" / "package.json").read_text())["version"]   # the one source
    assert wheel.name.startswith(f"eksft_nb-{version}-"), wheel.name
    print(f"wheel: {wheel.name}, {wheel.stat().st_size / 2**20:.2f} MB")

    # it carries the prebuilt extension and the server extension's config; it needs no build tool to run
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
    data = [n.split(".data/data/", 1)[1] for n in names if ".data/data/" in n]
    assert {LABEXT + "package.json", LABEXT + "install.json",
            "etc/jupyter/jupyter_server_config.d/eksft_nb.json"} <= set(data), data
    assert [n for n in data if n.startswith(LABEXT + "static/remoteEntry.") and n.endswith(".js")], data
    assert any(n.endswith("backends/schemas/jobset.x-k8s.io_jobsets.yaml") for n in names)
    requires = runtime_requirements(wheel)
    assert requires and not {Requirement(r).name.lower() for r in requires} & BUILD_TOOLS, requires

    # a fresh venv, a real (not editable) install with every dependency: this pip installs into it
    # (--python), so the venv needs no pip of its own (ensurepip: seconds of a busy machine)
    venv = tmp_path / "venv"
    base = Path(getattr(sys, "_base_executable", sys.executable))
    run([base, "-m", "venv", "--without-pip", venv], tmp_path, env)
    py, bindir = venv / "bin" / "python", venv / "bin"
    env["PATH"] = f"{bindir}{os.pathsep}{env['PATH']}"
    run([sys.executable, "-m", "pip", "--python", py, "install", "-q", TORCH_SPEC, wheel],   # one resolve
        tmp_path, env)
    where = run([py, "-c", "import eksft_nb; print(eksft_nb.__file__, eksft_nb.__version__)"], tmp_path,
                env).stdout
    assert where.startswith(str(venv)) and where.split()[1] == version, where

    # the CLI: a short job whose killed rank is healed by a restart
    out = run([py, "-m", "eksft_nb", "run", "--name", JOB, "--model", "tiny", "--steps", "12", "--ckpt-every",
               "5",
               "--fault", "sigkill:1@7", "--json"], tmp_path, env, timeout=600).stdout
    summary = json.loads(out[out.index("{"):])
    assert summary["state"] == "succeeded" and summary["steps_done"] == 12, summary
    assert summary["restart_events"], summary

    # the magic
    magic = ("from IPython.core.interactiveshell import InteractiveShell as S; ip = S.instance();"
             " ip.run_line_magic('load_ext', 'eksft_nb'); print(sorted(ip.magics_manager.magics['cell']))")
    assert "ftrain" in run([py, "-c", magic], tmp_path, env).stdout

    # both extensions, enabled and OK, from the venv's own share/ and etc/
    labext = plain(run([bindir / "jupyter", "labextension", "list"], tmp_path, env))
    lines = [line for line in labext.splitlines() if "eksft-nb-labextension" in line]
    assert len(lines) == 1 and "enabled" in lines[0] and "OK" in lines[0] and "eksft-nb" in lines[0], labext
    assert f"{venv}/share/jupyter/labextensions" in labext, labext
    text = plain(run([bindir / "jupyter", "server", "extension", "list"], tmp_path, env))
    assert f"{venv}/etc/jupyter" in text and "eksft_nb.lab enabled" in text, text
    assert re.search(r"eksft_nb\.lab\s+OK", text), text

    # the jobs panel, in a JupyterLab started from the venv, lists the job the CLI ran
    with jupyterlab(tmp_path / "lab", bindir / "jupyter", env=env) as lab:
        show_panel(lab)


def show_panel(lab: dict[str, Any]) -> None:
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=str(CHROMIUM), headless=True, args=FLAGS)
        page = browser.new_page(viewport={"width": 1280, "height": 800})
        try:
            page.goto(f"{lab['url']}/lab?token={lab['token']}")
            page.wait_for_function("() => window.jupyterapp", timeout=90_000, polling=250)
            page.evaluate("() => window.jupyterapp.restored")
            assert page.evaluate("() => window.jupyterapp.commands.hasCommand('eksft:show-jobs')"), \
                "the installed wheel's JupyterLab has no eksft extension"
            page.evaluate("() => window.jupyterapp.commands.execute('eksft:show-jobs')")
            page.locator(".eksft-panel[data-live=true]").wait_for(timeout=60_000)
            page.locator(f'.eksft-job[data-job="{JOB}"][data-state="succeeded"]').wait_for(state="attached",
                                                                                          timeout=60_000)
        except Exception:
            page.screenshot(path=str(lab["dir"] / "failure.png"))
            raise
        finally:
            browser.close()
