"""The torchft engine (``--engine torchft``) on the local backend, with real replica groups: a group killed
by SIGKILL restarts and heals from its peer (no committed step lost, the groups' weights identical at the
end, the batches it missed counted); an exception inside backward throws that step away; every process of
the job listens on loopback only; what the engine does not take is refused in one line."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from eksft_nb import commands
from eksft_nb.control import FaultCommand
from eksft_nb.errors import EksftError
from eksft_nb.jobdir import JobDir
from eksft_nb.spec import JobSpec, ModelConfig
from jobs import cli, events, story, wait_for
from test_ports import Listeners, is_loopback

pytest.importorskip("torchft")

STEPS = 60


def torchft_spec(name: str, **changes: object) -> JobSpec:
    spec = JobSpec(
        name=name, engine="torchft", nnodes=2, nproc_per_node=1, steps=STEPS, model=ModelConfig("tiny")
    )
    return spec.replace(**changes) if changes else spec


def of(name: str, kind: str, rank: int | None = None, after: float = 0.0) -> list:
    return [e for e in events(name, kind) if (rank is None or e.rank == rank) and e.t >= after]


def until(name: str, kind: str, rank: int | None = None, after: float = 0.0) -> object:
    """A probe for wait_for: those events, or the job's end (which ends the wait: the assertions then say
    what went wrong)."""
    return lambda: of(name, kind, rank, after) or of(name, "job_end")


@pytest.fixture(scope="module")
def healed() -> Iterator[tuple[str, Listeners]]:
    """A 2-group job: group 1 killed at step 3; once it healed, an exception inside its backward; then group
    0 (the one that reported the steps) killed; once it healed too, the job runs to its end. Its listeners
    sampled throughout. The groups are stragglers (the registry's slow-rank) until the test ends that: the
    job runs long enough for a killed group to come back however slowly this machine starts a process,
    and no longer."""
    name = "tft-heal"
    commands.launch(torchft_spec(name), [pace(0, step=1), FaultCommand("sigkill", rank=1, step=3)])
    with watched(name) as listeners:
        heal = wait_for("group 1 to heal from group 0", until(name, "heal", 1), timeout=600)[0]
        commands.inject_command(name, pace(1))  # the restarted process has no pace: group 0 goes next
        commands.inject(name, "exception", rank=1)
        wait_for("group 1 to throw a step away", until(name, "step_discarded", 1), timeout=300)
        wait_for("group 1 to heal the thrown-away step", until(name, "heal", 1, heal.t + 1e-6), timeout=300)
        commands.inject(name, "sigkill", rank=0)
        wait_for("group 0 to heal from group 1", until(name, "heal", 0), timeout=600)
        commands.inject_command(name, pace(1, delay=0.01, duration=1))
        wait_for("the job to end", lambda: of(name, "job_end"), timeout=600)
    yield name, listeners


@contextmanager
def watched(name: str) -> Iterator[Listeners]:
    """The listeners of a launched job's processes, sampled while the block runs; the job is stopped if it
    has not ended by then."""
    uid = wait_for("the job's uid", lambda: JobDir.for_name(name).supervisor().get("job_uid"), timeout=120)
    listeners = Listeners(uid)
    listeners.start()
    try:
        yield listeners
    finally:
        listeners.stop()
        if not of(name, "job_end"):
            commands.stop(name)


def pace(rank: int, step: int | None = None, delay: float = 2.0, duration: int = 10**6) -> FaultCommand:
    """The registry's straggler on ``rank``: ``delay`` seconds a step for ``duration`` steps."""
    return FaultCommand("slow-rank", rank=rank, step=step, params={"delay": delay, "duration": duration})


@pytest.mark.slow
def test_a_killed_group_heals_from_its_peer_and_the_job_ends_with_every_step(healed) -> None:
    name, _ = healed
    end = of(name, "job_end")[0]
    assert end["state"] == "succeeded" and end["final_step"] == STEPS, story(name)
    steps = [e["step"] for e in events(name, "step")]
    assert steps == list(range(1, STEPS + 1)), steps  # every step committed once, in order: none lost
    digests = {e.rank: e["digest"] for e in events(name, "rank_end")}
    assert set(digests) == {0, 1} and digests[0] == digests[1], digests


@pytest.mark.slow
def test_the_events_tell_the_quorum_changes_the_heal_and_the_skipped_batches(healed) -> None:
    name, _ = healed
    kill = next(e for e in events(name, "fault") if e["fault"] == "sigkill")
    sizes = [e["participants"] for e in of(name, "quorum", rank=1)]
    assert sizes[0] == 2 and 1 in sizes and sizes[-1] == 2, sizes  # both, group 1 alone, both again
    heal = of(name, "heal", rank=1)[0]
    assert (
        heal["step"] > heal["from_step"] >= 2 and heal["skipped_batches"] == heal["step"] - heal["from_step"]
    )
    restart = of(name, "restart")[0]
    assert restart["level"] == "job" and restart["blame_rank"] == 1 and restart["restored_from"] == "peer"
    assert restart["fault_time"] == kill.t and restart["rolled_back_steps"] == 0
    assert restart["resumed_step"] == heal["step"] and restart["skipped_batches"] == heal["skipped_batches"]
    assert 0 < restart["downtime_s"] < restart["group_downtime_s"], restart
    row = commands.status(name)
    assert row["restarts"]["job"] == 2 and row["step"] == STEPS, row
    # group 0 lost: group 1, first in the quorum then, reported the steps
    lost = next(e for e in events(name, "fault") if e["fault"] == "sigkill" and e["target_rank"] == 0)
    back = of(name, "heal", rank=0)[0]
    assert {e.rank for e in events(name, "step") if lost.t < e.t < back.t} == {1}
    assert of(name, "restart")[1]["blame_rank"] == 0


@pytest.mark.slow
def test_an_exception_inside_backward_throws_the_step_away_and_the_group_heals_it(healed) -> None:
    name, _ = healed
    fault = next(e for e in events(name, "fault") if e["fault"] == "exception")
    thrown = of(name, "step_discarded", rank=1)[0]
    assert "injected exception" in thrown["reason"] and thrown.t > fault.t
    again = of(name, "heal", rank=1, after=thrown.t)[0]
    assert again["skipped_batches"] == 1 and again["step"] == thrown["step"], again  # group 0 committed it
    assert not of(name, "rank_error", rank=1, after=fault.t)  # the group went on: nothing restarted it
    assert [e["blame_rank"] for e in of(name, "failure")] == [1, 0]  # the two kills, not the exception


@pytest.mark.slow
def test_every_process_of_a_torchft_job_listens_on_loopback_only(healed) -> None:
    name, listeners = healed
    who = " ".join(listeners.seen.values())
    assert "torchft_lighthouse" in who and "eksft_nb.engines.torchft.trainer" in who, listeners.seen
    wide = {f"{ip}:{port}": w for (ip, port), w in listeners.seen.items() if not is_loopback(ip)}
    assert not wide, f"listening beyond loopback: {wide}"


@pytest.mark.parametrize(
    "changes, words",
    [
        ({"backend": "eks", "eks.image": "img"}, "runs its replica groups as a JobSet"),
        ({"nnodes": 1}, "2 or more replica groups"),
        ({"nproc_per_node": 2}, "1 rank per replica group"),
        ({"spare_nodes": 1}, "--spare-nodes is NVRx's"),
        ({"ft.soft_timeout": 3.0}, "--soft-timeout is an NVRx setting"),
    ],
)
def test_what_the_torchft_engine_does_not_take_is_refused_in_one_line(changes: dict, words: str) -> None:
    with pytest.raises(EksftError) as refused:
        commands.prepare(torchft_spec("tft-refused", **changes))
    assert words in str(refused.value) and "\n" not in str(refused.value)


def test_a_fault_the_torchft_engine_cannot_fire_is_refused_before_launch() -> None:
    done = cli(
        "run",
        "--name",
        "tft-refused",
        "--engine",
        "torchft",
        "--nnodes",
        "2",
        "--nproc-per-node",
        "1",
        "--fault",
        "hang:0@5",
    )
    assert done.returncode != 0 and "cannot fire hang" in done.stderr, done.stderr
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert not JobDir.for_name("tft-refused").path.exists()


def test_a_dry_run_shows_the_lighthouse_on_loopback_and_one_process_per_group() -> None:
    shown = commands.dry_run(torchft_spec("tft-dry", nnodes=3))
    assert "torchft_lighthouse" in shown and "--bind 127.0.0.1:" in shown, shown
    assert shown.count("-m eksft_nb.engines.torchft.trainer") == 3 and "NUM_REPLICA_GROUPS=3" in shown, shown
