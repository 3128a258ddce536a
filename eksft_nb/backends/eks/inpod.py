"""Commands that run inside a job's pods, with the pod's environment (``EKSFT_SPEC``, ``EKSFT_JOB_DIR``).

``python -m eksft_nb.backends.eks.inpod COMMAND``:

- ``prepare``: the init container. Creates the job folder on the shared volume (as a local job's
  folder) and queues the faults scheduled at launch; refuses a folder left by a different job of
  the same name, so checkpoints never mix.
- ``inject JSON``: queue a fault command (the control plane execs this).
- ``ckpts``: the job's checkpoints, as JSON.
- ``signal RANK SIGNAL``: signal a rank, if it runs in this pod (exit 3 if it does not).
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

from ...checkpoint_folders import list_checkpoints
from ...control import FaultCommand, submit
from ...errors import ControlError
from ...jobdir import JobDir, atomic_write
from ...spec import JobSpec
from . import names

NOT_HERE = 3


def _job() -> tuple[JobSpec, JobDir]:
    spec_path = Path(os.environ["EKSFT_SPEC"])
    return JobSpec.load(spec_path), JobDir(Path(os.environ["EKSFT_JOB_DIR"]))


def prepare() -> int:
    spec, jd = _job()
    if jd.spec_path.exists() and JobSpec.from_json(jd.spec_path.read_text()).digest() != spec.digest():
        print(f"eksft: error: {jd.path} holds a different job named {spec.name}: remove that folder from the volume, "
              "or launch with another --name", file=sys.stderr)
        return 1
    for folder in (jd.path, jd.logs, jd.pending, jd.fired, jd.progress, jd.ckpt_dir(spec)):
        folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    if not jd.spec_path.exists():
        atomic_write(jd.spec_path, spec.to_json())
    faults = Path(os.environ["EKSFT_SPEC"]).with_name(names.FAULTS)
    try:
        scheduled = json.loads(faults.read_text()) if faults.exists() else []
        if not isinstance(scheduled, list):
            raise ControlError(f"{faults} is not a list of fault commands", "launch the job again with eksft-nb")
        commands = [FaultCommand.from_dict(data).validate(spec.world_size, spec.nnodes) for data in scheduled]
    except (ValueError, ControlError) as e:
        print(f"eksft: error: the scheduled faults cannot be queued: {e}", file=sys.stderr)
        return 1
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


def ckpts() -> int:
    spec, jd = _job()
    print(json.dumps([i.to_dict() for i in list_checkpoints(jd.ckpt_dir(spec))]))
    return 0


def send_signal(rank: int, signame: str) -> int:
    """The rank's progress beacon names its pid; signal it only if that pid is the rank, here."""
    spec, jd = _job()
    try:
        pid = json.loads((jd.progress / f"rank-{rank}.json").read_text())["pid"]
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except (OSError, ValueError, KeyError):
        return NOT_HERE
    if f"RANK={rank}".encode() not in environ or f"EKSFT_JOB={spec.name}".encode() not in environ:
        return NOT_HERE
    name = signame.upper() if signame.upper().startswith("SIG") else f"SIG{signame.upper()}"
    if name not in signal.Signals.__members__:
        print(f"eksft: error: unknown signal {signame!r}: use e.g. SIGKILL, SIGTERM or SIGUSR1", file=sys.stderr)
        return 2
    os.kill(pid, signal.Signals[name])
    print(f"sent {name} to rank {rank} (pid {pid})")
    return 0


def main(argv: list[str]) -> int:
    commands = {"prepare": (0, prepare), "inject": (1, lambda: inject(argv[1])), "ckpts": (0, ckpts),
                "signal": (2, lambda: send_signal(int(argv[1]), argv[2]))}
    if not argv or argv[0] not in commands or len(argv) != 1 + commands[argv[0]][0] or \
            (argv[0] == "signal" and not argv[1].isdigit()):
        print("usage: python -m eksft_nb.backends.eks.inpod {prepare | inject JSON | ckpts | signal RANK SIGNAL}",
              file=sys.stderr)
        return 2
    return commands[argv[0]][1]()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
