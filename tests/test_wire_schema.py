"""The lab extension's TypeScript copies of Python's wire models (nbext/src) say what Python says:
a field, a type, a state or a label changed on one side only fails here."""

from __future__ import annotations

import re
import types
import typing
from typing import Any

from conftest import REPO
from eksft_nb.commands import JobRow
from eksft_nb.states import FAILED_ENDS, RestartLevel

SRC = REPO / "nbext" / "src"
SCALARS = {str: "string", int: "number", float: "number", bool: "boolean"}


def ts_type(t: Any) -> str:
    """How the TypeScript side writes Python type ``t`` (an index signature's key name dropped)."""
    args = typing.get_args(t)
    if typing.get_origin(t) in (typing.Union, types.UnionType):
        return " | ".join(ts_type(a) for a in args
                          if a is not type(None)) + (" | null" if type(None) in args else "")
    if typing.get_origin(t) is dict:
        return f"{{ [{ts_type(args[0])}]: {ts_type(args[1])} }}"
    return SCALARS[t]


def ts_interface(name: str, text: str) -> dict[str, str]:
    body = re.search(rf"export interface {name} \{{(.*?)\n\}}", text, re.S)
    assert body, f"no interface {name}"
    fields = re.findall(r"^\s+(\w+)\??: (.+);$", body.group(1), re.M)
    return {k: re.sub(r"\[\w+: (\w+)\]", r"[\1]", v) for k, v in fields}


def ts_const(name: str, text: str) -> str:
    found = re.search(rf"const {name}\b[^=]*= (.+?);\n", text, re.S)
    assert found, f"no const {name}"
    return found.group(1)


def test_the_job_row_is_the_same_in_typescript() -> None:
    python = {k: ts_type(t) for k, t in typing.get_type_hints(JobRow).items()}
    assert ts_interface("IJobRow", (SRC / "api.ts").read_text()) == python


def test_level_labels_and_failed_states_are_the_same_in_typescript() -> None:
    labels = dict(re.findall(r"(\w+): '([^']*)'", ts_const("LEVEL_LABELS", (SRC / "rows.ts").read_text())))
    assert labels == {level.value: level.label for level in RestartLevel if level.label != level.value}
    failed = set(re.findall(r"'([^']*)'", ts_const("FAILED", (SRC / "model.ts").read_text())))
    assert failed == {s.value for s in FAILED_ENDS}


def test_a_changed_type_is_caught() -> None:
    """The comparison itself: an interface that differs from the model in one type is told apart."""
    changed = (SRC / "api.ts").read_text().replace("  step: number;", "  step: string;", 1)
    python = {k: ts_type(t) for k, t in typing.get_type_hints(JobRow).items()}
    assert ts_interface("IJobRow", changed) != python
