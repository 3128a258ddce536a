"""The Job and JobSet controllers' failure handling, as Kubernetes and JobSet document it, for the replay.

Pure functions decide (:func:`pod_failure_action`, :func:`jobset_action`); :class:`IndexedJob` and
:func:`run_workload` apply them to pods that :class:`eks_kube.Controllers` runs as local processes.

Job (kubernetes.io, "Jobs" and "Handling retriable and non-retriable pod failures with Pod failure
policy"):

- a failed pod is matched against ``podFailurePolicy.rules`` in order, the first match acting:
  ``onExitCodes`` (``In``/``NotIn`` the values, over the exit codes other than 0 of the terminated
  containers, init containers included, or of ``containerName`` only) or ``onPodConditions`` (a condition
  of that type and status, True by default);
- ``FailJob``: the Job fails (reason ``PodFailurePolicy``, "Container C for pod NS/P failed with exit
  code N matching FailJob rule at index I") and its running pods are terminated; ``Ignore``: the failure
  counts toward no limit, a replacement is created (its ``job-index-ignored-failure-count`` one more);
  ``FailIndex``: the index fails; ``Count`` (or no match): the failure counts;
- counted failures: with ``backoffLimitPerIndex`` per index (``job-index-failure-count`` on the
  replacement), the index failing once it has more; an index that failed beyond ``maxFailedIndexes``
  fails the Job (``MaxFailedIndexesExceeded``), else the Job ends ``Failed`` (``FailedIndexes``) when all
  indexes ended; without it, one ``backoffLimit`` for the Job (``BackoffLimitExceeded``);
- ``podReplacementPolicy: Failed``: a replacement is created once the failed pod has terminated (here:
  once its process has exited);
- ``Complete`` once every index succeeded.

JobSet (jobset.sigs.k8s.io, "Failure Policy"): a failed child Job is matched against
``failurePolicy.rules`` in order (``onJobFailureReasons`` and ``onJobFailureMessagePatterns``, both when
given; ``targetReplicatedJobs``); the first match acts, else ``RestartJobSet``. ``FailJobSet``: the set
fails (``FailJobSetFailurePolicyAction``); ``RestartJobSet``: every child Job is recreated, the
``jobset.sigs.k8s.io/restart-attempt`` one more, unless the restarts counted toward ``maxRestarts``
reached it (``ReachedMaxRestarts``); ``RestartJobSetAndIgnoreMaxRestarts``: recreated, not counted.
``Completed`` once every child Job completed.
"""

from __future__ import annotations

import re
import threading
from dataclasses import dataclass, field
from typing import Any

JOBS = ("batch", "v1", "jobs")
JOBSETS = ("jobset.x-k8s.io", "v1alpha2", "jobsets")
INDEX = "batch.kubernetes.io/job-completion-index"
FAILURES = "batch.kubernetes.io/job-index-failure-count"
IGNORED = "batch.kubernetes.io/job-index-ignored-failure-count"
RESTART_ATTEMPT = "jobset.sigs.k8s.io/restart-attempt"


def failed_exit_codes(status: dict[str, Any], container: str | None = None) -> list[tuple[str, int]]:
    """(container, exit code) of each terminated container that did not exit 0, init containers first."""
    out = []
    for c in (status.get("initContainerStatuses") or []) + (status.get("containerStatuses") or []):
        code = ((c.get("state") or {}).get("terminated") or {}).get("exitCode")
        if code and (container is None or c.get("name") == container):
            out.append((c["name"], code))
    return out


def pod_failure_action(job_spec: dict[str, Any], pod: str, status: dict[str, Any]) -> tuple[str, str]:
    """The action of the first rule of the Job's ``podFailurePolicy`` that the failed pod matches, and the
    Job's failure message if it is FailJob; ("Count", "") when none matches."""
    for i, rule in enumerate((job_spec.get("podFailurePolicy") or {}).get("rules") or []):
        if (req := rule.get("onExitCodes")) is not None:
            hit = next(((c, code) for c, code in failed_exit_codes(status, req.get("containerName"))
                        if (code in req["values"]) == (req["operator"] == "In")), None)
            if hit is not None:
                return rule["action"], (f"Container {hit[0]} for pod {pod} failed with exit code {hit[1]} "
                                        f"matching {rule['action']} rule at index {i}")
        for pattern in rule.get("onPodConditions") or []:
            if any(c.get("type") == pattern["type"] and c.get("status") == pattern.get("status", "True")
                   for c in status.get("conditions") or []):
                return rule["action"], (f"Pod {pod} has condition {pattern['type']} matching "
                                        f"{rule['action']} rule at index {i}")
    return "Count", ""


def jobset_action(failure_policy: dict[str, Any] | None, replicated_job: str, reason: str,
                  message: str) -> str:
    """The action of the first ``failurePolicy`` rule a failed child Job matches; RestartJobSet if none."""
    for rule in (failure_policy or {}).get("rules") or []:
        reasons = rule.get("onJobFailureReasons") or []
        patterns = rule.get("onJobFailureMessagePatterns") or []
        targets = rule.get("targetReplicatedJobs") or []
        if (not reasons or reason in reasons) and (not targets or replicated_job in targets) \
                and (not patterns or any(re.search(p, message) for p in patterns)):
            return rule["action"]
    return "RestartJobSet"


@dataclass
class Outcome:
    condition: str          # Complete | Failed
    reason: str = ""
    message: str = ""


