"""Whether a pod on an EFA node can use EFA: the libfabric EFA provider and NCCL's aws-ofi-nccl plugin.

Without either, NCCL does not fail: it falls back to TCP sockets, tens of times slower, and says so
only at INFO level. ``prepare`` runs :func:`problem` on every pod that asks for EFA devices
(``FI_PROVIDER=efa``) and fails the pod with one line when something is missing.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Mapping
from pathlib import Path

# where the EFA installer (and AWS's Deep Learning Containers) put libfabric and aws-ofi-nccl
EFA_HOME = Path("/opt/amazon/efa")
PLUGIN_DIRS = ("/opt/amazon/ofi-nccl/lib", "/opt/amazon/ofi-nccl/lib64", "/opt/aws-ofi-nccl/lib",
               "/usr/local/lib", "/usr/lib", "/usr/lib64", "/usr/lib/x86_64-linux-gnu",
               "/usr/lib/aarch64-linux-gnu")
LIB_DIRS = (str(EFA_HOME / "lib"), str(EFA_HOME / "lib64"), *PLUGIN_DIRS[3:])
FI_INFO_TIMEOUT_S = 30.0


def problem(env: Mapping[str, str] = os.environ) -> str | None:
    """What keeps NCCL off EFA in this container, in one line, or None when the provider answers and
    the plugin is installed."""
    path = os.pathsep.join(filter(None, (env.get("PATH", ""), str(EFA_HOME / "bin"))))
    fi_info = shutil.which("fi_info", path=path)
    if fi_info:
        try:
            done = subprocess.run([fi_info, "-p", "efa", "-t", "FI_EP_RDM"], capture_output=True, text=True,
                                  timeout=FI_INFO_TIMEOUT_S, env=dict(env))
        except (OSError, subprocess.TimeoutExpired) as e:
            return f"`fi_info -p efa` did not answer ({type(e).__name__})"
        if done.returncode != 0:
            said = (done.stderr or done.stdout).strip().splitlines()
            return ("libfabric has no usable EFA provider (`fi_info -p efa`: "
                    f"{said[-1][:200] if said else f'exit {done.returncode}'})")
    elif not _found(env, LIB_DIRS, "libfabric.so*"):
        return f"libfabric (the EFA provider) is not installed: no fi_info, no libfabric.so in {EFA_HOME}/lib"
    if not _found(env, PLUGIN_DIRS, "libnccl-net*.so*"):
        return "aws-ofi-nccl (libnccl-net*.so, NCCL's EFA plugin) is not installed: NCCL would use TCP"
    return None


def _found(env: Mapping[str, str], defaults: tuple[str, ...], pattern: str) -> bool:
    dirs = [d for d in env.get("LD_LIBRARY_PATH", "").split(os.pathsep) if d] + list(defaults)
    return any(next(Path(d).glob(pattern), None) is not None for d in dirs if Path(d).is_dir())
