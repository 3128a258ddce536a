"""User-facing errors: one line that names the problem and the fix; and what such a line may echo of a
value (:func:`shown`) or suggest for it (:func:`closest`)."""

from __future__ import annotations

import difflib
import reprlib
from collections.abc import Iterable
from typing import Any


class EksftError(Exception):
    """An error a user can act on. ``str()`` is one line: what is wrong, then what to do."""

    def __init__(self, problem: str, fix: str = "") -> None:
        self.problem = problem.rstrip(".")
        self.fix = fix.rstrip(".")
        super().__init__(f"{self.problem}: {self.fix}" if self.fix else self.problem)


class SpecError(EksftError):
    """A job spec (or an option that sets one) is invalid."""


class JobError(EksftError):
    """A job-level operation cannot be done (unknown job, finished job, missing checkpoint...)."""


class UnknownJobError(JobError):
    """No job of that name (the server extension answers 404)."""


class ControlError(EksftError):
    """A control command (fault, stop, resume) is malformed or does not apply."""


# ---- what a message echoes of a value ------------------------------------------------------------

SHOWN_CHARS = 80   # the most of a value a one-line message echoes
PATH_CHARS = 1024  # a path the user gave is echoed whole up to this: a deep folder is still one line


def shown(value: Any, limit: int = SHOWN_CHARS) -> str:
    """``value`` as a one-line message may echo it: its repr, cut to ``limit`` characters with an ellipsis
    and its full size when longer. A name, a command line or a spec field may be megabytes: the message
    stays one readable line, and only the part shown is ever copied (the repr is bounded before it is
    built, whatever the value's size or depth)."""
    if isinstance(value, (str, bytes)):
        text = repr(value[:limit])
        if len(value) <= limit and len(text) <= limit + 3:   # the quotes (and b) around it
            return text
        unit = "chars" if isinstance(value, str) else "bytes"
        return f"{text[:limit]}... ({len(value):,} {unit})"
    short = reprlib.Repr()
    short.maxlevel, short.maxstring, short.maxother, short.maxlong = 3, limit, limit, limit
    try:
        text = short.repr(value)
    except ValueError:   # an int past Python's digit limit for str()
        return f"<a {type(value).__name__} too large to show>"
    return text if len(text) <= limit else f"{text[:limit]}..."


def closest(word: Any, candidates: Iterable[str]) -> str:
    """The candidate most like ``word`` (the first when none is alike), for a "did you mean" fix; a word of
    any size costs no more than its first :data:`SHOWN_CHARS` characters."""
    options = list(candidates)
    text = word[:SHOWN_CHARS] if isinstance(word, str) else shown(word)
    match = difflib.get_close_matches(text, options, n=1, cutoff=0.0)
    return match[0] if match else options[0]
