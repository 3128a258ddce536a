"""Part 1, checkpoint stall: how long each way of saving blocks the training loop, how long until the
save is committed, and how much the background write slows the steps it overlaps.

Two ranks of the built-in GPT (FSDP2 on gloo) run :mod:`bench.ckpt_worker` under ``torchrun``, once
per state size. Per save, a rank's figure is the slowest rank's (the next collective waits for it).
"""

from __future__ import annotations

import json
import math
import subprocess
import tempfile
from pathlib import Path
from typing import Any

from .common import FULL, PY, QUICK, REPO, SMOKE, fmt, load_avg, med, rank_env, ratio, stat, table

BASELINES = ("torch.save", "dcp.save", "dcp.async_save")
EKSFT, FLOOR = "eksft async", "memcpy floor"
TARGET_FLOOR_X, TARGET_DCP_X = 1.5, 0.1


# peak memory of a run per byte of state: the state and its gradients, and one copy each for the
# memcpy floor, eksft's staging buffers and dcp.async_save's staging, with some margin
MEMORY_PER_STATE_BYTE = 5.0
STATE_BYTES = {"2MB": 2 * 2**20, "100MB": 102 * 2**20, "1GB": 961 * 2**20, "4GB": 3840 * 2**20}


# size -> (state sizes, measured saves per method)
RUNS = {FULL: (("100MB", "1GB", "4GB"), 5), QUICK: (("100MB",), 3), SMOKE: (("2MB",), 2)}


def run(size: str, sizes: tuple[str, ...] | None = None) -> dict[str, Any]:
    """``sizes``: the state sizes to measure instead of ``size``'s (a size this machine has not the memory
    for is reported as skipped)."""
    default, saves = RUNS[size]
    sizes = sizes or default
    return {"saves_per_method": saves, "targets": {"eksft_blocked_vs_floor_max": TARGET_FLOOR_X,
                                                   "eksft_blocked_vs_dcp_save_max": TARGET_DCP_X},
            "sizes": {size: _skip(size) or measure(size, saves) for size in sizes}}


def _skip(size: str) -> dict[str, Any] | None:
    import psutil

    need, free = STATE_BYTES[size] * MEMORY_PER_STATE_BYTE, psutil.virtual_memory().available
    if free >= need:
        return None
    return {"skipped": f"needs about {need / 2**30:.0f} GiB of free memory, {free / 2**30:.1f} GiB available"}


