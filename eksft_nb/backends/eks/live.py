"""Live settings of an EKS job: the change goes, as a fault does, through ``kubectl exec`` into one of its
running pods, where the in-pod ``set`` queues it in the job folder on the shared volume for the ranks
(:mod:`eksft_nb.settings`: rank 0 proposes it in the step's all-reduce, every rank takes it at one step, the
record on the volume makes it hold across restarts); ``settings`` reads the ones in force there, or, once the
pods are gone, from the job's events."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ...errors import ControlError, JobError
from ...jobdir import JobDir
from ...monitor import JobMonitor
from ...settings import of_spec
from ...states import ACTIVE, ENDED
from ..inbox import settings_in_force
from . import names
from .render import INPOD


def set_settings(backend: Any, name: str, changes: Mapping[str, int]) -> dict[str, Any]:
    """Queue checked ``changes`` for the running job ``name``; the request's record (seq, before, values)."""
    cluster, spec, _ = backend._job(name)
    if spec.script:
        raise ControlError(f"job {spec.name!r} runs a script: its own loop decides when it saves",
                           "live settings go to the built-in trainer; change the script's own interval")
    state = backend.state(name).state
    if state not in ACTIVE:
        how = "has already ended" if state in ENDED else "is not running"
        raise JobError(f"job {spec.name!r} {how} ({state}): live settings only go to a running job",
                       "resume it (it starts with the settings in force when it stopped) or launch anew")
    pod = backend._running_pods(cluster, spec, "change its live settings")[0]
    return _answer(pod, *cluster.exec(pod, names.container(spec), INPOD + ["set", json.dumps(dict(changes))]))


def settings(backend: Any, name: str) -> dict[str, Any]:
    """The live settings in force (the spec's until a change): from the job folder where this machine mounts
    the volume, else read in a running pod, else (the pods gone: a job to resume) the change its ranks last
    reported taking, from its events."""
    cluster, spec, _ = backend._job(name)
    folder = Path(backend.mount, spec.name) if backend.mount else None
    if folder is not None and (folder / "spec.json").is_file():
        return settings_in_force(JobDir(folder))
    try:
        pod = backend._running_pods(cluster, spec, "read its live settings")[0]
    except JobError:
        mon = JobMonitor()
        mon.update(backend.events(name).read())
        if not mon.settings:
            return {"seq": 0, "values": of_spec(spec), "step": None}
        last = mon.settings[max(mon.settings)]
        return {"seq": last["seq"], "values": {**of_spec(spec), **last["values"]}, "step": last["step"]}
    return _answer(pod, *cluster.exec(pod, names.container(spec), INPOD + ["settings"]))


def _answer(pod: str, code: int, out: str) -> dict[str, Any]:
    """The in-pod command's JSON line, or its one-line refusal as the error it is."""
    lines = out.strip().splitlines()
    said = next((line.split("eksft: error: ", 1)[1] for line in lines if "eksft: error: " in line), "")
    if code == 2 and said:
        problem, _, fix = said.partition(": ")
        raise ControlError(problem, fix)
    try:
        record = json.loads(lines[-1]) if code == 0 and lines else None
    except ValueError:
        record = None
    if not isinstance(record, dict):
        raise JobError(f"the live settings command in pod {pod} failed: {out.strip()[-300:]}",
                       "check that the image has the same eksft-nb version")
    return record
