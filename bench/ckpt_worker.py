"""One rank of the checkpoint-stall benchmark; :mod:`bench.ckpt` starts two under ``torchrun``.

The built-in GPT (FSDP2, gloo, one thread per rank, like the trainer) trains while its
model+optimizer state is saved with each method in turn. The methods take turns save by save
(round-robin), so load drift on a shared machine hits them all alike. One turn: a few clean
steps, the save (the training loop is blocked until the call returns), then training goes on until
every rank sees the save committed (polled at step boundaries, as a trainer would). Rank 0 writes
the raw per-save figures as JSON; :mod:`bench.ckpt` summarises them.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# (vocab, d_model, n_layers, n_heads): model + AdamW state of about 2 MB (the tests' smallest input), 100 MB,
# 1 GB and 4 GB
SIZES = {"2MB": (512, 64, 2, 4), "100MB": (8192, 256, 6, 4), "1GB": (16384, 1024, 4, 16),
         "4GB": (32768, 2048, 4, 16)}
BATCH, SEQ = 2, 32
CLEAN_STEPS = 3          # steps before each save: the unloaded step time
MAX_OVERLAP_STEPS = 400  # a save that is not committed after this many steps is reported as such


@dataclass
class Record:
    """One rank's figures for one save (``stage_s``: eksft only, its copy into the staging buffers)."""

    blocked_s: float
    committed_s: float
    overlap_steps: list[float] = field(default_factory=list)
    stage_s: float | None = None
    blocked_cpu_s: float = 0.0  # CPU time of the training thread while blocked (load-independent)


class Method:
    """A way to save the state. ``save`` blocks the training loop; ``done`` is polled at step boundaries."""

    name = ""

    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx
        self.dir = ctx.root / self.name.replace(" ", "_")

    def save(self, i: int, step: int) -> None:
        raise NotImplementedError

    def done(self, step: int) -> bool:
        return True

    def folder(self, i: int) -> Path:
        return self.dir / f"save_{i:03d}"

    def written(self, i: int) -> int:
        """Rank 0, once save ``i`` is committed: the bytes it put on disk (then removed to keep disk use
        flat)."""
        folder = self.folder(i)
        if not folder.exists():
            return 0
        size = sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())
        shutil.rmtree(folder)
        return size


class Memcpy(Method):
    """The floor: one copy of every local tensor of the state into buffers allocated once."""

    name = "memcpy floor"

    def __init__(self, ctx: Context) -> None:
        super().__init__(ctx)
        self.buffers = [t.detach().clone().share_memory_() for t in ctx.local_tensors()]

    def save(self, i: int, step: int) -> None:
        for buf, src in zip(self.buffers, self.ctx.local_tensors()):
            buf.copy_(src)


class TorchSave(Method):
    """``torch.save`` of this rank's shards to its own file, fsynced (as DCP does)."""

    name = "torch.save"

    def save(self, i: int, step: int) -> None:
        from torch.distributed.tensor import DTensor

        path = self.folder(i) / f"rank{self.ctx.rank}.pt"
        path.parent.mkdir(parents=True, exist_ok=True)
        state = _map(self.ctx.state["train"].state_dict(),
                     lambda t: t.to_local() if isinstance(t, DTensor) else t)
        with open(path, "wb") as f:
            self.ctx.torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())


class DcpSave(Method):
    name = "dcp.save"

    def save(self, i: int, step: int) -> None:
        import torch.distributed.checkpoint as dcp

        dcp.save(self.ctx.state, checkpoint_id=str(self.folder(i)), process_group=self.ctx.ckpt_group)


class DcpAsyncSave(Method):
    """``dcp.async_save`` with its defaults (a thread, a fresh CPU copy per save), on its own group."""

    name = "dcp.async_save"

    def __init__(self, ctx: Context) -> None:
        super().__init__(ctx)
        import torch.distributed as dist

        self.group = dist.new_group(backend="gloo", timeout=datetime.timedelta(minutes=10))
        self.future: Any = None

    def save(self, i: int, step: int) -> None:
        import torch.distributed.checkpoint as dcp

        self.future = dcp.async_save(self.ctx.state, checkpoint_id=str(self.folder(i)),
                                     process_group=self.group)

    def done(self, step: int) -> bool:
        if not self.future.done():
            return False
        self.future.result()  # raises if the save failed
        return True


