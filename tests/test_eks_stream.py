"""What pod and workload states mean for a job, and the events the EKS stream derives from them
(fed the way the watch and the log followers feed it, without a server)."""

from __future__ import annotations

import time
from typing import Any

import pytest

from eksft_nb.backends.eks.pods import pod_state
from eksft_nb.backends.eks.stream import LOG_DRAIN_S, Tracker, workload_outcome
from eksft_nb.events import LOG_PREFIX, make
from eksft_nb.spec import JobSpec

T0 = 1_800_000_000.0


def stamp(t: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t))


def pod(state: dict[str, Any] | None = None, *, name: str = "demo-1-abcde", node: int = 1, restarts: int = 0,
        last: dict[str, Any] | None = None, init: dict[str, Any] | None = None,
        **status: Any) -> dict[str, Any]:
    container = {"name": "trainer", "image": "img:1", "restartCount": restarts,
                 "state": state or {"running": {}}}
    if last:
        container["lastState"] = {"terminated": last}
    body = {"phase": "Running", "containerStatuses": [container], **status}
    if init:
        body["initContainerStatuses"] = [{"name": "prepare", "image": "img:1", "state": init}]
    return {"metadata": {"name": name, "uid": f"uid-{name}-{node}",
                         "annotations": {"batch.kubernetes.io/job-completion-index": str(node)}},
            "spec": {"hostname": f"demo-{node}"}, "status": body}


@pytest.mark.parametrize("status,phase,failed,stuck,reason", [
    (pod(), "running", False, False, ""),
    (pod({"terminated": {"exitCode": 137, "reason": "OOMKilled"}}), "failed", True, False,
     "ft_launcher was OOM-killed (the pod reached its memory limit: raise --memory)"),
    (pod({"terminated": {"exitCode": 137, "reason": "Error"}}), "failed", True, False,
     "ft_launcher was killed (SIGKILL, exit 137)"),
    (pod({"waiting": {"reason": "CrashLoopBackOff"}},
         last={"exitCode": 1, "message": "boom\nValueError: bad"}),
     "failed", True, False,
     "ft_launcher keeps failing (exited with code 1: ValueError: bad), restarting with back-off"),
    (pod({"waiting": {"reason": "PodInitializing"}}, phase="Pending",
         init={"terminated": {"exitCode": 1,
                              "message": "/checkpoints/demo holds a different job named demo"}}),
     "failed", True, False,
     "the prepare step exited with code 1: /checkpoints/demo holds a different job named demo"),
    (pod({"waiting": {"reason": "ImagePullBackOff", "message": "not found"}}, phase="Pending"), "pending",
     False, True,
     "image img:1 cannot be pulled (ImagePullBackOff: not found)"),
    (pod({"waiting": {"reason": "CreateContainerConfigError", "message": 'secret "hf" not found'}},
         phase="Pending"),
     "pending", False, True, 'CreateContainerConfigError: secret "hf" not found'),
    (pod(conditions=[{"type": "DisruptionTarget", "status": "True", "reason": "DeletionByTaintManager",
                      "message": "Taint manager: deleting due to NoExecute taint"}]), "failed", True, False,
     "disrupted (DeletionByTaintManager: Taint manager: deleting due to NoExecute taint)"),
    (pod(phase="Failed", reason="Evicted", message="The node was low on resource: ephemeral-storage."),
     "failed", True,
     False, "evicted: The node was low on resource: ephemeral-storage."),
    # the prepare step's refusal: its termination message says why
    (pod({"waiting": {"reason": "PodInitializing"}}, phase="Failed",
         init={"terminated": {"exitCode": 78, "message": "this pod asks for EFA, but aws-ofi-nccl ..."}}),
     "failed", True, False,
     "the prepare step refused to run as configured (exit 78): this pod asks for EFA, but aws-ofi-nccl ..."),
    # drained: not a failure (the workload recreates it), evicted (DisruptionTarget) or not
    (pod({"terminated": {"exitCode": 138, "message": "drained on SIGTERM at step 12 (saved and committed): "
                                                     "the workload recreates the pod"}}, phase="Failed",
         conditions=[{"type": "DisruptionTarget", "status": "True", "reason": "EvictionByEvictionAPI"}]),
     "failed", False, False,
     "ft_launcher drained on SIGTERM (exit 138): drained on SIGTERM at step 12 (saved and committed): the "
     "workload recreates the pod"),
])
def test_pod_states_in_words(status: dict, phase: str, failed: bool, stuck: bool, reason: str) -> None:
    ps = pod_state(status, "trainer")
    assert (ps.phase, ps.failed, ps.stuck, ps.reason) == (phase, failed, stuck, reason)
    assert ps.drained == (ps.exit_code == 138)


