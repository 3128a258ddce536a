"""What the cluster a job goes to sets that eksft does not: Slurm's KillWait and the batch script's
``--signal`` lead, Kueue's waitForPodsReady. Read where it can be (``scontrol show config``), else the
scheduler's documented default, said as such: a pre-flight never guesses silently."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

# Slurm's defaults (slurm.conf(5)): SIGKILL this long after SIGTERM; preemption's GraceTime per partition
SLURM_KILL_WAIT_S = 30.0
SLURM_GRACE_TIME_S = 0.0
# Kueue's Configuration: waitForPodsReady is off unless enabled; enabled, its timeout defaults to 5 min
KUEUE_PODS_READY_S = 300.0
# torch's c10d rendezvous, as ft_launcher runs it (eksft passes no join_timeout)
RDZV_JOIN_S = 900.0
_CONF = re.compile(r"^\s*(\w+)\s*=\s*(.*?)\s*$")
_SIGNAL = re.compile(r"--signal=(?:[BR]+:)?(?:SIG)?(\w+)(?:@(\d+))?")


@dataclass(frozen=True)
class Fact:
    seconds: float | None
    source: str  # where the value comes from: "scontrol show config", "Slurm's default (...)"


def slurm_config(read: Any = None) -> dict[str, str] | None:
    """``scontrol show config`` as a dict, or None where no controller answers (not a Slurm host).
    ``read``: a stand-in for the command (tests)."""
    if read is None:
        from ..backends.slurm import cluster

        try:
            done = cluster.run(["scontrol", "show", "config"], "read the cluster's configuration")
        except cluster.SlurmError:
            return None
        if done.returncode != 0:
            return None
        text = done.stdout
    else:
        text = read()
    found = {}
    for line in text.splitlines()[:2000]:
        if m := _CONF.match(line):
            found[m.group(1)] = m.group(2)
    return found or None


def kill_wait(config: dict[str, str] | None) -> Fact:
    """Seconds from Slurm's SIGTERM to its SIGKILL of a job's processes (a cancel, the time limit)."""
    value = (config or {}).get("KillWait", "")
    m = re.match(r"(\d+)", value)
    if m:
        return Fact(float(m.group(1)), "scontrol show config")
    why = "no controller answered here" if config is None else "scontrol did not say"
    return Fact(SLURM_KILL_WAIT_S, f"Slurm's default ({why})")


def signal_lead(directives: list[str]) -> Fact:
    """The batch script's ``#SBATCH --signal=[B:]SIG[@SECONDS]``: how long before the time limit Slurm
    signals the job (60 s where no time is given); None where it asks for no signal."""
    for line in directives:
        if m := _SIGNAL.search(line):
            return Fact(float(m.group(2) or 60), "the batch script's --signal")
    return Fact(
        None,
        "the batch script asks for no --signal: the time limit's SIGTERM comes KillWait before its SIGKILL",
    )