class Eksft(Method):
    """eksft's async path: :class:`~eksft_nb.runtime.checkpoint.CheckpointManager` as the trainer uses it."""

    name = "eksft async"

    def __init__(self, ctx: Context) -> None:
        super().__init__(ctx)
        from eksft_nb.runtime.checkpoint import CheckpointManager

        self.events: list[dict[str, Any]] = []
        # every=0: never due on its own; save() makes the chosen step due, as a schedule would
        # job_uid: a job uid, so the staged buffers live in a named /dev/shm file, as in a job
        # (see restore_times)
        self.mgr = CheckpointManager(self.dir, rank=ctx.rank, world_size=ctx.world, group=ctx.ckpt_group,
                                     every=0,
                                     mode="async", keep_last=2,
                                     emit=lambda kind, **data: self.events.append({"kind": kind, **data}),
                                     job_uid=f"bench{os.getppid()}", process=ctx.process)
        self.saving: int | None = None
        self.stager = self.mgr.stager = TimedStager(self.mgr.stager)

    def save(self, i: int, step: int) -> None:
        self.mgr.every, self.saving = step, step
        self.mgr.maybe_save(step, self.ctx.state)
        self.mgr.every = 0

    def done(self, step: int) -> bool:
        self.mgr.maybe_save(step, self.ctx.state)  # finalizes (commits) once every rank's write is done
        return self.mgr.last_committed == self.saving

    def written(self, i: int) -> int:
        """The size in the commit record (the manager prunes old checkpoints itself: keep_last=2)."""
        return next(e["bytes"] for e in reversed(self.events)
                    if e["kind"] == "checkpoint" and e["phase"] == "committed" and e["step"] == self.saving)


class TimedStager:
    """eksft's stager, timed: splits eksft's blocked time into staging (state_dict() and the copy into
    shared memory) and the rest (DCP save planning across ranks, hand-off to the writer)."""

    def __init__(self, stager: Any) -> None:
        self.stager, self.last_s = stager, 0.0

    def stage(self, state: Any) -> Any:
        t0 = time.perf_counter()
        staged = self.stager.stage(state)
        self.last_s = time.perf_counter() - t0
        return staged

    def __getattr__(self, name: str) -> Any:
        """Everything else is the stager's own (what the manager reads of it: staged bytes, copy time...)."""
        return getattr(self.stager, name)


METHODS = (Memcpy, TorchSave, DcpSave, DcpAsyncSave, Eksft)


class Context:
    """The model, optimizer and process groups of this rank."""

    def __init__(self, size: str, root: Path) -> None:
        import torch
        import torch.distributed as dist

        from eksft_nb.runtime.checkpoint import CheckpointProcess, ModelState
        from eksft_nb.runtime.model import build_model

        self.torch, self.dist = torch, dist
        self.process = CheckpointProcess()  # the rank process's writer and buffers, as the session's
        self.process.writer.start()  # as the trainer does: the writer process spawns while the model is built
        torch.set_num_threads(1)
        dist.init_process_group("gloo", timeout=datetime.timedelta(minutes=10))
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.ckpt_group = dist.new_group(backend="gloo", timeout=datetime.timedelta(minutes=10))
        self.root = root
        vocab, d, layers, heads = SIZES[size]
        self.vocab = vocab
        self.model = build_model(vocab, d, layers, heads, SEQ, 0, torch.device("cpu"), fsdp=True)
        self.optim = torch.optim.AdamW(self.model.parameters(), lr=1e-4)
        self.state = {"train": ModelState(self.model, self.optim)}
        self.gen = torch.Generator().manual_seed(self.rank)
        self.steps = 0
        for _ in range(2):  # the optimizer state exists from the first step on
            self.step()

    def step(self) -> float:
        from eksft_nb.runtime.model import loss_fn

        t0 = time.perf_counter()
        tokens = self.torch.randint(0, self.vocab, (BATCH, SEQ + 1), generator=self.gen)
        loss = loss_fn(self.model, tokens)
        loss.backward()
        self.optim.step()
        self.optim.zero_grad(set_to_none=True)
        mean = loss.detach().clone()
        self.dist.all_reduce(mean)
        self.steps += 1
        return time.perf_counter() - t0

    def local_tensors(self) -> list[Any]:
        """This rank's shards of the parameters and of the optimizer state, in a fixed order."""
        out = [p.to_local() if hasattr(p, "to_local") else p for p in self.model.parameters()]
        for p in self.model.parameters():
            for v in self.optim.state[p].values():
                if isinstance(v, self.torch.Tensor):
                    out.append(v.to_local() if hasattr(v, "to_local") else v)
        return [t.detach() for t in out]

    def all_true(self, flag: bool) -> bool:
        t = self.torch.tensor([1 if flag else 0], dtype=self.torch.int32)
        self.dist.all_reduce(t, op=self.dist.ReduceOp.MIN)
        return bool(t.item())

    def state_bytes(self) -> int:
        t = self.torch.tensor([sum(x.numel() * x.element_size() for x in self.local_tensors())],
                              dtype=self.torch.int64)
        self.dist.all_reduce(t)
        return int(t.item())


