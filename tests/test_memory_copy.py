"""Restoring from the newest in-memory copy (the staged buffers of the last committed save, each in
a named /dev/shm file of its own): when it is used, and that anything doubtful falls back to storage."""

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
from eksft_nb.runtime.memcopy import Header, buffer_path, copy_path, decode_value, encode_value, parse_header
from jobs import fsdp_snapshot, run_ranks

# ---- the header parser ----------------------------------------------------------------------------

_DTYPES = sorted(memcopy._ITEMSIZE)


@st.composite
def headers(draw: Any) -> dict[str, Any]:
    """A header as the stager writes one."""
    count = draw(st.integers(0, 6))
    files = draw(st.permutations(range(count + draw(st.integers(0, 2))))) if count else []
    entries = []
    for i in range(count):
        dtype = draw(st.sampled_from(_DTYPES))
        shape = draw(st.lists(st.integers(0, 5), max_size=3))
        nbytes = math.prod(shape) * memcopy._ITEMSIZE[dtype]
        dtensor = draw(st.none() | st.just({"shape": [8], "mesh": [2], "placements": ["S(0)"],
                                            "coordinate": [1]}))
        entries.append({"key": f"/m/{i}", "dtype": dtype, "shape": shape, "file": files[i], "nbytes": nbytes,
                        "digest": "0badcafe" * -(-nbytes // memcopy.CHUNK), "dtensor": dtensor})
    return {"format": memcopy.FORMAT, "version": memcopy.VERSION, "run": "r1", "rank": 1, "world_size": 2,
            "step": draw(st.integers(0, 10**6)), "committed_at": 1.5e9, "entries": entries,
            "values": {"/data/position": 7, "/o/betas": {"t": [0.9, 0.99]}}}


def _consistent(header: Header) -> bool:
    """Every buffer has a file of its own, a size its shape and dtype give, and its checksums."""
    entries = header.entries.values()
    return len({e.file for e in entries}) == len(header.entries) and all(
        e.nbytes == math.prod(e.shape) * memcopy._ITEMSIZE[e.dtype] and len(e.digest) == 8
        * -(-e.nbytes // memcopy.CHUNK)
        for e in entries)


@settings(max_examples=150, deadline=None)
@given(headers())
def test_a_header_the_stager_writes_parses_back(raw: dict[str, Any]) -> None:
    header = parse_header(json.dumps(raw))
    assert isinstance(header, Header), header
    assert (header.step, len(header.entries)) == (raw["step"], len(raw["entries"])) and _consistent(header)
    assert [e.file for e in header.entries.values()] == [e["file"] for e in raw["entries"]]


_JUNK = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
                     lambda inner: st.lists(inner,
                                            max_size=3) | st.dictionaries(
                                                st.text(max_size=8), inner, max_size=3),
                     max_leaves=8)


@settings(max_examples=200, deadline=None)
@given(headers(), st.data())
def test_a_damaged_header_is_refused_with_a_reason_never_an_exception(raw: dict[str, Any], data: Any) -> None:
    """Another job's, a stale, a truncated or a garbage header: a Header that is still consistent
    (a file per buffer, sized by shape and dtype, with its checksums) or one line saying why not."""
    how = data.draw(st.sampled_from(["field", "entry", "shared file", "truncate", "bytes"]))
    if how == "field":
        raw[data.draw(st.sampled_from(sorted(raw)))] = data.draw(_JUNK)
    elif how == "entry" and raw["entries"]:
        entry = data.draw(st.sampled_from(raw["entries"]))
        entry[data.draw(st.sampled_from(sorted(entry)))] = data.draw(_JUNK | st.integers(-10, 10**4))
    elif how == "shared file" and len(raw["entries"]) > 1:
        raw["entries"][-1]["file"] = raw["entries"][0]["file"]
    text: str | bytes = json.dumps(raw)
    if how == "truncate":
        text = text[:data.draw(st.integers(0, len(text) - 1))]
    elif how == "bytes":
        text = data.draw(st.binary(max_size=200))
    header = parse_header(text)
    if isinstance(header, str):
        assert header and "\n" not in header
    else:
        assert _consistent(header)
    if how == "shared file" and len(raw["entries"]) > 1:
        assert header == f"its buffer '/m/{len(raw['entries']) - 1}' shares its file with another"


_PLAIN = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8)
                      | st.binary(max_size=8),
                      lambda inner: st.lists(inner, max_size=3) | st.tuples(inner, inner)
                      | st.dictionaries(st.text(max_size=8), inner, max_size=3), max_leaves=8)


@settings(max_examples=150, deadline=None)
@given(_PLAIN)
def test_plain_values_round_trip_through_the_header(value: Any) -> None:
    assert decode_value(json.loads(json.dumps(encode_value(value)))) == value


def test_a_job_uid_that_is_not_a_plain_name_keeps_no_copy() -> None:
    assert copy_path("", 0) is None and copy_path("../x", 0) is None and copy_path("..", 0) is None
    assert copy_path("abc123", 3) == Path("/dev/shm/eksft-abc123-3")
    assert buffer_path(copy_path("abc123", 3), 12) == Path("/dev/shm/eksft-abc123-3.12")
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


def _record(run: str, rank: int) -> Path:
    return copy_path(run, rank).with_name(copy_path(run, rank).name + ".json")


def _wait_published(run: str, rank: int) -> None:
    """The copy's record is written in the background once its digest is computed."""
    deadline = time.monotonic() + 120
    while not _record(run, rank).exists():
        assert time.monotonic() < deadline, "the in-memory copy was never published"
        time.sleep(0.02)


def _rank(rank: int, incarnation: int, root: str, store: str, run: str, out: str) -> None:
    """Incarnation 0 trains and saves (steps 5 and 10) and ends without cleaning up, like a rank that
    is killed. Incarnation 1 is the next process of the same rank: it restores from memory, then
    from storage once rank 1's copy is corrupted, and once rank 0's record is garbage."""
    os.environ["RANK"] = str(rank)
    from eksft_nb.runtime.checkpoint import CheckpointManager, ModelState

    dist.init_process_group("gloo", store=dist.FileStore(store, 2), rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=120))
    events: list[dict[str, Any]] = []
    mgr = CheckpointManager(Path(root), rank=rank, world_size=2, group=dist.new_group(backend="gloo"),
                            every=5, mode="async", keep_last=3,
                            emit=lambda kind, **data: events.append({"kind": kind, **data}), job_uid=run)
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
                largest = max(json.loads(_record(run, 1).read_text())["entries"], key=lambda e: e["nbytes"])
                with open(buffer_path(copy_path(run, 1), largest["file"]), "r+b") as f:
                    f.seek(100)
                    byte = f.read(1)
                    f.seek(100)
                    f.write(bytes([byte[0] ^ 0xFF]))
            if case == "garbage header" and rank == 0:
                _record(run, 0).write_text('{"format": "eksft-memory-copy",')
            dist.barrier()
            model, optim = _model()
            data = {"position": 0}
            step = mgr.restore({"train": ModelState(model, optim), "data": data}, "latest", restarting=True)
            got = fsdp_snapshot(model, optim)
            resume = [e for e in events if e["kind"] == "resume"][-1]
            result[case] = {"step": step, "position": data["position"], "source": resume["source"],
                            "memory": resume.get("memory"),
                            "same": got.keys() == saved.keys()
                            and all(torch.equal(got[k], v) for k, v in saved.items())}
    Path(out).write_text(json.dumps(result))
    dist.destroy_process_group()
    mgr.writer.stop()


