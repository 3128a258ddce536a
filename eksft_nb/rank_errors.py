"""The ranks' own errors, named where users look: a job that fails says the last error its ranks died of,
with the fix where eksft knows one.

Errors come from the ranks' ``rank_error`` events (the built-in trainer and the script runner report
the exception a rank fails with, and where it was raised) and from the launchers' logs (the last line
of a rank's traceback: what a rank that died before it could report leaves behind).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

KEEP = 32  # errors remembered: the newest matter
_NAME = r"([\w-]{1,64}(?:\.[\w-]{1,64}){0,4})"  # a section's name (a sentence's full stop is not part of it)
_UNKNOWN_SECTION = re.compile(rf"Unknown section: {_NAME}")
_KEY = re.compile(rf"^KeyError: '{_NAME}'")
_NO_MODULE = re.compile(r"No module named '([\w.]{1,64})'")


@dataclass(frozen=True)
class RankError:
    t: float
    rank: int | None  # None: a launcher's log line, whose rank is not known
    text: str  # "KeyError: 'init'"
    where: str = ""  # where it was raised: "nvidia_resiliency_ext/fault_tolerance/timeouts_calc.py:145"

    def said(self) -> str:
        who = f"rank {self.rank}: " if self.rank is not None else ""
        fix = fix_for(self.text, self.where)
        return f"{who}{self.text[:200]}" + (f" ({fix})" if fix else "")


def fix_for(text: str, where: str = "") -> str | None:
    """What to do about an error eksft recognises; None for the rest."""
    if m := _UNKNOWN_SECTION.search(text):
        return section_fix(m.group(1))
    if (m := _KEY.match(text)) and "nvidia_resiliency_ext/fault_tolerance" in where:
        return section_fix(m.group(1))
    if (m := _NO_MODULE.search(text)) and m.group(1).split(".")[0] in ("eksft_nb", "nvidia_resiliency_ext"):
        return (
            f"the ranks' python has no {m.group(1).split('.')[0]}: put the environment eksft-nb is "
            "installed in first on PATH where the ranks run"
        )
    return None


def section_fix(name: str) -> str:
    return (
        f"the script uses NVRx section '{name}', which ft_launcher has no timeout for: add "
        f"--section-timeouts {name}:SECONDS (or list it in --ft-cfg-path)"
    )


def raised_at(e: BaseException) -> str:
    """Where ``e`` was raised: the innermost frame's file (from its package folder on) and line."""
    tb = e.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    if tb is None:
        return ""
    path = tb.tb_frame.f_code.co_filename.replace("\\", "/")
    for marker in ("/site-packages/", "/dist-packages/", "/nvidia_resiliency_ext/"):
        if marker in path:
            path = path.rsplit(marker, 1)[1]
            if marker == "/nvidia_resiliency_ext/":  # unpacked with pip --target (NVRx 0.6, 0.7 here)
                path = "nvidia_resiliency_ext/" + path
            break
    return f"{path[-160:]}:{tb.tb_lineno}"
