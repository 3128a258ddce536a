"""Every value that reaches a script is written here, one way for each reader of it: bash (:func:`word`,
:func:`expanding`), sbatch's ``#SBATCH`` lines (:func:`directive`) and Slurm's file-name patterns
(:func:`filename`).

A value holds no control character (the spec refuses them: :func:`control_char`): quoting keeps a
space, a quote or a ``$`` literal, but a newline in an ``#SBATCH`` line ends the directive and starts a
shell line, whatever the quotes.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Iterable

# C0 controls (newline, carriage return, tab, escape...), DEL, C1 controls, and the Unicode line and
# paragraph separators some readers take for a newline
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029]")
_SBATCH_SPECIAL = re.compile(r"""([\\"'#\s])""")


def control_char(text: str) -> str | None:
    """The first control character of ``text`` as its escape (``\\n``), or None when it has none."""
    m = _CONTROL.search(text)
    return None if m is None else repr(m.group())[1:-1]


def _plain(text: str) -> str:
    if (bad := control_char(text)) is not None:
        raise ValueError(f"a control character ({bad}) cannot be written into a script: {text[:80]!r}")
    return text


def word(text: str) -> str:
    """``text`` as one literal word of a bash command line."""
    return shlex.quote(_plain(text))


def expanding(text: str, variables: Iterable[str]) -> str:
    """``text`` as one word of a bash command line in which only ``variables`` (written ``$NAME`` or
    ``${NAME}`` in ``text``) expand, each to one word whatever it holds; everything else is literal."""
    names = sorted(set(variables), key=len, reverse=True)
    pattern = re.compile("|".join(rf"\$\{{{re.escape(n)}\}}|\${re.escape(n)}(?![A-Za-z0-9_])"
                                  for n in names)) if names else None
    out, at = [], 0
    for m in pattern.finditer(_plain(text)) if pattern else ():
        out += [re.sub(r'([$`"\\])', r"\\\1", text[at:m.start()]), m.group()]
        at = m.end()
    out.append(re.sub(r'([$`"\\])', r"\\\1", text[at:]))
    return '"' + "".join(out) + '"'


def export(name: str, value: str) -> str:
    """``export NAME=value``, the value literal."""
    if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
        raise ValueError(f"not an environment variable name: {name[:80]!r}")
    return f"export {name}={word(value)}"


def directive(flag: str, value: str | None = None) -> str:
    """An ``#SBATCH`` line. sbatch reads its words itself, not bash: quotes group (a space ends a word
    even after a backslash), a backslash escapes the next character, an unquoted ``#`` starts a comment.
    A value that holds any of those is written in double quotes, its ``"`` and ``\\`` escaped."""
    if value is None:
        return f"#SBATCH {flag}"
    if _SBATCH_SPECIAL.search(_plain(value)) is None:
        return f"#SBATCH {flag}={value}"
    escaped = re.sub(r'(["\\])', r"\\\1", value)
    return f'#SBATCH {flag}="{escaped}"'


def filename(path: str) -> str:
    """``path`` inside a Slurm output pattern (``--output``), where ``%`` starts a field (``%j``)."""
    return _plain(path).replace("%", "%%")