def test_pytorchjob_pods_are_numbered_master_first() -> None:
    master = {"metadata": {"name": "demo-master-0", "labels": {"training.kubeflow.org/replica-type": "master",
                                                               "training.kubeflow.org/replica-index": "0"}}}
    worker = {"metadata": {"name": "demo-worker-1", "labels": {"training.kubeflow.org/replica-type": "worker",
                                                               "training.kubeflow.org/replica-index": "1"}}}
    assert (pod_state(master, "pytorch").node, pod_state(worker, "pytorch").node) == (0, 2)


@pytest.mark.parametrize("kind,condition,reason,outcome", [
    ("Job", "Complete", "", ("succeeded", "all pods finished")),
    ("Job", "Failed", "FailedIndexes", ("failed", "a node failed more often than max_job_restarts allows "
                                                  "(FailedIndexes: Job has failed indexes)")),
    ("JobSet", "Completed", "", ("succeeded", "all pods finished")),
    ("JobSet", "Failed", "ReachedMaxRestarts",
     ("failed", "a node failed more often than max_job_restarts allows "
                                                          "(ReachedMaxRestarts: Job has failed indexes)")),
    ("PyTorchJob", "Succeeded", "", ("succeeded", "all pods finished")),
    ("PyTorchJob", "Failed", "PyTorchJobFailed",
     ("failed", "the workload failed (PyTorchJobFailed: Job has failed "
                                                            "indexes)")),
])
def test_workload_outcomes(kind: str, condition: str, reason: str, outcome: tuple) -> None:
    obj = {"kind": kind, "status": {"conditions": [
        {"type": "Suspended", "status": "False"},
        {"type": condition, "status": "True", "reason": reason,
         "message": "Job has failed indexes" if reason else ""}]}}
    assert workload_outcome(obj) == outcome
    obj["status"]["conditions"][1]["status"] = "False"
    assert workload_outcome(obj) is None


def line(kind: str, rank: int | None, t: float, **data: Any) -> str:
    return LOG_PREFIX + make(kind, "demo", rank, t=t, **data).to_json()


def step(s: int, t: float) -> str:
    return line("step", 0, t, step=s, loss=1.0, tokens=64, step_time=0.5)


def rank_start(rank: int, t: float, attempt: int = 0, injob: int = 0, start: int = 0, pid: int = 10) -> str:
    return line("rank_start", rank, t, pid=pid, host="h", job_attempt=attempt, injob_restart=injob,
                inprocess_iteration=0, world_size=2, start_step=start)


def tracker(kind: str = "job") -> Tracker:
    spec = JobSpec(name="demo", backend="eks", nnodes=2, nproc_per_node=1,
                   steps=10).replace(**{"eks.kind": kind})
    return Tracker(spec, created=T0, server="https://eks.example")


def test_a_pytorchjob_pod_restarted_in_place_is_a_job_restart() -> None:
    tr = tracker("pytorchjob")
    tr.feed(("line", "demo-master-0", rank_start(0, T0 + 1)))
    tr.feed(("line", "demo-master-0", step(1, T0 + 2)))
    p = pod(restarts=1, last={"exitCode": 1, "reason": "Error"}, name="demo-worker-0")
    p["spec"] = {}
    p["metadata"]["labels"] = {"training.kubeflow.org/replica-type": "worker",
                               "training.kubeflow.org/replica-index": "0"}
    p["status"]["containerStatuses"][0]["name"] = "pytorch"
    tr.feed(("pod", "MODIFIED", p, False))
    tr.feed(("pod", "MODIFIED", p, False))   # seen again: still one failure
    tr.feed(("line", "demo-master-0", rank_start(0, T0 + 20, injob=1)))
    tr.feed(("line", "demo-master-0", step(1, T0 + 22)))
    events = tr.take()
    failures = [e for e in events if e.kind == "failure"]
    assert [e["cause"] for e in failures] == ["pod demo-worker-0 (node 1): ft_launcher exited with code 1, "
                                              "restarted in place"]
    [restart] = [e for e in events if e.kind == "restart"]
    assert (restart["level"], restart["resumed_step"]) == ("job", 0)