def measure(size: str, saves: int) -> dict[str, Any]:
    before = load_avg()
    with tempfile.TemporaryDirectory(prefix="eksft-bench-ckpt-") as tmp:
        out = Path(tmp) / "out.json"
        cmd = [PY, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
               f"--log-dir={tmp}/logs",
               "-m", "bench.ckpt_worker", "--size", size, "--saves", str(saves), "--root", f"{tmp}/ckpt",
               "--out", str(out)]
        proc = subprocess.run(cmd, env=rank_env(), cwd=REPO, capture_output=True, text=True, timeout=3600)
        if proc.returncode != 0 or not out.exists():
            raise RuntimeError(f"checkpoint benchmark ({size}) "
                               f"failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
        raw = json.loads(out.read_text())
    return {**summarise(raw), "load_avg_before": before, "load_avg_after": load_avg()}


def summarise(raw: dict[str, Any]) -> dict[str, Any]:
    """Per method: blocked and committed times (medians over the measured saves, the warm-up apart),
    overlapped step times against clean ones, and ratios to the memcpy floor and to dcp.save."""
    ranks = raw["records"]
    clean = stat(raw["clean_steps"])
    methods: dict[str, Any] = {}
    for name in ranks[0]:
        per_save = list(zip(*(r[name] for r in ranks)))  # save i -> its record on every rank
        worst = [max(recs, key=lambda r: r["blocked_s"]) for recs in per_save]
        measured = worst[1:]
        overlap = [t for rec in per_save[1:] for t in rec[0]["overlap_steps"]]
        committed = [max(r["committed_s"] for r in recs) for recs in per_save[1:]]
        entry = {"first_blocked_s": worst[0]["blocked_s"],
                 "blocked_s": stat([r["blocked_s"] for r in measured]),
                 "blocked_cpu_s": stat([max(r.get("blocked_cpu_s",
                                                  0.0) for r in recs) for recs in per_save[1:]]),
                 "committed_s": stat([c for c in committed if not math.isnan(c)]),
                 "uncommitted": sum(math.isnan(c) for c in committed),
                 "overlap_step_s": stat(overlap),
                 "overlap_slowdown": ratio(med(stat(overlap)), med(clean)) if overlap else None,
                 "bytes_written": stat(raw["disk_bytes"][name][1:])}
        if measured[0].get("stage_s") is not None:
            entry["stage_s"] = stat([r["stage_s"] for r in measured])
            entry["plan_and_handoff_s"] = stat([r["blocked_s"] - r["stage_s"] for r in measured])
        methods[name] = entry
    floor, dcp = med(methods[FLOOR]["blocked_s"]), med(methods["dcp.save"]["blocked_s"])
    floor_cpu = med(methods[FLOOR]["blocked_cpu_s"])
    for entry in methods.values():
        entry["blocked_vs_floor"] = ratio(med(entry["blocked_s"]), floor)
        entry["blocked_cpu_vs_floor"] = ratio(med(entry["blocked_cpu_s"]), floor_cpu)
        entry["blocked_vs_dcp_save"] = ratio(med(entry["blocked_s"]), dcp)
    eksft = methods[EKSFT]
    return {"state_bytes": raw["state_bytes"], "dims": raw["dims"], "batch": raw["batch"], "seq": raw["seq"],
            "world_size": raw["world_size"], "clean_step_s": clean, "methods": methods,
            "restore": raw.get("restore"),
            "targets_met": {"blocked_vs_floor": eksft["blocked_vs_floor"] <= TARGET_FLOOR_X,
                            "blocked_vs_dcp_save": eksft["blocked_vs_dcp_save"] <= TARGET_DCP_X}}


def report(result: dict[str, Any]) -> str:
    out = []
    for size, r in result["sizes"].items():
        if "skipped" in r:
            out.append(f"1. checkpoint stall, {size}: skipped, {r['skipped']}\n")
            continue
        rows = []
        for name, m in r["methods"].items():
            rows.append([name, fmt(med(m["blocked_s"]), ".3f"), fmt(m["first_blocked_s"], ".3f"),
                         fmt(med(m["committed_s"]), ".2f"), fmt(m["blocked_vs_floor"], ".1f", "x"),
                         fmt(m["blocked_vs_dcp_save"], ".3f", "x"),
                         fmt(m["overlap_slowdown"], ".2f", "x") if m["overlap_slowdown"] else "-"])
        title = (f"1. checkpoint stall, {r['state_bytes'] / 2**20:.0f} MiB model+optimizer state, 2 ranks "
                 f"(median of {result['saves_per_method']} saves; clean step "
                 f"{fmt(med(r['clean_step_s']), '.3f')} s; "
                 f"load {r['load_avg_before'][0]}->{r['load_avg_after'][0]})")
        out.append(table(title,
                         ["method", "blocked s", "1st save s", "committed s", "vs floor", "vs dcp.save",
                                 "overlapped step"], rows))
        e = r["methods"][EKSFT]
        met = r["targets_met"]
        out.append(f"  eksft blocked = staging {fmt(med(e['stage_s']), '.3f')} s + DCP planning/hand-off "
                   f"{fmt(med(e['plan_and_handoff_s']), '.3f')} s.  Targets: <= {TARGET_FLOOR_X}x floor "
                   f"{'MET' if met['blocked_vs_floor'] else 'NOT MET'}, <= {TARGET_DCP_X}x dcp.save "
                   f"{'MET' if met['blocked_vs_dcp_save'] else 'NOT MET'}")
        out.append(f"  CPU time of the training thread while blocked (what the load does not inflate): eksft "
                   f"{fmt(med(e['blocked_cpu_s']), '.4f')} s, floor "
                   f"{fmt(med(r['methods'][FLOOR]['blocked_cpu_s']), '.4f')} s "
                   f"= {fmt(e['blocked_cpu_vs_floor'], '.2f', 'x')}")
        if r.get("restore"):
            mem, sto = r["restore"]["memory"], r["restore"]["storage"]
            out.append(f"  eksft restore (slowest rank): from memory {mem['wall_s']:.3f} s (CPU "
                       f"{mem['cpu_s']:.3f} s, "
                       f"CRC-32 check {fmt(mem['verify_s'], '.3f')} s, loaded from {mem['source']}); "
                       "from storage "
                       f"{sto['wall_s']:.3f} s (CPU {sto['cpu_s']:.3f} s, SHA-256 check "
                       f"{fmt(sto['verify_s'], '.3f')} s, "
                       f"loaded from {sto['source']}; the files were in the page cache)")
        out.append("")
    return "\n".join(out)
