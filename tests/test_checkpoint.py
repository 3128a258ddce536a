"""Checkpoints in one process (world size 1): staging, commit records, verification, safe loading."""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import pickle
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from eksft_nb.checkpoint_folders import list_checkpoints, step_dir, verify
from eksft_nb.errors import JobError
from eksft_nb.runtime.checkpoint import CheckpointManager, CheckpointProcess, load
from jobs import fsdp_snapshot


@pytest.fixture(scope="module")
def group() -> Any:
    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1, timeout=datetime.timedelta(seconds=60))
    yield dist.new_group(backend="gloo")
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def process() -> Any:
    """The test process's writer and buffers, shared by its managers as a rank process's are."""
    shared = CheckpointProcess()
    yield shared
    shared.writer.stop()


def _manager(root: Path, group: Any, mode: str, events: list,
             process: CheckpointProcess) -> CheckpointManager:
    return CheckpointManager(root, rank=0, world_size=1, group=group, every=5, mode=mode, keep_last=2,
                             emit=lambda kind, **data: events.append(data), process=process)


def _state(model: torch.nn.Module, step: int) -> dict[str, Any]:
    return {"model": model.state_dict(), "progress": {"step": torch.tensor(step)}}


@pytest.mark.parametrize("mode", ["async", "sync"])
def test_save_is_the_state_at_save_time_and_loads_bit_exact(tmp_path: Path, group: Any,
                                                            process: CheckpointProcess, mode: str) -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 64)
    events: list = []
    mgr = _manager(tmp_path, group, mode, events, process)
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    mgr.maybe_save(5, _state(model, 5))
    with torch.no_grad():  # training goes on while the async writer works: it must not see this
        for p in model.parameters():
            p.add_(1.0)
    mgr.finish()
    [info] = list_checkpoints(tmp_path)
    assert info.state == "committed" and info.step == 5 and info.world_size == 1
    assert set(info.files) >= {".metadata", "__0_0.distcp"} and all(f["sha256"] for f in info.files.values())
    assert verify(info) is None
    phases = [e["phase"] for e in events]
    assert phases[0] == "begin" and phases[-1] == "committed"
    assert events[-1]["blocked_s"] >= 0 and events[-1]["bytes"] > 0
    target = _state(torch.nn.Linear(64, 64), 0)
    load(info.path, target, group)
    assert int(target["progress"]["step"]) == 5
    for k, v in expected.items():
        assert torch.equal(target["model"][k], v), k


def test_saves_that_reuse_the_cached_plan_load_bit_exact(tmp_path: Path, group: Any,
                                                         process: CheckpointProcess) -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 64)
    mgr = _manager(tmp_path, group, "async", [], process)
    for step in (5, 10, 15, 20):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(step)
        expected = {k: v.clone() for k, v in model.state_dict().items()}
        mgr.maybe_save(step, _state(model, step))
        mgr.finish()
    assert mgr.plan_cache.reused == 3  # the later saves skipped planning
    staged = mgr.stager._buffers.values()  # each its own storage: NVRx clones a view on the training thread
    assert staged and all(t.untyped_storage().nbytes() == t.numel() * t.element_size() for t in staged)
    [*_, info] = list_checkpoints(tmp_path)
    assert info.step == 20 and verify(info) is None
    target = _state(torch.nn.Linear(64, 64), 0)
    load(info.path, target, group)
    assert int(target["progress"]["step"]) == 20
    for k, v in expected.items():
        assert torch.equal(target["model"][k], v), k


