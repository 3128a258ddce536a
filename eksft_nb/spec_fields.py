"""A spec field's command-line flag, help text and choices, and the option table built from them: every
user-settable field of :class:`~eksft_nb.spec.JobSpec` carries its flag and help in its metadata
(:func:`opt`), so ``%%ftrain --help`` and ``python -m eksft_nb run --help`` list the same options
(:func:`eksft_nb.spec.spec_options`), and a command-line value is read one way
(:func:`parse_option_value`).
"""

from __future__ import annotations

import dataclasses
import enum
import shlex
from collections.abc import Iterator
from dataclasses import dataclass, field, fields
from typing import Any, Literal, get_args, get_origin, get_type_hints

from .errors import SpecError, closest, shown


def opt(default: Any, flag: str, help: str, choices: type[enum.Enum] | None = None, **kw: Any) -> Any:
    """A dataclass field with its command-line flag and help text (``choices``: the enum whose values are
    the field's only ones; the field holds the value itself, as a file names it)."""
    meta = {"flag": flag, "help": help, **({"choices": tuple(c.value for c in choices)} if choices else {})}
    if callable(default) and not isinstance(default, (str, int, float, bool)):
        return field(default_factory=default, metadata=meta, **kw)
    return field(default=default, metadata=meta, **kw)


@dataclass(frozen=True)
class SpecOption:
    """One command-line option and the spec field it sets."""

    path: str           # dotted path in the spec, e.g. "checkpoint.every"
    flag: str           # e.g. "--ckpt-every"
    type: type          # int, float, str or bool
    optional: bool      # None is an accepted value
    choices: tuple[str, ...] | None
    help: str
    default: Any


def options_of(cls: type, prefix: str, instance: Any) -> Iterator[SpecOption]:
    """The options of dataclass ``cls`` and of the dataclasses it nests, their defaults ``instance``'s."""
    hints = get_type_hints(cls)
    for f in fields(cls):
        value = getattr(instance, f.name)
        if dataclasses.is_dataclass(value):
            yield from options_of(type(value), f"{prefix}{f.name}.", value)
            continue
        base, optional, choices = _unwrap(hints[f.name])
        choices = f.metadata.get("choices", choices)
        yield SpecOption(f"{prefix}{f.name}", f.metadata["flag"], base, optional, choices, f.metadata["help"],
                         value)


def _unwrap(tp: Any) -> tuple[type, bool, tuple[str, ...] | None]:
    optional = False
    args = get_args(tp)
    if get_origin(tp) is not None and type(None) in args and get_origin(tp) is not Literal:
        optional = True
        tp = next(a for a in args if a is not type(None))
    if get_origin(tp) is Literal:
        return str, optional, tuple(get_args(tp))
    if get_origin(tp) is list:
        return list, optional, None
    return tp, optional, None


def parse_option_value(option: SpecOption, raw: str) -> Any:
    """Convert a command-line string to the field's type, with a clear error."""
    if option.optional and raw.lower() in ("none", "null", ""):
        return None
    try:
        if option.type is bool:
            if raw.lower() in ("1", "true", "yes", "on"):
                return True
            if raw.lower() in ("0", "false", "no", "off"):
                return False
            raise ValueError(raw)
        if option.type is list:
            return shlex.split(raw)
        value = option.type(raw)
    except ValueError:
        raise SpecError(f"{option.flag} expects {option.type.__name__}, got {shown(raw)}",
                        f"write e.g. {option.flag} "
                        f"{option.default if option.default is not None else 1}") from None
    if option.choices and value not in option.choices:
        raise SpecError(f"{option.flag} must be one of {', '.join(option.choices)}, got {shown(raw)}",
                        f"use {option.flag} {closest(raw, option.choices)}")
    return value


def flag_of(cls: type, fname: str) -> str:
    """The flag of dataclass ``cls``'s field ``fname``."""
    return next(f.metadata["flag"] for f in fields(cls) if f.name == fname)
