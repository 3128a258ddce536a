"""A user's own torchft script under ``--engine torchft`` (``examples/torchft_train.py``, unmodified: a
torchft Manager, DDP and OptimizerWrapper): its replica groups run beside a Lighthouse on loopback, the
steps torchft committed come from its optimizer, its quorums and heals are events, a group killed by
SIGKILL restarts and heals from its peer, and the job ends with every step done and the groups' weights
identical. A script torchft cannot run is refused in one line; a notebook cell runs the same way."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from eksft_nb import commands, magics
from eksft_nb.control import FaultCommand
from eksft_nb.goodput import missing_batches
from eksft_nb.monitor import JobMonitor
from eksft_nb.spec import JobSpec
from eksft_nb.engines.torchft.hold import restart_point
from jobs import events, story, wait_for
from test_ports import Listeners, is_loopback
from test_torchft import Holds, alone, fault, of, pace, until, watched

pytest.importorskip("torchft")

EXAMPLE = Path(__file__).parents[1] / "examples" / "torchft_train.py"
STEPS = 60


@pytest.fixture(scope="module")
def healed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Listeners]]:
    """The example with 2 groups: group 1 killed at step 3, its new process held before it sets up until
    group 0 committed a step alone (test_torchft's matrix has a group back before that); once it healed,
    an exception injected into it; then the job runs to its end. Group 0 is a straggler (the registry's
    slow-rank) until then, so that group 1 comes back before group 0 ends however slowly a process starts
    here. Its listeners sampled throughout."""
    name = "tft-script"
    spec = JobSpec(name=name, engine="torchft", nnodes=2, nproc_per_node=1, script=str(EXAMPLE),
                   script_args=["--steps", str(STEPS)])
    holds = Holds(tmp_path_factory.mktemp("holds"))
    holds.add(restart_point(1, 1))
    with holds.env():
        commands.launch(spec, [pace(0, step=1), FaultCommand("sigkill", rank=1, step=3)])
    with watched(name) as listeners:
        try:
            kill = wait_for("the sigkill", lambda: fault(name, "sigkill"), timeout=300)[0]
            wait_for("group 0 to commit a step alone", alone(name, 0, kill.t), timeout=300)
        finally:
            holds.release()
        heal = wait_for("group 1 to heal from group 0", until(name, "heal", 1), timeout=600)[0]
        commands.inject(name, "exception", rank=1)
        wait_for("group 1 to throw a step away", until(name, "step_discarded", 1, heal.t), timeout=300)
        wait_for("group 1 to heal that step", until(name, "heal", 1, heal.t + 1e-6), timeout=300)
        commands.inject_command(name, pace(0, delay=0.01, duration=1))
        wait_for("the job to end", lambda: of(name, "job_end"), timeout=600)
    yield name, listeners


@pytest.mark.slow
def test_a_users_torchft_script_heals_a_killed_group_throws_a_failed_step_away_and_ends_with_every_step(
        healed: tuple[str, Listeners]) -> None:
    name, listeners = healed
    end = of(name, "job_end")[0]
    assert end["state"] == "succeeded" and "every replica group" in end["reason"], story(name)
    steps = [e["step"] for e in events(name, "step")]
    assert steps == list(range(1, STEPS + 1)), steps  # each step torchft committed, once, in order
    digests = {e.rank: e["digest"] for e in events(name, "rank_end")}
    assert set(digests) == {0, 1} and digests[0] == digests[1] is not None, digests
    kill = next(e for e in events(name, "fault") if e["fault"] == "sigkill")
    assert kill.rank == 1 and kill["at_step"] == 3
    sizes = [e["participants"] for e in of(name, "quorum", rank=0)]
    assert sizes[0] == 2 and 1 in sizes and sizes[-1] == 2, sizes  # both, group 0 alone, both again
    heal = of(name, "heal", rank=1)[0]
    # group 1 was killed entering step 3 (from_step: the job's last step when its loss was seen); group 0
    # committed steps alone before it was back, and the step group 1 healed in (torchft's async quorum, the
    # example's: a healing group's gradients are zeroed): the batches group 1 skipped
    assert heal["step"] > heal["from_step"] >= 2, heal
    assert heal["skipped_batches"] == heal["step"] - heal["from_step"] + 1, heal
    alone_steps = [e for e in events(name, "step") if heal["from_step"] < e["step"] <= heal["step"] + 1]
    assert {(e.rank, e["batches"]) for e in alone_steps} == {(0, 1)}, alone_steps
    assert len(alone_steps) == heal["skipped_batches"], alone_steps
    restart = of(name, "restart")[0]
    assert restart["blame_rank"] == 1 and restart["restored_from"] == "peer", restart
    assert restart["fault_time"] == kill.t, restart
    assert restart["resumed_step"] == heal["step"] and restart["skipped_batches"] == heal["skipped_batches"]
    fault = next(e for e in events(name, "fault") if e["fault"] == "exception")
    thrown = of(name, "step_discarded", rank=1, after=fault.t)[0]
    assert "injected exception" in thrown["reason"], thrown
    again = of(name, "heal", rank=1, after=thrown.t)[0]
    assert again["step"] == thrown["step"], again  # group 0 committed it
    # with group 1's batch (its gradients went out before the vote); the step it healed in, without
    by_step = {e["step"]: e["batches"] for e in events(name, "step")}
    assert (by_step[thrown["step"]], by_step[thrown["step"] + 1]) == (2, 1), by_step
    assert again["skipped_batches"] == 1, again
    mon = JobMonitor()
    mon.update(events(name))
    assert sum(e["skipped_batches"] for e in of(name, "heal")) == missing_batches(mon), story(name)
    assert not of(name, "rank_error", rank=1, after=fault.t)  # thrown away, not a crash: nothing restarted
    assert [e["blame_rank"] for e in of(name, "failure")] == [1], story(name)
    who = " ".join(listeners.seen.values())
    assert "torchft.gateway --bind" in who and "eksft_nb.engines.torchft.script" in who, listeners.seen
    wide = {f"{ip}:{port}": w for (ip, port), w in listeners.seen.items() if not is_loopback(ip)}
    assert not wide, f"listening beyond loopback: {wide}"


@pytest.mark.slow
def test_a_script_with_no_torchft_manager_is_refused_in_one_line(tmp_path: Path) -> None:
    script = tmp_path / "plain.py"
    script.write_text("import torch\nm = torch.nn.Linear(2, 1)\no = torch.optim.SGD(m.parameters(), lr=0.1)\n"
                      "m(torch.ones(1, 2)).sum().backward()\no.step()\n")
    name = "tft-plain"
    commands.launch(JobSpec(name=name, engine="torchft", nnodes=2, nproc_per_node=1, script=str(script)))
    end = wait_for("the job to end", lambda: of(name, "job_end"), timeout=300)[0]
    assert end["state"] == "failed" and "before creating a torchft Manager" in end["reason"], story(name)
    assert "examples/torchft_train.py" in end["reason"] and "\n" not in end["reason"]
    assert not of(name, "restart") and len(of(name, "launch")) == 2, story(name)


def test_a_torchft_cell_runs_as_a_script_in_every_replica_group() -> None:
    spec, faults, _ = magics.parse_cell("--name tft-cell --engine torchft --nnodes 2 --nproc-per-node 1 "
                                        "--fault sigkill:1@5", EXAMPLE.read_text())
    shown = commands.dry_run(spec)
    assert shown.count(f"-m eksft_nb.engines.torchft.script {spec.script}") == 2, shown
    assert [(f.fault, f.rank, f.step) for f in faults] == [("sigkill", 1, 5)]
