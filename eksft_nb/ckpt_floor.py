"""How far a job's checkpoints are from their physical floor: what no tool could save faster on this machine.

- The stall of an async save cannot be less than one copy of a rank's state into memory: its bytes over the
  copy bandwidth the ranks measured while staging (the fastest copy of the job's saves: each staging times
  its copies alone, the ``copy_s`` of its ``staged`` event). A sync save blocks for its write: its floor is
  the write's.
- The write cannot be faster than a rank's state over the storage's throughput: here the fastest write the
  job's own saves reached (a rank's share of a save's bytes over rank 0's write time), the storage as this
  job found it at its best (its rated throughput may be higher).

The distance (the median save's stall over its floor) says how much a setting or a tool could still win:
near 1x, only a smaller state or a faster machine helps.
"""

from __future__ import annotations

import statistics
from typing import Any

from .monitor import JobMonitor
from .states import CheckpointState


def floor(mon: JobMonitor, world_size: int) -> dict[str, Any] | None:
    """The floors of ``mon``'s committed saves and the median save's distance to them (None: no save)."""
    saves = [c for c in mon.saves if c.state == CheckpointState.COMMITTED and c.blocked_s is not None]
    if not saves or world_size < 1:
        return None
    per_rank = [c.staged_bytes or (c.bytes / world_size if c.bytes else None) for c in saves]
    copies = [b / c.copy_s for b, c in zip(per_rank, saves) if b and c.copy_s and c.copy_s > 0]
    writes = [b / w for b, c in zip(per_rank, saves)
              if b and (w := (c.background_s if c.mode == "async" else c.blocked_s)) and w > 0]
    known = [b for b in per_rank if b]
    out: dict[str, Any] = {"saves": len(saves), "mode": saves[-1].mode,
                           "bytes_per_rank": statistics.median(known) if known else None,
                           "copy_bps": max(copies) if copies else None,
                           "write_bps": max(writes) if writes else None,
                           "stall_s": round(statistics.median(c.blocked_s or 0.0 for c in saves), 4)}
    b = out["bytes_per_rank"]
    asynchronous = out["mode"] == "async"
    rate = out["copy_bps"] if asynchronous else out["write_bps"]
    out["stall_floor_s"] = round(b / rate, 5) if b and rate else None
    background = [c.background_s for c in saves if c.background_s]
    out["write_s"] = round(statistics.median(background), 4) if asynchronous and background else None
    out["write_floor_s"] = round(b / out["write_bps"], 5) if b and out["write_bps"] else None
    return out


def floor_text(f: dict[str, Any]) -> list[str]:
    """The floors as lines: the stall against its floor, the write against its floor."""
    b = f["bytes_per_rank"]
    size = f"{b / 1e6:.1f} MB a rank" if b else "its size unknown"
    if f["stall_floor_s"]:
        rate = f["copy_bps"] if f["mode"] == "async" else f["write_bps"]
        what = "the fastest copy of the ranks' stagings" if f["mode"] == "async" else "the fastest write"
        stall = (f"checkpoint stall {f['stall_s']:.3f}s a save (median of {f['saves']}), "
                 f"{f['stall_s'] / f['stall_floor_s']:.1f}x its floor {f['stall_floor_s']:.4f}s ({size} at "
                 f"{rate / 1e9:.2f} GB/s, {what} this job measured)")
    else:
        stall = (f"checkpoint stall {f['stall_s']:.3f}s a save (median of {f['saves']}); its floor is "
                 "unknown: the copy bandwidth was not measured (events from before it was, or a script's "
                 "own saves)")
    lines = [stall]
    if f["write_s"] and f["write_floor_s"]:
        times = f["write_s"] / f["write_floor_s"]
        lines.append(f"  write {f['write_s']:.3f}s a save in the background, {times:.1f}x its floor "
                     f"{f['write_floor_s']:.4f}s at {f['write_bps'] / 1e6:.0f} MB/s (the fastest write "
                     "this job measured; the storage's rated throughput may be higher)")
    return lines
