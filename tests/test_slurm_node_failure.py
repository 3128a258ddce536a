"""The Slurm watcher on a lost node, without a cluster: srun's lines and the launchers' log lines fed to its
own handling as they come, and the incidents and the outcome it makes of them. A killed launcher ends the
step; the other launchers' failure lines as it ends are that one incident's (counted, on a loaded machine
they made three incidents, and progress_patience failed a job that should have been requeued)."""

from __future__ import annotations

import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from eksft_nb.backends.slurm import cluster
from eksft_nb.backends.slurm.allocation import Watcher
from eksft_nb.backends.slurm.render import REQUEUE_EXIT
from eksft_nb.events import EventWriter, make, read_all
from eksft_nb.jobdir import JobDir
from eksft_nb.spec import JobSpec
from eksft_nb.states import JobState

KILLED = "srun: error: n1: task 0: Killed"            # srun's line for node 0's launcher, ended by SIGKILL
NODE_FAILURE = "srun: error: Node failure on n1"
EXITED = "srun: error: n2: task 1: Exited with exit code 1"
LOST = "torch.distributed.DistNetworkError: Failed to recv, got 0 bytes. Connection was likely closed."
KILLED_CAUSE = "a node of the allocation failed (srun: the ft_launcher on n1 was killed)"


def nvrx(at: float, level: str, text: str) -> str:
    """A line of ft_launcher's own (NVRx 0.7), logged at ``at``."""
    stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(at)) + f",{int(at % 1 * 1000):03d}"
    return f"{stamp} [{level}] [vm] [workload:?(?) infra:1(0)] {text}"


def exited(at: float, code: int) -> str:
    """torchelastic's line for a rank's process that ended with ``code``, logged at ``at``."""
    stamp = time.strftime("%m%d %H:%M:%S", time.localtime(at)) + f".{int(at % 1 * 1e6):06d}"
    return (f"E{stamp} 4242 torch/distributed/elastic/multiprocessing/api.py:1002] failed (exitcode: {code}) "
            f"local_rank: 0 (pid: 4343) of binary: /usr/bin/python")


def restarting(at: float) -> str:
    return nvrx(at, "INFO", "launcher.py:636 [default] Worker group FAILED. 2/3 attempts left; will restart "
                            "worker group")


def hang(at: float) -> str:
    return nvrx(at, "WARNING", "rank_monitor_server.py:497 [Cycle 0] Did not get subsequent heartbeat. "
                               "Waited 6.00 seconds.")


class Step:
    """The watcher of a job of two nodes (one rank each) whose step launched a minute ago, so that every
    line and event fed to it is in the past: 25 steps ran, checkpoints 10 and 20 committed."""

    def __init__(self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, slurm_state: str | None = None,
                 **changes: object) -> None:
        for var in ("SLURM_JOB_ID", "SLURM_RESTART_COUNT", "SLURM_JOB_NODELIST"):
            monkeypatch.delenv(var, raising=False)
        if slurm_state is not None:   # job 7, in Slurm's record in that state
            monkeypatch.setenv("SLURM_JOB_ID", "7")
            job = cluster.SlurmJob("7", slurm_state, "None", "gpu", "n[1-2]", 0)
            monkeypatch.setattr(cluster, "show_job", lambda job_id: job)
        spec = JobSpec().replace(backend="slurm", nnodes=2, nproc_per_node=1, steps=30, device="cpu",
                                 **{"slurm.shared_dir": str(tmp_path), **changes}).validate()
        self.jd = JobDir(tmp_path / spec.name)
        self.jd.create(spec)
        self.t0 = time.time() - 60
        with monkeypatch.context() as launched:   # the watcher launched its step then
            launched.setattr(time, "time", lambda: self.t0)
            self.watcher = Watcher(self.jd, ["srun", "--ntasks-per-node=1", "ft_launcher"])
        self.ranks = [EventWriter(self.jd.events_path, spec.name, rank=r) for r in (0, 1)]
        for r in (0, 1):
            self.event(r, "rank_start", 1, pid=100 + r, host=f"n{r + 1}", job_attempt=0, injob_restart=0,
                       inprocess_iteration=0, world_size=2, start_step=0)
        for step in range(1, 26):
            self.event(0, "step", 1 + step * 0.2, step=step, loss=1.0, tokens=64, step_time=0.2)
            if step % 10 == 0:
                self.event(0, "checkpoint", 1.1 + step * 0.2, phase="committed", step=step)
        self.pump()

    def event(self, rank: int, kind: str, after: float, **data: object) -> None:
        """Rank ``rank``'s event, ``after`` seconds into the step."""
        self.ranks[rank].write(make(kind, self.jd.name, rank, t=self.t0 + after, **data))

    def kill_launcher(self, after: float = 10.0) -> None:
        """The kill-launcher fault on node 0, as its rank reports it before it kills its launcher."""
        self.event(0, "fault", after, fault="kill-launcher", id="f1", target_rank=None, at_step=25, params={},
                   node=0)

    def launcher(self, node: int, *lines: str) -> None:
        with open(self.jd.logs / f"launcher-0-{node}.log", "a") as log:
            log.write("".join(f"{line}\n" for line in lines))

    def srun(self, *lines: str) -> None:
        self.watcher._srun_errors(SimpleNamespace(stderr=[f"{line}\n" for line in lines]))

    def pump(self) -> None:
        self.watcher._pump()

    def failures(self) -> list:
        return [e for e in read_all(self.jd.events_path) if e.kind == "failure"]


