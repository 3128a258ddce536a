"""Builds the JupyterLab extension for a wheel or sdist: hatch-jupyter-builder calls ``build``
(pyproject.toml).

npm ci installs exactly the committed lock file, then ``npm run build:prod`` runs tsc and jupyter-builder into
eksft_nb/labextension/. Only a build from a source tree runs this: the sdist carries the built extension.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

NBEXT = Path(__file__).resolve().parent


def build(target_name: str, version: str) -> None:
    """Build nbext/ (the hook's ``target_name``/``version`` change nothing: every build is the same)."""
    npm = shutil.which("npm")
    if npm is None:
        raise RuntimeError("npm is missing, needed to build the JupyterLab extension from source → install "
                           "Node.js >= 20.19 with npm, or install eksft-nb from a wheel or the sdist")
    subprocess.run([npm, "ci", "--no-audit", "--no-fund", "--ignore-scripts", "--loglevel=error"], cwd=NBEXT,
                   check=True)
    subprocess.run([npm, "run", "build:prod"], cwd=NBEXT, check=True)