def _run(tmp_path: Path, incarnation: int, run: str) -> list[dict[str, Any]]:
    outs = [tmp_path / f"out{incarnation}-{r}.json" for r in range(2)]
    args = [(r, incarnation, str(tmp_path / "ckpt"), str(tmp_path / f"store{incarnation}"), run, str(outs[r]))
            for r in range(2)]
    assert run_ranks(_rank, args) == [0, 0]
    return [json.loads(o.read_text()) for o in outs]


def test_the_next_rank_process_restores_from_memory_and_falls_back_to_storage_when_in_doubt(
    tmp_path: Path) -> None:
    """Two real ranks save; their successors (new processes, as after an in-job restart) restore the
    newest checkpoint from the copies left in /dev/shm, bit exact and without reading storage; a
    corrupted copy on one rank, or a garbage record, sends every rank to storage, with the same result."""
    run = f"test{uuid.uuid4().hex[:12]}"
    try:
        _run(tmp_path, 0, run)
        kept = [json.loads(_record(run, r).read_text())["entries"] for r in range(2)]
        assert all(buffer_path(copy_path(run, r), e["file"]).stat().st_size == e["nbytes"]
                   for r in range(2) for e in kept[r] if e["nbytes"])
        result = _run(tmp_path, 1, run)[0]
    finally:
        removed = memcopy.remove_copies(run)
    files = 2 + sum(1 for entries in kept for e in entries if e["nbytes"])  # a record and a file per buffer
    assert removed == files and not list(Path("/dev/shm").glob(f"*eksft-{run}-*"))
    assert result["intact"] == {"step": 10, "position": 10, "source": "memory", "memory": None, "same": True}
    corrupt = result["corrupt data"]
    assert (corrupt["step"], corrupt["position"], corrupt["source"],
            corrupt["same"]) == (10, 10, "storage", True)
    assert "rank 1: its buffers do not match their checksums" in corrupt["memory"]
    garbage = result["garbage header"]
    assert (garbage["step"], garbage["position"], garbage["source"],
            garbage["same"]) == (10, 10, "storage", True)
    assert "rank 0: its header is not JSON" in garbage["memory"]


