"""Real 2-rank jobs whose storage fails or misleads: a full disk, slow storage, checkpoints of
another run in the folder, a corrupt shard found by the rank that verifies it. Each ends with
parameters bit-identical to a fault-free run."""

from __future__ import annotations

import pytest

from eksft_nb.checkpoint_folders import list_checkpoints, verify
from jobs import cli, events, job_dir, run_job

pytestmark = pytest.mark.slow


def test_a_full_disk_and_slow_storage_lose_no_step_and_say_what_was_lost(reference_digest: str) -> None:
    # the disk of rank 0 is full for steps 15-24, that of rank 1 for steps 45-54 (checkpoint and
    # event writes fail with ENOSPC); rank 1's checkpoint writes start 2 s late for steps 62-71.
    # Sync saves, so that the saves fall exactly into those windows (see test_checkpoint for async)
    name = "storage-faults"
    summary = run_job(name, "--ckpt-mode", "sync", "--fault", "disk-full:0@15", "--fault", "disk-full:1@45",
                      "--fault", "slow-storage:1@62")
    assert summary["state"] == "succeeded", summary
    assert summary["restarts"] == {"inprocess": 0, "injob": 0, "job": 0}  # training went on
    assert summary["digest"] == reference_digest
    ckpt = events(name, "checkpoint")
    committed = [e["step"] for e in ckpt if e["phase"] == "committed"]
    # each failed save retried until it worked
    assert committed == [10, 25, 30, 40, 55, 60, 70, 80], committed
    # rank 0 could not write its own events while its disk was full: what it lost is reported
    [lost] = events(name, "events_lost")
    assert lost.rank == 0 and "No space left" in lost["error"]
    assert summary["events_lost"] == [{"rank": 0, "count": lost["count"], "error": lost["error"],
                                       "kinds": lost["kinds"]}]
    assert f"events lost: {lost['count']} of rank 0" in cli("summary", name).stdout
    assert lost["kinds"]["step"] == 10 and lost["kinds"]["checkpoint"] >= 5  # steps 15-24, saves 20-24
    assert sorted(e["step"] for e in events(name, "step")) == [s for s in range(1, 81) if not 15 <= s <= 24]
    # rank 1's failed saves are reported by rank 0, whose disk was fine by then
    failed = [e for e in ckpt if e["phase"] == "failed"]
    assert [e["step"] for e in failed] == [50, 51, 52, 53, 54]
    assert all("rank 1" in e["error"] and "No space left on device" in e["error"] for e in failed)
    [slowed] = [e for e in ckpt if e["phase"] == "committed" and e["step"] == 70]
    assert slowed["blocked_s"] >= 2.0
    infos = [i for i in list_checkpoints(job_dir(name) / "ckpt") if i.state == "committed"]
    assert infos[-1].step == 80 and all(verify(i) is None for i in infos)


def test_a_restart_never_jumps_to_a_newer_checkpoint_of_another_run(tmp_path) -> None:
    shared = str(tmp_path / "shared-ckpt")
    first = run_job("lineage-a", "--steps", "30", "--ckpt-mode", "sync", "--ckpt-dir", shared)
    assert first["state"] == "succeeded", first
    assert [i.step for i in list_checkpoints(shared) if i.state == "committed"] == [10, 20, 30]
    # a new run starts from step 10 of that folder and fails before its first save of its own
    second = run_job("lineage-b", "--steps", "30", "--ckpt-mode", "sync", "--ckpt-dir", shared, "--resume",
                     "step:10",
                     "--fault", "exception:0@13")
    assert second["state"] == "succeeded", second
    assert [e["step"] for e in events("lineage-b", "resume")] == [10, 10]  # not 30, the other run's
    assert [r["level"] for r in second["restart_events"]] == ["inprocess"]
    assert second["digest"] == first["digest"]  # the same seed from step 10: the same parameters


def test_each_rank_verifies_its_own_share_and_all_skip_a_corrupt_checkpoint_together(
        corrupt_job: tuple[str, dict]) -> None:
    # sync saves: checkpoint 20 is committed when step 20 ends, so it is the one corrupted at step 25 (the
    # run test_engine checks too)
    name, summary = corrupt_job
    assert summary["state"] == "succeeded", summary
    [fault] = [e for e in events(name, "fault") if e["fault"] == "corrupt-checkpoint"]
    victim = fault["path"].rsplit("/", 1)[1]
    names = sorted([".metadata", "__0_0.distcp", "__1_0.distcp"])
    finder = next(r for r in (0, 1) if victim in names[r::2])  # the rank whose share holds the shard
    [rejected] = [e for e in events(name, "checkpoint") if e["phase"] == "rejected"]
    assert rejected.rank == finder and rejected["step"] == 20 and victim in rejected["reason"]
    resume = events(name, "resume")[0]
    assert resume["step"] == 10 and resume["skipped"] == [
        {"step": 20, "path": str(job_dir(name) / "ckpt" / "step_00000020"),
         "reason": rejected["reason"], "rank": finder}]
    assert resume["verified_files"] == [2, 1]  # every rank hashed its own share of checkpoint 10
