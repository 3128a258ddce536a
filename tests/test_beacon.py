"""The ranks' progress beacons: written at once (``signal`` finds a rank by its beacon), and at 1k ranks
on Lustre few enough that the metadata server is not a rank's second job; a hang is still blamed from
beacons written after it began."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from jobs import wait_for

from eksft_nb.jobdir import JobDir
from eksft_nb.runtime.session import RankInfo, Session, beacon_interval
from eksft_nb.spec import JobSpec


@pytest.mark.parametrize("world,heartbeat,interval", [
    (2, 15.0, 1.0), (64, 15.0, 1.0), (1024, 900.0, 16.0), (1024, 15.0, 7.5), (8192, 900.0, 128.0),
    (8192, 60.0, 30.0)])
def test_the_job_writes_few_beacons_a_second_whatever_its_size(world: int, heartbeat: float,
                                                               interval: float) -> None:
    assert beacon_interval(world, heartbeat) == interval
    assert world / interval <= 64 or interval == heartbeat / 2   # beacon writes per second, the whole job
    assert interval <= max(1.0, heartbeat / 2)                   # a hang outlasts a beacon


def test_a_rank_of_a_large_job_writes_its_beacon_at_once_then_seldom(tmp_path: Path) -> None:
    spec = JobSpec(name="big", nnodes=128, nproc_per_node=8,
                   steps=10).replace(**{"ft.heartbeat_timeout": 900.0,
                                                                                 "ft.soft_timeout": 300.0,
                                                                                 "ft.hard_timeout": 600.0})
    jd = JobDir(tmp_path / "big")
    jd.create(spec)
    session = Session(spec, jd.path,
                      RankInfo(rank=1000, local_rank=0, world_size=1024, node=125, injob_restart=0,
                                              job_attempt=0))
    try:
        beacon = jd.progress / "rank-1000.json"
        record = wait_for("the first beacon", lambda: beacon.exists() and json.loads(beacon.read_text()),
                          timeout=60)
        assert record["rank"] == 1000 and record["step_done"] == 0 and record["pid"] > 0
        assert session._beacon.interval == 16.0
    finally:
        session.close()
