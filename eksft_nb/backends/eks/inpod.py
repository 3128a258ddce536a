"""Commands that run inside a job's pods, with the pod's environment (``EKSFT_SPEC``, ``EKSFT_JOB_DIR``).

``python -m eksft_nb.backends.eks.inpod COMMAND``:

- ``prepare``: the init container. Creates the job folder on the shared volume (as a local job's
  folder) and queues the faults scheduled at launch; refuses a folder left by a different job of
  the same name, so checkpoints never mix, and, on an EFA pod, an image without the EFA provider or
  aws-ofi-nccl (see :mod:`.efa`), and an image whose NVRx, torch or GPUs cannot run the spec
  (:mod:`eksft_nb.preflight.doctor`). A refusal exits with ``failures.CONFIG_ERROR``, which fails the job.
- ``inject JSON``: queue a fault command (the control plane execs this).
- ``ckpts``: the job's checkpoints, as JSON.
- ``signal RANK SIGNAL``: signal a rank, if it runs in this pod (exit 3 if it does not).
- ``set JSON``: queue a live settings change for the ranks (``settings``: print the ones in force).
- ``launch ft_launcher ARGS...``: the trainer container's command when the spec keeps warm ranks
  (``ft.warm_ranks``): starts the pod's zygote (:mod:`eksft_nb.runtime.zygote`), then becomes
  ``ft_launcher ARGS...`` with the warm shim, as installed in this image, as its worker.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ...checkpoint_folders import list_checkpoints
from ...control import FaultCommand, submit
from ... import settings
from ...errors import ControlError, EksftError
from ...jobdir import JobDir, atomic_write
from ...launcher import ZYGOTE_MODULE, warm_worker, worker_index
from ...runtime.warm_shim import SOCKET_ENV, ZYGOTE_ENV
from ...spec import JobSpec
from ...preflight.doctor import refusal
from ...procs import start_ticks
from ...states import JobState
from ..inbox import queue_settings, settings_in_force
from . import efa, names
from .failures import CONFIG_ERROR

NOT_HERE = 3


def _job() -> tuple[JobSpec, JobDir]:
    spec_path = Path(os.environ["EKSFT_SPEC"])
    return JobSpec.load(spec_path), JobDir(Path(os.environ["EKSFT_JOB_DIR"]))


def prepare() -> int:
    spec, jd = _job()
    if os.environ.get("FI_PROVIDER") == "efa" and (missing := efa.problem()):
        print(f"eksft: error: this pod asks for EFA, but {missing}: use an image with the EFA installer and "
              "aws-ofi-nccl (see the README), or --efa-per-node 0", file=sys.stderr)
        return CONFIG_ERROR
    if (refused := refusal(spec)) is not None:   # this image's NVRx, torch, GPUs cannot run the spec
        print(f"eksft: error: {refused}", file=sys.stderr)
        return CONFIG_ERROR
    if jd.spec_path.exists() and JobSpec.from_json(jd.spec_path.read_text()).digest() != spec.digest():
        print(f"eksft: error: {jd.path} holds a different job named {spec.name}: remove that folder from "
              "the volume, "
              "or launch with another --name", file=sys.stderr)
        return CONFIG_ERROR
    for folder in (jd.path, jd.logs, jd.pending, jd.fired, jd.progress, jd.ckpt_dir(spec)):
        folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    if not jd.spec_path.exists():
        atomic_write(jd.spec_path, spec.to_json())
    faults = Path(os.environ["EKSFT_SPEC"]).with_name(names.FAULTS)
    try:
        scheduled = json.loads(faults.read_text()) if faults.exists() else []
        if not isinstance(scheduled, list):
            raise ControlError(f"{faults} is not a list of fault commands",
                               "launch the job again with eksft-nb")
        commands = [FaultCommand.from_dict(data).validate(spec.world_size, spec.nnodes) for data in scheduled]
    except (ValueError, ControlError) as e:
        print(f"eksft: error: the scheduled faults cannot be queued: {e}", file=sys.stderr)
        return CONFIG_ERROR
    for command in commands:
        if not (jd.fired / command.id).exists():  # replacement pods must not re-arm a fault that fired
            submit(jd.pending, command)
    print(f"job folder {jd.path} ready")
    return 0


def inject(text: str) -> int:
    """Queue a command after the same checks the ranks make (the control plane checked it too, but
    anyone who may exec into the pod can call this)."""
    spec, jd = _job()
    try:
        command = FaultCommand.from_json(text).validate(spec.world_size, spec.nnodes)
    except ControlError as e:
        print(f"eksft: error: {e}", file=sys.stderr)
        return 2
    print(submit(jd.pending, command))
    return 0


def set_settings(text: str) -> int:
    """Queue a live settings change (JSON: name -> value) for the job's ranks, after the checks the local
    and Slurm backends make (anyone who may exec into the pod can call this); print the request's record."""
    spec, jd = _job()
    try:
        changes = settings.check_values(json.loads(text))
        record = queue_settings(jd, JobState.RUNNING, changes)   # this pod runs: the job does
    except (ValueError, RecursionError):
        print("eksft: error: the settings are not valid JSON", file=sys.stderr)
        return 2
    except EksftError as e:
        print(f"eksft: error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(record))
    return 0


def settings_now() -> int:
    """Print the live settings in force (the spec's until a change) and the step they took effect at."""
    _, jd = _job()
    try:
        print(json.dumps(settings_in_force(jd)))
    except EksftError as e:
        print(f"eksft: error: {e}", file=sys.stderr)
        return 2
    return 0


def ckpts() -> int:
    spec, jd = _job()
    print(json.dumps([i.to_dict() for i in list_checkpoints(jd.ckpt_dir(spec))]))
    return 0


def send_signal(rank: int, signame: str) -> int:
    """The rank's progress beacon names its pid; signal it only if that pid is the rank, here: the
    beacon was written in this pod (its host) by the process that has that pid now (its start in
    clock ticks), which carries the job's name. (A rank forked by the pod's zygote shows the
    zygote's environment, without its RANK.)"""
    spec, jd = _job()
    try:
        record = json.loads((jd.progress / f"rank-{rank}.json").read_text())
        pid = record["pid"]
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except (OSError, ValueError, KeyError, TypeError):
        return NOT_HERE
    if (not isinstance(pid, int) or pid <= 0 or record.get("host") != socket.gethostname()
            or record.get("start_ticks") is None or record.get("start_ticks") != start_ticks(pid)
            or f"EKSFT_JOB={spec.name}".encode() not in environ):
        return NOT_HERE
    name = signame.upper() if signame.upper().startswith("SIG") else f"SIG{signame.upper()}"
    if name not in signal.Signals.__members__:
        print(f"eksft: error: unknown signal {signame!r}: use e.g. SIGKILL, SIGTERM or SIGUSR1",
              file=sys.stderr)
        return 2
    os.kill(pid, signal.Signals[name])
    print(f"sent {name} to rank {rank} (pid {pid})")
    return 0


def launch(argv: list[str]) -> int:
    """Start the pod's zygote, then exec the launch line ``argv`` with the warm shim as its worker.

    The container's main process stays ft_launcher (exec: the kubelet's SIGTERM reaches it, the pause
    container is PID 1 and reaps). The zygote inherits the container's environment, as the ranks do,
    so its start-up variables match theirs, and its stdout is the pod log. It dies with ft_launcher
    (the kernel's parent-death signal, kept across the exec), and a rank it forked dies with its shim
    (see :mod:`eksft_nb.runtime.warm_shim`), so nothing outlives the launcher to hold the pod.
    A replaced pod starts a new zygote: only the restarts inside a pod get warm ranks."""
    at = worker_index(argv)
    if at is None:
        print("eksft: error: `launch` takes a launch line (ft_launcher ... -m eksft_nb.runtime.MODULE ...): "
              "render the pod again with this eksft-nb", file=sys.stderr)
        return CONFIG_ERROR
    # a private folder (0700): no other user of the pod's node or network namespace can bind or reach it
    name = os.path.join(tempfile.mkdtemp(prefix="eksft-warm-"), "zygote.sock")
    launcher = os.getpid()

    def die_with_launcher() -> None:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)   # PR_SET_PDEATHSIG
        if os.getppid() != launcher:
            os._exit(1)

    zygote = subprocess.Popen([sys.executable, "-m", ZYGOTE_MODULE, name], stdin=subprocess.DEVNULL,
                              preexec_fn=die_with_launcher)
    _wait_listening(name, zygote)
    os.environ[SOCKET_ENV], os.environ[ZYGOTE_ENV] = name, str(zygote.pid)
    try:
        os.execvp(argv[0], [*argv[:at], *warm_worker(sys.executable), *argv[at:]])
    except OSError as e:   # the zygote dies with this process
        print(f"eksft: error: cannot run {argv[0]} ({e.strerror}): the image needs it on PATH",
              file=sys.stderr)
    return CONFIG_ERROR


