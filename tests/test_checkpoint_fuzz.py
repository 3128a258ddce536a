"""The loader fuzzer (issues 18 and 34): checkpoint folders and ``.metadata`` pickles derived from a
genuine save (opcode-level mutations, BUILD/SETITEM(S)/REDUCE/NEWOBJ/APPEND gadgets on allowed classes,
records of the wrong type or length or sharing bytes, symlinks, FIFOs, compressed archive entries) or
made to work an unpickler without bound (hash collisions, huge counts, deep nesting), each with its
checksums recomputed as an attacker would. Every case is refused with one line or loads the saved
state bit for bit; none hangs (a hard deadline), none raises the process's peak memory by more than
twice the checkpoint's size (plus a fixed allowance for the interpreter's own arenas), and none
changes the process (a fingerprint of pathlib's, torch's and DCP's classes before and after)."""

from __future__ import annotations

import datetime
import os
import pickle
import pickletools
import resource
import shutil
import signal
import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from ckpt_craft import (FLOODS, deflated, fingerprint, flood, inflating, name, relay, rewrite, tensor_archive,
                        text)
from eksft_nb.checkpoint_folders import list_checkpoints, step_dir, verify
from eksft_nb.errors import JobError
from eksft_nb.runtime.checkpoint import CheckpointManager, load

DEADLINE_S = 60          # one case: verify, load and restore (a genuine one takes well under a second)
ARENA_ALLOWANCE = 8 << 20  # what the interpreter and allocators may add to the peak RSS on their own


class Hang(BaseException):
    """Raised by the deadline's alarm: a BaseException, so that no loader's ``except Exception`` eats it."""


@contextmanager
def deadline(seconds: float) -> Iterator[None]:
    """Fail a case that runs past ``seconds``: from then on :class:`Hang` is raised in this (the main)
    thread every second, out of a blocking system call too (opening a FIFO), until the case gives up,
    and the case fails even if some code swallowed it (DCP's collectives catch BaseException). The
    signal goes to this thread: a process-wide alarm may be taken by one of torch's threads."""
    def fire(*_: Any) -> None:
        raise Hang(f"a case ran past {seconds}s (a hang)")

    main, done, expired = threading.get_ident(), threading.Event(), threading.Event()

    def watch() -> None:
        if done.wait(seconds):
            return
        expired.set()
        while not done.is_set():
            signal.pthread_kill(main, signal.SIGALRM)
            done.wait(1.0)

    old = signal.signal(signal.SIGALRM, fire)
    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        yield
    finally:
        while True:  # a last Hang may land in here: stop the watcher all the same
            try:
                done.set()
                watcher.join()
                signal.signal(signal.SIGALRM, old)
                break
            except Hang:
                continue
    if expired.is_set():
        raise Hang(f"a case ran past {seconds}s (a hang), and something swallowed the signal")


def _peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _state(model: torch.nn.Module, step: int) -> dict[str, Any]:
    return {"model": model.state_dict(), "lr": 0.0, "name": "", "progress": {"step": torch.tensor(step)}}


def _manager(root: Path, group: Any) -> CheckpointManager:
    return CheckpointManager(root, rank=0, world_size=1, group=group, every=5, mode="sync", keep_last=3,
                             emit=lambda *a, **k: None)


class _Genuine(tuple):
    def __repr__(self) -> str:  # Hypothesis prints its arguments: not the bytes
        return "<two genuine checkpoints>"


