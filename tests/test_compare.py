"""The comparison of engines (``eksft_nb.resilience.compare``): its seeded plan, and its arithmetic over
each engine's events (the shapes NVRx's supervisor and ranks, torchft's supervisor and groups, and the
torchrun baseline write). The whole run, on real jobs, is notebooks/07_engines.ipynb (test_notebooks)."""

from __future__ import annotations

from typing import Any

import pytest

from eksft_nb.engines.torchft.checks import FAULTS as TORCHFT_FAULTS
from eksft_nb.errors import EksftError
from eksft_nb.events import RESTART_PHASES, Event, make
from eksft_nb.goodput import compute
from eksft_nb.monitor import JobMonitor
from eksft_nb.resilience.compare import CANDIDATES, plan, text
from eksft_nb.resilience.ledger import ledger

BATCH, SEQ = 8, 64
STEP_S = 0.1


class Run:
    """A job's events in time order, as its writers emit them."""

    def __init__(self, name: str) -> None:
        self.name, self.t, self.events = name, 100.0, []
        self.torchft = "torchft" in name   # its steps say how many groups' batches they trained

    def at(self, dt: float, kind: str, rank: int | None = None, **data: Any) -> Event:
        self.t += dt
        e = make(kind, self.name, rank, t=self.t, **data)
        self.events.append(e)
        return e

    def start(self, rank: int, attempt: int = 0, injob: int = 0, step: int = 0, dt: float = 0.5) -> Event:
        return self.at(dt, "rank_start", rank, pid=1000 + rank, host="h", job_attempt=attempt,
                       injob_restart=injob, inprocess_iteration=0, world_size=2, start_step=step,
                       t_enter=self.t, t_group=self.t + dt / 2)

    def steps(self, first: int, last: int, rank: int = 0, step_s: float = STEP_S, groups: int = 2) -> None:
        for s in range(first, last + 1):
            self.at(step_s, "step", rank, step=s, loss=10.0 / s, tokens=groups * BATCH * SEQ,
                    step_time=step_s, **({"batches": groups} if self.torchft else {}))

    def fault(self, kind: str, rank: int, step: int) -> Event:
        return self.at(0.01, "fault", rank, fault=kind, id=f"{kind}{step}", target_rank=rank, at_step=step)


def nvrx_run() -> tuple[Run, Event, Event]:
    """Saves at 5 and 10; rank 1 killed at the start of step 13: an in-job restart from step 10."""
    r = Run("cmp-nvrx")
    r.at(0, "job_start", spec_digest="d", world_size=2, steps=20, backend="local", host="h", pid=1)
    r.start(0), r.start(1, dt=0.01)
    r.steps(1, 5)
    for step in (5, 10):
        if step == 10:
            r.steps(6, 10)
        r.at(0.01, "checkpoint", 0, phase="begin", step=step, mode="async")
        r.at(0.02, "checkpoint", 0, phase="staged", step=step, blocked_s=0.02)
        r.at(0.05, "checkpoint", 0, phase="committed", step=step, blocked_s=0.02, background_s=0.05)
    r.steps(11, 12)
    fault = r.fault("sigkill", 1, 13)
    r.at(0.4, "failure", level="injob", cause="injected sigkill on rank 1", blame_rank=1, fault_time=fault.t,
         detected_at=fault.t + 0.4)
    r.start(0, injob=1, step=10, dt=1.0), r.start(1, injob=1, step=10, dt=0.01)
    r.at(0.3, "resume", 0, step=10, path="p", load_s=0.2, skipped=[], source="memory")
    first_start = r.t + 0.05
    phases = {"detection": 0.4, "teardown": 0.5, "reformation": 0.2, "restore": 0.3,
              "first_step": round(first_start - fault.t - 1.4, 4)}
    restart = r.at(0.0, "restart", level="injob", cause="injected sigkill on rank 1", blame_rank=1,
                   fault_time=fault.t, detection_s=0.4, downtime_s=first_start - fault.t, rolled_back_steps=2,
                   resumed_step=10, phases=phases, restored_from="memory")
    r.steps(11, 20)
    r.at(0.1, "job_end", state="succeeded", reason="all 20 steps done", final_step=20, digest="abc")
    return r, fault, restart


