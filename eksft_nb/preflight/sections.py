"""Which NVRx sections a job's ranks open, and which of them ft_launcher has a timeout for.

NVRx bounds a section only when its config names it. A section it was not given differs by release:
0.4.1 fails the rank that opens it (``Unknown section: NAME``), 0.5 on skips it (its time counts as
out-of-section), and a script that asks NVRx to compute a section's timeout from what it measured
(NVRx's own example) fails with ``KeyError: 'NAME'``. Known beforehand, it is said before
the launch: from the sections the user passes (``--section-timeouts``, an NVRx config in
``--ft-cfg-path``) against the ones a script opens (read from its source).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

MAX_SOURCE_BYTES = 4 << 20  # a training script is kilobytes: read no further
MAX_CONFIG_BYTES = 1 << 20
# RankMonitorClient.start_section("name") / .start_section('name'), however the client is named
_OPENS = re.compile(r"""\.start_section\(\s*(?:section\s*=\s*)?["']([A-Za-z_][\w.-]*)["']\s*\)""")


@dataclass(frozen=True)
class FtConfig:
    """An NVRx fault-tolerance config file's section timeouts (None: unbounded) and its out-of-section one."""

    path: str
    sections: dict[str, float | None]
    out_of_section: float | None
    error: str | None = None  # why it could not be read here


def script_sections(path: str | Path) -> list[str] | None:
    """The sections a script opens, in order of first appearance in its source (a literal name passed to
    ``start_section``); None where its source cannot be read here (on a cluster's image, say)."""
    try:
        with open(path, "rb") as f:
            text = f.read(MAX_SOURCE_BYTES).decode(errors="replace")
    except OSError:
        return None
    return list(dict.fromkeys(_OPENS.findall(text)))


def read_ft_config(path: str) -> FtConfig:
    """The ``fault_tolerance`` section of an NVRx config file, as ``ft_launcher --ft-cfg-path`` reads it
    (the first such mapping, at any depth). Never raises: a file that cannot be read carries ``error``."""
    try:
        with open(Path(path).expanduser(), "rb") as f:
            raw = f.read(MAX_CONFIG_BYTES + 1)
        if len(raw) > MAX_CONFIG_BYTES:
            return FtConfig(path, {}, None, f"it is over {MAX_CONFIG_BYTES >> 20} MiB")
        data = yaml.safe_load(raw.decode(errors="replace"))
    except OSError as e:
        return FtConfig(path, {}, None, f"it cannot be read here ({e.strerror})")
    except (yaml.YAMLError, RecursionError, ValueError) as e:
        return FtConfig(path, {}, None, f"it is not YAML ({str(e)[:80]})")
    ft = _find(data, 0)
    if not isinstance(ft, dict):
        return FtConfig(path, {}, None, "it has no fault_tolerance section")
    raw_sections = ft.get("rank_section_timeouts") or {}
    sections: dict[str, float | None] = {}
    if isinstance(raw_sections, dict):
        for name, value in raw_sections.items():
            if isinstance(name, str) and re.fullmatch(r"[A-Za-z_][\w.-]*", name):
                sections[name] = _seconds(value)
    return FtConfig(path, sections, _seconds(ft.get("rank_out_of_section_timeout")))


def _find(data: Any, depth: int) -> Any:
    if depth > 20 or not isinstance(data, dict):
        return None
    if isinstance(data.get("fault_tolerance"), dict):
        return data["fault_tolerance"]
    for value in data.values():
        if (found := _find(value, depth + 1)) is not None:
            return found
    return None


def _seconds(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        return None
    return float(value)


def missing(opened: list[str], configured: dict[str, float | None]) -> list[str]:
    """The sections of ``opened`` that ft_launcher has no timeout for."""
    return [name for name in opened if name not in configured]
