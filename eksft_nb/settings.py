"""Live settings: the spec fields a running job takes without a restart, and their two records.

``python -m eksft_nb set NAME ckpt-every=25 keep-last=5`` writes the *request*,
``control/settings.json`` (the command channel the faults use), with a sequence number one above the
last. Rank 0 of the built-in trainer reads it at a step boundary and carries its values in the
all-reduce every rank makes there anyway, so every rank takes them at the same step
(:mod:`eksft_nb.runtime.live`). Rank 0 then writes the *effective* record, ``settings.json`` next to
``spec.json``, which ranks read when they start: the change holds across in-process, in-job and
job-level restarts, and ``resume`` starts the new job with it.

Both files are read as untrusted input: anything but a well-formed record of known settings within
range is refused with one line.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .control import read_command
from .fault_registry import integer
from .errors import ControlError, closest, shown
from .jobdir import JobDir, atomic_write
from .spec import JobSpec, spec_options

VERSION = 1
MAX_VALUE = 1_000_000  # the ranks agree in a float32 all-reduce: integers up to 2**24 are exact


@dataclass(frozen=True)
class Live:
    """A setting a running job takes: the spec field it overrides and its range."""

    path: str
    low: int
    help: str


LIVE: dict[str, Live] = {
    "ckpt-every": Live("checkpoint.every", 0, "save every N steps (0: never)"),
    "keep-last": Live("checkpoint.keep_last", 2, "committed checkpoints to keep (>= 2)"),
}

# why a spec field cannot change under a running job (the rest: the ranks read it once, at start)
FROZEN = {
    "world-size": "the ranks and their process groups are formed at launch",
    "nnodes": "the ranks and their process groups are formed at launch",
    "nproc-per-node": "the ranks and their process groups are formed at launch",
    "backend": "a job runs where it was launched",
    "ckpt-mode": "the async writer is set up (or not) when a rank starts",
    "ckpt-dir": "restarts resume from the folder the job started with",
    "steps": "the end of training is fixed at launch (resume with --steps to train further)",
}
KEY = re.compile(r"[a-z][a-z0-9.-]{0,40}")
VALUE = re.compile(r"[+-]?[0-9]{1,12}")
MAX_RECORD_KEYS = 8


def live_names() -> str:
    return ", ".join(LIVE)


def _key(raw: str) -> str:
    """``--ckpt-every``, ``ckpt_every`` and ``checkpoint.every`` all name ``ckpt-every``."""
    key = raw.strip().lower().removeprefix("--").replace("_", "-")
    for name, live in LIVE.items():
        if key == live.path.replace("_", "-"):
            return name
    return key


def check_name(raw: Any) -> str:
    """The live setting ``raw`` names, or one line: unknown, or why it cannot change while the job runs."""
    if not isinstance(raw, str) or KEY.fullmatch(_key(raw)) is None:
        raise ControlError(f"{shown(raw)} is not a setting name", f"use one of: {live_names()}")
    key = _key(raw)
    if key in LIVE:
        return key
    flags = {o.flag[2:]: o.path for o in spec_options()}
    paths = {o.path.replace("_", "-"): o.flag[2:] for o in spec_options()}
    frozen = key if key in flags or key in FROZEN else paths.get(key)
    if frozen is not None:
        why = FROZEN.get(frozen, "the ranks read it once, when they start")
        flag = f"--{frozen}" if frozen in flags else "--nnodes and --nproc-per-node"
        raise ControlError(
            f"{frozen} cannot change while the job runs ({why})",
            f"set one of {live_names()}, or launch a new job with {flag}",
        )
    raise ControlError(
        f"unknown setting {shown(raw)}", f"did you mean {closest(key, LIVE)}? Live: {live_names()}"
    )


def check_value(name: str, raw: Any) -> int:
    """``raw`` (an integer, or its text) as the value of live setting ``name``, within range."""
    live = LIVE[name]
    value = raw
    if isinstance(raw, str):
        value = int(raw.strip()) if VALUE.fullmatch(raw.strip()) else None
    fix = f"use an integer from {live.low} to {MAX_VALUE} ({live.help})"
    if not integer(value):
        raise ControlError(f"{name}={shown(raw)} is not an integer", fix)
    if not live.low <= value <= MAX_VALUE:   # said alike whether it came as text (CLI) or a number (REST)
        raise ControlError(f"{name}={value} is out of range", fix)
    return value


def check_values(values: Any) -> dict[str, int]:
    """A mapping of setting names to values (a request's, a record's), every one checked; at least one."""
    if not isinstance(values, Mapping) or not values:
        raise ControlError(
            f"settings {shown(values)} are not a non-empty object of name to value",
            "give e.g. ckpt-every=25 keep-last=5",
        )
    if len(values) > MAX_RECORD_KEYS:
        raise ControlError(
            f"{len(values)} settings in one change", f"change at most {len(LIVE)}: {live_names()}"
        )
    out: dict[str, int] = {}
    for raw, value in values.items():
        name = check_name(raw)
        if name in out:
            raise ControlError(f"{name} is given twice", "give each setting once")
        out[name] = check_value(name, value)
    return out


def parse_assignments(items: Sequence[str]) -> dict[str, int]:
    """``["ckpt-every=25", "keep-last=5"]`` (the CLI's and the magic's words) as checked values."""
    if not items:
        raise ControlError("no setting given", "give e.g. ckpt-every=25 keep-last=5")
    pairs: dict[str, str] = {}
    for item in items:
        key, eq, value = str(item).partition("=")
        if not eq or not key.strip():
            raise ControlError(f"{shown(item)} is not NAME=VALUE", "write e.g. ckpt-every=25")
        name = check_name(key)
        if name in pairs:
            raise ControlError(f"{name} is given twice", "give each setting once")
        pairs[name] = value
    return check_values(pairs)


def of_spec(spec: JobSpec) -> dict[str, int]:
    """The live settings as the spec sets them (what a job runs with until a change)."""
    c = spec.checkpoint
    return {"ckpt-every": c.every, "keep-last": c.keep_last}


def spec_changes(values: Mapping[str, int]) -> dict[str, int]:
    """Dotted spec fields for ``values``, for a job started anew with them (``resume``)."""
    return {LIVE[name].path: value for name, value in values.items()}


# ---- the records ------------------------------------------------------------------------------


def request_path(jd: JobDir) -> Path:
    return jd.pending.parent / "settings.json"


def effective_path(jd: JobDir) -> Path:
    return jd.path / "settings.json"


def read_record(path: Path) -> dict[str, Any] | None:
    """A request or effective record (None where there is none), checked; a bad one raises ControlError."""
    if not os.path.lexists(path):
        return None
    raw = read_command(path)
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError):
        raise ControlError(
            f"{path.name} is not valid JSON", "write settings with `python -m eksft_nb set`"
        ) from None
    if (
        not isinstance(data, dict)
        or data.get("v") != VERSION
        or not integer(data.get("seq"))
        or not 1 <= data["seq"] <= MAX_VALUE
    ):
        raise ControlError(
            f"{path.name} is not a version-{VERSION} settings record",
            "write settings with `python -m eksft_nb set`",
        )
    if "step" in data and not (integer(data["step"]) and data["step"] >= 0):
        raise ControlError(
            f"{path.name} step is {shown(data['step'])}", "it must be a step (an integer >= 0)"
        )
    return {"seq": data["seq"], "values": check_values(data.get("values")), "step": data.get("step")}


def in_force(jd: JobDir, spec: JobSpec) -> tuple[int, dict[str, int], int | None]:
    """(sequence number, values, the step they took effect at) of the effective record, else the spec's."""
    record = read_record(effective_path(jd))
    values = of_spec(spec)
    if record is None:
        return 0, values, None
    return record["seq"], {**values, **record["values"]}, record["step"]


