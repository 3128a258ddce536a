"""Checkpoints across two real ranks (two processes, gloo): what one rank does to a folder while the
other is already writing into it."""

from __future__ import annotations

import datetime
import json
import os
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from eksft_nb.checkpoint_folders import list_checkpoints, step_dir
from eksft_nb.runtime.checkpoint import load
from jobs import run_ranks

STEPS = (5, 10, 15, 20)
LEFTOVER = "__1_0.distcp.leftover"  # in the folder of step 15 before the job starts


def _rank(rank: int, root: str, store: str, out: str) -> None:
    """One rank: async saves at STEPS, each committed before the next. From the third save on, rank 0
    starts each save late, once rank 1's writer has finished its files for it or after a few seconds
    (with the save plan kept, rank 1 writes without waiting for rank 0): the order a busy rank 0 sees
    in training, where it prunes after a commit while rank 1 goes on to the next save."""
    os.environ["RANK"] = str(rank)
    from eksft_nb.runtime.checkpoint import CheckpointManager

    dist.init_process_group("gloo", store=dist.FileStore(store, 2), rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=120))
    events: list[dict[str, Any]] = []
    mgr = CheckpointManager(Path(root), rank=rank, world_size=2, group=dist.new_group(backend="gloo"),
                            every=5,
                            mode="async", keep_last=10, emit=lambda kind, **data: events.append(data))
    if rank == 0:
        save = mgr._save

        def late_save(step: int, state: dict[str, Any]) -> None:
            deadline = time.monotonic() + (3 if step > STEPS[1] else 0)  # rank 1 waits for rank 0: go on
            folder = step_dir(Path(root), step)
            while not (folder / "manifest-1.json").exists() and not (folder / LEFTOVER).exists() \
                    and time.monotonic() < deadline:
                time.sleep(0.01)
            save(step, state)
        mgr._save = late_save  # type: ignore[method-assign]
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8)
    for step in STEPS:
        with torch.no_grad():
            model.weight.add_(1.0)
        mgr.maybe_save(step, {"model": model.state_dict()})
        mgr.finish()
    Path(out).write_text(json.dumps([e for e in events if e.get("phase") == "failed"]))
    dist.destroy_process_group()
    mgr.writer.stop()  # a multiprocessing child joins its children before atexit would stop the writer


def test_rank_0_never_removes_files_another_rank_is_writing(tmp_path: Path) -> None:
    """Rank 1 may be ahead of rank 0 in the same save: rank 0 must not take its files for a leftover and
    remove them. A real leftover is still removed, before any rank writes into its folder."""
    root = tmp_path / "ckpt"
    step_dir(root, 15).mkdir(parents=True)  # a leftover ahead: cleared before any rank writes into it
    (step_dir(root, 15) / LEFTOVER).write_bytes(b"from a crashed run")
    (step_dir(root, 15) / "commit.json").write_text("{}")
    outs = [tmp_path / f"out{r}.json" for r in range(2)]
    assert run_ranks(_rank,
                     [(r, str(root), str(tmp_path / "store"), str(outs[r])) for r in range(2)]) == [0, 0]
    assert json.loads(outs[0].read_text()) == []  # no save failed
    committed = [i.step for i in list_checkpoints(root) if i.state == "committed"]
    assert committed == list(STEPS)
    assert not (step_dir(root, 15) / LEFTOVER).exists()


def _changing_rank(rank: int, root: str, store: str, out: str) -> None:
    """One rank saving its own tensor every 5 steps (async, each save finished before the next);
    from step 15 on, rank 1 alone also saves a second tensor. Writes what committed and failed,
    and whether each committed checkpoint loads back this rank's tensors bit-exactly."""
    os.environ["RANK"] = str(rank)
    from eksft_nb.runtime.checkpoint import CheckpointManager

    dist.init_process_group("gloo", store=dist.FileStore(store, 2), rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=60))
    group = dist.new_group(backend="gloo")
    events: list[dict[str, Any]] = []
    mgr = CheckpointManager(Path(root), rank=rank, world_size=2, group=group, every=5, mode="async",
                            keep_last=10,
                            emit=lambda kind, **data: events.append(data))
    state = {f"w{rank}": torch.full((16, 16), float(rank))}
    saved: dict[int, dict[str, torch.Tensor]] = {}
    for step in range(1, 22):
        state[f"w{rank}"].add_(1.0)
        if rank == 1 and step == 15:
            state["extra1"] = torch.arange(8.0)
        if mgr.due(step):
            saved[step] = {k: v.clone() for k, v in state.items()}
        mgr.maybe_save(step, state)
        mgr.finish()
    committed = [i.step for i in list_checkpoints(Path(root)) if i.state == "committed"]
    exact = {}
    for step in committed:
        target = {k: torch.zeros_like(v) for k, v in saved[step].items()}
        load(step_dir(Path(root), step), target, group)
        exact[step] = all(torch.equal(target[k], v) for k, v in saved[step].items())
    Path(out).write_text(json.dumps({"failed": [[e["step"], e["error"]] for e in events
                                                if e.get("phase") == "failed"],
                                     "committed": committed, "exact": exact,
                                     "reused": mgr.plan_cache.reused}))
    dist.destroy_process_group()
    mgr.writer.stop()


def test_a_layout_change_on_one_rank_fails_that_save_everywhere_and_the_next_commits(tmp_path: Path) -> None:
    """With the save plan kept, no rank checks the others' layouts before it writes. When only rank 1's
    staged state changes layout, nothing hangs: that save fails on both ranks (never committed), the
    next step's plans anew everywhere and commits, and every committed checkpoint loads bit-exactly."""
    root = tmp_path / "ckpt"
    outs = [tmp_path / f"out{r}.json" for r in range(2)]
    assert run_ranks(_changing_rank,
                     [(r, str(root), str(tmp_path / "store"), str(outs[r])) for r in range(2)],
                     timeout=240) == [0, 0]
    result = [json.loads(o.read_text()) for o in outs]
    [[step, error]] = result[0]["failed"]  # rank 0 reports it, with rank 1's reason
    assert step == 15 and error.startswith("rank 1: its staged state changed layout"), error
    assert result[0]["committed"] == result[1]["committed"] == [5, 10, 16, 20]
    assert all(r["exact"] == {"5": True, "10": True, "16": True, "20": True} for r in result)
    assert [r["reused"] for r in result] == [1, 1]  # planned anew at 16 on both ranks, kept at 20
