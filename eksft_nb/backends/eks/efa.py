"""Whether a pod on an EFA node can use EFA: the libfabric EFA provider and NCCL's aws-ofi-nccl plugin.

Without either, NCCL does not fail: it falls back to TCP sockets, tens of times slower, and says so
only at INFO level. ``prepare`` runs :func:`problem` on every pod that asks for EFA devices
(``FI_PROVIDER=efa``) and fails the pod with one line when something is missing. A plugin file is not
a plugin NCCL loads, so the trainer container (where the GPU libraries are) then asks what NCCL would
load, as NCCL looks for it (:func:`nccl_plugin`, in a child process: ``python -m
eksft_nb.backends.eks.efa``): a loader error fails the pod in one line too, and an image whose
aws-ofi-nccl installs only ``libnccl-net-ofi.so`` gets ``NCCL_NET_PLUGIN=ofi`` rather than TCP.
"""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import subprocess
import sys
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


PLUGIN_SYMBOLS = tuple(f"ncclNetPlugin_v{n}" for n in range(12, 1, -1))   # what NCCL looks for, newest first


def _loads(name: str) -> str | None:
    """None if ``name`` loads as the dynamic loader finds it (as NCCL dlopens it) and exports an NCCL net
    plugin; else why not."""
    try:
        lib = ctypes.CDLL(name, mode=os.RTLD_LAZY | os.RTLD_LOCAL)
    except OSError as e:
        return str(e)
    for symbol in PLUGIN_SYMBOLS:
        try:
            ctypes.c_void_p.in_dll(lib, symbol)
            return None
        except ValueError:
            continue
    return f"{name} exports no {PLUGIN_SYMBOLS[-1][:-1]}N: it is not an NCCL net plugin"


def nccl_plugin(env: Mapping[str, str] = os.environ) -> tuple[dict[str, str], str | None]:
    """What NCCL would load as its network plugin in this process's environment: ``NCCL_NET_PLUGIN``'s
    ``libnccl-net-NAME.so`` (or NAME itself), else ``libnccl-net.so``. Returns the environment to add
    (``NCCL_NET_PLUGIN=ofi`` where only aws-ofi-nccl's own name loads) and the problem, if none loads."""
    chosen = env.get("NCCL_NET_PLUGIN")
    if chosen and chosen.lower() == "none":
        return {}, "NCCL_NET_PLUGIN=none: NCCL loads no network plugin and would use TCP sockets"
    names = [f"libnccl-net-{chosen}.so", chosen] if chosen else ["libnccl-net.so"]
    why = [w for n in names if (w := _loads(n)) is not None]
    if len(why) < len(names):
        return {}, None
    if not chosen and _loads("libnccl-net-ofi.so") is None:
        return {"NCCL_NET_PLUGIN": "ofi"}, None
    return {}, (f"NCCL would load no network plugin ({why[0][:200]}): put aws-ofi-nccl's lib folder on the "
                "image's LD_LIBRARY_PATH (or ld.so.conf)")


def check_in_child(env: Mapping[str, str]) -> tuple[dict[str, str], str | None]:
    """:func:`nccl_plugin` in a child process (a library's constructor runs there, not here)."""
    try:
        done = subprocess.run([sys.executable, "-m", __name__], capture_output=True, text=True, env=dict(env),
                              timeout=FI_INFO_TIMEOUT_S)
        fix, problem = json.loads(done.stdout.strip().splitlines()[-1])
    except (OSError, subprocess.TimeoutExpired, ValueError, IndexError) as e:
        return {}, f"the NCCL plugin check did not answer ({type(e).__name__})"
    return fix, problem


if __name__ == "__main__":
    print(json.dumps(nccl_plugin()))
