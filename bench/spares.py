"""Part ``spares``: a lost node with a hot spare against the same loss without one (a job restart), on the
NVRx this process imports (run it as ``PYTHONPATH=.venv/nvrx-0.7.0 python -m bench --only spares`` for
0.7.0's own standby nodes), locally and on a real Slurm (three node daemons on this machine, as the tests
start them), the pairs interleaved so that both see the same load, the load recorded around every run.

- local: 2 nodes x 1 rank, ``kill-launcher`` once a checkpoint is committed (:func:`.recovery.eksft_job`):
  with ``--spare-nodes 1`` an in-job restart with the spare, without it the supervisor's job restart;
- Slurm: 2 nodes x 1 rank of the tiny model, ``kill-launcher:1@40``, in-process off (a lost peer fails the
  survivors' collectives at once; nothing on the other nodes sees a launcher go): with a spare an in-job
  restart, without one a requeue of the allocation (Slurm's own job restart).

A recovery is from the fault to the first step completed after it (as part 2's).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from eksft_nb import nvrx
from eksft_nb.events import read_all

from .common import FULL, REPO, SMOKE, fmt, load_avg, med, stat, table
from .recovery import SPARE_SPEC, eksft_job

SLURM_ARGS = ["--model", "tiny", "--steps", "80", "--ckpt-every", "10", "--seed", "0", "--nnodes", "2",
              "--nproc-per-node", "1", "--no-inprocess", "--fault", "kill-launcher:1@40"]


def run(size: str) -> dict[str, Any]:
    """Two pairs per backend (``--quick``: one; ``--smoke``: one local pair, no Slurm)."""
    repeats = 2 if size == FULL else 1
    found = nvrx.installed()
    out: dict[str, Any] = {"nvrx": found.version if found else None, "load_before": load_avg(),
                           "local": _pairs(repeats, _local), "slurm": None}
    if size == SMOKE:
        out["slurm_skipped"] = "--smoke runs the local pair only"
    else:
        try:
            out["slurm"] = _slurm(repeats)
        except _NoSlurm as e:
            out["slurm_skipped"] = str(e)
    out["load_after"] = load_avg()
    return out


def _pairs(repeats: int, one: Any, *extra: Any) -> dict[str, Any]:
    """``repeats`` pairs (no spare, then spare), each run's recovery seconds with the load around it."""
    runs: dict[str, list[dict[str, Any]]] = {"job": [], "spare": []}
    for i in range(repeats):
        for who in ("job", "spare"):
            before = load_avg()
            got = one(f"{who}-{i}", who == "spare", *extra)
            runs[who].append({**got, "load_before": before, "load_after": load_avg()})
    out: dict[str, Any] = {who: {"runs": rs, "total_s": stat([r["total_s"] for r in rs if r["total_s"]]),
                                 "levels": sorted({r["level"] for r in rs if r["level"]})}
                           for who, rs in runs.items()}
    spare, job = med(out["spare"]["total_s"]), med(out["job"]["total_s"])
    out["spare_faster"] = None if spare is None or job is None else spare < job
    return out


def _local(name: str, spare: bool) -> dict[str, Any]:
    recs = eksft_job(f"spares-{name}", ["kill-launcher"], None, {**SPARE_SPEC, "spare_nodes": int(spare)})
    if not recs:
        return {"level": None, "total_s": None, "phases": {}}
    r = recs[0]
    return {"level": r.level, "total_s": r.total_s, "phases": r.phases}


class _NoSlurm(Exception):
    pass


def _slurm(repeats: int) -> dict[str, Any]:
    import tempfile

    sys.path.insert(0, str(REPO / "tests"))
    try:
        import pytest
        from slurm_cluster import free_base, slurm_cluster
    except ImportError as e:
        raise _NoSlurm(f"the tests' Slurm helper cannot be imported ({e})") from e
    base = Path(tempfile.mkdtemp(prefix="eksft-bench-slurm-"))
    try:
        with slurm_cluster(base, nodes=3) as c:
            env = {k: v for k, v in c.env.items() if k != "EKSFT_SHARED_DIR"}
            env["NVRX_ENABLE_MULTI_LAUNCHERS_PER_NODE"] = "1"   # three "nodes" on one machine: one address
            return _pairs(repeats, _slurm_run, c.shared, env, free_base)
    except pytest.skip.Exception as e:
        raise _NoSlurm(f"no Slurm here: {e}") from e


def _slurm_run(name: str, spare: bool, shared: Path, env: dict[str, str], free_base: Any) -> dict[str, Any]:
    name = f"spares-slurm-{name}"
    argv = ["run", "--backend", "slurm", "--shared-dir", str(shared), "--name", name, *SLURM_ARGS,
            "--spare-nodes", str(int(spare)), "--slurm-port", str(free_base()), "--json"]
    proc = subprocess.run([sys.executable, "-m", "eksft_nb", *argv], capture_output=True, text=True,
                          timeout=1800, env=env, cwd=os.getcwd())
    summary = json.loads(proc.stdout[proc.stdout.index("{"):]) if "{" in proc.stdout else {}
    events = read_all(shared / name / "events.jsonl")
    restart = next((e for e in events if e.kind == "restart"), None)
    fault = next((e for e in events if e.kind == "fault"), None)
    if restart is None or fault is None:
        return {"level": None, "total_s": None, "phases": {}, "state": summary.get("state")}
    start = restart["fault_time"] + restart["downtime_s"]
    first = next((e for e in events if e.kind == "step" and e.t >= start), None)
    return {"level": restart["level"], "total_s": None if first is None else first.t - fault.t,
            "phases": restart.get("phases") or {}, "state": summary.get("state"),
            "digest": summary.get("digest")}


def report(result: dict[str, Any]) -> str:
    lines = [f"   hot spares on NVRx {result['nvrx']}: a lost node (kill-launcher), 2 nodes x 1 rank, with a "
             f"spare and without (load {result['load_before']} -> {result['load_after']})"]
    for where in ("local", "slurm"):
        part = result.get(where)
        if not part:
            lines.append(f"  {where}: {result.get('slurm_skipped', 'not run')}")
            continue
        rows = [[label, "/".join(part[who]["levels"]) or "-", str(len(part[who]["runs"])),
                 " ".join(fmt(r["total_s"], ".2f") for r in part[who]["runs"]),
                 fmt(med(part[who]["total_s"]), ".2f")] for who, label in (("spare", "hot spare"),
                                                                           ("job", "no spare"))]
        lines.append(table(f"   {where}: seconds from the fault to the first step after it",
                           ["who", "level", "n", "each", "median"], rows))
        verdict = {True: "the spare is faster than the job restart", False: "the spare is NOT faster",
                   None: "not measured"}[part["spare_faster"]]
        lines.append(f"  {where}: {verdict}")
    return "\n".join(lines) + "\n"
