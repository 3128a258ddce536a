"""Keep library noise out of what users read, unless they ask for debug output (EKSFT_DEBUG=1)."""

from __future__ import annotations

import logging
import os
import warnings

PYNVML_WARNING = "ignore:The pynvml package is deprecated:FutureWarning"


def debug_enabled() -> bool:
    return os.environ.get("EKSFT_DEBUG", "") not in ("", "0")


def quiet_env(env: dict[str, str]) -> dict[str, str]:
    """Environment for processes eksft starts (launchers, ranks, supervisors)."""
    if not debug_enabled():
        env.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
        env["PYTHONWARNINGS"] = ",".join(w for w in (env.get("PYTHONWARNINGS"), PYNVML_WARNING) if w)
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def quiet_process() -> None:
    """Call first thing in a process that imports torch and NVRx."""
    warnings.filterwarnings("ignore", message="The pynvml package is deprecated", category=FutureWarning)
    warnings.filterwarnings("ignore", message="logging not initialized", category=UserWarning)
    if not debug_enabled():
        os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    root = logging.getLogger()
    if not root.handlers:
        logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                            level=logging.DEBUG if debug_enabled() else logging.WARNING)
    if not debug_enabled():
        for name in ("inprocess", "nvidia_resiliency_ext", "torch.distributed", "torch.distributed.elastic"):
            logging.getLogger(name).setLevel(logging.CRITICAL)