def test_a_kept_save_plan_follows_the_state_it_saves(tmp_path: Path, group: Any,
                                                     process: CheckpointProcess) -> None:
    """The save plan is kept from save to save while the staged state keeps its layout; a tensor
    added or reshaped after that fails that one save (never committed: the plan is made on every
    rank together) and the next one plans anew, and plain values are written as they are at each
    save: every committed checkpoint loads back bit-exactly (a stale plan would leave the new tensor out)."""
    events: list = []
    mgr = _manager(tmp_path, group, "async", events, process)
    gen = torch.Generator().manual_seed(0)
    extras: list[dict[str, torch.Tensor]] = [{}, {}, {}, {"ema": torch.randn(4, 4, generator=gen)},
                                             {"ema": torch.randn(6, generator=gen)},
                                             {"ema": torch.randn(6, generator=gen)}]
    weights = torch.randn(8, 8, generator=gen)
    for i, extra in enumerate(extras):
        step = 5 * (i + 1)
        weights.add_(1.0)  # new values in the same tensor
        mgr.maybe_save(step, {"w": weights, "lr": step / 7, "name": f"run{step}", **extra})
        mgr.finish()
        if mgr.retry:  # the layout changed: this save failed, the next step's plans anew
            assert step_dir(tmp_path, step) not in [i.path for i in list_checkpoints(tmp_path)
                                                    if i.state == "committed"]
            step += 1
            mgr.maybe_save(step, {"w": weights, "lr": step / 7, "name": f"run{step}", **extra})
            mgr.finish()
        target = {"w": torch.zeros(8, 8), "lr": 0.0, "name": "",
                  **{k: torch.zeros_like(v) for k, v in extra.items()}}
        load(step_dir(tmp_path, step), target, group)
        assert torch.equal(target["w"],
                           weights) and target["lr"] == step / 7 and target["name"] == f"run{step}"
        assert all(torch.equal(target[k], v) for k, v in extra.items()), step
    # the two layout changes, once each
    assert [e["step"] for e in events if e["phase"] == "failed"] == [20, 25]
    # planned at 5, 21 and 26; kept at 10, 15 and 30
    assert mgr.plan_cache is not None and mgr.plan_cache.reused == 1


def test_a_kept_save_plan_runs_no_collective_until_the_commit(tmp_path: Path, group: Any,
                                                              process: CheckpointProcess,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """With the plan kept, a save's stall is this rank's alone: staging and handing the write over
    wait for no other rank (no collective), and the committed checkpoint loads bit-exactly."""
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 16)
    mgr = _manager(tmp_path, group, "async", [], process)
    mgr.maybe_save(5, _state(model, 5))
    mgr.finish()
    with torch.no_grad():
        model.weight.add_(1.0)
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    calls: list[str] = []
    for name in ("all_reduce", "broadcast", "broadcast_object_list", "all_gather_object", "all_gather",
                 "gather_object", "scatter_object_list", "reduce_scatter", "barrier"):
        real = getattr(dist, name)
        monkeypatch.setattr(dist, name, lambda *a, _real=real, _name=name,
                            **k: (calls.append(_name), _real(*a, **k))[1])
    mgr.maybe_save(10, _state(model, 10))
    assert calls == [] and mgr.plan_cache.reused == 1
    mgr.finish()
    assert calls  # the commit is collective
    [*_, info] = list_checkpoints(tmp_path)
    assert info.step == 10 and info.state == "committed"
    target = _state(torch.nn.Linear(16, 16), 0)
    load(info.path, target, group)
    assert all(torch.equal(target["model"][k], v) for k, v in expected.items())


def test_corruption_is_detected_with_the_file_named(tmp_path: Path, group: Any,
                                                    process: CheckpointProcess) -> None:
    model = torch.nn.Linear(16, 16)
    mgr = _manager(tmp_path, group, "async", [], process)
    mgr.maybe_save(5, _state(model, 5))
    mgr.finish()
    [info] = list_checkpoints(tmp_path)
    shard = info.path / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    assert verify(info) == "checksum mismatch in __0_0.distcp"
    shard.write_bytes(bytes(data[:-1]))
    assert "has" in verify(info) and "commit record says" in verify(info)


def test_a_failed_write_is_reported_and_retried_at_the_next_step(tmp_path: Path, group: Any,
                                                                 process: CheckpointProcess) -> None:
    model = torch.nn.Linear(16, 16)
    events: list = []
    mgr = _manager(tmp_path, group, "async", events, process)
    mgr.fail_next_write = True
    mgr.maybe_save(5, _state(model, 5))
    mgr.maybe_save(6, _state(model, 6), last=True)  # finalizes the failure, then retries
    failed = [e for e in events if e["phase"] == "failed"]
    assert failed and "injected save failure" in failed[0]["error"]
    committed = [i.step for i in list_checkpoints(tmp_path) if i.state == "committed"]
    assert committed == [6]


