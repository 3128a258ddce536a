"""The kubelet's part, for tests: run a rendered pod's containers as local processes.

A :class:`LocalPod` takes a pod (template) exactly as rendered and starts its containers' command
and args with their environment, resolved as kubelet resolves it (``valueFrom.fieldRef`` from the
pod's metadata, ``configMapKeyRef`` from its ConfigMap, ``$(VAR)`` references in args), on this machine. A
process here cannot have the pod's mount namespace, so each volume's mount path is replaced by a local folder
wherever it appears (args, env, the ConfigMap's files; the FSx volume is one folder shared by all pods; a
Secret's keys are written as files with its volume's mode), and each DNS name in ``hosts`` by the address it
resolves to.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

from eksft_nb.engines.torchft.hold import HOLD_ENV

VAR_REF = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)")
FIELD_REF = re.compile(r"^metadata\.(annotations|labels)\['([^']+)'\]$")


@dataclass
class LocalPod:
    template: dict[str, Any]        # the pod template: {"metadata": ..., "spec": ...}
    name: str
    root: Path                      # holds the local stand-ins of the pod's volumes
    config: dict[str, str]          # the ConfigMap's data
    annotations: dict[str, str] = field(default_factory=dict)   # what controllers add (completion index...)
    hosts: dict[str, str] = field(default_factory=dict)         # DNS name -> address
    ip: str = "127.0.0.1"                                       # the pod's IP (status.podIP): this machine
    secrets: dict[str, dict[str, str]] = field(default_factory=dict)   # a Secret's name -> its stringData

    @cached_property
    def mounts(self) -> dict[str, Path]:
        """Mount path -> local folder, for the pod's volumes (memory-backed ones stay where they are).

        The ConfigMap is written out with the same mapping applied to its files, since the ranks
        read paths (a resume checkpoint, the script) from them."""
        volumes = {v["name"]: v for v in self.template["spec"].get("volumes", [])}
        spec = self.template["spec"]
        out: dict[str, Path] = {}
        config_folders = []
        for c in spec["containers"] + spec.get("initContainers", []):
            for m in c.get("volumeMounts", []):
                v = volumes[m["name"]]
                if "persistentVolumeClaim" in v:
                    out[m["mountPath"]] = self.root / "volumes" / v["persistentVolumeClaim"]["claimName"]
                elif "configMap" in v:
                    out[m["mountPath"]] = self.root / "pods" / self.name / m["name"]
                    config_folders.append(out[m["mountPath"]])
                elif "secret" in v:   # as the kubelet writes it: each key a file of the volume's mode
                    folder = out[m["mountPath"]] = self.root / "pods" / self.name / m["name"]
                    folder.mkdir(parents=True, exist_ok=True, mode=0o700)
                    for key, value in self.secrets[v["secret"]["secretName"]].items():
                        (folder / key).write_text(value)
                        (folder / key).chmod(v["secret"].get("defaultMode", 0o644))
        for folder in out.values():
            folder.mkdir(parents=True, exist_ok=True)
        for folder in config_folders:
            for key, text in self.config.items():
                (folder / key).write_text(self._map(text, out))
        return out

    def container(self, name: str) -> dict[str, Any]:
        spec = self.template["spec"]
        return next(c for c in spec["containers"] + spec.get("initContainers", []) if c["name"] == name)

    def env(self, container: str) -> dict[str, str]:
        meta = {**self.template.get("metadata", {})}
        meta["annotations"] = {**meta.get("annotations", {}), **self.annotations}
        env: dict[str, str] = {}
        for var in self.container(container).get("env", []):
            if "value" in var:
                env[var["name"]] = _expand(var["value"], env)
            elif "configMapKeyRef" in var["valueFrom"]:   # the pod's own ConfigMap, the only one it names
                env[var["name"]] = self.config[var["valueFrom"]["configMapKeyRef"]["key"]]
            else:
                path = var["valueFrom"]["fieldRef"]["fieldPath"]
                m = FIELD_REF.match(path)
                env[var["name"]] = {"metadata.name": self.name, "status.podIP": self.ip}.get(path) or (
                    meta.get(m.group(1), {}).get(m.group(2), "") if m else "")
        return {k: self._local(v) for k, v in env.items()}

    def argv(self, container: str) -> list[str]:
        c, env = self.container(container), self.env(container)
        return [self._local(_expand(a, env)) for a in c.get("command", []) + c.get("args", [])]

    def process_env(self, container: str) -> dict[str, str]:
        """The image's environment (this venv first on PATH) plus the container's; where the kubelet's
        termination-message file is for this container (``/dev/termination-log`` in a pod)."""
        base = {"PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
                "HOME": str(self.root), "LANG": os.environ.get("LANG", "C.UTF-8"),
                "EKSFT_TERMINATION_LOG": str(self.termination_log(container)),
                # the eksft-nb under test (and the NVRx the test chose: pods on one machine share an address,
                # which NVRx 0.7 allows only when told it is a simulation), and the test's holds on its ranks
                # (engines/torchft/hold.py)
                **{k: os.environ[k] for k in ("PYTHONPATH", "LD_LIBRARY_PATH",
                                              "NVRX_ENABLE_MULTI_LAUNCHERS_PER_NODE", HOLD_ENV)
                   if k in os.environ}}
        return {**base, **self.env(container)}

    def termination_log(self, container: str) -> Path:
        """The file this container's termination message is read from (the kubelet mounts one per
        container)."""
        folder = self.root / "pods" / self.name
        folder.mkdir(parents=True, exist_ok=True)
        return folder / f"{container}.termination-log"

    def run(self, container: str, argv: list[str] | None = None,
            **kw: Any) -> subprocess.CompletedProcess[str]:
        """Run the container's command (or ``argv``, like ``kubectl exec``) to completion."""
        return subprocess.run(self._argv(container, argv), env=self.process_env(container),
                              capture_output=True,
                              text=True, cwd=self.root, **kw)

    def start(self, container: str, log: Path) -> subprocess.Popen[bytes]:
        with open(log, "ab") as out:
            return subprocess.Popen(self._argv(container, None), env=self.process_env(container), stdout=out,
                                    stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=self.root,
                                    start_new_session=True)

    def to_pod_paths(self, text: str) -> str:
        """Local folders back to the mount paths, as a process in the pod would have printed them."""
        for mount, folder in self.mounts.items():
            text = text.replace(str(folder), mount)
        return text

    def _argv(self, container: str, argv: list[str] | None) -> list[str]:
        argv = self.argv(container) if argv is None else [self._local(a) for a in argv]
        return [sys.executable if argv[0] == "python" else argv[0], *argv[1:]]

    def _local(self, text: str) -> str:
        return self._map(text, self.mounts)

    def _map(self, text: str, mounts: dict[str, Path]) -> str:
        for mount, folder in sorted(mounts.items(), key=lambda kv: -len(kv[0])):
            text = re.sub(rf"(?<![\w/.]){re.escape(mount)}(?=/|\b|$)", str(folder), text)
        for host, address in self.hosts.items():
            text = text.replace(host, address)
        return text


def _expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion: defined variables are replaced, $$ escapes, the rest stays."""
    return VAR_REF.sub(lambda m: "$" if m.group(0) == "$$" else env.get(m.group(1), m.group(0)), text)