def write_request(jd: JobDir, spec: JobSpec, changes: Mapping[str, int]) -> dict[str, Any]:
    """Queue ``changes`` (checked) for the running job in ``jd``: the request holds every live value,
    the ones in force (or asked for before and not yet taken) with ``changes`` over them, and a
    sequence number above every earlier one. Writers take the control folder's lock in turn.
    Returns seq (None: nothing to change, nothing written), the values before and after."""
    lock = os.open(jd.pending.parent / "settings.lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)
        seq, values, _ = in_force(jd, spec)
        asked = read_record(request_path(jd))
        if asked is not None and asked["seq"] > seq:
            seq, values = asked["seq"], {**values, **asked["values"]}
        after = {**values, **changes}
        if after == values:
            return {"seq": None, "before": values, "values": after}
        record = {"v": VERSION, "seq": seq + 1, "values": after, "t": time.time()}
        atomic_write(request_path(jd), json.dumps(record, sort_keys=True))
        return {"seq": seq + 1, "before": values, "values": after}
    finally:
        os.close(lock)


def write_effective(jd: JobDir, seq: int, values: Mapping[str, int], step: int) -> None:
    atomic_write(
        effective_path(jd),
        json.dumps(
            {"v": VERSION, "seq": seq, "values": dict(values), "step": step, "t": time.time()}, sort_keys=True
        ),
    )
