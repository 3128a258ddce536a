"""Commands that run inside a job's pods, with the pod's environment (``EKSFT_SPEC``, ``EKSFT_JOB_DIR``).

``python -m eksft_nb.backends.eks.inpod COMMAND``:

- ``prepare``: the init container. Creates the job folder on the shared volume (as a local job's
  folder) and queues the faults scheduled at launch; refuses a folder left by a different job of
  the same name, so checkpoints never mix, and, on an EFA pod, an image without the EFA provider or
  aws-ofi-nccl (see :mod:`.efa`), and an image whose NVRx, torch or GPUs cannot run the spec as rendered
  (:mod:`eksft_nb.preflight.doctor`; hot spares are NVRx 0.6+'s standby nodes: ``NVRx.cannot_run``). A
  refusal exits with ``failures.CONFIG_ERROR``, which fails the job.
- ``inject JSON``: queue a fault command (the control plane execs this).
- ``ckpts``: the job's checkpoints, as JSON.
- ``signal RANK SIGNAL``: signal a rank, if it runs in this pod (exit 3 if it does not).
- ``set JSON``: queue a live settings change for the ranks (``settings``: print the ones in force).
- ``launch ft_launcher ARGS...``: the trainer container's command: starts the pod's zygote when the spec
  keeps warm ranks (the warm shim, as installed in this image, is then ft_launcher's worker), runs
  ft_launcher with the flags only this image's NVRx takes (its cycle records into the job folder) and
  ends as the pod's ranks did, a drain included (see :mod:`.pod_entry`).

A refusal is also the container's termination message, which ``status`` shows.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
from pathlib import Path

from ...checkpoint_folders import list_checkpoints
from ...control import FaultCommand, submit
from ... import settings
from ...errors import ControlError, EksftError
from ...jobdir import JobDir, atomic_write
from ...spec import JobSpec
from ...preflight.doctor import refusal
from ...procs import start_ticks
from ...states import JobState
from ..inbox import queue_settings, settings_in_force
from . import efa, names, pod_entry
from .failures import CONFIG_ERROR

NOT_HERE = 3


def _job() -> tuple[JobSpec, JobDir]:
    spec_path = Path(os.environ["EKSFT_SPEC"])
    return JobSpec.load(spec_path), JobDir(Path(os.environ["EKSFT_JOB_DIR"]))


def refuse(problem: str) -> int:
    """A configuration error: one line on stderr and as the container's termination message."""
    print(f"eksft: error: {problem}", file=sys.stderr)
    pod_entry.termination_message(problem)
    return CONFIG_ERROR


def unwritable(path: Path, error: OSError) -> str:
    """Why this pod cannot write the job folder, with the fix: the shared volume's owner and mode (a root
    squashed to nobody, a volume root only root may write, a folder an earlier job left as another user)."""
    me = f"uid {os.getuid()} gid {os.getgid()}"
    where = next((p for p in (path, *path.parents) if p.exists()), path)
    try:
        st = where.stat()
        owner = f"{where} belongs to uid {st.st_uid} gid {st.st_gid}, mode {st.st_mode & 0o7777:o}"
    except OSError:
        owner = f"{where} cannot be read"
    return (f"this pod ({me}) cannot write the job folder ({error.strerror or error}: {path}); {owner}: "
            "let the pods' user write the shared volume (e.g. once, from a root pod: chown -R "
            f"{os.getuid()}:{os.getgid()} {names.CKPT_MOUNT}), or launch with --run-as-user matching its "
            "owner")


def prepare() -> int:
    spec, jd = _job()
    if os.environ.get("FI_PROVIDER") == "efa" and (missing := efa.problem()):
        return refuse(f"this pod asks for EFA, but {missing}: use an image with the EFA installer and "
                      "aws-ofi-nccl (see the README), or --efa-per-node 0")
    if (refused := refusal(spec)) is not None:   # this image's NVRx, torch, GPUs cannot run the spec
        return refuse(refused)
    try:
        other = jd.spec_path.exists() and \
            JobSpec.from_json(jd.spec_path.read_text()).digest() != spec.digest()
    except (OSError, ValueError, EksftError) as e:
        return refuse(f"{jd.spec_path} cannot be read ({e}): remove that folder from the volume, or launch "
                      "with another --name")
    if other:
        return refuse(f"{jd.path} holds a different job named {spec.name}: remove that folder from the "
                      "volume, or launch with another --name")
    try:
        for folder in (jd.path, jd.logs, jd.pending, jd.fired, jd.progress, jd.ckpt_dir(spec)):
            folder.mkdir(parents=True, exist_ok=True, mode=0o700)
        if not jd.spec_path.exists():
            atomic_write(jd.spec_path, spec.to_json())
    except OSError as e:
        return refuse(unwritable(Path(e.filename or jd.path), e))
    faults = Path(os.environ["EKSFT_SPEC"]).with_name(names.FAULTS)
    try:
        scheduled = json.loads(faults.read_text()) if faults.exists() else []
        if not isinstance(scheduled, list):
            raise ControlError(f"{faults} is not a list of fault commands",
                               "launch the job again with eksft-nb")
        commands = [FaultCommand.from_dict(data).validate(spec.world_size, spec.nnodes) for data in scheduled]
    except (ValueError, ControlError) as e:
        return refuse(f"the scheduled faults cannot be queued: {e}")
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


def main(argv: list[str]) -> int:
    if argv[:1] == ["launch"]:
        return pod_entry.launch(argv[1:])
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