def test_a_node_fault_names_the_pod_it_took_down() -> None:
    tr = tracker()
    tr.feed(("line", "demo-1-abcde",
             line("fault", 1, T0 + 5, fault="kill-launcher", id="k1", target_rank=None,
                                           at_step=3, node=1)))
    tr.feed(("pod", "MODIFIED", pod({"terminated": {"exitCode": 137, "reason": "Error",
                                                    "finishedAt": stamp(T0 + 6)}}), False))
    [failure] = [e for e in tr.take() if e.kind == "failure"]
    assert (failure["level"], failure["cause"], failure["fault_time"], failure["detected_at"]) == (
        "job",
        "injected kill-launcher on node 1: pod demo-1-abcde (node 1): ft_launcher was killed "
        "(SIGKILL, exit 137)",
        T0 + 5, T0 + 6)


def test_stopping_is_not_a_failure() -> None:
    tr = tracker()
    tr.feed(("line", "demo-0-aaaaa", step(1, T0 + 1)))
    tr.feed(("pod", "DELETED", pod(), True))   # the watcher saw the workload being deleted
    tr.feed(("workload", None))
    tr.finish(T0 + 10)
    events = tr.take()
    assert [e.kind for e in events] == ["job_start", "step", "job_end"]
    assert (events[-1]["state"], events[-1]["final_step"]) == ("stopped", 1)


def test_a_late_reader_dates_an_old_failure_by_the_pod() -> None:
    """Attached after the fact: the failed pod is listed before the logs are replayed."""
    tr = tracker()
    tr.feed(("pod", "ADDED", pod({"terminated": {"exitCode": 1, "reason": "Error",
                                                 "finishedAt": stamp(T0 + 30)}}), False))
    for s, t in ((1, T0 + 10), (2, T0 + 20)):       # before the failure: the incident stays open
        tr.feed(("line", "demo-0-aaaaa", step(s, t)))
    tr.feed(("line", "demo-0-aaaaa", rank_start(0, T0 + 40, attempt=1, start=2)))
    tr.feed(("line", "demo-0-aaaaa", step(3, T0 + 45)))
    [restart] = [e for e in tr.take() if e.kind == "restart"]
    assert (restart["level"], restart["detection_s"], restart["downtime_s"], restart["resumed_step"]) == (
        "job", 0.0, 14.5, 2)


def outcome(condition: str = "Complete") -> tuple:
    return ("workload", {"status": {"conditions": [{"type": condition, "status": "True"}]}})


def test_job_end_waits_for_every_ranks_end_whatever_order_the_pods_logs_arrive_in() -> None:
    """Rank 1's pod log is read (to its end) before rank 0's is even followed: job_end must still
    carry rank 0's digest. Each pod's lines arrive in order, so a log that ended has said it all."""
    tr = tracker()
    tr.feed(outcome())
    tr.feed(("line", "demo-1-abcde", rank_start(1, T0 + 1, pid=11)))   # rank 1's log, read to its end
    tr.feed(("line", "demo-1-abcde", line("rank_end", 1, T0 + 9, final_step=10, exit_code=0)))
    tr.finish(time.time())
    assert not tr.ended   # rank 0 has not been heard from: its pod's log may not be followed yet
    tr.feed(("log_start", ("uid-0", 0), "demo-0-aaaaa"))
    tr.feed(("line", "demo-0-aaaaa", rank_start(0, T0 + 1, pid=10)))
    tr.finish(time.time())
    assert not tr.ended   # its log is open: its end may come
    tr.feed(("line", "demo-0-aaaaa", line("rank_end", 0, T0 + 9, final_step=10, digest="d0")))
    tr.feed(("log_end", ("uid-0", 0)))
    tr.finish(time.time())
    [end] = [e for e in tr.take() if e.kind == "job_end"]
    assert (end["state"], end["digest"]) == ("succeeded", "d0")

    # a rank that writes no end (the built-in trainer's rank 1): its pod's log ending is enough
    tr = tracker()
    tr.feed(outcome())
    for rank, pod_name in ((0, "demo-0-aaaaa"), (1, "demo-1-abcde")):
        tr.feed(("log_start", (pod_name, 0), pod_name))
        tr.feed(("line", pod_name, rank_start(rank, T0 + 1)))
    tr.feed(("line", "demo-0-aaaaa", line("rank_end", 0, T0 + 9, final_step=10, digest="d0")))
    tr.feed(("log_end", ("demo-0-aaaaa", 0)))
    tr.finish(time.time())
    assert not tr.ended
    tr.feed(("log_end", ("demo-1-abcde", 0)))
    tr.finish(time.time())
    assert tr.ended and tr.take()[-1]["digest"] == "d0"


