"""Generated checkpoint folders (Hypothesis): whatever is on disk, listing, verifying, loading and
restoring refuse it with one line or handle it: never a traceback, a hang, code run, a file read or
written outside the folder, or a change to what was saved."""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from eksft_nb.checkpoint_folders import COMMIT, REJECTED, list_checkpoints, verify
from eksft_nb.errors import JobError
from eksft_nb.runtime.checkpoint import CheckpointManager, load
from test_checkpoint import hostile_metadata

STEP = "step_00000005"
SHARD = "__0_0.distcp"


@pytest.fixture(scope="module")
def saved() -> Any:
    """A real checkpoint (world size 1, sync save) to mutate: its files' bytes and the saved state."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=60))
    group = dist.new_group(backend="gloo")
    root = Path(tempfile.mkdtemp(prefix="eksft-ckpt-inputs-"))
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    CheckpointManager(root, rank=0, world_size=1, group=group, every=5, mode="sync", keep_last=2,
                      emit=lambda *a, **k: None).maybe_save(5, _state(model, 5))
    files = {p.name: p.read_bytes() for p in (root / STEP).iterdir()}
    yield _Saved((group, files, {k: v.clone() for k, v in model.state_dict().items()}))
    shutil.rmtree(root)
    dist.destroy_process_group()


class _Saved(tuple):
    def __repr__(self) -> str:  # Hypothesis prints its arguments: not the bytes
        return "<the saved checkpoint>"


def _state(model: torch.nn.Module, step: int) -> dict[str, Any]:
    return {"model": model.state_dict(), "progress": {"step": torch.tensor(step)}}


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**80, 2**80) | st.floats() | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4),
    max_leaves=12)
bad_names = st.sampled_from(["../outside.bin", "/etc/passwd", "a/b", "", ".", "..", COMMIT, REJECTED, "x\ny",
                             "..\\x", "n" * 300, SHARD + "\x00"])
FIELDS = ["step", "world_size", "bytes", "time", "files", "run", "mode"]

mutations = st.one_of(
    st.tuples(st.just("commit-json"), json_values),
    st.tuples(st.just("commit-field"), st.sampled_from(FIELDS), json_values),
    st.tuples(st.just("commit-bytes"), st.binary(max_size=64)),
    st.tuples(st.just("listed-name"), bad_names),
    st.tuples(st.just("foreign-world"), st.integers(2, 1 << 40)),
    st.tuples(st.just("truncate"), st.sampled_from([SHARD, ".metadata", COMMIT]), st.integers(0, 400),
              st.booleans()),
    st.tuples(st.just("garbage"), st.sampled_from([SHARD, ".metadata"]), st.binary(max_size=256),
              st.booleans()),
    st.tuples(st.just("swap"), st.booleans()),
    st.tuples(st.just("delete"), st.sampled_from([SHARD, ".metadata", COMMIT])),
    st.tuples(st.just("symlink-out"), st.sampled_from([SHARD, ".metadata", COMMIT, REJECTED])),
    st.tuples(st.just("folder-symlink")),
    st.tuples(st.just("hostile-metadata")),
    st.tuples(st.just("rejected"), st.binary(max_size=40)),
)


def _rehash(ckpt: Path, name: str) -> None:
    """What an attacker does after changing a file: recompute its entry in commit.json."""
    try:
        record = json.loads((ckpt / COMMIT).read_text())
        data = (ckpt / name).read_bytes()
        record["files"][name] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
        (ckpt / COMMIT).write_text(json.dumps(record))
    except (OSError, ValueError, TypeError, KeyError):
        pass


def _edit_commit(ckpt: Path, change: Any) -> None:
    try:
        record = json.loads((ckpt / COMMIT).read_text())
        change(record)
        (ckpt / COMMIT).write_text(json.dumps(record))
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        pass


def _apply(root: Path, outside: Path, m: tuple) -> None:
    ckpt = root / STEP
    kind = m[0]
    if not ckpt.is_dir() or ckpt.is_symlink():
        return
    if kind == "commit-json":
        (ckpt / COMMIT).write_text(json.dumps(m[1]))
    elif kind == "commit-field":
        _edit_commit(ckpt, lambda r: r.__setitem__(m[1], m[2]))
    elif kind == "commit-bytes":
        (ckpt / COMMIT).write_bytes(m[1])
    elif kind == "listed-name":
        _edit_commit(ckpt, lambda r: r["files"].__setitem__(m[1], r["files"].pop(SHARD)))
    elif kind == "foreign-world":
        _edit_commit(ckpt, lambda r: r.__setitem__("world_size", m[1]))
    elif kind in ("truncate", "garbage"):
        f = ckpt / m[1]
        if f.is_file() and not f.is_symlink():
            f.write_bytes(f.read_bytes()[:m[2]] if kind == "truncate" else m[2])
            if m[3]:
                _rehash(ckpt, m[1])
    elif kind == "swap":
        a, b = ckpt / SHARD, ckpt / ".metadata"
        if a.is_file() and b.is_file() and not a.is_symlink() and not b.is_symlink():
            da, db = a.read_bytes(), b.read_bytes()
            a.write_bytes(db)
            b.write_bytes(da)
            if m[1]:
                _rehash(ckpt, SHARD)
                _rehash(ckpt, ".metadata")
    elif kind == "delete":
        (ckpt / m[1]).unlink(missing_ok=True)
    elif kind == "symlink-out":  # the same bytes, but outside the folder
        f = ckpt / m[1]
        if f.is_file() and not f.is_symlink():
            outside.write_bytes(f.read_bytes())
        f.unlink(missing_ok=True)
        f.symlink_to(outside)
    elif kind == "folder-symlink":
        elsewhere = outside.parent / "elsewhere"
        shutil.move(str(ckpt), elsewhere)
        ckpt.symlink_to(elsewhere, target_is_directory=True)
    elif kind == "hostile-metadata":
        (ckpt / ".metadata").write_bytes(hostile_metadata(f"touch {outside.parent / 'pwned'}"))
        _rehash(ckpt, ".metadata")
    elif kind == "rejected":
        (ckpt / REJECTED).write_bytes(m[1])


def _snapshot(base: Path) -> dict[str, str]:
    """Every file and link under ``base`` (rejection records aside), by content or target."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(base):
        for name in filenames + [d for d in dirnames if os.path.islink(os.path.join(dirpath, d))]:
            p = Path(dirpath) / name
            if name == REJECTED or (name.startswith(f".{REJECTED}.") and name.endswith(".tmp")):
                continue
            out[str(p.relative_to(base))] = ("-> " + os.readlink(p)) if p.is_symlink() else \
                hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def _one_line(text: str) -> None:
    assert text and "\n" not in text and "Traceback" not in text, text


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                   HealthCheck.too_slow])
@given(changes=st.lists(mutations, min_size=1, max_size=3))
def test_any_checkpoint_folder_is_refused_with_one_line_or_loads_what_was_saved(
    saved: Any, changes: list) -> None:
    group, files, expected = saved
    base = Path(tempfile.mkdtemp(prefix="eksft-ckpt-case-"))
    try:
        root, outside = base / "ckpt", base / "outside.bin"
        (root / STEP).mkdir(parents=True)
        for name, data in files.items():
            (root / STEP / name).write_bytes(data)
        outside.write_bytes(b"outside the checkpoint folder")
        for change in changes:
            _apply(root, outside, change)
        before, outside_bytes = _snapshot(base), outside.read_bytes()

        for info in list_checkpoints(root):
            reason = verify(info)
            if reason is not None:
                _one_line(reason)
                event("verify refuses")
                continue
            target = _state(torch.nn.Linear(4, 4), 0)
            try:
                load(info.path, target, group)
            except JobError as e:
                _one_line(str(e))
                event("load refuses")
            else:  # it verified and loaded: it must be what was saved
                event("loads")
                assert int(target["progress"]["step"]) == 5
                assert all(torch.equal(target["model"][k], v) for k, v in expected.items())
        assert _snapshot(base) == before  # listing, verifying and loading change nothing

        mgr = CheckpointManager(root, rank=0, world_size=1, group=group, every=5, mode="sync", keep_last=2,
                                emit=lambda *a, **k: None)
        target = _state(torch.nn.Linear(4, 4), 0)
        try:
            step = mgr.restore(target, "latest", restarting=True)
        except JobError as e:
            _one_line(str(e))
            event("restore refuses")
        else:
            event(f"restore resumes at {step}")
            assert step in (0, 5)
            if step == 5:
                assert all(torch.equal(target["model"][k], v) for k, v in expected.items())
        assert _snapshot(base) == before  # a rejection is recorded beside the files, never in them
        assert outside.read_bytes() == outside_bytes  # nothing was written through a link
        assert not (base / "pwned").exists()
    finally:
        shutil.rmtree(base, ignore_errors=True)