def _wait_listening(name: str, zygote: subprocess.Popen, timeout: float = 30.0) -> None:
    """Until the zygote listens (the first thing it does, a fraction of a second: its socket appears
    at ``name`` once it listens), so that the first workers find it; one that cannot start leaves
    the ranks cold, as the shim then says."""
    deadline = time.monotonic() + timeout
    while zygote.poll() is None and time.monotonic() < deadline and not os.path.exists(name):
        time.sleep(0.01)


def main(argv: list[str]) -> int:
    if argv[:1] == ["launch"]:
        return launch(argv[1:])
    commands = {"prepare": (0, prepare), "inject": (1, lambda: inject(argv[1])), "ckpts": (0, ckpts),
                "signal": (2, lambda: send_signal(int(argv[1]), argv[2])),
                "set": (1, lambda: set_settings(argv[1])), "settings": (0, settings_now)}
    if not argv or argv[0] not in commands or len(argv) != 1 + commands[argv[0]][0] or \
            (argv[0] == "signal" and not argv[1].isdigit()):
        print("usage: python -m eksft_nb.backends.eks.inpod {prepare | inject JSON | ckpts | signal "
              "RANK SIGNAL | set JSON | settings | "
              "launch ft_launcher ARGS...}",
              file=sys.stderr)
        return 2
    return commands[argv[0]][1]()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
