"""What ``--engine torchft`` takes: the command layer refuses the rest in one line, before anything starts."""

from __future__ import annotations

import functools
import importlib.util
import subprocess
import sys

from ...errors import ControlError, SpecError
from ...spec import JobSpec
from . import lighthouse, netns

# the faults a torchft job fires: a rank killed (its group restarts and heals from a peer), a whole
# replica group lost (kill-launcher on node N: group N's process group), a hang (the supervisor finds it,
# ends the group and restarts it), an exception inside backward (the step is thrown away), a straggler
FAULTS = ("sigkill", "kill-launcher", "hang", "exception", "slow-rank")
# in a user's script: the ones its runner fires and the tests prove there (exception: reported to the
# Manager before its next commit decision)
SCRIPT_FAULTS = ("sigkill", "exception", "slow-rank")


def check(spec: JobSpec, launching: bool = False) -> None:
    """Raise :class:`SpecError` when ``spec`` does not apply to the torchft engine (the faults it fires:
    :class:`.engine.TorchftEngine`); ``launching`` locally: also when this machine cannot keep the job's
    Lighthouse private (see :func:`private`; a Slurm node's Lighthouse says so when it starts, and the job
    ends with that line)."""
    if importlib.util.find_spec("torchft") is None:
        raise SpecError(
            "--engine torchft needs torchft, which is not installed here",
            "pip install 'torchft>=0.2.0,<0.3' (wheels for Linux x86_64), or use --engine nvrx",
        )
    if launching and spec.backend == "local" and (why := private()) is not None:
        raise SpecError(f"--engine torchft on the {spec.backend} backend runs its Lighthouse on a network of "
                        f"its own (torchft's accepts any peer that reaches it), and {why}", netns.FIX)
    if spec.script and spec.backend != "local":
        raise SpecError(
            f"--engine torchft runs a --script on the local backend so far, not {spec.backend}",
            "use --backend local for the script, or the built-in trainer on a cluster",
        )
    if spec.nnodes < 2:
        raise SpecError(
            f"--engine torchft needs 2 or more replica groups (--nnodes), got {spec.nnodes}: a lost "
            "group heals from a peer",
            "use e.g. --nnodes 2",
        )
    if spec.nproc_per_node != 1 and (spec.script or spec.backend != "local"):
        # HSDP (N ranks per group, FSDP inside it) runs the built-in trainer on the local backend: a
        # cluster's group is one process in its pod or step, a script's group one process under the probe
        where = "a --script" if spec.script else f"the {spec.backend} backend"
        raise SpecError(
            f"--engine torchft runs 1 rank per replica group on {where} so far, got --nproc-per-node "
            f"{spec.nproc_per_node} (HSDP runs the built-in trainer on the local backend)",
            "use --nproc-per-node 1 (and --nnodes for more groups), or the built-in trainer locally",
        )
    if spec.spare_nodes:
        raise SpecError(
            "--spare-nodes is NVRx's (hot spares in its rendezvous); torchft has none",
            "drop --spare-nodes, or use --engine nvrx",
        )
    ft = spec.ft
    for flag, value in (
        ("--step-timeout", ft.step_timeout),
        ("--section-timeouts", ft.section_timeouts),
        ("--setup-timeout", ft.setup_timeout),
        ("--out-of-section-timeout", ft.out_of_section_timeout),
        ("--ft-cfg-path", ft.cfg_path),
        ("--soft-timeout", ft.soft_timeout),
        ("--hard-timeout", ft.hard_timeout),
    ):
        if value is not None:
            raise SpecError(
                f"{flag} is an NVRx setting (in-process restart, ft_launcher's sections); "
                "torchft does not use it",
                f"drop {flag}, or use --engine nvrx",
            )


@functools.lru_cache(maxsize=1)
def private() -> str | None:
    """Why this machine cannot make the Lighthouse's private network namespace (None: it can): asked of a
    short-lived process (:mod:`.netns`), as the Lighthouse's own launcher does it."""
    try:
        done = subprocess.run([sys.executable, "-I", "-S", str(lighthouse.NETNS), "--probe"],
                              capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"the probe for it failed ({e})"
    return None if done.returncode == 0 else (done.stderr.strip().split(": ")[0] or "it cannot be made here")


def check_settings(spec: JobSpec) -> None:
    """Refuse live settings: the replica groups read the checkpoint settings once, when they start (they
    agree on nothing else at a step, as NVRx's ranks do in their all-reduce)."""
    raise ControlError(
        f"{spec.name} runs --engine torchft, whose replica groups take no live settings (they read "
        "--ckpt-every and --keep-last once, when they start)",
        "launch the job with the settings you want (run it again with --ckpt-every N --keep-last K)")