def test_a_rank_never_heard_from_holds_job_end_only_for_the_drain_time() -> None:
    tr = tracker()
    tr.feed(outcome())
    tr.feed(("line", "demo-0-aaaaa", line("rank_end", 0, T0 + 9, final_step=10, digest="d0")))
    tr.finish(tr.outcome_at + 1)
    assert not tr.ended
    tr.finish(tr.outcome_at + LOG_DRAIN_S + 1)
    assert tr.ended and tr.take()[-1]["digest"] == "d0"


def test_failures_are_dated_on_the_pods_clock() -> None:
    """The pods' clock is an hour behind the notebook's: a failure the notebook notices in a launcher
    line must not look like it took an hour to detect."""
    pods_now = time.time() - 3600
    tr = tracker()
    for rank in (0, 1):
        tr.feed(("line", f"demo-{rank}-aaaaa", rank_start(rank, pods_now - 30, pid=40 + rank)))
    for s in (1, 2, 3):
        tr.feed(("line", "demo-0-aaaaa", step(s, pods_now - 20 + s)))
    tr.feed(("line", "demo-1-aaaaa", line("fault", 1, pods_now - 1, fault="sigkill", id="f1", target_rank=1,
                                           at_step=4)))
    tr.feed(("line", "demo-1-aaaaa",
             "[2026-01-01 00:00:10,000] [ERROR] [ft_launcher8@demo-1] failed (exitcode: -9) "
                                     "local_rank: 0 (pid: 41) of binary: python"))
    for rank in (0, 1):
        tr.feed(("line", f"demo-{rank}-aaaaa",
                 rank_start(rank, pods_now + 2, pid=50 + rank, injob=1, start=3)))
    tr.feed(("line", "demo-0-aaaaa", step(4, pods_now + 4)))
    [failure] = [e for e in tr.take() if e.kind == "failure"]
    assert failure["cause"] == "injected sigkill on rank 1" and failure["fault_time"] == pods_now - 1
    assert 0 <= failure["detected_at"] - failure["fault_time"] < 60
    [restart] = tr.mon.restarts
    assert restart["detection_s"] < 60 and restart["downtime_s"] < 60


def test_many_restarts_keep_one_process_per_rank_and_blame_the_newest() -> None:
    """A long job's in-job restarts: the tracker remembers each rank's newest process only, and a
    launcher's line about that process still names its rank."""
    now = time.time() - 1000
    tr = tracker()
    for restart in range(50):
        for rank in (0, 1):
            tr.feed(("line", f"demo-{rank}-aaaaa", rank_start(rank, now + 10 * restart, injob=restart,
                                                              pid=100 * restart + rank)))
        tr.feed(("line", "demo-0-aaaaa", step(restart + 1, now + 10 * restart + 2)))
    assert len(tr.rank_of) == 2
    tr.feed(("line", "demo-1-aaaaa",
             "[2026-01-01 00:00:10,000] [ERROR] [ft_launcher8@demo-1] failed (exitcode: -9) "
                                     "local_rank: 0 (pid: 4901) of binary: python"))
    [failure] = [e for e in tr.take() if e.kind == "failure" and e["blame_rank"] == 1]
    assert failure["cause"].startswith("rank 1")


def drained_pod(name: str, node: int, t: float) -> dict[str, Any]:
    return pod({"terminated": {"exitCode": 138, "finishedAt": stamp(t),
                               "message": "drained on SIGTERM at step 4 (saved and committed)"}},
               name=name, node=node, phase="Failed")


