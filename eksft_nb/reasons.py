"""The line every front end shows beside a job (``status``, the widget dashboard's header; the lab panel's
row says the same in nbext/src/jobrow.ts): why it failed, with the fix where the command layer gives one;
what it waits for and since when; or the backend's note on a job that runs. A job that ended well says
nothing more than its state."""

from __future__ import annotations

import time
from typing import Any

from .states import FAILED_ENDS

ERROR, WAITING, NOTE = "error", "waiting", "note"


def kind(row: Any) -> str:
    """Which line a row (a commands.JobRow) gets: ERROR (it failed), WAITING, NOTE, or "" (none)."""
    if row["state"] in FAILED_ENDS:
        return ERROR if row["detail"] else ""
    if row["ended"]:
        return ""
    if row["waiting_since"] is not None:
        return WAITING
    return NOTE if row["detail"] else ""


def line(row: Any, now: float | None = None) -> str:
    """The line itself ("" for none): a wait is counted up to ``now`` (default: now)."""
    said = kind(row)
    if said != WAITING:
        return row["detail"] if said else ""
    since = row["waiting_since"]
    now = time.time() if now is None else now
    return f"waiting {waited(now - since)} (since {time.strftime('%H:%M:%S', time.localtime(since))}): " \
           f"{row['detail']}"


def waited(seconds: float) -> str:
    """A wait's length in words: "45 s", "3 min 12 s", "2 h 05 min"."""
    s = max(0, int(seconds))
    if s < 60:
        return f"{s} s"
    if s < 3600:
        return f"{s // 60} min {s % 60:02d} s"
    return f"{s // 3600} h {s % 3600 // 60:02d} min"
