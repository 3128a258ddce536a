"""What a pod's status means for the job: one :class:`PodState` per pod, in words a user can act on."""

from __future__ import annotations

import calendar
import signal
import time
from dataclasses import dataclass
from typing import Any

from ...runtime.drain import DRAIN_EXIT
from . import names
from .failures import CONFIG_ERROR

IMAGE_ERRORS = ("ErrImagePull", "ImagePullBackOff", "InvalidImageName", "ErrImageNeverPull")
CONFIG_ERRORS = ("CreateContainerConfigError", "CreateContainerError", "RunContainerError")
HUNG_AFTER_S = 60.0   # past the grace period: a deleted pod this much later is on a node that does not answer
# a container that waits with one of these will not start until someone fixes something
STUCK = ("ImagePullBackOff", "InvalidImageName", "ErrImageNeverPull") + CONFIG_ERRORS


@dataclass(frozen=True)
class PodState:
    name: str
    uid: str
    node: int | None      # node index (Job completion index, PyTorchJob replica)
    phase: str            # pending | running | succeeded | failed
    reason: str = ""      # why, in one line (empty when nothing is wrong)
    failed: bool = False  # the node failed: its launcher died, it was OOM-killed, evicted, lost...
    stuck: bool = False   # waiting on something that needs a fix (image, configuration)
    deleting: bool = False
    exit_code: int | None = None
    ended_at: float | None = None   # when the container ended, or the pod's deletion began
    restarts: int = 0     # container restarts in place (PyTorchJob)...
    last_exit: str = ""   # ...and how the previous one ended
    drained: bool = False   # its ranks drained on SIGTERM (saved, stopped): to be recreated, not a failure
    since: float | None = None   # pending: since when it waits for what ``reason`` says

    def hung(self, grace_s: float, now: float) -> bool:
        """Still there well past its grace period after its deletion began: its node does not answer (a
        pod of an unreachable node stays Terminating until the node is gone), and its index waits for it."""
        return self.deleting and self.phase in ("running", "pending") and self.ended_at is not None \
            and now - self.ended_at > grace_s + HUNG_AFTER_S

    @property
    def label(self) -> str:
        return f"pod {self.name}" + (f" (node {self.node})" if self.node is not None else "")


def pod_state(pod: dict[str, Any], container: str, process: str = "ft_launcher") -> PodState:
    """``process``: what the ``container`` runs (:func:`.names.process`)."""
    meta, status = pod.get("metadata", {}), pod.get("status") or {}
    base = dict(name=meta.get("name", "?"), uid=meta.get("uid", ""), node=node_index(pod),
                deleting=bool(meta.get("deletionTimestamp")))
    statuses = {c["name"]: c for c in status.get("containerStatuses") or []}
    main = statuses.get(container, {})
    terminated = (main.get("state") or {}).get("terminated") or {}
    last = (main.get("lastState") or {}).get("terminated") or {}
    base.update(restarts=main.get("restartCount", 0), last_exit=describe_exit(last) if last else "",
                ended_at=parse_time(terminated.get("finishedAt") or meta.get("deletionTimestamp")))
    disruption = next((c for c in status.get("conditions") or [] if c.get("type") == "DisruptionTarget"
                       and c.get("status") == "True"), None)
    if terminated.get("exitCode") == DRAIN_EXIT:   # evicted or not: it saved, and is recreated
        return PodState(**base, phase="failed", drained=True, exit_code=DRAIN_EXIT,
                        reason=f"{process} {describe_exit(terminated)}")
    if status.get("reason") == "Evicted":
        return PodState(**base, phase="failed", failed=True,
                        reason=f"evicted: {status.get('message', '')}".strip())
    if disruption or status.get("reason") == "NodeLost":
        why = (f"{disruption.get('reason')}: {disruption.get('message', '')}" if disruption
               else "its node is unreachable")
        return PodState(**base, phase="failed", failed=True, reason=f"disrupted ({why.strip()})")
    for init in status.get("initContainerStatuses") or []:
        problem = _container_problem(init, "the prepare step")
        if problem:
            return PodState(**base, **problem)
    problem = _container_problem(main, process)
    if problem:
        return PodState(**base, **problem)
    if "terminated" in (main.get("state") or {}):
        return PodState(**base, phase="succeeded", exit_code=0)
    if "running" in (main.get("state") or {}):
        return PodState(**base, phase="running")
    if status.get("phase") == "Succeeded":
        return PodState(**base, phase="succeeded", exit_code=0)
    scheduled = next((c for c in status.get("conditions") or [] if c.get("type") == "PodScheduled"), None)
    if scheduled and scheduled.get("status") == "False":
        return PodState(**base, phase="pending", since=parse_time(scheduled.get("lastTransitionTime")),
                        reason=f"not scheduled: {scheduled.get('message') or scheduled.get('reason')}")
    waiting = (main.get("state") or {}).get("waiting") or {}
    return PodState(**base, phase="pending", reason=waiting.get("reason", ""),
                    since=parse_time(meta.get("creationTimestamp")))


