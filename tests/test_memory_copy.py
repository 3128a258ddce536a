"""Restoring from the newest in-memory copy (the staged buffers of the last committed save, in a
named /dev/shm file per rank): when it is used, and that anything doubtful falls back to storage."""

from __future__ import annotations

import datetime
import json
import math
import os
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

from eksft_nb.runtime import memcopy
from eksft_nb.runtime.memcopy import Header, copy_path, decode_value, encode_value, parse_header
from jobs import fsdp_snapshot, run_ranks

# ---- the header parser ----------------------------------------------------------------------------

_DTYPES = sorted(memcopy._ITEMSIZE)


@st.composite
def headers(draw: Any) -> tuple[dict[str, Any], int]:
    """A header as the stager writes one, and its data file's size."""
    entries, offset = [], 0
    for i in range(draw(st.integers(0, 6))):
        dtype = draw(st.sampled_from(_DTYPES))
        shape = draw(st.lists(st.integers(0, 5), max_size=3))
        offset += draw(st.integers(0, 2)) * memcopy.ALIGN
        nbytes = math.prod(shape) * memcopy._ITEMSIZE[dtype]
        dtensor = draw(st.none() | st.just({"shape": [8], "mesh": [2], "placements": ["S(0)"], "coordinate": [1]}))
        entries.append({"key": f"/m/{i}", "dtype": dtype, "shape": shape, "offset": offset, "nbytes": nbytes,
                        "dtensor": dtensor})
        offset += -(-nbytes // memcopy.ALIGN) * memcopy.ALIGN
    size = offset + draw(st.integers(0, 100))
    header = {"format": memcopy.FORMAT, "version": memcopy.VERSION, "run": "r1", "rank": 1, "world_size": 2,
              "step": draw(st.integers(0, 10**6)), "committed_at": 1.5e9, "size": size, "digest": "0badcafe" * -(-size // memcopy.CHUNK),
              "entries": entries, "values": {"/data/position": 7, "/o/betas": {"t": [0.9, 0.99]}}}
    return header, size


@settings(max_examples=150, deadline=None)
@given(headers())
def test_a_header_the_stager_writes_parses_back(case: tuple[dict[str, Any], int]) -> None:
    raw, size = case
    header = parse_header(json.dumps(raw), size)
    assert isinstance(header, Header), header
    assert (header.step, header.size, len(header.entries)) == (raw["step"], size, len(raw["entries"]))
    assert all(e.offset + e.nbytes <= size for e in header.entries.values())


_JUNK = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
                     lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
                     max_leaves=8)


@settings(max_examples=200, deadline=None)
@given(headers(), st.data())
def test_a_damaged_header_is_refused_with_a_reason_never_an_exception(case: tuple[dict[str, Any], int],
                                                                       data: Any) -> None:
    """Another job's, a stale, a truncated or a garbage header: a Header that is still consistent
    (buffers inside the file, apart, sized by shape and dtype) or one line saying why not."""
    raw, size = case
    how = data.draw(st.sampled_from(["field", "entry", "truncate", "size", "bytes"]))
    if how == "field":
        raw[data.draw(st.sampled_from(sorted(raw)))] = data.draw(_JUNK)
    elif how == "entry" and raw["entries"]:
        entry = data.draw(st.sampled_from(raw["entries"]))
        entry[data.draw(st.sampled_from(sorted(entry)))] = data.draw(_JUNK | st.integers(-10, 10**4))
    text: str | bytes = json.dumps(raw)
    if how == "truncate":
        text = text[:data.draw(st.integers(0, len(text) - 1))]
    elif how == "size":
        size = data.draw(st.integers(0, 10**4))
    elif how == "bytes":
        text = data.draw(st.binary(max_size=200))
    header = parse_header(text, size)
    if isinstance(header, str):
        assert header and "\n" not in header
    else:
        spans = sorted((e.offset, e.offset + e.nbytes) for e in header.entries.values())
        assert all(end <= size for _, end in spans) and all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))
        assert all(e.nbytes == math.prod(e.shape) * memcopy._ITEMSIZE[e.dtype] for e in header.entries.values())


_PLAIN = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8)
                      | st.binary(max_size=8),
                      lambda inner: st.lists(inner, max_size=3) | st.tuples(inner, inner)
                      | st.dictionaries(st.text(max_size=8), inner, max_size=3), max_leaves=8)


@settings(max_examples=150, deadline=None)
@given(_PLAIN)
def test_plain_values_round_trip_through_the_header(value: Any) -> None:
    assert decode_value(json.loads(json.dumps(encode_value(value)))) == value


def test_a_run_id_that_is_not_a_plain_name_keeps_no_copy() -> None:
    assert copy_path("", 0) is None and copy_path("../x", 0) is None and copy_path("..", 0) is None
    assert copy_path("abc123", 3) == Path("/dev/shm/eksft-abc123-3")
    assert memcopy.remove_copies("") == 0 and memcopy.remove_copies("a/b") == 0


