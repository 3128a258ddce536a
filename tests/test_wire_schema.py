"""The lab extension's TypeScript wire types (nbext/src) say what Python's models say: a field, a type or
an optional field changed on one side only fails here. The words the panel learns from the server
(restart level labels, the failed ends, the live settings) have no copy in the TypeScript."""

from __future__ import annotations

import re
import types
import typing
from typing import Any

from conftest import REPO
from eksft_nb.commands import JobRow, Removal, ResumeResult, SettingsResult, StopResult
from eksft_nb.lab import wire
from eksft_nb.settings import LIVE
from eksft_nb.states import FAILED_ENDS, JobState, RestartLevel

SRC = REPO / "nbext" / "src"
SCALARS = {str: "string", int: "number", float: "number", bool: "boolean", Any: "any"}
# every TypeScript wire type and the Python model it copies
MODELS: dict[str, Any] = {
    "IJobRow": JobRow, "IStopResult": StopResult, "IResumeResult": ResumeResult,
    "ISettingsResult": SettingsResult, "IFaultKindInfo": wire.FaultKindInfo, "ILiveSetting": wire.LiveSetting,
    "IBackendStatus": wire.BackendStatus, "IJobsReply": wire.JobsReply,
    "ISettingsInForce": wire.SettingsInForce, "ICheckpointRow": wire.CheckpointRow,
    "ICheckpointsReply": wire.CheckpointsReply, "IRemoval": Removal, "IRemovalsReply": wire.RemovalsReply,
    "IFigure": wire.Figure, "IWhatIfView": wire.WhatIfView}
NAMES = {model: name for name, model in MODELS.items()}


def ts_type(t: Any) -> str:
    """How the TypeScript side writes Python type ``t`` (an index signature's key name dropped)."""
    args = typing.get_args(t)
    if typing.get_origin(t) in (typing.Union, types.UnionType):
        return " | ".join(ts_type(a) for a in args
                          if a is not type(None)) + (" | null" if type(None) in args else "")
    if typing.get_origin(t) is dict:
        return f"{{ [{ts_type(args[0])}]: {ts_type(args[1])} }}"
    if typing.get_origin(t) is list:
        return f"{ts_type(args[0])}[]"
    return NAMES[t] if t in NAMES else SCALARS[t]


def python_fields(model: Any) -> dict[str, str]:
    """``{field (with ? where not required): its TypeScript type}`` of a TypedDict."""
    return {k + ("" if k in model.__required_keys__ else "?"): ts_type(t)
            for k, t in typing.get_type_hints(model).items()}


def sources() -> str:
    return "\n".join(p.read_text() for p in sorted(SRC.glob("*.ts")))


def ts_interface(name: str, text: str) -> dict[str, str]:
    """An interface's fields (those of the one it extends first), each as ``name`` or ``name?``."""
    found = re.search(rf"export interface {name}(?: extends (\w+))? \{{(.*?)\n\}}", text, re.S)
    assert found, f"no interface {name}"
    fields = ts_interface(found.group(1), text) if found.group(1) else {}
    for key, optional, value in re.findall(r"^  (\w+)(\??): (.+);$", found.group(2), re.M):
        fields[key + optional] = re.sub(r"\[\w+: (\w+)\]", r"[\1]", value)
    return fields


def test_every_wire_type_is_the_same_in_typescript() -> None:
    text = sources()
    for name, model in MODELS.items():
        assert ts_interface(name, text) == python_fields(model), name


def test_every_wire_model_has_its_typescript_type() -> None:
    """A new model in lab/wire.py without its interface (or not listed here) fails."""
    models = {v for k, v in vars(wire).items() if typing.is_typeddict(v) and not k.startswith("_")}
    assert models <= set(MODELS.values()), models - set(MODELS.values())


def test_the_words_are_served_not_copied() -> None:
    reply = wire.jobs_reply([], {"local": {"ok": True}})
    assert reply["levels"] == {level.value: level.label for level in RestartLevel}
    assert list(reply["levels"]) == [level.value for level in RestartLevel]   # the rows' order of levels
    assert set(reply["failed"]) == {s.value for s in FAILED_ENDS}
    assert reply["states"] == [s.value for s in JobState]   # the order the panel counts them in
    assert [s["name"] for s in reply["settings"]] == list(LIVE)
    assert set(reply) == set(wire.JobsReply.__annotations__)
    words = ({s.value for s in JobState} | {level.label for level in RestartLevel} | set(LIVE)
             | {level.value for level in RestartLevel if level.value != "job"})   # "job": also a plain word
    literals = set(re.findall(r"'([^'\n]*)'|\"([^\"\n]*)\"", sources()))
    copied = {s for pair in literals for s in pair if s in words}
    assert copied == set(), f"TypeScript copies these words of Python's: {copied}"


def test_a_changed_type_is_caught() -> None:
    """The comparison itself: a field whose type, optionality or presence differs is told apart."""
    text = sources()
    python = python_fields(wire.SettingsInForce)
    for before, after in (("  seq: number;\n  values", "  seq: string;\n  values"),
                          ("  seq: number;\n  values", "  seq?: number;\n  values"),
                          ("  seq: number;\n  values", "  values")):
        changed = text.replace(before, after, 1)
        assert changed != text and ts_interface("ISettingsInForce", changed) != python, after
    extended = text.replace("interface IStopResult extends IJobRow {", "interface IStopResult {", 1)
    assert ts_interface("IStopResult", extended) != python_fields(StopResult)
