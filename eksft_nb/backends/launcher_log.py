"""ft_launcher's log, line by line: what a supervisor acts on (a hung rank, a failed worker, a group
restart) and when the launcher logged it. Shared by the local supervisor and the Slurm allocation's
watcher, which read the same launcher's log."""

from __future__ import annotations

import re
import time
from dataclasses import dataclass

# ft_launcher's log, as NVRx 0.4.1 (``[2026-01-02 03:04:05,678] [WARNING] [RankMonServer...] msg``) and
# 0.6 (``2026-01-02 03:04:05,678 [WARNING] [host] [workload:0(0) infra:?(?)] file.py:123 msg``) write it
_WORKER_FAILED = re.compile(r"failed \(exitcode: (-?\d+)\) local_rank: (\d+) \(pid: (\d+)\)")
# a rank monitor's timeout (0.4.1 adds "FT timeout elapsed." after each, 0.6 logs only these)
_FT_TIMEOUT = re.compile(r"FT timeout elapsed|Did not get (initial|subsequent) heartbeat|"
                         r"Section '[^']*' has been open for|Was out of section for")
# which timeout fired, and its length: "Section 'step' has been open for 61.02 seconds. Timeout is 60.00
# seconds." / "Did not get subsequent heartbeat. Waited 900.00 seconds." / "Was out of section for ..."
_WHICH = re.compile(r"Section '([^']{1,64})' has been open|Did not get (initial|subsequent) heartbeat|"
                    r"(Was out of section)")
_LENGTH = re.compile(r"(?:Timeout is|Waited) (\d+(?:\.\d+)?) seconds")
# the last line of a rank's traceback, as the launcher's log carries the workers' stderr:
# "KeyError: 'init'", "torch.distributed.DistBackendError: ...", "pkg.mod.RankMonitorClientError: ..."
_ERROR = re.compile(r"^((?:[A-Za-z_]\w*\.){0,8}[A-Za-z_]\w*(?:Error|Exception|Interrupt|Exit))(?:: (.*))?$")
_ATTEMPTS = re.compile(r"Worker group (\w+)\. (\d+)/(\d+) attempts left")
_LOGGED_AT = re.compile(r"^\[?(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d{3})\]? ")
_GLOG_AT = re.compile(r"^[IWEF](\d{4}) (\d\d:\d\d:\d\d)\.(\d{1,9}) ")


@dataclass(frozen=True)
class LauncherLine:
    """What the supervisor acts on in one line of ft_launcher's log."""

    kind: str                 # hang (a rank monitor timed out) | worker_failed | restarting (the group) |
    #                           error (a rank's traceback ended with this exception)
    at: float                 # when it was logged, epoch seconds
    exitcode: int = 0         # worker_failed: the rank's exit code (negative: killed by that signal)
    local_rank: int = 0
    pid: int = 0
    left: tuple[int, int] = (0, 0)  # restarting: in-job restarts left, of how many
    # hang: which timeout ("step section", "subsequent heartbeat", "out-of-section"); error: the exception
    detail: str = ""
    timeout_s: float | None = None  # hang: that timeout's length, where the line says it


def parse_launcher_line(line: str, now: float | None = None) -> LauncherLine | None:
    """The event in one ft_launcher log line (NVRx 0.4.1 or 0.6 format), or None for any other line."""
    if m := _WORKER_FAILED.search(line):
        return LauncherLine("worker_failed", _logged_at(line, now), exitcode=int(m.group(1)),
                            local_rank=int(m.group(2)), pid=int(m.group(3)))
    if _FT_TIMEOUT.search(line):
        which, length = _WHICH.search(line), _LENGTH.search(line)
        detail = ("" if which is None else f"{which.group(1)} section" if which.group(1)
                  else f"{which.group(2)} heartbeat" if which.group(2) else "out-of-section")
        return LauncherLine("hang", _logged_at(line, now), detail=detail,
                            timeout_s=float(length.group(1)) if length else None)
    if m := _ATTEMPTS.search(line):
        return LauncherLine("restarting", _logged_at(line, now), left=(int(m.group(2)), int(m.group(3))))
    m = _ERROR.match(line.rstrip()) if len(line) < 2000 else None
    if m and not m.group(1).endswith("ChildFailedError"):   # torchelastic's: only says a worker failed
        name = m.group(1).rsplit(".", 1)[-1]
        text = f"{name}: {m.group(2)}" if m.group(2) else name
        return LauncherLine("error", time.time() if now is None else now, detail=text[:300])
    return None


def _logged_at(line: str, now: float | None = None) -> float:
    """When ft_launcher logged ``line`` (its own timestamp: this supervisor reads the log up to a poll
    later, and by then the launcher may already be restarting the group); now if it carries none.
    NVRx writes ``2026-01-02 03:04:05,678`` (0.6; bracketed in 0.4.1), torch ``E0102 03:04:05.678901``."""
    now = time.time() if now is None else now
    if m := _LOGGED_AT.match(line):
        at = time.mktime(time.strptime(m.group(1), "%Y-%m-%d %H:%M:%S")) + int(m.group(2)) / 1000
    elif m := _GLOG_AT.match(line):  # no year: the one that puts it in the past
        year = time.localtime(now).tm_year
        stamp = f"{m.group(1)} {m.group(2)}"
        at = time.mktime(time.strptime(f"{year}{stamp}", "%Y%m%d %H:%M:%S")) + float(f"0.{m.group(3)}")
        if at > now + 86400:
            at = time.mktime(time.strptime(f"{year - 1}{stamp}",
                                           "%Y%m%d %H:%M:%S")) + float(f"0.{m.group(3)}")
    else:
        return now
    return min(now, at)