def test_a_real_write_failure_does_not_shift_the_results_of_later_saves(tmp_path: Path, group: Any,
                                                                        process: CheckpointProcess) -> None:
    """The writer process may write no file past 64 bytes (a file-size limit: the kernel fails the
    writes with EFBIG), so the shard and then the manifest fail to write; once it may again, every
    later save must read its own result and commit the state it saved."""
    import resource

    model = torch.nn.Linear(16, 16)
    events: list = []
    mgr = _manager(tmp_path, group, "async", events, process)
    pid = mgr.writer.caller.process.pid
    soft, hard = resource.prlimit(pid, resource.RLIMIT_FSIZE)
    resource.prlimit(pid, resource.RLIMIT_FSIZE, (64, hard))
    try:
        mgr.maybe_save(5, _state(model, 5))
        mgr.finish()
    finally:
        resource.prlimit(pid, resource.RLIMIT_FSIZE, (soft, hard))
    saved = {}
    for step in (6, 10):  # 6: the retry of the failed save; 10: the next scheduled one
        with torch.no_grad():
            model.weight.add_(1.0)
        saved[step] = model.weight.detach().clone()
        mgr.maybe_save(step, _state(model, step))
        mgr.finish()
    failed = [e for e in events if e["phase"] == "failed"]
    assert [e["step"] for e in failed] == [5] and "File too large" in failed[0]["error"], failed
    committed = [i for i in list_checkpoints(tmp_path) if i.state == "committed"]
    assert [i.step for i in committed] == [6, 10]
    for info in committed:
        assert verify(info) is None
        target = _state(torch.nn.Linear(16, 16), 0)
        load(info.path, target, group)
        assert int(target["progress"]["step"]) == info.step
        assert torch.equal(target["model"]["weight"], saved[info.step])


@pytest.mark.timeout(180)
def test_a_writer_that_dies_fails_its_save_with_the_reason_and_a_new_writer_commits_the_retry(
        tmp_path: Path, group: Any) -> None:
    """The writer process killed under a save (the OOM killer): NVRx's wait polls a dead writer
    forever and its check never says done, so the save never finalized and every later one was
    deferred in silence. It fails with the reason, and the retry starts a new writer."""
    import signal

    own = CheckpointProcess()  # this test kills its writer
    try:
        model = torch.nn.Linear(16, 16)
        events: list = []
        mgr = _manager(tmp_path, group, "async", events, own)
        mgr.writer.done_locally(blocking=True)  # it has started
        dead = mgr.writer.caller.process
        os.kill(dead.pid, signal.SIGSTOP)  # the save is handed over, not yet written, when it dies
        mgr.maybe_save(5, _state(model, 5))
        os.kill(dead.pid, signal.SIGKILL)
        mgr.finish()
        [failed] = [e for e in events if e["phase"] == "failed"]
        assert failed["step"] == 5 and "checkpoint writer process died (exit code -9)" in failed["error"]
        assert not [i for i in list_checkpoints(tmp_path) if i.state == "committed"]
        with torch.no_grad():
            model.weight.add_(1.0)
        mgr.maybe_save(6, _state(model, 6), last=True)  # the retry
        mgr.finish()
        assert mgr.writer.caller.process.pid != dead.pid
        [info] = [i for i in list_checkpoints(tmp_path) if i.state == "committed"]
        assert info.step == 6 and verify(info) is None
        target = _state(torch.nn.Linear(16, 16), 0)
        load(info.path, target, group)
        assert torch.equal(target["model"]["weight"], model.weight)
    finally:
        own.writer.stop()


