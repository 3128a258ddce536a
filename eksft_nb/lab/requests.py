"""What a request to ``/eksft/`` may carry, checked before anything runs.

A body is untrusted JSON: it is read into exactly the arguments the command layer takes, or refused
with one :class:`~eksft_nb.errors.EksftError` line. Field values go through the validators the CLI
uses (the fault command's, the spec's), so a bad value gets the CLI's message.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from typing import Any

from .. import commands
from ..control import FaultCommand
from ..fault_registry import integer
from ..errors import ControlError, shown
from ..spec import JobSpec

MAX_BODY = 64 * 1024      # bytes: a spec and a few faults fit many times over
MAX_FAULTS = 64
MAX_LOG_LINES = 100_000
MAX_REMOVALS = 1000       # jobs in one rm of many (the panel's "clear finished")

Check = tuple[Callable[[Any], bool], str]


def _optional(check: Callable[[Any], bool]) -> Callable[[Any], bool]:
    return lambda v: v is None or check(v)


_BACKEND: Check = (lambda v: isinstance(v, str), '"local" or "eks"')
_ANY: Check = (lambda v: True, "")    # checked by the command's own validator

# route -> field -> check; every field a route takes, and nothing else
INJECT: dict[str, Check] = {"fault": _ANY, "rank": _ANY, "step": _ANY, "after": _ANY, "node": _ANY,
                            "delay": _ANY,
                            "duration": _ANY, "backend": _BACKEND}
STOP: dict[str, Check] = {"backend": _BACKEND}
RESUME: dict[str, Check] = {
    "step": (_optional(integer), "a committed checkpoint's step (an integer), or null for the newest"),
    "as": (_optional(lambda v: isinstance(v, str)), "the new job's name (a string), or null"),
    "steps": (_optional(integer), "an integer (steps in total), or null"),
    "backend": _BACKEND}
SETTINGS: dict[str, Check] = {
    "values": (lambda v: isinstance(v, dict), 'an object of live settings, e.g. {"ckpt-every": 25}'),
    "whatif": (lambda v: isinstance(v, bool), "true to apply the what-if's recommended interval"),
    "backend": _BACKEND}
REMOVE: dict[str, Check] = {
    "jobs": (lambda v: isinstance(v, list) and len(v) <= MAX_REMOVALS
             and all(isinstance(j, dict) and set(j) <= {"name", "backend"} and isinstance(j.get("name"), str)
                     and isinstance(j.get("backend", "local"), str) for j in v),
             f'a list of at most {MAX_REMOVALS} jobs like {{"name": "a", "backend": "local"}}')}
LAUNCH: dict[str, Check] = {
    "spec": (lambda v: isinstance(v, dict),
             'an object of spec fields, e.g. {"steps": 80, "model.preset": "tiny"}'),
    "faults": (lambda v: isinstance(v, list) and len(v) <= MAX_FAULTS and all(isinstance(f, str) for f in v),
               f'a list of at most {MAX_FAULTS} faults like "sigkill:1@30"')}


# POST /eksft/check: the launch form's spec, pre-flighted before it is launched
CHECK: dict[str, Check] = {"spec": LAUNCH["spec"],
                           "from": (_optional(lambda v: isinstance(v, str)),
                                    "the name of a job whose measured step and save times to use, or null"),
                           "backend": _BACKEND}


def body(raw: bytes, shape: Mapping[str, Check]) -> dict[str, Any]:
    """The request body as a dict holding only fields of ``shape``, each passing its check."""
    example = "{" + ", ".join(f'"{k}": ...' for k in list(shape)[:2]) + "}"
    if len(raw) > MAX_BODY:
        raise ControlError(f"the request body is {len(raw)} bytes", f"send at most {MAX_BODY} bytes")
    try:
        data = json.loads(raw) if raw.strip() else {}
    except (ValueError, RecursionError):
        raise ControlError("the request body is not valid JSON",
                           f"send one JSON object, e.g. {example}") from None
    if not isinstance(data, dict):
        raise ControlError(f"the request body must be a JSON object, got {type(data).__name__}",
                           f"send e.g. {example}")
    unknown = sorted(set(data) - set(shape))
    if unknown:
        raise ControlError(f"unknown field(s) in the request: {shown(', '.join(unknown))}",
                           f"use only {', '.join(shape)}")
    for key, value in data.items():
        ok, what = shape[key]
        if not ok(value):
            raise ControlError(f"request field {key} is {shown(value)}", f"it must be {what}")
    return data


def inject_args(data: dict[str, Any]) -> tuple[FaultCommand, str]:
    """The fault command (types checked as a command file's) and the backend of
    ``commands.inject_command``."""
    if "fault" not in data:
        raise ControlError("the request lacks its fault", 'send e.g. {"fault": "sigkill", "rank": 1}')
    params = {k: data[k] for k in ("delay", "duration") if k in data}
    fields = {k: data[k] for k in ("fault", "rank", "step", "after", "node") if k in data}
    return FaultCommand.from_dict({**fields, "params": params}), data.get("backend", "local")


def launch_args(data: dict[str, Any]) -> tuple[JobSpec, list[FaultCommand]]:
    """The spec (dotted fields over the defaults; text values read as the CLI reads its options) and
    faults."""
    return commands.prepare(commands.spec_from_options(data.get("spec", {}), validate=False),
                            data.get("faults", []))


def remove_args(data: dict[str, Any]) -> list[tuple[str, str]]:
    """The (name, backend) pairs of ``commands.remove_jobs``, each named once."""
    if "jobs" not in data:
        raise ControlError("the request lacks its jobs",
                           'send e.g. {"jobs": [{"name": "a", "backend": "local"}]}')
    return list(dict.fromkeys((j["name"], j.get("backend", "local")) for j in data["jobs"]))


def check_args(data: dict[str, Any]) -> tuple[JobSpec, str | None, str]:
    """The spec (as :func:`launch_args` reads it), the job to take measured times from, and its backend."""
    return (commands.spec_from_options(data.get("spec", {}), validate=False), data.get("from"),
            data.get("backend", "local"))


def query_int(raw: str | None, name: str, default: int, low: int, high: int) -> int:
    """An integer query argument within [low, high]."""
    if raw is None:
        return default
    try:
        value = int(raw)
    except ValueError:
        value = None
    if value is None or not low <= value <= high:
        raise ControlError(f"query argument {name} is {shown(raw)}", f"use an integer from {low} to {high}")
    return value


def query_bool(raw: str | None, name: str) -> bool:
    if raw is None or raw.lower() in ("", "0", "false", "no"):
        return False
    if raw.lower() in ("1", "true", "yes"):
        return True
    raise ControlError(f"query argument {name} is {shown(raw)}", "use true or false")