def turn(ctx: Context, method: Method, i: int, clean: list[float]) -> Record:
    """Clean steps, one save, then steps until every rank sees it committed."""
    ctx.dist.barrier()
    clean.extend(ctx.step() for _ in range(CLEAN_STEPS))
    t0, c0 = time.perf_counter(), time.thread_time()
    method.save(i, ctx.steps)
    rec = Record(blocked_s=time.perf_counter() - t0, committed_s=0.0, blocked_cpu_s=time.thread_time() - c0)
    if isinstance(method, Eksft):
        rec.stage_s = method.stager.last_s
    while not ctx.all_true(method.done(ctx.steps)):
        if len(rec.overlap_steps) >= MAX_OVERLAP_STEPS:
            rec.committed_s = float("nan")
            return rec
        rec.overlap_steps.append(ctx.step())
    rec.committed_s = time.perf_counter() - t0
    return rec


def restore_times(ctx: Context, eksft: Eksft) -> dict[str, Any]:
    """Restore eksft's last checkpoint into the live state, from the ranks' in-memory copies and then
    from storage (the copy's record removed), as a restart would; the slowest rank's wall and CPU
    seconds for each. Storage here is the page cache the files were just written to: a floor."""
    from eksft_nb.runtime import memcopy

    mgr, path = eksft.mgr, memcopy.copy_path(eksft.mgr.job_uid, ctx.rank)
    record = path.with_name(path.name + ".json")
    deadline = time.monotonic() + 120
    while not record.exists() and time.monotonic() < deadline:  # published once its digest is computed
        time.sleep(0.05)
    out: dict[str, Any] = {}
    for source in ("memory", "storage"):
        if source == "storage":
            record.unlink(missing_ok=True)
        ctx.dist.barrier()
        t0, c0 = time.perf_counter(), time.process_time()
        mgr.restore(ctx.state, "latest", restarting=True)
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        resume = next(e for e in reversed(eksft.events) if e["kind"] == "resume")
        mine = {"wall_s": wall, "cpu_s": cpu, "source": resume.get("source"),
                "verify_s": resume.get("verify_s")}
        gathered: list[Any] = [None] * ctx.world
        ctx.dist.all_gather_object(gathered, mine)
        out[source] = max(gathered, key=lambda r: r["wall_s"])
    return out


def main() -> None:
    from eksft_nb.runtime import memcopy
    from eksft_nb.runtime.quiet import quiet_process

    quiet_process()
    p = argparse.ArgumentParser()
    p.add_argument("--size", choices=list(SIZES), required=True)
    p.add_argument("--saves", type=int, required=True, help="measured saves per method (after one warm-up)")
    p.add_argument("--root", type=Path, required=True, help="folder the checkpoints are written to")
    p.add_argument("--out", type=Path, required=True, help="JSON file rank 0 writes")
    args = p.parse_args()

    ctx = Context(args.size, args.root)
    methods = [cls(ctx) for cls in METHODS]
    records: dict[str, list[Record]] = {m.name: [] for m in methods}
    written: dict[str, list[int]] = {m.name: [] for m in methods}
    clean: list[float] = []
    for i in range(args.saves + 1):  # save 0 of each method is the warm-up
        for m in methods:
            records[m.name].append(turn(ctx, m, i, clean))
            ctx.dist.barrier()
            if ctx.rank == 0:
                written[m.name].append(m.written(i))
    state_bytes = ctx.state_bytes()
    gathered: list[Any] = [None] * ctx.world
    ctx.dist.all_gather_object(gathered, {k: [r.__dict__ for r in v] for k, v in records.items()})
    eksft = next(m for m in methods if isinstance(m, Eksft))
    eksft.mgr.finish()
    restore = restore_times(ctx, eksft)
    memcopy.remove_copies(eksft.mgr.job_uid)
    if ctx.rank == 0:
        out = {"size": args.size, "dims": SIZES[args.size], "batch": BATCH, "seq": SEQ,
               "world_size": ctx.world,
               "state_bytes": state_bytes, "clean_steps": clean, "records": gathered, "disk_bytes": written,
               "eksft_events": [e for e in eksft.events if e["kind"] == "checkpoint"], "restore": restore}
        args.out.write_text(json.dumps(out, allow_nan=True))
    ctx.dist.barrier()
    ctx.dist.destroy_process_group()


def _map(obj: Any, fn: Any) -> Any:
    if isinstance(obj, dict):
        return {k: _map(v, fn) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_map(v, fn) for v in obj]
    return fn(obj)


if __name__ == "__main__":  # the NVRx writer is spawned: it re-imports this module
    main()