def test_a_save_does_not_commit_without_a_ranks_manifest(tmp_path: Path, group: Any,
                                                         process: CheckpointProcess) -> None:
    model = torch.nn.Linear(16, 16)
    events: list = []
    mgr = _manager(tmp_path, group, "async", events, process)
    mgr.maybe_save(5, _state(model, 5))
    mgr.writer.done_locally(blocking=True)
    (tmp_path / "step_00000005" / "manifest-0.json").unlink()  # the rank's record of its files is lost
    mgr.finish()
    [failed] = [e for e in events if e["phase"] == "failed"]
    assert "manifest-0.json is missing" in failed["error"]
    assert not [i for i in list_checkpoints(tmp_path) if i.state == "committed"]
    mgr.maybe_save(6, _state(model, 6), last=True)  # the retry commits
    assert [i.step for i in list_checkpoints(tmp_path) if i.state == "committed"] == [6]


def test_an_inprocess_restart_commits_the_save_a_fault_left_uncommitted(tmp_path: Path, group: Any,
                                                                        process: CheckpointProcess) -> None:
    """A fault a few steps after an async save, before a step boundary committed it: the in-process
    restart (same process, same writer, a new manager) resumes from that save, not from scratch."""
    model = torch.nn.Linear(16, 16)
    events: list = []
    first = _manager(tmp_path, group, "async", events, process)
    first.maybe_save(5, _state(model, 5))  # then the fault, before step 6 ends
    saved = model.weight.detach().clone()
    restarted = _manager(tmp_path, group, "async", events, process)
    target = _state(torch.nn.Linear(16, 16), 0)
    assert restarted.restore(target, "latest", restarting=True) == 5, events
    assert int(target["progress"]["step"]) == 5 and torch.equal(target["model"]["weight"], saved)
    assert [(e["phase"], e["step"]) for e in events
            if "phase" in e] == [("begin", 5), ("staged", 5), ("committed", 5)]
    assert restarted.restore(_state(torch.nn.Linear(16, 16), 0), "latest", restarting=True) == 5  # once only


def test_the_background_writer_runs_at_a_lower_cpu_priority(tmp_path: Path, group: Any,
                                                            process: CheckpointProcess) -> None:
    """It shares cores with the ranks: a step must not wait for it, so it takes what they leave."""
    from eksft_nb.runtime.checkpoint.writer import WRITER_NICE

    writer = _manager(tmp_path, group, "async", [], process).writer
    writer.done_locally(blocking=True)  # its first request has run
    ours = os.getpriority(os.PRIO_PROCESS, 0)
    assert os.getpriority(os.PRIO_PROCESS, writer.caller.process.pid) == min(19, ours + WRITER_NICE)


def test_restore_keeps_heartbeating_while_it_hashes(tmp_path: Path, group: Any,
                                                    process: CheckpointProcess) -> None:
    state = {"w": torch.randn(3 << 20)}  # 12 MiB: three 4 MiB blocks to hash
    _manager(tmp_path, group, "sync", [], process).maybe_save(5, state)
    beats: list = []
    mgr = CheckpointManager(tmp_path, rank=0, world_size=1, group=group, every=5, mode="sync", keep_last=2,
                            emit=lambda kind, **data: None, keepalive=lambda: beats.append(1),
                            process=process)
    mgr.keepalive_every = 0.0  # every call of the keepalive is seen
    assert mgr.restore({"w": torch.zeros(3 << 20)}, "latest") == 5
    assert len(beats) >= 3


def test_a_commit_between_steps_is_progress(tmp_path: Path, group: Any, process: CheckpointProcess) -> None:
    """Committing an async save between steps tells the rank's liveness (NVRx's in-process soft timeout)
    of progress: a slow commit and the step after it are not one long silence taken for a hang."""
    model = torch.nn.Linear(16, 16)
    beats: list = []
    mgr = CheckpointManager(tmp_path, rank=0, world_size=1, group=group, every=5, mode="async", keep_last=2,
                            emit=lambda kind, **data: None, keepalive=lambda: beats.append(1),
                            process=process)
    mgr.maybe_save(5, _state(model, 5))
    mgr.writer.done_locally(blocking=True)   # its write is done: the next step boundary commits it
    assert beats == [] and mgr.last_committed != 5
    mgr.maybe_save(6, _state(model, 6))      # not due: it only commits the save at 5
    assert mgr.last_committed == 5 and beats == [1]
    mgr.finish()