@pytest.fixture()
def group() -> Any:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=60))
    yield dist.new_group(backend="gloo")
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def process() -> Any:
    """The test process's writer and buffers, shared by its managers as a rank process's are."""
    from eksft_nb.runtime.checkpoint import CheckpointProcess

    shared = CheckpointProcess()
    yield shared
    shared.writer.stop()


def test_a_copy_being_overwritten_by_a_newer_save_is_not_used(tmp_path: Path, group: Any,
                                                              process: Any) -> None:
    """The fault hits while a newer save is staged (its write then fails): the buffers no longer hold
    the newest committed step, so it comes from storage; another run's copy is never looked at."""
    from eksft_nb.runtime.checkpoint import CheckpointManager

    run = f"test{uuid.uuid4().hex[:12]}"
    events: list[dict[str, Any]] = []
    try:
        mgr = CheckpointManager(tmp_path, rank=0, world_size=1, group=group, every=5, mode="async",
                                keep_last=3, emit=lambda kind, **data: events.append({"kind": kind, **data}),
                                job_uid=run, process=process)
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
        other = CheckpointManager(tmp_path, rank=0, world_size=1, group=group, every=5, mode="async",
                                  keep_last=3,
                                  emit=lambda kind, **data: events.append({"kind": kind, **data}),
                                  job_uid=run + "x", process=process)
        assert other.restore({"model": fresh}, "latest", restarting=False) == 5
        assert events[-1]["source"] == "storage"
    finally:
        memcopy.remove_copies(run)


