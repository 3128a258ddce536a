"""The torchft engine (``--engine torchft``) on the local backend, with real replica groups, through the
fault matrix of one job: a group's rank killed by SIGKILL restarts and heals from its peer (no committed
step lost, the batches it missed counted); an exception inside backward throws that step away in the group
first in the quorum, and the other group, which committed it, reports it; a whole group lost (the registry's
kill-launcher) heals likewise (a group restarted alone is forked from a zygote that imported
ahead); a hung group is found by the supervisor, restarted, and heals while the other
trains on; the loss of every group restarts the job from its newest checkpoint, loaded from the in-memory
copy of the group that saved it. After each, the job ends with every step reported once and the groups'
weights identical. Every process of the job listens on loopback only; what the engine does not take is
refused in one line. With 2 ranks per
group (HSDP: FSDP inside a group, torchft across), a rank's SIGKILL loses its group, which restarts as a
whole and heals rank by rank from its peer's shards."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from eksft_nb import commands
from eksft_nb.checkpoint_folders import list_checkpoints
from eksft_nb.control import FaultCommand
from eksft_nb.engines.torchft.heal import skipped_batches
from eksft_nb.engines.torchft.hold import HOLD_ENV, restart_point, step_point
from eksft_nb.errors import EksftError
from eksft_nb.goodput import compute, missing_batches
from eksft_nb.jobdir import JobDir
from eksft_nb.monitor import JobMonitor
from eksft_nb.resilience.ledger import ledger
from eksft_nb.spec import JobSpec, ModelConfig
from eksft_nb.states import CheckpointState
from jobs import cli, events, story, wait_for
from test_ports import Listeners, is_loopback

pytest.importorskip("torchft")

STEPS = 150  # paced (PACE_S a step) until the last fault: the job outlasts its five faults
PACE_S = 1.0  # each lost group's race with its peer is held by the test (Holds), not left to the pace
CKPT_EVERY = 5
BATCH_TOKENS = JobSpec().batch * JobSpec().seq  # one group's batch of a step


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


def fault(name: str, kind: str) -> list:
    return [e for e in events(name, "fault") if e["fault"] == kind]


class Holds:
    """The test's holds on a job's ranks (``eksft_nb/engines/torchft/hold.py``): a file per point, in a folder
    the job's processes were launched with (:meth:`env`); removing it lets the rank go. A lost group's race
    with its peer is paced with them, so each outcome is produced in a case of its own and asserted exactly:
    its new process waits before it sets up (the peer commits steps alone), or the peer waits before its
    next step until the new process is up (the group is back before its peer committed a step alone)."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        folder.mkdir(parents=True, exist_ok=True)

    @contextmanager
    def env(self) -> Iterator[None]:
        """Jobs launched inside wait at these holds (every process of theirs inherits the variable)."""
        old = os.environ.get(HOLD_ENV)
        os.environ[HOLD_ENV] = str(self.folder)
        try:
            yield
        finally:
            if old is None:
                os.environ.pop(HOLD_ENV, None)
            else:
                os.environ[HOLD_ENV] = old

    def add(self, *points: str) -> None:
        for point in points:
            (self.folder / point).touch()

    def release(self, *points: str) -> None:
        for point in points or [p.name for p in self.folder.iterdir()]:
            (self.folder / point).unlink(missing_ok=True)

    def held(self) -> bool:
        """Whether a point is still held."""
        return any(self.folder.iterdir())


def step_done(name: str, step: int) -> object:
    """A probe for wait_for: step ``step`` committed (by every group in its quorum), or the job's end."""
    return lambda: [e for e in of(name, "step") if e["step"] >= step] or of(name, "job_end")


def alone(name: str, rank: int, after: float) -> object:
    """A probe for wait_for: a step that ``rank``'s group committed alone (one group's batch) after
    ``after``, or the job's end."""
    return lambda: [e for e in of(name, "step", rank, after) if e["batches"] == 1] or of(name, "job_end")