@pytest.mark.parametrize("mode", ["async", "sync"])
def test_a_full_disk_fails_saves_until_it_has_room_again(tmp_path: Path, group: Any,
                                                         process: CheckpointProcess, mode: str) -> None:
    model = torch.nn.Linear(16, 16)
    events: list = []
    fault: list = [("full", 0.0)]  # the disk-full fault in force: writes go to /dev/full (ENOSPC)
    mgr = CheckpointManager(tmp_path, rank=0, world_size=1, group=group, every=5, mode=mode, keep_last=2,
                            emit=lambda kind, **data: events.append(data), storage_fault=lambda: fault[0],
                            process=process)
    mgr.maybe_save(5, _state(model, 5))
    mgr.finish()
    mgr.maybe_save(6, _state(model, 6))  # the retry fails too
    mgr.finish()
    fault[0] = None
    mgr.maybe_save(7, _state(model, 7), last=True)
    failed = [e for e in events if e["phase"] == "failed"]
    assert [e["step"] for e in failed] == [5, 6] and all("No space left" in e["error"] for e in failed)
    [info] = [i for i in list_checkpoints(tmp_path) if i.state == "committed"]
    assert info.step == 7 and verify(info) is None
    target = _state(torch.nn.Linear(16, 16), 0)
    load(info.path, target, group)
    assert int(target["progress"]["step"]) == 7 and torch.equal(target["model"]["weight"], model.weight)


def test_slow_storage_delays_the_background_write_not_training(tmp_path: Path, group: Any,
                                                               process: CheckpointProcess) -> None:
    events: list = []
    mgr = CheckpointManager(tmp_path, rank=0, world_size=1, group=group, every=5, mode="async", keep_last=2,
                            emit=lambda kind, **data: events.append(data),
                            storage_fault=lambda: ("slow", 1.0),
                            process=process)
    mgr.maybe_save(5, _state(torch.nn.Linear(16, 16), 5))
    mgr.finish()
    [staged] = [e for e in events if e["phase"] == "staged"]
    [committed] = [e for e in events if e["phase"] == "committed"]
    assert committed["background_s"] >= 1.0 > staged["blocked_s"]


def test_old_checkpoints_are_pruned_to_keep_last(tmp_path: Path, group: Any,
                                                 process: CheckpointProcess) -> None:
    model = torch.nn.Linear(8, 8)
    mgr = _manager(tmp_path, group, "sync", [], process)
    for step in (5, 10, 15, 20):
        mgr.maybe_save(step, _state(model, step))
    assert [i.step for i in list_checkpoints(tmp_path)] == [15, 20]


def test_a_save_in_flight_by_another_writer_is_not_pruned_while_newer_than_the_oldest_kept(
        tmp_path: Path, group: Any, process: CheckpointProcess) -> None:
    """torchft: the group that saved before another took over may still be writing an older step when
    the other commits a newer one; that commit's prune must not remove the folder under its writer."""
    model = torch.nn.Linear(8, 8)
    mgr = _manager(tmp_path, group, "sync", [], process)
    for step in (5, 10):
        mgr.maybe_save(step, _state(model, step))
    folder = list_checkpoints(tmp_path)[-1].path
    in_flight = folder.with_name(folder.name.replace("10", "12"))   # another writer's, no commit record yet
    shutil.copytree(folder, in_flight)
    (in_flight / "commit.json").unlink()
    mgr.maybe_save(15, _state(model, 15))
    assert [(i.step, i.state) for i in list_checkpoints(tmp_path)] == [
        (10, "committed"), (12, "incomplete"), (15, "committed")]
    mgr.maybe_save(20, _state(model, 20))   # older than every kept one now: debris, removed
    assert [i.step for i in list_checkpoints(tmp_path)] == [15, 20]


