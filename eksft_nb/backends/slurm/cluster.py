"""The Slurm commands the backend runs (sbatch, scontrol, squeue, sacct, scancel), with typed errors.

Everything they print is untrusted input: a job id must be digits, a record is parsed field by field.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from dataclasses import dataclass

from ...errors import JobError
from ...states import JobState

TIMEOUT_S = 30.0
_FIELD = re.compile(r"(\w+)=(\S*)")

# Slurm's job states (scontrol/squeue/sacct) -> ours
_STATES = {
    "PENDING": JobState.STARTING, "CONFIGURING": JobState.STARTING, "REQUEUED": JobState.STARTING,
    "REQUEUE_HOLD": JobState.STARTING, "REQUEUE_FED": JobState.STARTING, "RESV_DEL_HOLD": JobState.STARTING,
    "SUSPENDED": JobState.STARTING, "RUNNING": JobState.RUNNING, "COMPLETING": JobState.RUNNING,
    "STAGE_OUT": JobState.RUNNING, "SIGNALING": JobState.RUNNING, "RESIZING": JobState.RUNNING,
    "COMPLETED": JobState.SUCCEEDED, "CANCELLED": JobState.STOPPED,
}


class SlurmError(JobError):
    """A Slurm command failed or printed what it should not."""


@dataclass(frozen=True)
class SlurmJob:
    """What ``scontrol show job`` (or ``sacct``) says of one job."""

    job_id: str
    slurm_state: str        # e.g. PENDING, RUNNING, CANCELLED
    reason: str             # e.g. Resources, Priority, None
    partition: str
    nodes: str              # the allocation's node list, e.g. n[1-2]
    restarts: int           # times it was requeued
    excluded: str = ""      # the nodes it may not run on (ExcNodeList), e.g. n3

    @property
    def state(self) -> JobState:
        return _STATES.get(self.slurm_state, JobState.FAILED)


def run(argv: list[str], what: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    """Run one Slurm command; a missing command or a timeout is a :class:`SlurmError`."""
    if shutil.which(argv[0]) is None:
        raise SlurmError(f"{argv[0]} is not on PATH, so this machine cannot {what}",
                         "run eksft-nb on a Slurm login node (or install the Slurm client and its "
                         "slurm.conf)")
    try:
        return subprocess.run(argv, input=stdin, capture_output=True, text=True, timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise SlurmError(f"{argv[0]} did not answer within {TIMEOUT_S:g}s (to {what})",
                         "check that slurmctld runs: `scontrol ping`") from None


def sbatch(script: str, cwd: str) -> str:
    """Submit ``script``; the new job's id."""
    done = subprocess_checked(["sbatch", "--parsable", f"--chdir={cwd}"], "submit the job", stdin=script)
    job_id = done.stdout.strip().split(";")[0]
    if not job_id.isdigit():
        raise SlurmError(f"sbatch printed {done.stdout.strip()[:80]!r} instead of a job id",
                         "check the Slurm version")
    return job_id


def subprocess_checked(argv: list[str], what: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    done = run(argv, what, stdin)
    if done.returncode != 0:
        raise SlurmError(f"{argv[0]} failed to {what}: {(done.stderr or done.stdout).strip()[-300:]}",
                         "fix what Slurm says (the partition, account or QOS may not exist)")
    return done


def show_job(job_id: str) -> SlurmJob | None:
    """The controller's record of a job; None once it has forgotten it (after MinJobAge), then
    ``sacct``'s, where the cluster keeps accounting."""
    done = run(["scontrol", "show", "job", "-o", job_id], "read the job's state")
    if done.returncode == 0 and done.stdout.strip():
        f = dict(_FIELD.findall(done.stdout.splitlines()[0]))
        if f.get("JobId") == job_id:
            return SlurmJob(job_id, f.get("JobState", ""), f.get("Reason", ""), f.get("Partition", ""),
                            f.get("NodeList", ""), _int(f.get("Restarts", "0")),
                            "" if f.get("ExcNodeList") in (None, "(null)") else f["ExcNodeList"])
    if shutil.which("sacct") is None:
        return None
    done = run(["sacct", "-n", "-P", "-X", "-j", job_id, "-o", "JobID,State,Partition,NodeList"],
               "read its history")
    for line in done.stdout.splitlines() if done.returncode == 0 else []:
        parts = line.split("|")
        if len(parts) == 4 and parts[0] == job_id:
            return SlurmJob(job_id, parts[1].split()[0] if parts[1] else "", "", parts[2], parts[3], 0)
    return None


def scancel(job_id: str) -> None:
    subprocess_checked(["scancel", job_id], f"cancel job {job_id}")


def requeue(job_id: str) -> None:
    subprocess_checked(["scontrol", "requeue", job_id], f"requeue job {job_id}")


def exclude(job_id: str, nodes: list[str]) -> None:
    """Keep a requeued (pending) job off ``nodes`` (Slurm takes the change only while it is pending)."""
    subprocess_checked(["scontrol", "update", f"JobId={job_id}", f"ExcNodeList={','.join(nodes)}"],
                       f"keep job {job_id} off {','.join(nodes)}")


def signal_steps(job_id: str, signame: str) -> None:
    """Send ``signame`` to every process of the job's steps (not its batch shell), as a preemption's grace
    period or ``scancel --signal`` does."""
    subprocess_checked(["scancel", f"--signal={signame}", job_id], f"signal job {job_id}'s steps")


def config() -> dict[str, str]:
    """The cluster's configuration (``scontrol show config``: ``KillWait = 30 sec``), values as written."""
    done = run(["scontrol", "show", "config"], "read the cluster's configuration")
    return dict(re.findall(r"^(\w+)\s*=\s*(.*?)\s*$", done.stdout if done.returncode == 0 else "", re.M))


def seconds(value: str | None) -> int | None:
    """``"30 sec"`` (or ``"30"``) as 30; None for anything else."""
    m = re.fullmatch(r"(\d+)(?: sec)?", (value or "").strip())
    return int(m.group(1)) if m else None


def partition(name: str) -> dict[str, str]:
    """``scontrol show partition NAME``'s fields ({} when it cannot say)."""
    done = run(["scontrol", "show", "partition", name, "-o"], f"read partition {name}")
    return dict(_FIELD.findall(done.stdout)) if done.returncode == 0 else {}


def lost_nodes(nodelist: str) -> list[str]:
    """The nodes of ``nodelist`` that Slurm holds lost (down, failed, not responding): a node failure, which
    neither a user's ``scancel`` nor a drain makes."""
    if not nodelist or nodelist == "(null)":
        return []
    done = run(["scontrol", "show", "node", "-o", nodelist], "read the nodes' states")
    lost = []
    for line in done.stdout.splitlines() if done.returncode == 0 else []:
        f = dict(_FIELD.findall(line))
        if set(re.split(r"[+*]", f.get("State", ""))) & {"DOWN", "FAIL", "FAILING", "NOT_RESPONDING"}:
            lost.append(f.get("NodeName", ""))
    return lost


def hostnames(nodelist: str) -> list[str]:
    """A node list (``n[1-3]``) as names."""
    done = run(["scontrol", "show", "hostnames", nodelist], "expand a node list")
    return done.stdout.split() if done.returncode == 0 else []


def _int(text: str) -> int:
    return int(text) if text.isdigit() else 0