@pytest.fixture(scope="module")
def genuine() -> Any:
    """Checkpoints at steps 5 and 10 of a 256x256 model (with bytes entries), their files and states."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=60))
    group = dist.new_group(backend="gloo")
    root = Path(tempfile.mkdtemp(prefix="eksft-fuzz-genuine-"))
    torch.manual_seed(0)
    model = torch.nn.Linear(256, 256)
    states = {}
    for step in (5, 10):
        with torch.no_grad():
            model.weight.add_(1.0)
        state = _state(model, step) | {"lr": step / 7, "name": f"run{step}"}
        _manager(root, group).maybe_save(step, state)
        states[step] = {k: (v.clone() if isinstance(v, torch.Tensor) else v)
                        for k, v in {**state["model"], "lr": state["lr"], "name": state["name"],
                                     "step": state["progress"]["step"]}.items()}
    files = {s: {p.name: p.read_bytes() for p in step_dir(root, s).iterdir()} for s in (5, 10)}
    size = sum(len(b) for b in files[10].values())
    for _ in range(2):  # warm the allocators: the first loads grow the heap whatever they read
        for s in (5, 10):
            load(step_dir(root, s), _state(torch.nn.Linear(256, 256), 0), group)
    shutil.rmtree(root)
    yield _Genuine((group, files, states, size))
    dist.destroy_process_group()


class _Spans(list):
    def __repr__(self) -> str:
        return "<the genuine .metadata's opcodes>"


def _spans(data: bytes) -> list[bytes]:
    """The opcodes of a pickle, each with its argument, FRAME dropped (so that splicing keeps it readable)."""
    ops = list(pickletools.genops(data))
    ends = [pos for _, _, pos in ops[1:]] + [len(data)]
    return _Spans(data[pos:end] for (op, _, pos), end in zip(ops, ends) if op.name != "FRAME")


CLASSES = [("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"), ("torch", "Size"), ("torch", "float32"),
           ("collections", "OrderedDict"), ("torch.serialization", "_get_layout"),
           ("torch.distributed.checkpoint.metadata", "Metadata"),
           ("torch.distributed.checkpoint.metadata", "TensorStorageMetadata"),
           ("torch.distributed.checkpoint.metadata", "TensorProperties"),
           ("torch.distributed.checkpoint.metadata", "MetadataIndex"),
           ("torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING"),
           ("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("os", "system"),
           ("torch.distributed.checkpoint.filesystem", "os.system")]
ATTRS = ["__truediv__", "__init__", "__getstate__", "__reduce_ex__", "__eq__", "__hash__", "relative_path",
         "__class__", "__dict__", "x"]
VALUES = [b"N", b"K\x00", b"J\xff\xff\xff\x7f", b"\x88", text("x"), text("../outside"), b")", b"]", b"}",
          name("pathlib", "PosixPath"), name("torch", "Size")]


@st.composite
def gadgets(draw: Any) -> bytes:
    """A few opcodes that push an allowed (or not) global and then BUILD, SETITEM(S), REDUCE, NEWOBJ or
    APPEND onto it (leaving the stack as it was, so that the genuine metadata still follows)."""
    cls = name(*draw(st.sampled_from(CLASSES)))
    attr, value = text(draw(st.sampled_from(ATTRS))), draw(st.sampled_from(VALUES))
    op = draw(st.sampled_from(["build-slots", "build-dict", "setitem", "setitems", "reduce", "newobj",
                               "append", "build-new", "build-enum"]))
    body = {
        "build-slots": cls + b"N}" + attr + value + b"s\x86b",
        "build-dict": cls + b"}" + attr + value + b"sb",
        "setitem": cls + attr + value + b"s",
        "setitems": cls + b"(" + attr + value + b"u",
        "reduce": cls + b"(" + value + b"tR",
        "newobj": cls + b"(" + value + b"t\x81",
        "append": cls + value + b"a",
        "build-new": cls + b")\x81}" + attr + value + b"sb",
        "build-enum": cls + b"K\x00\x85R}" + attr + value + b"sb",
    }[op]
    return body + b"0"  # POP


@st.composite
def pickle_mutations(draw: Any, spans: list[bytes]) -> bytes:
    """The genuine ``.metadata`` with a few opcode-level changes."""
    out = list(spans)
    for _ in range(draw(st.integers(1, 3))):
        i = draw(st.integers(1, len(out) - 1))  # never the PROTO opcode
        kind = draw(st.sampled_from(["delete", "duplicate", "swap", "opcode", "gadget", "argument",
                                     "truncate"]))
        event(f"pickle: {kind}")
        if kind == "delete":
            del out[i]
        elif kind == "duplicate":
            out.insert(i, out[i])
        elif kind == "swap" and i + 1 < len(out):
            out[i], out[i + 1] = out[i + 1], out[i]
        elif kind == "opcode":
            out[i] = bytes([draw(st.sampled_from(sorted({op.code.encode("latin-1")[0]
                                                         for op in pickletools.opcodes})))]) + out[i][1:]
        elif kind == "gadget":
            out.insert(i, draw(gadgets()))
        elif kind == "argument" and len(out[i]) > 1:
            out[i] = out[i][:1] + draw(st.binary(min_size=len(out[i]) - 1, max_size=len(out[i]) - 1))
        elif kind == "truncate":
            out = out[:i]
        if len(out) < 2:
            break
    return b"".join(out)


ODD = [None, -1, 0, 1 << 70, 3.5, "x", "../outside.distcp", "/etc/passwd", "commit.json", ".metadata",
       "link.distcp", "fifo.distcp", [], {}, (), ("zstd",), torch.Size([1 << 40]), torch.Size([]), b"x",
       torch.float64, torch.sparse_coo]


@st.composite
def record_mutations(draw: Any) -> tuple[str, str, Any]:
    """A record of the metadata set to a value of the wrong type, size or length."""
    target = draw(st.sampled_from([
        "storage.relative_path", "storage.offset", "storage.length", "storage.transform_descriptors",
        "index.fqn", "index.offset", "tensor.size", "tensor.chunks", "chunk.offsets", "chunk.sizes",
        "properties.dtype", "properties.layout", "metadata.state_dict_metadata", "metadata.storage_data",
        "metadata.planner_data", "metadata.storage_meta", "metadata.version", "storage.length+1",
        "storage.offset+1"]))
    return "record", target, draw(st.sampled_from(ODD))


def _mutate_record(md: Any, target: str, value: Any, which: int) -> None:
    owner_name, field = target.split(".", 1)
    items = list(md.storage_data.items())
    index, record = items[which % len(items)]
    tensors = [v for v in md.state_dict_metadata.values() if hasattr(v, "chunks")]
    tensor = tensors[which % len(tensors)]
    if field.endswith("+1"):
        setattr(record, field[:-2], getattr(record, field[:-2]) + 1)
    elif owner_name == "storage":
        setattr(record, field, value)
    elif owner_name == "index":  # a key of storage_data: replace the entry
        try:
            new = type(index)(**{f: getattr(index, f) for f in ("fqn", "offset", "index")} | {field: value})
            md.storage_data = {(new if k is index else k): v for k, v in items}
        except (TypeError, ValueError, RuntimeError):  # a key DCP's own class cannot make
            pass
    elif owner_name == "tensor":
        setattr(tensor, field, value)
    elif owner_name == "chunk":
        setattr(tensor.chunks[0], field, value)
    elif owner_name == "properties":
        setattr(tensor.properties, field, value)
    else:
        setattr(md, field, value)


FOLDER_CHANGES = ["link-listed", "link-unlisted", "fifo-metadata", "fifo-data", "unlist-metadata", "deflate",
                  "bomb", "bigger-storage", "other-tensor", "bytes-as-tensor", "metadata-dir", "shared-bytes"]


def _mutate_folder(folder: Path, outside: Path, kind: str) -> None:
    shard = folder / "__0_0.distcp"
    if kind == "link-listed":  # the same bytes, outside the folder, behind a listed name
        outside.write_bytes(shard.read_bytes())
        shard.unlink()
        shard.symlink_to(outside)
    elif kind in ("link-unlisted", "fifo-data"):  # records pointing at a plain name commit.json lacks
        outside.write_bytes(shard.read_bytes())
        if kind == "link-unlisted":
            (folder / "link.distcp").symlink_to(outside)
        else:
            os.mkfifo(folder / "link.distcp")
        md = pickle.loads((folder / ".metadata").read_bytes())
        for record in md.storage_data.values():
            record.relative_path = "link.distcp"
        rewrite(folder, ".metadata", pickle.dumps(md))
    elif kind == "fifo-metadata":
        rewrite(folder, ".metadata", None, listed=False)
        (folder / ".metadata").unlink()
        os.mkfifo(folder / ".metadata")
    elif kind == "unlist-metadata":
        rewrite(folder, ".metadata", None, listed=False)
    elif kind == "shared-bytes":  # the "name" entry's record points at the bytes of "lr" (loaded as the name)
        md = pickle.loads((folder / ".metadata").read_bytes())
        records = {index.fqn: record for index, record in md.storage_data.items()}
        records["name"].offset, records["name"].length = records["lr"].offset, records["lr"].length
        rewrite(folder, ".metadata", pickle.dumps(md))
    elif kind == "metadata-dir":
        rewrite(folder, ".metadata", None, listed=False)
        (folder / ".metadata").unlink()
        (folder / ".metadata").mkdir()
    else:
        def change(fqn: str, archive: bytes) -> bytes:
            if fqn != "model.weight":
                return deflated(archive) if kind == "deflate" and fqn == "name" else archive
            return {"deflate": lambda: deflated(archive), "bomb": lambda: inflating(archive, 64 << 20),
                    "bigger-storage": lambda: tensor_archive(torch.ones(1 << 18)[:1 << 16].view(256, 256)),
                    "other-tensor": lambda: tensor_archive(torch.ones(256, 256, dtype=torch.float64)),
                    "bytes-as-tensor": lambda: tensor_archive(torch.ones(1))}[kind]()
        relay(folder, change)


def _matches(loaded: dict[str, Any], expected: dict[str, Any]) -> bool:
    got = {**loaded["model"], "lr": loaded["lr"], "name": loaded["name"], "step": loaded["progress"]["step"]}
    return got.keys() == expected.keys() and all(
        torch.equal(got[k], v) and got[k].dtype == v.dtype if isinstance(v, torch.Tensor) else
        (type(got[k]) is type(v) and got[k] == v) for k, v in expected.items())


def _one_line(text_: str) -> None:
    assert text_ and "\n" not in text_ and "Traceback" not in text_, text_


def _fresh(files: dict[int, dict[str, bytes]]) -> tuple[Path, Path, Path]:
    """A copy of the genuine checkpoints in a folder of its own: (that folder, the root, a path outside)."""
    base = Path(tempfile.mkdtemp(prefix="eksft-fuzz-"))
    root = base / "ckpt"
    for step, named in files.items():
        step_dir(root, step).mkdir(parents=True)
        for n, b in named.items():
            (step_dir(root, step) / n).write_bytes(b)
    return base, root, base / "outside.distcp"


def _check_case(genuine: Any, root: Path, note: Any = event) -> str:
    """Verify, load and restore step 10 as crafted: refused in one line or loaded bit for bit, within the
    deadline, without growing the peak memory past twice the checkpoint or changing the process; the
    restore falls back to the sound step 5 if it refuses step 10. Returns what the loader did."""
    group, _, states, size = genuine
    newest = step_dir(root, 10)
    before, peak = fingerprint(), _peak_rss()
    with deadline(DEADLINE_S):
        [info] = [i for i in list_checkpoints(root) if i.step == 10]
        reason = verify(info)
        target = _state(torch.nn.Linear(256, 256), 0)
        if reason is not None:
            _one_line(reason)
            outcome = "verify refuses"
        else:
            try:
                load(newest, target, group)
            except JobError as e:
                _one_line(str(e))
                outcome = "load refuses"
            else:
                outcome = "loads"
                assert _matches(target, states[10]), "it loaded, but not what was saved"
        restored = _state(torch.nn.Linear(256, 256), 0)
        step = _manager(root, group).restore(restored, "latest", restarting=True)
        assert step in (5, 10) and _matches(restored, states[step]), step  # never 0: step 5 is sound
    assert fingerprint() == before, "a case changed a class of pathlib, torch or DCP"
    grown = _peak_rss() - peak
    assert grown <= 2 * size + ARENA_ALLOWANCE, f"peak memory grew by {grown} bytes (checkpoint: {size})"
    note(outcome)
    return outcome


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                   HealthCheck.too_slow,
                                                                   HealthCheck.data_too_large])
@given(data=st.data())
def test_no_crafted_metadata_hangs_grows_or_changes_the_process(genuine: Any, data: Any) -> None:
    """Opcode-level mutations and gadgets (half the cases), and records of the wrong type or length."""
    files = genuine[1]
    base, root, _ = _fresh(files)
    try:
        newest = step_dir(root, 10)
        if data.draw(st.booleans(), label="opcodes"):
            rewrite(newest, ".metadata", data.draw(pickle_mutations(_spans(files[10][".metadata"]))))
        else:
            _, target, value = data.draw(record_mutations())
            event(f"record: {target}")
            md = pickle.loads(files[10][".metadata"])
            _mutate_record(md, target, value, data.draw(st.integers(0, 7), label="which"))
            rewrite(newest, ".metadata", pickle.dumps(md))
        _check_case(genuine, root)
    finally:
        shutil.rmtree(base, ignore_errors=True)


@pytest.mark.parametrize("change", FOLDER_CHANGES)
def test_no_crafted_folder_hangs_grows_or_changes_the_process(genuine: Any, change: str) -> None:
    """Symlinks, FIFOs, a directory, an unlisted .metadata, compressed and re-laid archive entries."""
    base, root, outside = _fresh(genuine[1])
    try:
        _mutate_folder(step_dir(root, 10), outside, change)
        assert _check_case(genuine, root, note=lambda _: None) != "loads"  # each is a tampering to refuse
    finally:
        shutil.rmtree(base, ignore_errors=True)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                  HealthCheck.too_slow])
@given(shape=st.sampled_from(FLOODS), n=st.sampled_from([1, 2, 8, 9, 33, 1000, 4097, 30_000, 100_000]))
def test_no_flooded_metadata_hangs_grows_or_changes_the_process(genuine: Any, shape: str, n: int) -> None:
    """Issue 34: keys of one hash (ints, DCP's MetadataIndex, a repeated string), chunks whose offsets
    collide, a list reached n times, n-deep marks and lists, n empty dicts (the most memory an opcode
    holds), n-long sizes and paths, in place of step 10's .metadata: each is refused in one line (by the
    size cap, the budget of opcodes or its own rule), within the deadline and the memory bound, and
    the restore falls back to step 5."""
    base, root, _ = _fresh(genuine[1])
    try:
        rewrite(step_dir(root, 10), ".metadata", flood(shape, n))
        event(f"flood: {shape}")
        assert _check_case(genuine, root) == "load refuses"
    finally:
        shutil.rmtree(base, ignore_errors=True)