# ---- real saves and restores --------------------------------------------------------------------

def _model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    from eksft_nb.runtime.model import build_model

    model = build_model(64, 16, 2, 2, 8, 0, torch.device("cpu"), fsdp=True)
    return model, torch.optim.AdamW(model.parameters(), lr=0.01)


def _train(model: torch.nn.Module, optim: torch.optim.Optimizer, seed: int) -> None:
    from eksft_nb.runtime.model import loss_fn

    gen = torch.Generator().manual_seed(seed)
    loss_fn(model, torch.randint(0, 64, (2, 9), generator=gen)).backward()
    optim.step()
    optim.zero_grad()


def _wait_published(run: str, rank: int) -> None:
    """The copy's record is written in the background once its digest is computed."""
    deadline = time.monotonic() + 120
    while not copy_path(run, rank).with_name(copy_path(run, rank).name + ".json").exists():
        assert time.monotonic() < deadline, "the in-memory copy was never published"
        time.sleep(0.02)


def _rank(rank: int, incarnation: int, root: str, store: str, run: str, out: str) -> None:
    """Incarnation 0 trains and saves (steps 5 and 10) and ends without cleaning up, like a rank that
    is killed. Incarnation 1 is the next process of the same rank: it restores from memory, then
    from storage once rank 1's copy is corrupted, and once rank 0's record is garbage."""
    os.environ["RANK"] = str(rank)
    from eksft_nb.runtime.checkpointer import CheckpointManager, ModelState, _AsyncWriter

    dist.init_process_group("gloo", store=dist.FileStore(store, 2), rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=120))
    events: list[dict[str, Any]] = []
    mgr = CheckpointManager(Path(root), rank=rank, world_size=2, group=dist.new_group(backend="gloo"), every=5,
                            mode="async", keep_last=3, emit=lambda kind, **data: events.append({"kind": kind, **data}),
                            run=run)
    model, optim = _model()
    result: dict[str, Any] = {}
    if incarnation == 0:
        for step in (5, 10):
            _train(model, optim, step)
            expected = fsdp_snapshot(model, optim)  # collective
            mgr.maybe_save(step, {"train": ModelState(model, optim), "data": {"position": step}})
            _train(model, optim, 100 + step)   # training goes on while the writer works
            mgr.finish()
        if rank == 0:
            torch.save(expected, Path(out).with_name("expected.pt"))
        _wait_published(run, rank)
    else:
        saved = torch.load(Path(out).with_name("expected.pt"), weights_only=True)
        for case in ("intact", "corrupt data", "garbage header"):
            if case == "corrupt data" and rank == 1:
                with open(copy_path(run, 1), "r+b") as f:
                    f.seek(100)
                    byte = f.read(1)
                    f.seek(100)
                    f.write(bytes([byte[0] ^ 0xFF]))
            if case == "garbage header" and rank == 0:
                copy_path(run, 0).with_name(copy_path(run, 0).name + ".json").write_text('{"format": "eksft-memory-copy",')
            dist.barrier()
            model, optim = _model()
            data = {"position": 0}
            step = mgr.restore({"train": ModelState(model, optim), "data": data}, "latest", restarting=True)
            got = fsdp_snapshot(model, optim)
            resume = [e for e in events if e["kind"] == "resume"][-1]
            result[case] = {"step": step, "position": data["position"], "source": resume["source"],
                            "memory": resume.get("memory"),
                            "same": got.keys() == saved.keys() and all(torch.equal(got[k], v) for k, v in saved.items())}
    Path(out).write_text(json.dumps(result))
    dist.destroy_process_group()
    _AsyncWriter.stop()


def _run(tmp_path: Path, incarnation: int, run: str) -> list[dict[str, Any]]:
    outs = [tmp_path / f"out{incarnation}-{r}.json" for r in range(2)]
    args = [(r, incarnation, str(tmp_path / "ckpt"), str(tmp_path / f"store{incarnation}"), run, str(outs[r]))
            for r in range(2)]
    assert run_ranks(_rank, args) == [0, 0]
    return [json.loads(o.read_text()) for o in outs]


def test_the_next_rank_process_restores_from_memory_and_falls_back_to_storage_when_in_doubt(tmp_path: Path) -> None:
    """Two real ranks save; their successors (new processes, as after an in-job restart) restore the
    newest checkpoint from the copies left in /dev/shm, bit exact and without reading storage; a
    corrupted copy on one rank, or a garbage record, sends every rank to storage, with the same result."""
    run = f"test{uuid.uuid4().hex[:12]}"
    try:
        _run(tmp_path, 0, run)
        assert copy_path(run, 0).exists() and copy_path(run, 1).exists()
        result = _run(tmp_path, 1, run)[0]
    finally:
        removed = memcopy.remove_copies(run)
    assert removed == 4 and not list(Path("/dev/shm").glob(f"*eksft-{run}-*"))  # two files per rank, all gone
    assert result["intact"] == {"step": 10, "position": 10, "source": "memory", "memory": None, "same": True}
    corrupt = result["corrupt data"]
    assert (corrupt["step"], corrupt["position"], corrupt["source"], corrupt["same"]) == (10, 10, "storage", True)
    assert "rank 1: its buffers do not match their checksums" in corrupt["memory"]
    garbage = result["garbage header"]
    assert (garbage["step"], garbage["position"], garbage["source"], garbage["same"]) == (10, 10, "storage", True)
    assert "rank 0: its header is not JSON" in garbage["memory"]


