"""What the front ends print of the command layer's answers: a job's summary (with what its time cost and
its checkpoint floor), the list, a status line (with why it failed or what it waits for), its
checkpoints; as text, or as JSON with ``--json``. The terminal and the notebook print the same."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

from . import cost, reasons
from .ckpt_floor import floor_text
from .commands import JobRow
from .goodput import CATEGORIES
from .incidents import phases_text


def format_summary(s: dict[str, Any]) -> str:
    steps = (f"{s['steps_done']}/{s['total_steps']}" if s["total_steps"]
             else f"{s['steps_done']} (optimizer steps seen)")
    lines = [f"job {s['name']}: {s['state']}" + (f" ({s['reason']})" if s["reason"] else ""),
             f"steps done: {steps}   final parameters digest: {s['digest'] or '-'}",
             "restarts: " + ", ".join(f"{k} {v}" for k, v in s["restarts"].items())]
    if s.get("resumed_from"):   # where it started, and each checkpoint refused before that one
        lines.insert(1, f"resumed {s['resumed_from']}")
    if s["restart_events"]:
        lines.append(f"  {'level':<10}{'cause':<44}{'blamed':>7}{'detect':>8}{'downtime':>10}{'lost':>6}")
        for r in s["restart_events"]:
            blamed = "-" if r["blame_rank"] is None else str(r["blame_rank"])
            lines.append(f"  {r['level']:<10}{r['cause'][:43]:<44}{blamed:>7}{r['detection_s']:>7.1f}s"
                         f"{r['downtime_s']:>9.1f}s{r['rolled_back_steps']:>6}"
                         + ("  failed before a step" if r.get("recovered") is False else ""))
            if r.get("phases"):
                lines.append(f"    phases: {phases_text(r['phases'])}")
    for lost in s.get("events_lost", []):  # what the events file lacks: say so, never hide it
        kinds = ", ".join(f"{n} {k}" for k, n in (lost["kinds"] or {}).items())
        lines.append(f"events lost: {lost['count']} of rank {lost['rank']} ({kinds}): {lost['error']}")
    lines += [f"warning: {w}" for w in s.get("warnings", [])]
    g = s["goodput"]
    lines.append(f"goodput: {100 * g['goodput']:.1f}% of {g['wall_s']:.1f}s wall time")
    for key in CATEGORIES:
        sec = g[f"{key}_s"]
        pct = 100 * sec / g["wall_s"] if g["wall_s"] else 0.0
        lines.append(f"  {key.replace('_', ' '):<24}{sec:8.1f}s {pct:6.1f}%"
                     + (f"  {cost.text(s['cost']['terms'][key])}" if s.get("cost") else ""))
    lines += cost.account_text(s["cost"]) if s.get("cost") else []
    lines += floor_text(s["checkpoint_floor"]) if s.get("checkpoint_floor") else []
    return "\n".join(lines)


def format_list(rows: list[JobRow]) -> str:
    if not rows:
        return "no jobs yet: launch one with `python -m eksft_nb run`"
    lines = []
    for r in rows:
        if r["backend"] != "local":  # a listing reads no remote job's logs: its state only
            lines.append(f"{r['name']:<32}{r['state']:<11}{r['detail']}")
        else:
            lines.append(f"{r['name']:<32}{r['state']:<11}{r['step']:>7}/{r['total_steps'] or '-':<7}"
                         f"restarts {sum(r['restarts'].values())}"
                         + (f"  {r['detail']}" if r["detail"] else ""))
    return "\n".join(lines)


def format_status(r: JobRow) -> str:
    goodput = "-" if r["goodput"] is None else f"{100 * r['goodput']:.1f}%"
    said = reasons.line(r) or r["detail"]   # why it failed, what it waits for and since when
    return (f"{r['name']}: {r['state']}  step {r['step']}/{r['total_steps'] or '-'}  restarts "
            f"{r['restarts']}  "
            f"last checkpoint {r['last_checkpoint']}  goodput {goodput}"
            + (f"  ({said})" if said else ""))


def format_checkpoints(infos: list[dict[str, Any]]) -> str:
    if not infos:
        return "no checkpoints yet"
    lines = []
    for i in infos:
        when = time.strftime("%H:%M:%S", time.localtime(i["time"])) if i["time"] else "-"
        note = f"  ({i['reason']})" if i["reason"] else ""
        lines.append(f"step {i['step']:>7}  {i['state']:<10} {i['bytes'] / 2**20:8.2f} MiB  {when}  "
                     f"{i['path']}{note}")
    return "\n".join(lines)


def show(value: Any, as_json: bool, text: Callable[[Any], str]) -> None:
    print(json.dumps(value, indent=2) if as_json else text(value))
