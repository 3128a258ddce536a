"""The NVRx releases the tests run on (docs/nvrx-versions.md says which test runs on which).

- ``installed``: the one pip resolved into the venv (0.4.1 where glibc < 2.39, as here);
- ``0.6.0`` and ``0.7.0``: unpacked beside it by `make setup` (``.venv/nvrx-<version>``, their wheels are
  tagged for glibc 2.39 by name only); a job runs on one when its folder is first on ``PYTHONPATH``.

CI's time allows one release the full NVRx matrix: :data:`NEWEST` (0.7.0, what GPU machines resolve on
Python 3.12) gets it; the others (:data:`SMOKE`) get the smoke set.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from eksft_nb import nvrx

VENV = Path(__file__).resolve().parents[1] / ".venv"
NEWEST = "0.7.0"
SMOKE = ("installed", "0.6.0")


def folder(release: str) -> Path | None:
    """The folder to put first on ``PYTHONPATH`` for ``release`` (None: the venv's own); skips the test
    where `make setup` has not unpacked it."""
    if release == "installed":
        return None
    path = VENV / f"nvrx-{release}"
    if not (path / "nvidia_resiliency_ext").is_dir():
        pytest.skip(f"NVRx {release} is not unpacked in {path} (`make setup` does it)")
    return path


def version(release: str) -> str:
    """The version string a job on ``release`` reports."""
    return nvrx.installed().version if release == "installed" else release


def env(release: str, base: dict[str, str] | None = None) -> dict[str, str]:
    """``base`` (os.environ) with ``release``'s folder first on ``PYTHONPATH``."""
    out = dict(os.environ if base is None else base)
    if (path := folder(release)) is not None:
        out["PYTHONPATH"] = os.pathsep.join(p for p in (str(path), out.get("PYTHONPATH")) if p)
    return out


def use(release: str, monkeypatch: pytest.MonkeyPatch) -> Path | None:
    """Run every job the test starts (its CLI, supervisor, launchers and ranks) on ``release``."""
    path = folder(release)
    if path is not None:
        monkeypatch.setenv("PYTHONPATH", env(release)["PYTHONPATH"])
    return path