def test_a_drain_is_one_job_restart_and_never_a_success_short_of_the_last_step() -> None:
    """Every pod of a drained job exits 138: one job-level restart whose cause is the drain, closed by the
    recreated pods' first step with nothing rolled back. A workload that ends Complete with the ranks
    stopped short (an image whose eksft-nb exits 0 on a drain) ends stopped, with the drain."""
    tr = tracker()
    for rank in (0, 1):
        tr.feed(("line", f"demo-{rank}-aaaaa", rank_start(rank, T0 + 1)))
    for s in (1, 2, 3, 4):
        tr.feed(("line", "demo-0-aaaaa", step(s, T0 + 1 + s)))
    tr.feed(("line", "demo-0-aaaaa", line("drain", 0, T0 + 6, step=4, committed=True)))
    tr.feed(("pod", "MODIFIED", drained_pod("demo-1-aaaaa", 1, T0 + 7), False))
    tr.feed(("pod", "MODIFIED", drained_pod("demo-0-aaaaa", 0, T0 + 8), False))
    tr.feed(("pod", "MODIFIED", drained_pod("demo-0-aaaaa", 0, T0 + 8), False))   # seen again
    for rank in (0, 1):
        tr.feed(("line", f"demo-{rank}-bbbbb", rank_start(rank, T0 + 30, attempt=2, start=4)))
    tr.feed(("line", "demo-0-bbbbb", step(5, T0 + 31)))
    events = tr.take()
    [failure] = [e for e in events if e.kind == "failure"]
    assert failure["level"] == "job" and failure["cause"] == (
        "drained on SIGTERM at step 4 (saved and committed): pod demo-1-aaaaa (node 1) and the job's other "
        "pods are recreated by the workload")
    [restart] = [e for e in events if e.kind == "restart"]
    assert (restart["resumed_step"], restart["rolled_back_steps"]) == (4, 0)

    # Complete, stopped short: not succeeded
    tr = tracker()
    tr.feed(("line", "demo-0-aaaaa", step(3, T0 + 3)))
    tr.feed(("line", "demo-0-aaaaa", line("drain", 0, T0 + 4, step=3, committed=True)))
    tr.feed(outcome())
    tr.finish(tr.outcome_at + LOG_DRAIN_S + 1)
    end = tr.take()[-1]
    assert (end.kind, end["state"], end["final_step"]) == ("job_end", "stopped", 3)
    assert end["reason"].startswith("drained on SIGTERM at step 3 of 10 (saved and committed), and the "
                                    "workload ended Complete")
    tr = tracker()
    tr.feed(("line", "demo-0-aaaaa", step(3, T0 + 3)))
    tr.feed(outcome())
    tr.finish(tr.outcome_at + LOG_DRAIN_S + 1)
    end = tr.take()[-1]
    assert (end["state"], end["reason"]) == ("failed", "the pods finished at step 3 of 10: the workload is "
                                                       "Complete but training is not (see `logs --debug`)")


def test_a_failed_job_says_the_pod_behind_it_and_nccl_over_sockets_is_a_warning() -> None:
    spec = JobSpec(name="demo", backend="eks", nnodes=2, nproc_per_node=8).replace(**{
        "eks.gpus_per_node": 8, "eks.instance_type": "p5.48xlarge"})   # EFA by default
    tr = Tracker(spec, created=T0, server="https://eks.example")
    for text in ("demo-0-aaaaa NCCL INFO Using network AWS Libfabric", "demo-1-aaaaa NCCL INFO Using network "
                 "Socket", "demo-0-aaaaa NCCL INFO Using network Socket"):
        tr.feed(("line", text.split()[0], text))
    [warning] = [e for e in tr.take() if e.kind == "warning"]
    assert warning["what"] == "nccl-socket" and warning["message"].startswith(
        "NCCL in pod demo-1-aaaaa uses TCP sockets, not its 32 EFA devices (\"Using network Socket\")")
    refused = pod({"waiting": {"reason": "PodInitializing"}}, name="demo-1-abcde", phase="Failed",
                  init={"terminated": {"exitCode": 78, "message": "this pod asks for EFA, but aws-ofi-nccl "
                                                                  "is missing: use an image with it"}})
    tr.feed(("pod", "MODIFIED", refused, False))
    failed = {"type": "Failed", "status": "True", "reason": "PodFailurePolicy",
              "message": "Container prepare for pod default/demo-1-abcde failed with exit code 78 matching "
                         "FailJob rule at index 0"}
    tr.feed(("workload", {"status": {"conditions": [failed]}}))
    tr.finish(tr.outcome_at + 1)
    end = tr.take()[-1]
    assert end["state"] == "failed" and end["reason"].startswith(
        "pod demo-1-abcde (node 1): the prepare step refused to run as configured (exit 78): this pod asks "
        "for EFA, but aws-ofi-nccl is missing: use an image with it (the workload failed (PodFailurePolicy: ")