def test_restore_loads_the_newest_checkpoint_that_verifies(tmp_path: Path, group: Any,
                                                           process: CheckpointProcess) -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 16)
    events: list = []
    mgr = _manager(tmp_path, group, "sync", events, process)
    mgr.maybe_save(5, {"model": model, "step": 5})
    at_5 = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        model.weight.add_(1.0)
    mgr.maybe_save(10, {"model": model, "step": 10})
    newest = list_checkpoints(tmp_path)[-1]
    (newest.path / "__0_0.distcp").write_bytes(b"garbage")

    fresh = torch.nn.Linear(16, 16)
    restarted = _manager(tmp_path, group, "sync", events, process)
    step = restarted.restore({"model": fresh}, "latest", restarting=True)
    assert step == 5
    assert all(torch.equal(fresh.state_dict()[k], v) for k, v in at_5.items())
    rejected = [e for e in events if e.get("phase") == "rejected"]
    assert rejected[0]["step"] == 10 and "commit record says" in rejected[0]["reason"]
    resumed = [e for e in events if "skipped" in e][0]
    assert resumed["step"] == 5 and resumed["skipped"][0]["step"] == 10
    assert list_checkpoints(tmp_path)[-1].state == "rejected"
    assert _manager(tmp_path, group, "sync", [], process).restore({"model": fresh}, "none") == 0


def rewrite(folder: Path, name: str, data: bytes) -> None:
    """What an attacker does: replace a file of a checkpoint and recompute its entry in commit.json."""
    (folder / name).write_bytes(data)
    record = json.loads((folder / "commit.json").read_text())
    record["files"][name] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (folder / "commit.json").write_text(json.dumps(record))


class _Evil:
    def __reduce__(self) -> tuple:
        return (os.system, (f"touch {_Evil.marker}",))


def test_loading_refuses_metadata_that_would_run_code(tmp_path: Path, group: Any,
                                                      process: CheckpointProcess) -> None:
    model = torch.nn.Linear(8, 8)
    mgr = _manager(tmp_path, group, "sync", [], process)
    mgr.maybe_save(5, _state(model, 5))
    [info] = list_checkpoints(tmp_path)
    _Evil.marker = str(tmp_path / "pwned")
    rewrite(info.path, ".metadata", pickle.dumps(_Evil()))
    with pytest.raises(JobError, match="it names posix.system, which is not a DCP metadata class"):
        load(info.path, _state(torch.nn.Linear(8, 8), 0), group)
    assert not (tmp_path / "pwned").exists()


def hostile_metadata(command: str) -> bytes:
    """A pickle that names only classes reached through DCP's own modules, yet runs ``command``:
    at protocol 4 pickle resolves dotted names, so ``filesystem`` + ``"operator.attrgetter"`` is
    ``operator.attrgetter`` (a class), and attrgetter/methodcaller walk from a DCP class to
    ``os.system``."""
    def text(value: str) -> bytes:
        raw = value.encode()
        return b"\x8c" + bytes([len(raw)]) + raw  # SHORT_BINUNICODE

    def name(module: str, attr: str) -> bytes:
        return text(module) + text(attr) + b"\x93"  # STACK_GLOBAL

    fs = "torch.distributed.checkpoint.filesystem"
    return (b"\x80\x04"
            # mc("system", cmd)
            + name(fs, "operator.methodcaller") + text("system") + text(command) + b"\x86R"
            # mc("get", "os")
            + name(fs, "operator.methodcaller") + text("get") + text("os") + b"\x86R"
            + name(fs, "operator.attrgetter") + text("__init__.__globals__") + b"\x85R"         # ag(...)
            + name(fs, "FileSystemReader") + b"\x85R"   # FileSystemReader.__init__.__globals__
            + b"\x85R"                                  # ["os"]: the os module
            + b"\x85R"                                  # .system(command)
            + b".")