def _container_problem(c: dict[str, Any], who: str) -> dict[str, Any] | None:
    state = c.get("state") or {}
    waiting, terminated = state.get("waiting") or {}, state.get("terminated") or {}
    if waiting.get("reason") in IMAGE_ERRORS:
        return dict(phase="pending", stuck=waiting["reason"] in STUCK,
                    reason=f"image {c.get('image', '')} cannot be pulled ({waiting['reason']}: "
                           f"{waiting.get('message', '')})")
    if waiting.get("reason") in CONFIG_ERRORS:
        return dict(phase="pending", stuck=True, reason=f"{waiting['reason']}: {waiting.get('message', '')}")
    if waiting.get("reason") == "CrashLoopBackOff":
        last = (c.get("lastState") or {}).get("terminated") or {}
        return dict(phase="failed", failed=True, exit_code=last.get("exitCode"),
                    reason=f"{who} keeps failing ({describe_exit(last)}), restarting with back-off")
    if terminated and terminated.get("exitCode", 0) != 0:
        return dict(phase="failed", failed=True, exit_code=terminated.get("exitCode"),
                    reason=f"{who} {describe_exit(terminated)}")
    return None


def describe_exit(terminated: dict[str, Any]) -> str:
    code, reason = terminated.get("exitCode"), terminated.get("reason", "")
    if reason == "OOMKilled":
        text = "was OOM-killed (the pod reached its memory limit: raise --memory)"
    elif code == DRAIN_EXIT:
        text = f"drained on SIGTERM (exit {code})"
    elif code == CONFIG_ERROR:
        text = f"refused to run as configured (exit {code})"
    elif isinstance(code, int) and code > 128 and code - 128 in signal.Signals._value2member_map_:
        text = f"was killed ({signal.Signals(code - 128).name}, exit {code})"
    else:
        text = f"exited with code {code}"
    message = (terminated.get("message") or "").strip().splitlines()
    return text + (f": {message[-1][:200]}" if message else "")


def parse_time(stamp: str | None) -> float | None:
    """An API timestamp ("2026-01-02T03:04:05Z", fractions allowed) as epoch seconds."""
    if not stamp:
        return None
    whole, _, fraction = stamp.rstrip("Z").partition(".")
    return calendar.timegm(time.strptime(whole, "%Y-%m-%dT%H:%M:%S")) + float(f"0.{fraction or 0}")


def node_index(pod: dict[str, Any]) -> int | None:
    """Its node: a Job's completion index; in a JobSet its child Job's number plus that (eksft's JobSets
    have one child Job of a pod per node, or, a torchft job's, one child Job per node of one pod)."""
    meta = pod.get("metadata", {})
    annotations = meta.get("annotations") or {}
    value, child = annotations.get(names.COMPLETION_INDEX), annotations.get(names.JOB_INDEX) or "0"
    if value is not None and value.isdigit() and child.isdigit():
        return int(value) + int(child)
    labels = meta.get("labels") or {}
    kind = labels.get("training.kubeflow.org/replica-type")
    index = labels.get("training.kubeflow.org/replica-index")
    if kind and index and index.isdigit():
        return int(index) + (0 if kind.lower() == "master" else 1)
    return None


def hung_reason(pod: PodState) -> str:
    """What a hung pod holds up, and how to release it."""
    since = time.strftime("%H:%M:%S", time.localtime(pod.ended_at or time.time()))
    return (f"{pod.label} has been terminating since {since}: its node does not answer, and the Job replaces "
            "it only once it is gone (podReplacementPolicy: Failed); node auto-repair replaces the node, or "
            "taint it node.kubernetes.io/out-of-service=nodeshutdown:NoExecute to release the pod now")