@pytest.mark.parametrize("pod_seen", [True, False])
def test_a_failed_jobs_end_waits_for_the_pod_it_names_whichever_comes_first(pod_seen: bool) -> None:
    """The workload's Failed condition may arrive before the state of the pod it names (two watches): the
    job's end waits for that pod's own words, at most the log drain time, then says what it has."""
    tr = tracker()
    failed = {"type": "Failed", "status": "True", "reason": "PodFailurePolicy",
              "message": "Container prepare for pod default/demo-0-abcde failed with exit code 78 matching "
                         "FailJob rule at index 0"}
    tr.feed(("workload", {"status": {"conditions": [failed]}}))
    tr.finish(tr.outcome_at + 1)
    assert not tr.ended and not [e for e in tr.take() if e.kind == "job_end"]
    if pod_seen:
        why = "/checkpoints/demo holds a different job named demo: remove that folder"
        refused = pod({"waiting": {"reason": "PodInitializing"}}, name="demo-0-abcde", node=0, phase="Failed",
                      init={"terminated": {"exitCode": 78, "message": why}})
        tr.feed(("pod", "MODIFIED", refused, True))
        tr.finish(tr.outcome_at + 2)
    else:
        tr.finish(tr.outcome_at + LOG_DRAIN_S + 1)
    [end] = [e for e in tr.take() if e.kind == "job_end"]
    assert end["state"] == "failed"
    said = ("pod demo-0-abcde (node 0): the prepare step refused to run as configured (exit 78): "
            "/checkpoints/demo holds a different job named demo") if pod_seen else \
        "the workload failed (PodFailurePolicy: "
    assert end["reason"].startswith(said), end


def test_a_pod_hung_on_a_lost_node_is_said_once_with_what_releases_it() -> None:
    """Its node stopped answering: the pod stays Terminating past its grace period, and the Job will not
    replace it (podReplacementPolicy: Failed) until it is gone."""
    tr = tracker()
    now = time.time()
    hung = pod(name="demo-1-abcde")
    hung["metadata"]["deletionTimestamp"] = stamp(now - 30)
    tr.feed(("pod", "MODIFIED", hung, False))
    tr.finish(now)
    assert not [e for e in tr.take() if e.kind == "warning"]   # within its grace period: a pod ending
    hung["metadata"]["deletionTimestamp"] = stamp(now - 3600)
    tr.feed(("pod", "MODIFIED", hung, False))
    tr.finish(now)
    tr.finish(now + 1)
    [warning] = [e for e in tr.take() if e.kind == "warning"]
    assert warning["what"] == "pod-hung" and warning["message"].startswith(
        "pod demo-1-abcde (node 1) has been terminating since ")
    assert "node.kubernetes.io/out-of-service=nodeshutdown:NoExecute" in warning["message"]


def test_a_drain_said_before_its_event_arrives_takes_its_words() -> None:
    """The pods' states can arrive before rank 0's drain event (another stream): the failure says what the
    pod's termination message says, and the restart the drain event's words."""
    tr = tracker()
    tr.feed(("line", "demo-0-aaaaa", rank_start(0, T0 + 1)))
    tr.feed(("line", "demo-0-aaaaa", step(1, T0 + 2)))
    bare = pod({"terminated": {"exitCode": 138, "finishedAt": stamp(T0 + 7)}}, name="demo-0-aaaaa", node=0,
               phase="Failed")
    tr.feed(("pod", "MODIFIED", bare, False))
    tr.feed(("line", "demo-0-aaaaa", line("drain", 0, T0 + 6, step=1, committed=False)))
    tr.feed(("line", "demo-0-bbbbb", rank_start(0, T0 + 30, attempt=1, start=1)))
    tr.feed(("line", "demo-0-bbbbb", step(2, T0 + 31)))
    events = tr.take()
    [failure] = [e for e in events if e.kind == "failure"]
    [restart] = [e for e in events if e.kind == "restart"]
    assert failure["cause"].startswith("stopped on SIGTERM: pod demo-0-aaaaa (node 0)")
    assert restart["cause"].startswith("drained on SIGTERM at step 1 (its save could NOT be committed): pod "
                                       "demo-0-aaaaa (node 0)")