def test_a_dotted_name_in_metadata_cannot_reach_os_system(tmp_path: Path, group: Any,
                                                          process: CheckpointProcess) -> None:
    model = torch.nn.Linear(8, 8)
    events: list = []
    mgr = _manager(tmp_path, group, "sync", events, process)
    mgr.maybe_save(5, _state(model, 5))
    mgr.maybe_save(10, _state(model, 10))
    newest = list_checkpoints(tmp_path)[-1]
    marker = tmp_path / "pwned"
    payload = hostile_metadata(f"touch {marker}")
    assert len(payload) < 400  # a few hundred bytes, most of them the command
    (newest.path / ".metadata").write_bytes(payload)
    record = json.loads((newest.path / "commit.json").read_text())  # the attacker recomputes the checksums
    record["files"][".metadata"] = {"size": len(payload), "sha256": hashlib.sha256(payload).hexdigest()}
    (newest.path / "commit.json").write_text(json.dumps(record))
    [newest] = [i for i in list_checkpoints(tmp_path) if i.step == 10]
    assert verify(newest) is None  # the checksums match: only the allow-list stands in the way

    with pytest.raises(JobError) as refused:
        load(newest.path, _state(torch.nn.Linear(8, 8), 0), group)
    assert "operator.methodcaller, which is not a DCP metadata class" in str(refused.value)
    assert "\n" not in str(refused.value)
    assert not marker.exists()

    # a restart skips it with the reason and loads the older checkpoint, which is real
    target = _state(torch.nn.Linear(8, 8), 0)
    assert _manager(tmp_path, group, "sync", events, process).restore(target, "latest", restarting=True) == 5
    assert int(target["progress"]["step"]) == 5
    assert torch.equal(target["model"]["weight"], model.weight)
    [rejected] = [e for e in events if e.get("phase") == "rejected"]
    assert rejected["step"] == 10 and "not a DCP metadata class" in rejected["reason"]
    assert not marker.exists()


def test_metadata_may_only_name_files_inside_its_folder(tmp_path: Path, group: Any,
                                                        process: CheckpointProcess) -> None:
    model = torch.nn.Linear(8, 8)
    mgr = _manager(tmp_path, group, "sync", [], process)
    mgr.maybe_save(5, _state(model, 5))
    [info] = list_checkpoints(tmp_path)
    from eksft_nb.runtime.checkpoint import read_metadata

    metadata = read_metadata(info.path)
    for record in metadata.storage_data.values():
        record.relative_path = "../../outside.distcp"
    rewrite(info.path, ".metadata", pickle.dumps(metadata))
    with pytest.raises(JobError, match="outside the checkpoint folder"):
        load(info.path, _state(torch.nn.Linear(8, 8), 0), group)


def test_model_state_matches_get_state_dict_across_steps_and_new_parameters(group: Any) -> None:
    """ModelState keeps get_state_dict's per-model work across saves: what it returns must stay what
    get_state_dict returns, also once the optimizer has state and once the parameters are new objects."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from eksft_nb.runtime.checkpoint import ModelState

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    optim = torch.optim.AdamW(model.parameters(), lr=0.1)
    ms = ModelState(model, optim)
    for replace in (False, False, True):
        if replace:  # new parameter objects (and a new optimizer over them): the kept work is redone
            model[1] = torch.nn.Linear(4, 3)
            optim = ms.optim = torch.optim.AdamW(model.parameters(), lr=0.2)
        model(torch.randn(2, 4)).sum().backward()
        optim.step()
        got, (msd, osd) = ms.state_dict(), get_state_dict(model, optim)
        assert got["model"].keys() == msd.keys() and all(torch.equal(got["model"][k], v) for k,
                                                         v in msd.items())
        assert got["optim"]["param_groups"] == osd["param_groups"]
        assert got["optim"]["state"].keys() == osd["state"].keys()
        for fqn, st in osd["state"].items():
            assert all(torch.equal(got["optim"]["state"][fqn][k], v) for k, v in st.items())


def test_model_state_without_torchs_private_helpers_is_get_state_dict(
        group: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A torch release whose private state-dict helpers differ (users' GPU images run other torch
    versions): ModelState falls back to the public get_state_dict, and says the same."""
    from torch.distributed.checkpoint import state_dict as sd

    from eksft_nb.runtime.checkpoint import ModelState

    def other_torch(self: Any, sd: Any) -> None:   # what calling helpers that are not there raises
        raise AttributeError("module 'torch.distributed.checkpoint.state_dict' has no attribute "
                             "'_verify_options'")

    monkeypatch.setattr(ModelState, "_kept_state_dict", other_torch)
    model = torch.nn.Linear(4, 2)
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    ms = ModelState(model, optim)
    for _ in range(2):
        got, (msd, _osd) = ms.state_dict(), sd.get_state_dict(model, optim)
        assert got["model"].keys() == msd.keys() and all(torch.equal(got["model"][k], v) for k,
                                                         v in msd.items())
    assert ms._kept is False