def torchft_run() -> tuple[Run, dict[str, Event]]:
    """Two replica groups: group 1 killed at step 5 (group 0 trains alone until it heals at 9), then an
    exception inside group 1's backward at step 12 (the step thrown away, healed at once)."""
    r = Run("cmp-torchft")
    r.at(0, "job_start", spec_digest="d", world_size=2, steps=20, backend="local", host="h", pid=1)
    r.start(0), r.start(1, dt=0.01)
    r.at(0.1, "quorum", 0, quorum_id=1, participants=2, step=0)
    r.steps(1, 4)
    seen = {"kill": r.fault("sigkill", 1, 5)}
    seen["failure"] = r.at(0.2, "failure", level="job", cause="replica group 1's rank was killed (SIGKILL)",
                           blame_rank=1, fault_time=seen["kill"].t, detected_at=r.t + 0.2)
    r.at(0.5, "quorum", 0, quorum_id=2, participants=1, step=4)
    r.steps(5, 6, groups=1)
    seen["start"] = r.at(0.5, "rank_start", 1, pid=7, host="h", job_attempt=0, injob_restart=0,
                         inprocess_iteration=0, world_size=2, start_step=0, t_enter=r.t - 0.4,
                         group_restart=1)
    r.steps(7, 8, groups=1)
    seen["heal"] = r.at(0.3, "heal", 1, from_step=4, step=8, skipped_batches=4, heal_s=0.25)
    seen["restart"] = r.at(0.0, "restart", level="job", cause="replica group 1's rank was killed (SIGKILL)",
                           blame_rank=1, fault_time=seen["kill"].t, detection_s=seen["failure"]["detected_at"]
                           - seen["kill"].t, downtime_s=0.6, rolled_back_steps=0, resumed_step=8,
                           restored_from="peer", group_downtime_s=seen["heal"].t - seen["kill"].t,
                           skipped_batches=4, replica_group=1)
    r.steps(9, 11)
    seen["exception"] = r.fault("exception", 1, 12)
    seen["thrown"] = r.at(0.12, "step_discarded", 1, step=12, reason="injected exception on rank 1")
    r.steps(12, 12)
    seen["again"] = r.at(0.05, "heal", 1, from_step=11, step=12, skipped_batches=0, heal_s=0.02)
    r.steps(13, 20)
    r.at(0.1, "job_end", state="succeeded", reason="all 20 steps done", final_step=20)
    return r, seen


def test_an_nvrx_run_loses_what_its_restart_rolled_back_and_skips_nothing() -> None:
    r, fault, restart = nvrx_run()
    led = ledger(r.events, world_size=2, batch=BATCH)
    assert led["state"] == "succeeded" and led["steps_done"] == 20
    assert led["steps_lost"] == 2 and led["skipped_batches"] == 0 and led["lost_step_equivalents"] == 2
    assert led["terms"]["skipped"] == 0 and led["terms"]["recomputed"] == pytest.approx(2 * STEP_S, abs=1e-3)
    gp = compute(_mon(r.events))
    assert led["ettr"] == pytest.approx(gp.goodput, abs=1e-4)  # nothing skipped: goodput's own ETTR
    assert sum(led["terms"].values()) == pytest.approx(led["wall_s"], abs=1e-3)
    [row] = led["faults"]
    assert (row["fault"], row["rank"], row["step"], row["level"], row["restored_from"]) == \
        ("sigkill", 1, 13, "injob", "memory")
    assert row["phases"] == restart["phases"]
    assert row["stall_s"] == pytest.approx(restart["downtime_s"], abs=1e-3)
    assert row["recovery_s"] == pytest.approx(sum(restart["phases"].values()), abs=1e-3)
    assert row["steps_lost"] == 2 and row["skipped_batches"] == 0
    assert led["final_loss"] == pytest.approx(sum(10.0 / s for s in range(16, 21)) / 5, abs=1e-4)