def test_each_staged_buffer_is_a_storage_of_its_own_and_the_save_plan_is_kept(tmp_path: Path, group: Any,
                                                                               process: Any) -> None:
    """Staged buffers that were views into one shared file would be cloned by NVRx on the training
    thread at every save, and the save plan, which needs the staged buffers themselves, never kept."""
    from eksft_nb.runtime.checkpoint import CheckpointManager

    run = f"test{uuid.uuid4().hex[:12]}"
    try:
        mgr = CheckpointManager(tmp_path, rank=0, world_size=1, group=group, every=5, mode="async",
                                keep_last=2, emit=lambda kind, **data: None, job_uid=run, process=process)
        model = torch.nn.Linear(16, 8)
        for step in (5, 10, 15):
            mgr.maybe_save(step, {"model": model.state_dict(), "step": torch.tensor(step)})
            mgr.finish()
        _wait_published(run, 0)
        entries = json.loads(_record(run, 0).read_text())["entries"]
    finally:
        memcopy.remove_copies(run)
    assert mgr.plan_cache is not None and mgr.plan_cache.reused == 2  # planned at 5, kept at 10 and 15
    buffers = mgr.stager._buffers
    assert len(buffers) == 3 and all(
        b.untyped_storage().nbytes() == b.numel() * b.element_size() for b in buffers.values())
    assert sorted(e["file"] for e in entries) == [0, 1, 2] and mgr.shelf.path == copy_path(run, 0)


def test_a_state_that_does_not_fit_in_dev_shm_keeps_no_copy(tmp_path: Path) -> None:
    """/dev/shm too small (here a file-size limit makes reserving the file fail, as a full tmpfs
    would): the reason, and no file left; a buffer whose file cannot be made leaves none of the
    others' either, and the stager then uses anonymous shared memory as before."""
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
    wanted = {"/small": (torch.Size([16]), torch.float32), "/large": (torch.Size([1 << 18]), torch.float32)}
    shelf = memcopy.Shelf()
    shelf.bind("", 0, 1)  # no job uid: anonymous shared memory, no file
    buffers = shelf.allocate(wanted)
    assert all(b.is_shared() for b in buffers.values()) and shelf.path is None \
        and shelf.note == "the job has no job uid"
    run = f"test{uuid.uuid4().hex[:12]}"
    shelf.bind(run, 0, 1)
    blocker = buffer_path(copy_path(run, 0), 1)  # the large buffer's file cannot be made; the small one's can
    blocker.mkdir()
    try:
        buffers = shelf.allocate(wanted)
    finally:
        blocker.rmdir()
        left = list(Path("/dev/shm").glob(f"*eksft-{run}-*"))
        memcopy.remove_copies(run)
    assert not left and shelf.path is None and f"{blocker} cannot be created" in shelf.note  # all or none
    assert all(b.is_shared() and b.shape == wanted[k][0] for k, b in buffers.items())


def test_copies_of_jobs_with_no_live_process_are_swept_and_no_others() -> None:
    """What a job that could not clean up left (its supervisor killed with it) goes at the next
    launch; a live job's copies, and files that are not a job's copies, stay."""
    dead, live = uuid.uuid4().hex[:16], uuid.uuid4().hex[:16]
    paths = {name: Path("/dev/shm") / name for name in
             (f"eksft-{dead}-0", f"eksft-{dead}-0.7", f"eksft-{dead}-0.json", f".eksft-{dead}-1.json.123.tmp",
              f"eksft-{live}-0.3",
              f"eksft-{dead}-notarank", f"eksft-test{dead[:8]}-0", f"eksft-test{dead[:8]}-x-0")}
    try:
        for path in paths.values():
            path.write_bytes(b"x")
        memcopy.remove_stale_copies({live})
        assert sorted(n for n, p in paths.items() if p.exists()) == sorted(
            [f"eksft-{live}-0.3", f"eksft-{dead}-notarank", f"eksft-test{dead[:8]}-0",
             f"eksft-test{dead[:8]}-x-0"])
        assert memcopy.remove_copies(f"test{dead[:8]}") == 1  # not the run whose id it begins
        assert paths[f"eksft-test{dead[:8]}-x-0"].exists()
    finally:
        for path in paths.values():
            path.unlink(missing_ok=True)