def test_fsdp_model_and_optimizer_saves_with_the_kept_work_load_bit_exact(tmp_path: Path, group: Any,
                                                                          process: CheckpointProcess) -> None:
    """FSDP2 (DTensor) model and AdamW state through ModelState and the stager's kept DTensors,
    saved while training goes on and with the plan cached: the last save loads bit exact."""
    from eksft_nb.runtime.checkpoint import ModelState
    from eksft_nb.runtime.model import build_model, loss_fn

    def fresh() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        model = build_model(64, 16, 2, 2, 8, 0, torch.device("cpu"), fsdp=True)
        return model, torch.optim.AdamW(model.parameters(), lr=0.01)

    model, optim = fresh()
    mgr, state = _manager(tmp_path, group, "async", [], process), {"train": ModelState(model, optim)}
    gen = torch.Generator().manual_seed(0)
    for step in (5, 10, 15):
        loss_fn(model, torch.randint(0, 64, (2, 9), generator=gen)).backward()
        optim.step()
        optim.zero_grad()
        expected = fsdp_snapshot(model, optim)
        mgr.maybe_save(step, state)
        loss_fn(model, torch.randint(0, 64, (2, 9), generator=gen)).backward()  # training goes on
        optim.step()
        mgr.finish()
    assert mgr.plan_cache.reused == 2
    model2, optim2 = fresh()
    assert mgr.restore({"train": ModelState(model2, optim2)}) == 15
    got = fsdp_snapshot(model2, optim2)
    assert got.keys() == expected.keys() and all(torch.equal(got[k], v) for k, v in expected.items())


def test_managers_share_the_writer_and_buffers_only_of_the_process_they_are_given(
        tmp_path: Path, group: Any, process: CheckpointProcess) -> None:
    """An in-process restart's manager gets the rank process's writer and staging buffers; a manager
    made without them has its own, and staging through it leaves the others' buffers as they were."""
    first = _manager(tmp_path / "a", group, "sync", [], process)
    restarted = _manager(tmp_path / "a", group, "sync", [], process)
    assert first.writer is restarted.writer is process.writer
    assert first.stager is restarted.stager is process.stager
    other = CheckpointManager(tmp_path / "b", rank=0, world_size=1, group=group, every=5, mode="sync",
                              keep_last=2, emit=lambda kind, **data: None)
    assert other.writer is not process.writer and other.stager is not process.stager
    before = dict(process.stager._buffers)
    other.stager.stage({"w": torch.ones(4)})
    assert process.stager._buffers == before and other.stager._buffers.keys() == {"/w"}


def test_checkpoint_states_are_the_enums_members(tmp_path: Path, group: Any,
                                                 process: CheckpointProcess) -> None:
    from eksft_nb.checkpoint_folders import reject
    from eksft_nb.states import CheckpointState

    mgr = _manager(tmp_path, group, "sync", [], process)
    mgr.maybe_save(5, {"w": torch.ones(2)})
    mgr.maybe_save(10, {"w": torch.ones(2)})
    step_dir(tmp_path, 15).mkdir()
    reject(list_checkpoints(tmp_path)[0], "a test")
    states = [i.state for i in list_checkpoints(tmp_path)]
    assert states == [CheckpointState.REJECTED, CheckpointState.COMMITTED, CheckpointState.INCOMPLETE]
    assert all(type(s) is CheckpointState for s in states)
    assert json.dumps(states) == '["rejected", "committed", "incomplete"]'   # the wire keeps the words