@pytest.fixture()
def group() -> Any:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1, timeout=datetime.timedelta(seconds=60))
    yield dist.new_group(backend="gloo")
    dist.destroy_process_group()


def test_a_copy_being_overwritten_by_a_newer_save_is_not_used(tmp_path: Path, group: Any) -> None:
    """The fault hits while a newer save is staged (its write then fails): the buffers no longer hold
    the newest committed step, so it comes from storage; another run's copy is never looked at."""
    from eksft_nb.runtime.checkpointer import CheckpointManager

    run = f"test{uuid.uuid4().hex[:12]}"
    events: list[dict[str, Any]] = []
    try:
        mgr = CheckpointManager(tmp_path, rank=0, world_size=1, group=group, every=5, mode="async", keep_last=3,
                                emit=lambda kind, **data: events.append({"kind": kind, **data}), run=run)
        model = torch.nn.Linear(16, 16)
        mgr.maybe_save(5, {"model": model.state_dict()})
        mgr.finish()
        _wait_published(run, 0)
        at_5 = {k: v.clone() for k, v in model.state_dict().items()}
        with torch.no_grad():
            model.weight.add_(1.0)
        mgr.fail_next_write = True
        mgr.maybe_save(10, {"model": model.state_dict()})  # staged over step 5's buffers, never committed
        mgr.finish()
        fresh = torch.nn.Linear(16, 16)
        assert mgr.restore({"model": fresh}, "latest", restarting=True) == 5
        resume = [e for e in events if e["kind"] == "resume"][-1]
        assert resume["source"] == "storage" and "there is none" in resume["memory"]
        assert all(torch.equal(fresh.state_dict()[k], v) for k, v in at_5.items())
        other = CheckpointManager(tmp_path, rank=0, world_size=1, group=group, every=5, mode="async", keep_last=3,
                                  emit=lambda kind, **data: events.append({"kind": kind, **data}), run=run + "x")
        assert other.restore({"model": fresh}, "latest", restarting=False) == 5
        assert events[-1]["source"] == "storage"
    finally:
        memcopy.remove_copies(run)


def test_a_state_that_does_not_fit_in_dev_shm_keeps_no_copy(tmp_path: Path) -> None:
    """/dev/shm too small (here a file-size limit makes reserving the file fail, as a full tmpfs
    would): the reason, and no file left; the stager then uses anonymous shared memory as before."""
    import resource
    import signal

    path = tmp_path / "eksft-run-0"
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    previous = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (4096, hard))
    try:
        reserved = memcopy.reserve(path, 1 << 20)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, previous)
    assert isinstance(reserved, str) and "1 MB do not fit" in reserved and not path.exists()
    storage = memcopy.reserve(path, 1 << 20)  # with room, the same call reserves the file
    assert storage.nbytes() == 1 << 20 and path.stat().st_size == 1 << 20
    shelf = memcopy.Shelf()
    shelf.bind("", 0, 1)  # no run id: anonymous shared memory, no file
    assert shelf.allocate(100).is_shared() and shelf.path is None and shelf.note == "the job has no run id"


def test_copies_of_jobs_with_no_live_process_are_swept_and_no_others() -> None:
    """What a job that could not clean up left (its supervisor killed with it) goes at the next
    launch; a live job's copies, and files that are not a job's copies, stay."""
    dead, live = uuid.uuid4().hex[:16], uuid.uuid4().hex[:16]
    paths = {name: Path("/dev/shm") / name for name in
             (f"eksft-{dead}-0", f"eksft-{dead}-0.json", f".eksft-{dead}-1.json.123.tmp", f"eksft-{live}-0",
              f"eksft-{dead}-notarank", f"eksft-test{dead[:8]}-0", f"eksft-test{dead[:8]}-x-0")}
    try:
        for path in paths.values():
            path.write_bytes(b"x")
        memcopy.remove_stale_copies({live})
        assert sorted(n for n, p in paths.items() if p.exists()) == sorted(
            [f"eksft-{live}-0", f"eksft-{dead}-notarank", f"eksft-test{dead[:8]}-0", f"eksft-test{dead[:8]}-x-0"])
        assert memcopy.remove_copies(f"test{dead[:8]}") == 1  # not the run whose id it begins
        assert paths[f"eksft-test{dead[:8]}-x-0"].exists()
    finally:
        for path in paths.values():
            path.unlink(missing_ok=True)