def survivors_as_the_step_ends(step: Step) -> None:
    """What node 1's launcher logs once node 0's is gone, on a loaded machine: its rank loses its peer and
    exits, the launcher restarts the group, whose new rank fails again, then Slurm's SIGTERM."""
    t = step.t0 + 10
    step.launcher(1, LOST, exited(t + 0.2, 1), restarting(t + 0.3), hang(t + 1.0), exited(t + 1.2, 1),
                  exited(t + 1.5, -15))


# ---- a lost node: one incident, a job restart -------------------------------------------------------------

@pytest.mark.parametrize("seen", ["injected", "killed", "node-failure"])
def test_the_other_launchers_lines_as_the_step_ends_are_no_incidents_of_their_own(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture, seen: str) -> None:
    step = Step(tmp_path, monkeypatch)
    if seen == "injected":   # the fault's event is written before the launcher dies; srun says it later
        step.kill_launcher()
    else:
        step.srun(KILLED if seen == "killed" else NODE_FAILURE)
    survivors_as_the_step_ends(step)
    step.pump()
    assert step.failures() == []
    step.srun(KILLED)
    assert KILLED in capsys.readouterr().err   # srun's lines go on to the batch log
    outcome = step.watcher._outcome(137)
    [failure] = step.failures()
    assert failure["level"] == "job" and step.watcher.incidents.give_up is None
    if seen == "injected":
        assert outcome == KILLED_CAUSE and failure["fault_time"] == step.t0 + 10
        assert failure["cause"] == f"injected kill-launcher on node 0: {KILLED_CAUSE}"
    elif seen == "killed":
        assert outcome == failure["cause"] == KILLED_CAUSE
    else:   # srun's word on a failed node, without Slurm's signal: the step's end says it
        assert outcome == failure["cause"]
        assert outcome.startswith("the srun step of the launchers ended (exit 137)"), outcome