def test_a_torchft_run_counts_the_batches_its_rejoining_group_skipped_as_lost() -> None:
    r, seen = torchft_run()
    led = ledger(r.events, world_size=2, batch=BATCH)
    gp = compute(_mon(r.events))
    # steps 5-8 committed by group 0 alone: four batches of two a step missing, two steps' samples
    assert led["steps_lost"] == 0 and led["skipped_batches"] == 4 and led["samples_skipped"] == 4 * BATCH
    assert led["lost_step_equivalents"] == 2
    # one count: goodput's skipped term is the committed steps' missing batches, not the heals' 5 (the step
    # group 1 threw away had its gradients all-reduced: group 0's commit of it lacked nothing)
    assert gp.skipped_s == pytest.approx(2 * STEP_S, abs=1e-4)
    assert led["terms"] == {t: round(s, 4) for t, s in gp.seconds().items()}
    assert led["ettr"] == pytest.approx(gp.goodput, abs=1e-5) and gp.skipped_s > 0
    assert sum(led["terms"].values()) == pytest.approx(led["wall_s"], abs=1e-3)
    kill, thrown = led["faults"]
    # the group's recovery, from its own events: seen gone, a new process, its first quorum, the heal
    assert kill["level"] == "job" and kill["restored_from"] == "peer" and kill["skipped_batches"] == 4
    assert kill["stall_s"] == 0.6 and kill["steps_lost"] == 0
    start, heal = seen["start"], seen["heal"]
    assert kill["phases"] == pytest.approx({
        "detection": seen["failure"]["detected_at"] - seen["kill"].t,
        "teardown": start["t_enter"] - seen["failure"]["detected_at"],
        "reformation": heal.t - heal["heal_s"] - start["t_enter"], "restore": heal["heal_s"],
        "first_step": 0.0},
        abs=1e-3)
    assert kill["recovery_s"] == pytest.approx(seen["restart"]["group_downtime_s"], abs=1e-3)
    # the exception: no restart; the step thrown away by group 1 after its gradients were all-reduced (group
    # 0's step had both batches), the group healed at the next quorum
    assert (thrown["fault"], thrown["level"], thrown["stall_s"], thrown["skipped_batches"]) == \
        ("exception", "none", 0.0, 0)
    assert sum(r["skipped_batches"] for r in led["faults"]) == led["skipped_batches"]  # the rows add up
    assert thrown["detection_s"] == pytest.approx(seen["thrown"].t - seen["exception"].t, abs=1e-3)
    assert thrown["recovery_s"] == pytest.approx(seen["again"].t - seen["exception"].t, abs=1e-3)
    assert thrown["phases"]["restore"] == pytest.approx(0.02) and set(thrown["phases"]) == set(RESTART_PHASES)


def test_a_group_that_never_came_back_skipped_every_batch_after_it_was_lost() -> None:
    r, seen = torchft_run()
    cut = r.events.index(seen["start"])   # the job ended while group 1's new process was starting
    events = r.events[:cut]
    r2 = Run("cmp-torchft")
    r2.t, r2.events = events[-1].t, events
    r2.steps(7, 20, groups=1)
    r2.at(0.1, "job_end", state="succeeded", reason="all 20 steps done", final_step=20)
    led = ledger(r2.events, world_size=2, batch=BATCH)
    assert led["skipped_batches"] == 16 and led["faults"][0]["level"] is None   # steps 5 to 20 alone
    # lost and never back: said so, with the time from the fault to the job's end, not as "no restart"
    row = led["faults"][0]
    assert row["away_s"] == pytest.approx(r2.t - seen["kill"].t, abs=1e-3) and row["recovery_s"] is None
    result = {"plan": {"steps": 20, "every": 10, "faults": ["sigkill:1@5"], "seed": 0, "skipped": {}},
              "engines": {"torchft": {"label": "torchft", **led}}}
    [line] = [x for x in text(result).splitlines() if x.startswith("sigkill:1@5")]
    assert line.split()[2:4] == ["rejoining", "-"] and f">{row['away_s']:.2f}" in line, line


def test_a_fault_no_recovery_followed_is_said_so() -> None:
    r, _, _ = nvrx_run()
    cut = next(i for i, e in enumerate(r.events) if e.kind == "failure")
    [row] = ledger(r.events[:cut], world_size=2, batch=BATCH)["faults"]
    assert row["level"] is None and row["recovery_s"] is None and row["phases"] == {}


def test_the_plan_is_seeded_drawn_from_the_kinds_every_engine_fires_and_leaves_room_to_recover() -> None:
    a = plan(seed=3, steps=300, faults=4, every=10)
    assert a == plan(seed=3, steps=300, faults=4, every=10)
    assert a != plan(seed=4, steps=300, faults=4, every=10)
    kinds = [f.split("@")[0].split(":")[0] for f in a.faults]
    every_engine = [k.value for k in CANDIDATES if k.value in TORCHFT_FAULTS and k.value != "hang"]
    assert kinds == [every_engine[i % len(every_engine)] for i in range(4)] and "sigkill" in kinds
    assert set(a.skipped) == {k.value for k in CANDIDATES} - set(every_engine)
    steps = [c.step for c in a.commands()]
    assert steps == sorted(steps) and steps[0] > 2 * 10 and steps[-1] < 300 // 2
    assert all(s % 10 not in (0, 1) for s in steps)   # never on a save's step: each engine loses some steps
    assert all(c.rank in (0, 1) for c in a.commands() if c.fault != "kill-launcher")   # a node: each's own
    with pytest.raises(EksftError) as refused:
        plan(steps=30, faults=3, every=10)
    assert "do not fit" in str(refused.value) and "\n" not in str(refused.value)


def _mon(events: list[Event]) -> JobMonitor:
    mon = JobMonitor()
    mon.update(events)
    return mon
