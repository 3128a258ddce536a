"""Bounded reads of logs that anything in a job can grow (one 150 MB line): the last bytes of a
file, the last characters of a text, each with a line saying what was left out."""

from __future__ import annotations

import os
from pathlib import Path

MAX_LOG_BYTES = 1 << 20   # of one log file read, and of the text a logs command answers


def tail_lines(path: Path, max_bytes: int = MAX_LOG_BYTES) -> tuple[str | None, list[str]]:
    """The lines in the last ``max_bytes`` of ``path`` and, when the file holds more, a note saying so
    (the first of those lines may then be the end of a longer one)."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size > max_bytes:
            f.seek(size - max_bytes)
        data = f.read(max_bytes)
    note = f"{path.name}: only its last {max_bytes} of {size} bytes are shown" if size > max_bytes else None
    return note, data.decode(errors="replace").splitlines()


def bounded(text: str, max_chars: int = MAX_LOG_BYTES) -> str:
    """``text``, or its last ``max_chars`` characters after a line saying it was cut."""
    if len(text) <= max_chars:
        return text
    return f"[eksft] cut to the last {max_chars} of {len(text)} characters\n" + text[-max_chars:]
