"""A stand-in for ``eksft_nb.commands`` (issue 8 contract §2) until that module lands: the same
signatures over the Job API. Replaced by ``from .. import commands as ops`` once merged."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..backends import get_backend
from ..cli import injected
from ..control import FaultCommand, parse_fault
from ..goodput import compute
from ..job import Job, attach
from ..job import launch as _launch
from ..spec import JobSpec

ENDED = frozenset({"succeeded", "failed", "stopped", "lost"})


def job_row(job: Job) -> dict[str, Any]:
    mon = job.refresh()
    state = job.state
    spec = job.spec
    committed = mon.last_committed
    return {"name": job.name, "backend": job.backend.name, "state": state, "step": mon.max_step,
            "total_steps": None if spec.script else (mon.total_steps or spec.steps),
            "restarts": mon.restarts_by_level(), "goodput": compute(mon).goodput if mon.t_start else None,
            "last_checkpoint": committed.step if committed else None, "script": spec.script,
            "ended": state in ENDED, "detail": mon.reason}


def list_jobs(backend: str = "local") -> list[dict[str, Any]]:
    return [job_row(attach(j.name, backend)) for j in get_backend(backend).jobs()]


def status(name: str, backend: str = "local") -> dict[str, Any]:
    return job_row(attach(name, backend))


def launch(spec: JobSpec, faults: Sequence[str | FaultCommand] = ()) -> dict[str, Any]:
    return job_row(_launch(spec, [parse_fault(f) if isinstance(f, str) else f for f in faults]))


def inject(name: str, fault: str, *, rank: int | None = None, step: int | None = None, after: float | None = None,
           node: int = 0, params: dict[str, Any] | None = None, backend: str = "local",
           wait: float = 0.0) -> dict[str, Any]:
    job = attach(name, backend)
    cmd = job.inject(fault, rank=rank, step=step, node=node, after=after, **(params or {}))
    fired = job.fired(cmd, timeout=wait)
    return {"id": cmd.id, "job": name, "fault": cmd.fault,
            "target": f"rank {cmd.rank}" if cmd.rank is not None else f"node {cmd.node}",
            "when": cmd.when, "fired": fired is not None, "step": fired["step"] if fired else None,
            "message": injected(job, cmd)}


def stop(name: str, backend: str = "local") -> dict[str, Any]:
    job = attach(name, backend)
    job.stop()
    return job_row(job)


def checkpoints(name: str, backend: str = "local") -> list[dict[str, Any]]:
    return [c.to_dict() for c in attach(name, backend).checkpoints()]


def resume(name: str, *, step: int | None = None, new_name: str | None = None, steps: int | None = None,
           backend: str = "local") -> dict[str, Any]:
    changes = {"steps": steps} if steps else {}
    return job_row(attach(name, backend).resume(step=step, name=new_name, **changes))


def summary(name: str, backend: str = "local") -> dict[str, Any]:
    return attach(name, backend).summary()


def logs(name: str, lines: int = 200, debug: bool = False, backend: str = "local") -> str:
    return attach(name, backend).logs(lines, debug)
