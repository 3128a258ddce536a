"""What this environment has that a job's ranks use: Python, glibc, torch (its CUDA and NCCL), the GPUs,
NVRx, torchft, libfabric and NCCL's EFA plugin. Each is looked up, never assumed; what cannot be found
is None, and a probe that fails says why instead of raising."""

from __future__ import annotations

import importlib.metadata
import os
import platform
import shutil
import warnings
from dataclasses import dataclass, field
from pathlib import Path

from .. import nvrx
from . import platforms


@dataclass(frozen=True)
class Environment:
    python: str
    glibc: tuple[int, int] | None
    torch: str | None
    cuda: str | None  # the CUDA torch was built with
    nccl: tuple[int, int, int] | None  # the NCCL torch carries
    gpus: int  # the GPUs torch sees
    nvrx: nvrx.NVRx | None
    torchft: str | None
    libfabric: str | None  # where (fi_info, or the library), None: not found
    efa_plugin: str | None  # aws-ofi-nccl's libnccl-net*.so, None: not found
    notes: list[str] = field(default_factory=list)  # probes that failed, and why
    asked_torch: bool = True  # torch itself was asked (else its CUDA, NCCL and GPUs are not known)

    @property
    def pythons(self) -> tuple[int, int]:
        major, minor = self.python.split(".")[:2]
        return int(major), int(minor)

    def to_dict(self) -> dict[str, object]:
        return {
            "python": self.python,
            "glibc": ".".join(map(str, self.glibc)) if self.glibc else None,
            "torch": self.torch,
            "cuda": self.cuda,
            "nccl": ".".join(map(str, self.nccl)) if self.nccl else None,
            "gpus": self.gpus,
            "nvrx": self.nvrx.version if self.nvrx else None,
            "nvrx_wrapper": self.nvrx.inprocess if self.nvrx else None,
            "torchft": self.torchft,
            "libfabric": self.libfabric,
            "efa_plugin": self.efa_plugin,
            "notes": list(self.notes),
        }


def probe(import_torch: bool = True) -> Environment:
    """This environment. ``import_torch``: ask torch itself for its CUDA, NCCL and GPUs (a few seconds);
    else only its version, from its metadata."""
    notes: list[str] = []
    torch_version = _version("torch")
    cuda = nccl = None
    gpus = 0
    if import_torch and torch_version:
        try:
            with warnings.catch_warnings():  # torch's import warns about pynvml: noise to whoever reads this
                warnings.filterwarnings("ignore", category=FutureWarning)
                import torch

            cuda = torch.version.cuda
            gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
            if cuda:
                raw = torch.cuda.nccl.version()
                nccl = tuple(raw) if isinstance(raw, tuple) else (raw // 10000, raw // 100 % 100, raw % 100)
        except Exception as e:  # noqa: BLE001 - a broken torch is what doctor is for: said, not raised
            notes.append(f"torch could not say its CUDA, NCCL and GPUs: {type(e).__name__}: {str(e)[:120]}")
    nvrx.installed.cache_clear()  # a doctor after a pip install in the same process sees the new one
    return Environment(
        platform.python_version(),
        platforms.glibc(),
        torch_version,
        cuda,
        nccl,
        gpus,
        nvrx.installed(),
        _version("torchft"),
        _libfabric(),
        _efa_plugin(),
        notes,
        asked_torch=import_torch and torch_version is not None,
    )


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _libfabric() -> str | None:
    from ..backends.eks.efa import EFA_HOME, LIB_DIRS

    fi_info = shutil.which(
        "fi_info", path=os.pathsep.join((os.environ.get("PATH", ""), str(EFA_HOME / "bin")))
    )
    return fi_info or _first(LIB_DIRS, "libfabric.so*")


def _efa_plugin() -> str | None:
    from ..backends.eks.efa import PLUGIN_DIRS

    return _first(PLUGIN_DIRS, "libnccl-net*.so*")


def _first(defaults: tuple[str, ...], pattern: str) -> str | None:
    dirs = [d for d in os.environ.get("LD_LIBRARY_PATH", "").split(os.pathsep) if d] + list(defaults)
    for d in dirs:
        if Path(d).is_dir() and (hit := next(Path(d).glob(pattern), None)) is not None:
            return str(hit)
    return None
