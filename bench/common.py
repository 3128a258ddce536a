"""What every benchmark part shares: statistics, the machine it ran on, private job homes, tables."""

from __future__ import annotations

import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
PY = sys.executable
RESULTS = REPO / "bench" / "results"   # every run's raw JSON, kept: README.md's figures come from there

# How much each part runs: ``full`` (the figures), ``quick`` (a few minutes: each part's short version) and
# ``smoke`` (the smallest input: proves each part runs and computes, in seconds; the tests run it)
FULL, QUICK, SMOKE = "full", "quick", "smoke"
SIZES = (FULL, QUICK, SMOKE)


@dataclass(frozen=True)
class Stat:
    """Median and range of repeated measurements (the raw values are kept for the JSON)."""

    median: float
    min: float
    max: float
    n: int
    values: tuple[float, ...]

    @classmethod
    def of(cls, values: Sequence[float]) -> Stat | None:
        vals = tuple(float(v) for v in values)
        if not vals:
            return None
        return cls(statistics.median(vals), min(vals), max(vals), len(vals), vals)

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "values": list(self.values)}


def stat(values: Sequence[float]) -> dict[str, Any] | None:
    """``Stat.of(values)`` as a JSON-ready dict (None when there is nothing to summarise)."""
    s = Stat.of(values)
    return s.to_dict() if s else None


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def med(d: dict[str, Any] | None) -> float | None:
    """The median of a :func:`stat` dict, None-safe."""
    return d["median"] if d else None


def load_avg() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def machine() -> dict[str, Any]:
    """What the figures came from: cores, memory, CPU model, versions, load at the time."""
    import psutil
    import torch

    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor() or "unknown")
    try:
        from importlib.metadata import version

        nvrx = version("nvidia-resiliency-ext")
    except Exception:  # noqa: BLE001 - reported as unknown
        nvrx = "unknown"
    return {"nproc": len(os.sched_getaffinity(0)), "ram_gib": round(psutil.virtual_memory().total / 2**30, 1),
            "cpu": cpu, "load_avg": load_avg(), "python": platform.python_version(),
            "torch": torch.__version__,
            "nvrx": nvrx, "time": time.strftime("%Y-%m-%d %H:%M:%S %Z")}


def save(result: dict[str, Any], out: Path, stem: str, stamp: str | None = None) -> Path:
    """Write one standalone bench's results as ``out/STEM-STAMP.json`` (stamp: now) and return the path."""
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{stem}-{stamp or time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps(result, indent=1, default=str))
    return path


@contextmanager
def private_home() -> Iterator[Path]:
    """A fresh ``EKSFT_HOME`` for the jobs launched inside; every job still running is stopped on exit."""
    old = os.environ.get("EKSFT_HOME")
    home = Path(tempfile.mkdtemp(prefix="eksft-bench-"))
    os.environ["EKSFT_HOME"] = str(home)
    try:
        yield home
    finally:
        stop_all(home)
        if old is None:
            os.environ.pop("EKSFT_HOME", None)
        else:
            os.environ["EKSFT_HOME"] = old
        shutil.rmtree(home, ignore_errors=True)


def stop_all(home: Path) -> None:
    from eksft_nb.backends.local import LocalBackend

    backend = LocalBackend(home / "jobs")
    for job in backend.jobs():
        if job.state in ("starting", "running"):
            backend.stop(job.name)


def rank_env(**extra: str) -> dict[str, str]:
    """Environment for rank processes the bench starts itself (quiet, one thread, repo importable)."""
    from eksft_nb.runtime.quiet import quiet_env

    env = quiet_env(dict(os.environ))
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    env.update(extra)
    return env


def fmt(x: float | None, spec: str = ".2f", unit: str = "") -> str:
    return "-" if x is None else f"{x:{spec}}{unit}"


def table(title: str, header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A plain fixed-width table: first column left-aligned, the rest right-aligned."""
    cells = [list(header), *[list(r) for r in rows]]
    widths = [max(len(str(r[i])) for r in cells) for i in range(len(header))]

    def line(r: Sequence[str]) -> str:
        return "  ".join(str(c).ljust(w) if i == 0 else str(c).rjust(w) for i,
                         (c, w) in enumerate(zip(r, widths)))

    rule = "-" * len(line(header))
    return "\n".join([title, rule, line(header), rule, *[line(r) for r in rows], ""])