@dataclass
class IndexedJob:
    """One Indexed Job (a Job, or a JobSet's child Job number ``number``) run to its end by ``ctl``."""

    ctl: Any                      # eks_kube.Controllers
    name: str                     # the workload's name (the pods' prefix)
    workload: tuple[str, str, str]
    spec: dict[str, Any]          # the (child) Job's spec
    hosts: dict[str, str]
    number: int = 0
    annotations: dict[str, str] = field(default_factory=dict)   # on every pod (a JobSet's restart attempt)
    retries: int | None = None    # backoffLimitPerIndex, where the test sets it
    stopping: threading.Event = field(default_factory=threading.Event)
    outcome: Outcome | None = None
    pods: list[str] = field(default_factory=list)   # every pod it created, in order
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def run(self) -> Outcome:
        counts = {"failures": [0] * self.spec["completions"], "ignored": [0] * self.spec["completions"],
                  "total": 0, "failed_indexes": 0}
        threads = [threading.Thread(target=self._index, args=(i, counts), daemon=True)
                   for i in range(self.spec["completions"])]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if self.outcome is None:
            self.outcome = Outcome("Failed", "FailedIndexes", "Job has failed indexes") \
                if counts["failed_indexes"] else Outcome("Complete")
        return self.outcome

    def stop(self) -> None:
        """Terminate the running pods (a failed Job's, or a restarting JobSet's), create no more."""
        self.stopping.set()
        for pod in list(self.pods):
            self.ctl.terminate(pod)

    def _fail(self, reason: str, message: str) -> None:
        with self._lock:
            if self.outcome is None:
                self.outcome = Outcome("Failed", reason, message)
        self.stop()

    def _index(self, index: int, counts: dict[str, Any]) -> None:
        per_index = self.retries if self.retries is not None else self.spec.get("backoffLimitPerIndex")
        while not self.stopping.is_set():
            extra = {**self.annotations, FAILURES: str(counts["failures"][index])}
            if counts["ignored"][index]:
                extra[IGNORED] = str(counts["ignored"][index])
            [pod] = self.ctl.create_pods(self.name, self.workload, hosts=self.hosts,
                                         only=(self.number, index), annotations=extra)
            self.pods.append(pod)
            if self.ctl.run_pod(pod) == 0 or self.stopping.is_set():
                return
            action, message = pod_failure_action(self.spec, f"{self.ctl.ns}/{pod}", self.ctl.pod_status(pod))
            if action == "FailJob":
                return self._fail("PodFailurePolicy", message)
            if action == "Ignore":
                counts["ignored"][index] += 1
                continue
            if action != "FailIndex":
                counts["failures"][index] += 1
                counts["total"] += 1
                if per_index is None:
                    if counts["total"] > self.spec.get("backoffLimit", 6):
                        return self._fail("BackoffLimitExceeded",
                                          "Job has reached the specified backoff limit")
                    continue
                if counts["failures"][index] <= per_index:
                    continue
            counts["failed_indexes"] += 1   # the index failed
            allowed = self.spec.get("maxFailedIndexes")
            if allowed is not None and counts["failed_indexes"] > allowed:
                self._fail("MaxFailedIndexesExceeded",
                           "Job has exceeded the specified maximal number of failed indexes")
            return


def _first_failure(children: list[IndexedJob]) -> tuple[IndexedJob, Outcome] | None:
    """Run a JobSet's child Jobs until all completed (None) or one failed: then the others are deleted
    (their pods terminated), and the failed one is returned with its outcome."""
    failed: list[tuple[IndexedJob, Outcome]] = []
    done = threading.Condition()

    def watch(child: IndexedJob) -> None:
        outcome = child.run()
        with done:
            if outcome.condition == "Failed":
                failed.append((child, outcome))
            done.notify_all()

    threads = [threading.Thread(target=watch, args=(c,), daemon=True) for c in children]
    for t in threads:
        t.start()
    with done:
        done.wait_for(lambda: failed or all(not t.is_alive() for t in threads))
    if failed:
        for child in children:
            child.stop()
    for t in threads:
        t.join()
    return failed[0] if failed else None


def run_workload(ctl: Any, name: str, workload: tuple[str, str, str], hosts: dict[str, str],
                 retries: int | None = None) -> Outcome:
    """Run a Job or a JobSet (its one replicated job, ``replicas`` child Jobs) to its end, and set its
    terminal condition as its controller does."""
    owner = ctl.custom.get_namespaced_custom_object(*workload[:2], ctl.ns, workload[2], name)
    spec = owner["spec"]
    if "replicatedJobs" not in spec:
        outcome = IndexedJob(ctl, name, workload, spec, hosts, retries=retries).run()
        ctl.finish(name, outcome.condition, outcome.reason, outcome.message, workload=workload)
        return outcome
    [replicated] = spec["replicatedJobs"]
    policy = spec.get("failurePolicy") or {}
    restarts = counted = 0
    while True:
        children = [IndexedJob(ctl, name, workload, replicated["template"]["spec"], hosts, number=n,
                               annotations={RESTART_ATTEMPT: str(restarts)}, retries=retries)
                    for n in range(replicated.get("replicas", 1))]
        failed = _first_failure(children)
        if not failed:
            outcome = Outcome("Completed", "AllJobsCompleted", "jobset completed successfully")
            break
        first, why = failed
        action = jobset_action(policy, replicated["name"], why.reason, why.message)
        job = f"{name}-{replicated['name']}-{first.number}"
        if action == "FailJobSet":
            outcome = Outcome("Failed", "FailJobSetFailurePolicyAction",
                              f"applying FailJobSet failure policy action (first failed job: {job})")
            break
        if action == "RestartJobSet" and counted >= policy.get("maxRestarts", 0):
            outcome = Outcome("Failed", "ReachedMaxRestarts", "jobset failed due to reaching max number of "
                              f"restarts (first failed job: {job})")
            break
        restarts += 1
        counted += action == "RestartJobSet"
    ctl.finish(name, outcome.condition, outcome.reason, outcome.message, workload=workload)
    return outcome