def test_a_killed_launcher_is_requeued_and_its_node_kept_off_where_the_partition_has_nodes_enough(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    step = Step(tmp_path, monkeypatch, "RUNNING")
    asked: list[tuple] = []
    monkeypatch.setattr(cluster, "requeue", lambda job_id: asked.append(("requeue", job_id)))
    monkeypatch.setattr(cluster, "partition", lambda name: {"TotalNodes": "3"})
    monkeypatch.setattr(cluster, "exclude", lambda job_id, nodes: asked.append(("exclude", job_id, nodes)))
    step.kill_launcher()
    survivors_as_the_step_ends(step)
    step.srun(KILLED, EXITED)
    step.pump()
    assert step.watcher._settle(137) == REQUEUE_EXIT
    assert asked == [("requeue", "7"), ("exclude", "7", ["n1"])]
    [failure] = step.failures()
    assert failure["cause"] == f"injected kill-launcher on node 0: {KILLED_CAUSE}"


def test_a_killed_launcher_that_slurm_would_not_requeue_ends_the_job_failed_in_one_line(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Slurm requeues the job of a node it holds failed itself; not that of a killed launcher, so a
    refused requeue is the job's end, not a run that leaves it to Slurm."""
    step = Step(tmp_path, monkeypatch, "RUNNING")

    def refuse(job_id: str) -> None:
        raise cluster.SlurmError("scontrol failed to requeue job 7: Requested operation is disabled", "fix")

    monkeypatch.setattr(cluster, "requeue", refuse)
    step.srun(KILLED)
    assert step.watcher._settle(137) == 1
    [end] = [e for e in read_all(step.jd.events_path) if e.kind == "job_end"]
    assert end["state"] == JobState.FAILED
    refused = f"{KILLED_CAUSE}; Slurm would not requeue the job (scontrol failed to requeue job 7"
    assert end["reason"].startswith(refused), end.data


def test_a_killed_launcher_whose_peers_drained_on_slurms_sigterm_is_still_a_lost_node(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    step = Step(tmp_path, monkeypatch)
    step.srun(KILLED)   # srun says it, then ends the step: the survivors' ranks drain on its SIGTERM
    step.event(0, "drain", 11, step=25, committed=False)
    step.pump()
    assert step.watcher._outcome(137) == KILLED_CAUSE
    [failure] = step.failures()
    assert failure["level"] == "job" and failure["cause"] == KILLED_CAUSE
    assert step.watcher._restarts_used() == 1   # a failure, which counts against max_job_restarts


# ---- a Killed task that is no lost launcher ---------------------------------------------------------------

def test_a_launcher_killed_after_the_ranks_drained_is_the_drains_requeue(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A launcher that outlives ``KillWait`` after a drain's SIGTERM is killed by Slurm itself."""
    step = Step(tmp_path, monkeypatch)
    step.event(0, "drain", 11, step=25, committed=True)
    step.pump()
    step.srun(KILLED)
    assert step.watcher._outcome(137) == ("drained at step 25 (saved and committed) on SIGTERM to the "
                                          "job's steps: scancel --signal, or a preemption's grace period: "
                                          "requeued, it resumes from that save")
    assert step.watcher._restarts_used() == 0


def test_a_launcher_killed_at_the_time_limit_is_the_time_limits_end(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    step = Step(tmp_path, monkeypatch, "TIMEOUT")
    step.watcher._on_signal(15, None)   # Slurm's SIGTERM to the batch shell, then SIGKILL KillWait later
    step.srun(KILLED)
    state, reason = step.watcher._outcome(137)
    assert state == JobState.FAILED, reason
    assert reason.startswith("Slurm's time limit ended the job at step 25"), reason


def test_a_torchft_groups_killed_step_is_its_runners_to_restart(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    step = Step(tmp_path, monkeypatch, engine="torchft")
    step.srun(KILLED)
    state, reason = step.watcher._outcome(1)
    assert state == JobState.FAILED and reason.startswith("a replica group was lost more often than"), reason


# ---- a launcher's own failure still counts --------------------------------------------------------------

@pytest.mark.parametrize("srun", [(), (EXITED,)], ids=["srun-silent", "srun-exited"])
def test_a_launcher_failure_without_a_lost_node_is_an_incident(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, srun: tuple[str, ...]) -> None:
    step = Step(tmp_path, monkeypatch)
    step.srun(*srun)   # a launcher that gave up exits on its own: no lost task
    step.launcher(1, exited(step.t0 + 10, 1))
    step.pump()
    [failure] = step.failures()
    assert failure["level"] == "injob" and failure["cause"] == "rank 1 exited with code 1", failure.data


def test_a_launcher_failure_before_the_node_was_lost_is_an_incident_and_the_loss_another(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    step = Step(tmp_path, monkeypatch)
    step.launcher(1, exited(step.t0 + 9, 1))
    step.kill_launcher(10)
    survivors_as_the_step_ends(step)
    step.pump()
    step.srun(KILLED)
    step.watcher._outcome(137)
    assert [(f["level"], f["cause"]) for f in step.failures()] == [
        ("injob", "rank 1 exited with code 1"), ("job", f"injected kill-launcher on node 0: {KILLED_CAUSE}")]


def test_a_launcher_killed_in_the_run_before_hides_no_failure_of_this_one(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    step = Step(tmp_path, monkeypatch)
    step.kill_launcher(-5)   # before this step launched: the requeued run's launchers are new
    step.launcher(1, exited(step.t0 + 10, 1))
    step.pump()
    [failure] = step.failures()
    assert failure["level"] == "injob" and failure["cause"] == "rank 1 exited with code 1", failure.data


def test_with_a_hot_spare_the_survivors_restart_in_job_with_it(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """The step goes on without the lost node (``--kill-on-bad-exit=0``): its survivors' lines are the
    in-job restart in which NVRx's standby node joins them."""
    step = Step(tmp_path, monkeypatch, spare_nodes=1)
    step.kill_launcher()
    step.srun(KILLED)
    step.launcher(1, exited(step.t0 + 10.2, 1))
    step.pump()
    [failure] = step.failures()
    assert failure["level"] == "injob", failure.data
    assert failure["cause"] == ("injected kill-launcher on node 0: its ft_launcher was lost; a hot spare "
                                "took its place")

