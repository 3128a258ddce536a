"""Expectations of a resilience test, e.g. ``level<=injob, downtime<5s, lost<=10, state=reference``:
parsed strictly (an unknown key, operator or value is one line naming it and the fix) and checked
against one case's outcome."""

from __future__ import annotations

import math
import operator
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..errors import SHOWN_CHARS, EksftError, closest, shown
from ..states import RestartLevel

# who healed a fault, from least to most disruptive ("none": the job absorbed it without a restart)
LEVELS = ("none", *(level.value for level in RestartLevel))
LEVEL_WORDS = {**{w: w for w in LEVELS}, **{level.label: level.value for level in RestartLevel}}
OPS: dict[str, Callable[[Any, Any], bool]] = {"<=": operator.le, ">=": operator.ge, "<": operator.lt,
                                               ">": operator.gt, "==": operator.eq, "=": operator.eq}
KEYS = {"level": "who healed it (none, inprocess, injob, job)",
        "downtime": "seconds from fault to the next step",
        "detection": "seconds from fault to its detection", "lost": "steps rolled back",
        "state": "the final state (reference: the same as the fault-free run's, or for a torchft job "
                 "healed from a peer consistent with it)"}
CLAUSE = re.compile(r"^\s*([a-z]+)\s*(<=|>=|==|<|>|=)\s*(\S+)\s*$")
EXAMPLE = 'e.g. --expect "level<=injob, downtime<5s, lost<=10, state=reference"'
DEFAULT = "state=reference"


@dataclass(frozen=True)
class Expectation:
    key: str
    op: str
    value: Any     # a level's rank, seconds, a step count, or "reference"

    @property
    def text(self) -> str:
        shown = LEVELS[self.value] if self.key == "level" else f"{self.value:g}s" if self.key in (
            "downtime", "detection") else self.value
        return f"{self.key}{self.op}{shown}"

    def check(self, outcome: dict[str, Any]) -> str:
        """"" when ``outcome`` (a card row) meets it, else why not."""
        if self.key == "state":
            # consistent: a torchft job whose groups healed from a peer (see card.groups_state_check)
            ok = outcome["state_check"] in ("match", "consistent")
            return "" if ok else f"state: {outcome['state_detail']}"
        if self.key == "level":
            actual = outcome["level"]
            ok = actual is not None and OPS[self.op](LEVELS.index(actual), self.value)
            return "" if ok else f"healed at level {actual or 'unknown'}, expected {self.text}"
        actual = outcome[{"downtime": "downtime_s", "detection": "detection_s", "lost": "lost"}[self.key]]
        if actual is None:
            return f"{self.key} unknown (no recovery was recorded), expected {self.text}"
        if OPS[self.op](actual, self.value):
            return ""
        unit = "s" if self.key in ("downtime", "detection") else " steps"
        return f"{self.key} {actual:.2f}{unit}, expected {self.text}" if unit == "s" else \
            f"{self.key} {actual}{unit}, expected {self.text}"


def parse(text: str | None) -> list[Expectation]:
    """The expectations in ``text`` (comma-separated clauses; None or blank: ``state=reference``)."""
    if text is None or not text.strip():
        text = DEFAULT
    out = []
    for clause in text.split(","):
        if not clause.strip():
            raise EksftError(f"--expect {shown(text)} has an empty clause",
                             f"separate clauses with one comma, {EXAMPLE}")
        m = CLAUSE.match(clause)
        if not m:
            raise EksftError(f"cannot read expectation {shown(clause.strip())}",
                             f"write KEY OP VALUE, {EXAMPLE}")
        key, op, raw = m.groups()
        if key not in KEYS:
            raise EksftError(f"unknown expectation {shown(key)}",
                             f"did you mean {closest(key, KEYS)}? keys: "
                             + "; ".join(f"{k}: {v}" for k, v in KEYS.items()))
        out.append(Expectation(key, op, _value(key, op, raw)))
    return out


def _value(key: str, op: str, raw: str) -> Any:
    said = f"{key}{op}{raw if len(raw) <= SHOWN_CHARS else shown(raw)}"   # the clause, as a message echoes it
    if key == "state":
        if op not in ("=", "==") or raw != "reference":
            raise EksftError(f"cannot read {said}", "the state expectation is state=reference")
        return "reference"
    if key == "level":
        if raw not in LEVEL_WORDS:
            raise EksftError(f"unknown level {shown(raw)} in {said}",
                             f"use one of {', '.join(LEVELS)} (did you mean {closest(raw, LEVEL_WORDS)}?)")
        return LEVELS.index(LEVEL_WORDS[raw])
    if key == "lost":
        if not re.fullmatch(r"\d{1,9}", raw):
            raise EksftError(f"{said}: {shown(raw)} is not a whole number of steps", "write e.g. lost<=10")
        return int(raw)
    m = re.fullmatch(r"(\d+(?:\.\d*)?|\.\d+)(ms|s)?", raw)
    if not m:
        raise EksftError(f"{said}: {shown(raw)} is not a duration", f"write e.g. {key}<5s or {key}<500ms")
    seconds = float(m.group(1)) / (1000.0 if m.group(2) == "ms" else 1.0)
    if not math.isfinite(seconds):
        raise EksftError(f"{said} is not a finite duration", f"write e.g. {key}<5s")
    return seconds