@pytest.fixture(scope="module")
def matrix(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Listeners]]:
    """A 2-group job through the fault matrix, each fault once the last one healed: group 1's rank killed
    entering step 3, back before group 0 committed a step alone (group 0 held before step 3 until group 1's
    new process is up); an exception inside group 0's backward at a save's step (group 0 is first in the
    quorum, and saves the steps it reports); group 0 lost whole (kill-launcher), group 1 training alone
    meanwhile (group 0's new process held before it sets up until group 1 committed a step alone); group 1
    hung, group 0 training on alone likewise; then both groups lost at one step, two steps or more after a
    save (committed by then), and the job resumes from its newest checkpoint. Each loss comes after the
    step before it was reported, so no step of both groups is committed after the fault. Its listeners
    sampled throughout. The groups are stragglers (the registry's slow-rank) until the last fault: the job
    runs long enough for a lost group to come back however slowly this machine starts a process."""
    name = "tft-matrix"
    spec = torchft_spec(name, **{"checkpoint.every": CKPT_EVERY, "ft.max_job_restarts": 3})
    holds = Holds(tmp_path_factory.mktemp("holds"))
    holds.add(step_point(0, 3), step_point(1, 3))
    with holds.env():
        commands.launch(spec, [pace(0, step=1, delay=PACE_S), FaultCommand("sigkill", rank=1, step=3)])
    with watched(name) as listeners:
        try:
            wait_for("step 1", step_done(name, 1), timeout=300)
            holds.add(step_point(1, 1))   # group 1's next process waits before its first step
            wait_for("step 2", step_done(name, 2), timeout=300)
            holds.release(step_point(1, 3))   # group 1 goes on, and is killed entering step 3
            kill = wait_for("the sigkill", lambda: fault(name, "sigkill"), timeout=120)[0]
            wait_for("group 1's new process", until(name, "rank_start", 1, kill.t), timeout=600)
            holds.release(step_point(0, 3), step_point(1, 1))   # both groups go: one quorum
            wait_for("group 1 to heal from group 0", until(name, "heal", 1), timeout=300)
            commands.inject_command(name, pace(1, delay=PACE_S))  # the new process has none: group 0 next
            at = -(-(of(name, "step")[-1]["step"] + 4) // CKPT_EVERY) * CKPT_EVERY  # a save's step, ahead
            commands.inject(name, "exception", rank=0, step=at)
            wait_for("group 0 to throw a step away", until(name, "step_discarded", 0), timeout=300)
            again = wait_for("group 0 to heal the thrown-away step", until(name, "heal", 0), timeout=300)[0]
            at = of(name, "step")[-1]["step"] + 3   # group 0 lost entering it, after the step before it
            holds.add(step_point(0, at), step_point(1, at), restart_point(0, 1))
            commands.inject(name, "kill-launcher", node=0, step=at)
            wait_for(f"step {at - 1}", step_done(name, at - 1), timeout=300)
            holds.release(step_point(0, at), step_point(1, at))
            lost = wait_for("group 0's loss", lambda: fault(name, "kill-launcher"), timeout=120)[0]
            wait_for("group 1 to commit a step alone", alone(name, 1, lost.t), timeout=300)
            holds.release(restart_point(0, 1))   # group 0's new process sets up, and heals
            wait_for("group 0 to heal from group 1", until(name, "heal", 0, again.t + 1e-6), timeout=600)
            commands.inject_command(name, pace(0, delay=PACE_S))  # group 1 goes next
            holds.add(restart_point(1, 2))   # its new process waits before it sets up: group 0 trains on
            hang = commands.inject(name, "hang", rank=1, wait=300)
            assert hang["fired"], hang
            t_hang = wait_for("the hang's event", lambda: fault(name, "hang"), timeout=60)[0].t
            found = wait_for("the hang found", until(name, "failure", None, t_hang), timeout=300)[0]
            wait_for("group 0 to train on alone", alone(name, 0, found.t), timeout=300)
            holds.release(restart_point(1, 2))
            wait_for("the hung group 1 to heal", until(name, "heal", 1, t_hang), timeout=600)
        finally:
            holds.release()
        at = of(name, "step")[-1]["step"] + 4  # both groups lost at the start of one step ahead of both,
        while any((at - k) % CKPT_EVERY == 0 for k in range(3)):  # which no save can be in flight at
            at += 1
        for group in (0, 1):
            commands.inject(name, "kill-launcher", node=group, step=at)
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


def job_restart(name: str) -> tuple:
    """The restart of the whole job after every group was lost: its failure and restart events."""
    failure = next(e for e in of(name, "failure") if e["blame_rank"] is None)
    return failure, next(e for e in of(name, "restart") if e["fault_time"] == failure["fault_time"])


@pytest.mark.slow
def test_through_every_fault_the_job_ends_with_every_step_and_identical_groups(matrix) -> None:
    name, _ = matrix
    end = of(name, "job_end")[0]
    assert end["state"] == "succeeded" and end["final_step"] == STEPS, story(name)
    failure, restart = job_restart(name)
    steps = [e["step"] for e in events(name, "step")]
    before = [s for e, s in zip(events(name, "step"), steps) if e.t < failure["detected_at"]]
    after = steps[len(before):]
    # every step committed once, in order, up to the loss of every group; then on from the checkpoint
    assert before == list(range(1, len(before) + 1)), before
    assert after == list(range(restart["resumed_step"] + 1, STEPS + 1)), after
    digests = {e.rank: e["digest"] for e in of(name, "rank_end", after=failure.t)}
    assert set(digests) == {0, 1} and digests[0] == digests[1], digests


@pytest.mark.slow
def test_the_events_tell_the_quorum_changes_the_heal_and_the_skipped_batches(matrix) -> None:
    name, _ = matrix
    kill = fault(name, "sigkill")[0]
    sizes = {g: [e["participants"] for e in of(name, "quorum", rank=g)] for g in (0, 1)}
    assert all(s[0] == 2 and s[-1] == 2 for s in sizes.values()), sizes  # both at the start and at the end
    # the steps committed with one group's batch (while group 0, then group 1, was away) came from quorums
    # of one
    alone_steps = [e["step"] for e in of(name, "step") if e["batches"] == 1]
    assert alone_steps and 1 in sizes[0] and 1 in sizes[1], (sizes, alone_steps)
    # group 1, killed entering step 3, was back before group 0 committed a step alone: it healed at step 2,
    # the last step both committed, and skipped nothing
    heal = of(name, "heal", rank=1)[0]
    assert (heal["from_step"], heal["step"], heal["skipped_batches"]) == (2, 2, 0), heal.data
    assert all(e["participants"] == 2 for e in of(name, "quorum") if e.t < heal.t), sizes   # no quorum of one
    mon = JobMonitor()
    mon.update(events(name))
    gp, led = compute(mon), ledger(events(name), 2, JobSpec().batch)
    assert led["skipped_batches"] == missing_batches(mon) > 0, led
    assert led["terms"]["skipped"] == round(gp.skipped_s, 4) > 0 and led["ettr"] == round(gp.goodput, 5)
    restart = of(name, "restart")[0]
    assert restart["level"] == "job" and restart["blame_rank"] == 1 and restart["restored_from"] == "peer"
    assert restart["fault_time"] == kill.t and restart["rolled_back_steps"] == 0
    assert restart["resumed_step"] == 2 and restart["skipped_batches"] == 0
    # the survivors' stall: no step was committed between the fault and the heal, so it lasted until it
    assert restart["group_downtime_s"] > 0, restart.data
    assert restart["downtime_s"] == pytest.approx(restart["group_downtime_s"]), restart.data
    row = commands.status(name)
    assert row["restarts"]["job"] == 4 and row["step"] == STEPS, row
    # the four losses, in order: group 1, group 0, group 1 hung, every group (no one group to blame)
    assert [e["blame_rank"] for e in of(name, "failure")] == [1, 0, 1, None], story(name)


@pytest.mark.slow
def test_an_exception_inside_backward_throws_the_step_away_and_the_group_heals_it(matrix) -> None:
    name, _ = matrix
    raised = fault(name, "exception")[0]
    thrown = of(name, "step_discarded", rank=0)[0]
    assert "injected exception" in thrown["reason"] and thrown.t > raised.t
    again = of(name, "heal", rank=0, after=thrown.t)[0]
    # group 1 committed it, with group 0's batch (below): group 0 skipped none
    assert again["skipped_batches"] == 0 and again["step"] == thrown["step"], again
    # group 0 was first in that step's quorum: group 1, which committed the step, reported it, once, with
    # both groups' batches (group 0's gradients were all-reduced before it threw the step away)
    [step] = [e for e in of(name, "step") if e["step"] == thrown["step"]]
    assert step.rank == 1 and step["batches"] == 2 and step["tokens"] == 2 * BATCH_TOKENS, step.data
    # and saved it: it was due
    saves = [(e.rank, e["phase"]) for e in of(name, "checkpoint") if e["step"] == thrown["step"]]
    assert thrown["step"] % CKPT_EVERY == 0 and {r for r, _ in saves} == {1}, saves
    assert (1, "committed") in saves, saves
    next_loss = of(name, "failure", after=raised.t)[0]
    assert next_loss.t > fault(name, "kill-launcher")[0].t  # the exception restarted nothing
    assert not [e for e in of(name, "rank_error", rank=0, after=raised.t) if e.t < next_loss.t]


@pytest.mark.slow
def test_a_whole_group_lost_heals_from_its_peer_which_reports_the_steps_meanwhile(matrix) -> None:
    name, _ = matrix
    lost = fault(name, "kill-launcher")[0]
    assert lost["node"] == 0 and lost["target_rank"] is None, lost.data
    failure = of(name, "failure", after=lost.t)[0]
    assert failure["blame_rank"] == 0 and "SIGKILL" in failure["cause"], failure.data
    back = of(name, "heal", rank=0, after=lost.t)[0]
    restart = next(e for e in of(name, "restart") if e["fault_time"] == lost.t)
    assert restart["restored_from"] == "peer" and restart["resumed_step"] == back["step"], restart.data
    # group 1, first in the quorum while group 0 was lost, reported the steps it committed alone meanwhile
    # (group 0's new process was held until it had): the batches group 0 skipped
    meanwhile = [e for e in of(name, "step") if lost.t < e.t < back.t]
    assert meanwhile and {e.rank for e in meanwhile} == {1} and {e["batches"] for e in meanwhile} == {1}
    assert back["step"] - back["from_step"] == back["skipped_batches"] == len(meanwhile), back.data
    assert restart["skipped_batches"] == len(meanwhile)
    # the survivors' stall: until their first step after the fault, before the heal
    assert 0 < restart["downtime_s"] < restart["group_downtime_s"], restart.data


@pytest.mark.slow
def test_a_group_restarted_alone_is_forked_from_its_zygote_and_reports_its_set_up(matrix) -> None:
    name, _ = matrix
    kill = fault(name, "sigkill")[0]
    launch = of(name, "launch", after=kill.t)[0]   # the warm shim, which hands the command to the zygote
    start = of(name, "rank_start", rank=1, after=kill.t)[0]
    assert launch["node"] == 1 and start["group_restart"] == 1 and start["pid"] != launch["pid"], story(name)
    assert f"forked rank {start['pid']} " in (JobDir.for_name(name).logs / "zygote-g1.0.1.log").read_text()
    # its set-up's phases, each ended in turn after the process began, before it was ready
    setup = start["t_setup"]
    assert list(setup) == ["imports", "session", "model", "manager", "wiring"], setup
    assert start["t_enter"] - 0.05 <= setup["imports"] and list(setup.values()) == sorted(setup.values())
    assert setup["wiring"] <= start.t


@pytest.mark.slow
def test_a_hung_group_is_found_restarted_and_heals_while_its_peer_trains_on(matrix) -> None:
    name, _ = matrix
    hang = fault(name, "hang")[0]
    failure = of(name, "failure", after=hang.t)[0]
    assert failure["blame_rank"] == 1 and "hung" in failure["cause"], failure.data
    restart = next(e for e in of(name, "restart") if e["fault_time"] == hang.t)
    assert restart["restored_from"] == "peer" and restart["rolled_back_steps"] == 0, restart.data
    back = of(name, "heal", rank=1, after=hang.t)[0]
    assert restart["resumed_step"] == back["step"]
    # found by the supervisor, not by torchft's timeouts: the healthy group never failed, and trained on
    assert not [e for e in of(name, "rank_error", rank=0, after=hang.t) if e.t < back.t]
    assert [e for e in of(name, "step", rank=0) if failure["detected_at"] < e.t < back.t], story(name)


@pytest.mark.slow
def test_the_loss_of_every_group_resumes_from_the_newest_checkpoint_in_memory(matrix) -> None:
    name, _ = matrix
    failure, restart = job_restart(name)
    assert "every replica group was lost" in failure["cause"], failure.data
    assert restart["level"] == "job" and restart["restored_from"] == "memory", restart.data
    # one group saved that step: both loaded its in-memory copy (the other's own held another step)
    resumed = of(name, "resume", after=failure.t)
    assert {e.rank for e in resumed} == {0, 1}, [e.data for e in resumed]
    assert {(e["step"], e["source"]) for e in resumed} == {(restart["resumed_step"], "memory")}
    committed = [e["step"] for e in of(name, "checkpoint") if e["phase"] == "committed" and e.t < failure.t]
    assert restart["resumed_step"] == max(committed) > 0 and max(committed) % CKPT_EVERY == 0, committed
    on_disk = {i.step for i in list_checkpoints(JobDir.for_name(name).path / "ckpt")
               if i.state == CheckpointState.COMMITTED}
    assert STEPS in on_disk, on_disk  # the last step's save, by the group first in the quorum
    # one group saves each step: no step saved twice
    saves = [e["step"] for e in of(name, "checkpoint") if e["phase"] == "begin"]
    before = [s for s in saves if s <= max(committed)]
    assert len(before) == len(set(before)), saves


@pytest.mark.slow
def test_every_process_of_a_torchft_job_listens_on_loopback_only(matrix) -> None:
    name, listeners = matrix
    who = " ".join(listeners.seen.values())
    assert "torchft.gateway --bind" in who and "eksft_nb.engines.torchft.trainer" in who, listeners.seen
    wide = {f"{ip}:{port}": w for (ip, port), w in listeners.seen.items() if not is_loopback(ip)}
    assert not wide, f"listening beyond loopback: {wide}"


@pytest.mark.parametrize(
    "changes, words",
    [
        ({"backend": "eks", "eks.image": "img"}, "runs its replica groups as a JobSet"),
        ({"nnodes": 1}, "2 or more replica groups"),
        ({"nproc_per_node": 2, "backend": "eks", "eks.image": "img"}, "1 rank per replica group on the eks"),
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
        "kill-supervisor@5",
    )
    assert done.returncode != 0 and "cannot fire kill-supervisor" in done.stderr, done.stderr
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert not JobDir.for_name("tft-refused").path.exists()


def test_a_dry_run_shows_the_lighthouse_on_loopback_and_one_process_per_group() -> None:
    shown = commands.dry_run(torchft_spec("tft-dry", nnodes=3))
    # the Lighthouse's gateway on loopback, the Lighthouse itself on a network of its own behind it
    assert "netns.py -- " in shown and "-m eksft_nb.engines.torchft.gateway --bind 127.0.0.1:" in shown, shown
    assert shown.count("-m eksft_nb.engines.torchft.trainer") == 3 and "NUM_REPLICA_GROUPS=3" in shown, shown
    # a group of one rank binds any port for its store (none found free beforehand, to be taken meanwhile);
    # the ranks of a group of two must know their rank 0's before it binds
    assert shown.count("MASTER_PORT=0\n") == 3, shown
    hsdp = commands.dry_run(torchft_spec("tft-dry", nnodes=2, nproc_per_node=2))
    assert hsdp.count("-m eksft_nb.engines.torchft.trainer") == 4 and "RANK=3\n" in hsdp, hsdp
    assert "MASTER_PORT=0\n" not in hsdp and hsdp.count("MASTER_PORT=29521\n") == 2, hsdp


HSDP_STEPS = 20   # a save every 5: the last one sharded, as each before it


@pytest.fixture(scope="module")
def hsdp(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Listeners]]:
    """2 groups of 2 ranks (HSDP): group 1's rank 1 (rank 3) killed entering step 3, once step 2 is
    reported; group 0's ranks wait before step 3, and group 1's new ranks before their first step, until
    group 1's new process is up: both go together, and group 1 is back before group 0 committed a step
    alone (test_torchft's matrix has the other outcome). Its listeners sampled."""
    name = "tft-hsdp"
    spec = torchft_spec(name, nproc_per_node=2, steps=HSDP_STEPS, **{"checkpoint.every": CKPT_EVERY})
    holds = Holds(tmp_path_factory.mktemp("holds"))
    holds.add(*(step_point(rank, 3) for rank in range(4)))
    with holds.env():
        commands.launch(spec, [FaultCommand("sigkill", rank=3, step=3)])
    with watched(name) as listeners:
        try:
            wait_for("step 1", step_done(name, 1), timeout=300)
            holds.add(step_point(2, 1), step_point(3, 1))   # group 1's next ranks: before their first step
            wait_for("step 2", step_done(name, 2), timeout=300)
            holds.release(step_point(3, 3))   # rank 3 goes on, and is killed entering step 3
            kill = wait_for("the sigkill", lambda: fault(name, "sigkill"), timeout=120)[0]
            wait_for("group 1's new ranks", lambda: {e.rank for e in of(name, "rank_start", after=kill.t)}
                     >= {2, 3} or of(name, "job_end"), timeout=600)
            holds.release()   # every rank goes: one quorum
            wait_for("group 1 to heal from group 0", until(name, "heal", 2), timeout=300)
            wait_for("the job to end", lambda: of(name, "job_end"), timeout=600)
        finally:
            holds.release()
    yield name, listeners


@pytest.mark.slow
def test_hsdp_a_ranks_sigkill_restarts_its_group_which_heals_and_the_job_ends_identical(hsdp) -> None:
    name, listeners = hsdp
    end = of(name, "job_end")[0]
    assert end["state"] == "succeeded" and end["final_step"] == HSDP_STEPS, story(name)
    # every step reported once, in order, by the rank 0 of the group first in its quorum
    assert [e["step"] for e in events(name, "step")] == list(range(1, HSDP_STEPS + 1)), story(name)
    assert {e.rank for e in events(name, "step")} <= {0, 2}
    failure = of(name, "failure")[0]
    assert failure["blame_rank"] == 1 and "rank 3 was killed (SIGKILL)" in failure["cause"], failure.data
    restart = of(name, "restart")[0]
    heal = of(name, "heal", 2)[0]
    # rank 3 was killed entering step 3, and its group was back before group 0 committed a step alone: it
    # healed, rank by rank, at step 2, the last both groups committed, and skipped nothing
    assert (heal["from_step"], heal["step"], heal["skipped_batches"]) == (2, 2, 0), heal.data
    assert restart["restored_from"] == "peer" and restart["resumed_step"] == 2, restart.data
    assert restart["fault_time"] == fault(name, "sigkill")[0].t and restart["skipped_batches"] == 0
    assert restart["group_downtime_s"] > 0, restart.data
    assert restart["downtime_s"] == pytest.approx(restart["group_downtime_s"]), restart.data
    # the final state, gathered within each group: all four ranks report the same weights
    digests = {(e["replica_group"], e.rank): e["digest"] for e in of(name, "rank_end")}
    assert set(digests) == {(0, 0), (0, 1), (1, 2), (1, 3)} and len(set(digests.values())) == 1, digests
    # the checkpoints, saved by the group first in the quorum, sharded across its two ranks
    ckpts = {i.step: i.path for i in list_checkpoints(JobDir.for_name(name).path / "ckpt")
             if i.state == CheckpointState.COMMITTED}
    assert HSDP_STEPS in ckpts, ckpts
    assert {p.name.split("_")[2] for p in ckpts[HSDP_STEPS].glob("*.distcp")} == {"0", "1"}, ckpts
    # every rank, its group's process group and stores included, on loopback only
    wide = {f"{ip}:{port}": w for (ip, port), w in listeners.seen.items() if not is_loopback(ip)}
    assert "eksft_nb.engines.torchft.trainer" in " ".join(listeners.seen.values()) and not wide, wide


@pytest.mark.parametrize(("trained", "healed_to", "ranks", "shared", "async_quorum", "skipped"), [
    (4, 8, 1, None, False, 4),    # steps 5-8 committed without it
    (2, 2, 1, None, False, 0),    # back before its peer committed a step alone
    (11, 12, 1, 12, False, 0),    # it threw step 12 away after its gradients went out: 12 holds its batch
    (11, 12, 1, 12, True, 1),     # ... and healed in step 13, which its zeroed gradients took no part in
    (2, 5, 1, None, True, 4),     # steps 3-5 alone, then step 6 healing
    (4, 8, 2, None, False, 8),    # HSDP: each rank's batch
    (4, 8, 1, 3, False, 4),       # a step it shared before: nothing to do with this heal
])
def test_a_heal_counts_its_groups_batches_that_no_committed_step_holds(
        trained: int, healed_to: int, ranks: int, shared: int | None, async_quorum: bool,
        skipped: int) -> None:
    got = skipped_batches(trained, healed_to, ranks=ranks, shared=shared, async_quorum=async_quorum)
    assert got == skipped
