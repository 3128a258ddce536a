"""A Kubernetes API for tests: kmock's emulator over loopback HTTP, completed where the official
client needs it, plus the parts of the job controller and kubelet that the EKS backend observes.

- :class:`KubeEmulator` adds to kmock's ``KubernetesEmulator``: server-filled metadata and 201 on
  create, label/field selectors on list and watch, ``timeoutSeconds`` on watch, garbage collection
  of owned pods, pod logs (follow streams included), exec over the WebSocket v4 channel protocol
  (the command really runs, in a :class:`eks_pods.LocalPod`), and failure injection that answers
  before any side effect (an injected 500 on create stores nothing).
- :func:`running` serves it on 127.0.0.1 from a background thread, for the synchronous client.
- :class:`Controllers` plays the kubelet through the real client (a pod's containers run as local
  processes; SIGTERM, its grace period and SIGKILL; termination messages), and the Job and JobSet
  controllers' failure handling (:mod:`eks_controllers`).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import datetime
import itertools
import json
import os
import signal
import subprocess
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp.web
import kmock
import psutil
from kubernetes import client

from eks_controllers import JOBS, run_workload
from eks_pods import LocalPod

def now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass
class Injected:
    """Answer matching requests with an error status and/or after a delay, ``times`` times."""

    method: str
    path_part: str
    status: int | None = None
    delay: float = 0.0
    times: int = 1
    message: str = "injected"

    def matches(self, request: kmock.Request) -> bool:
        return (self.times > 0 and request.method.value.upper() == self.method
                and self.path_part in str(request.url.path))


@dataclass
class PodLog:
    lines: list[str] = field(default_factory=list)
    done: bool = False


def _get(obj: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        obj = obj.get(part) if isinstance(obj, dict) else None
    return obj


def matches(obj: dict[str, Any], params: Any) -> bool:
    """Equality label and field selectors (``a=b,c!=d``), which is all the backend uses."""
    labels = (obj.get("metadata") or {}).get("labels") or {}
    for key, source in (("labelSelector", lambda k: labels.get(k)),
                        ("fieldSelector", lambda k: _get(obj, k))):
        for term in filter(None, (params.get(key) or "").split(",")):
            k, op, v = (term.partition("!=") if "!=" in term else term.replace("==", "=").partition("="))
            value = source(k)
            if (op == "!=" and str(value) == v) or (op == "=" and (value is None or str(value) != v)):
                return False
    return True


class KubeEmulator(kmock.KubernetesEmulator):
    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        self.versions = itertools.count(1)
        self.logs: dict[tuple[str, str], PodLog] = {}
        self.injected: list[Injected] = []
        self.exec_calls: list[tuple[str, str, list[str]]] = []
        self.exec_in: Callable[[str, str, list[str]], tuple[str, int]] | None = None
        self.closing = False

    @property
    def requests(self) -> list[kmock.Request]:
        return list(self._requests)

    def inject(self, method: str, path_part: str, **kw: Any) -> Injected:
        rule = Injected(method.upper(), path_part, **kw)
        self.injected.append(rule)
        return rule

    async def _handle(self, request: kmock.Request) -> aiohttp.web.StreamResponse:
        rule = next((r for r in self.injected if r.matches(request)), None)
        if rule is not None:
            rule.times -= 1
            await asyncio.sleep(rule.delay)
            if rule.status:
                return await self._render_error(kmock.KubernetesError(status=rule.status, reason="Injected",
                                                                      message=rule.message))
        if request.subresource == "exec":
            return await self._serve_exec(request)
        if request.subresource == "log":
            return await self._serve_log(request)
        if request.action == kmock.action.CREATE and isinstance(request.data, dict):
            meta = request.data.setdefault("metadata", {})
            meta.setdefault("namespace", request.namespace)
            meta.update(uid=str(uuid.uuid4()), creationTimestamp=now(),
                        resourceVersion=str(next(self.versions)))
        if request.action == kmock.action.DELETE and request.name and request.resource.plural != "pods":
            await self._collect_owned(request)
        return await super()._handle(request)

    async def _serve_create(self, request: kmock.Request) -> Any:
        return kmock.Response(status=201, payload=await super()._serve_create(request))

    async def _serve_list(self, request: kmock.Request) -> Any:
        result = await super()._serve_list(request)
        result["items"] = [o for o in result["items"] if matches(o, request.params)]
        return result

    async def _serve_watch(self, request: kmock.Request) -> Any:
        timeout = float(request.params.get("timeoutSeconds") or 0) or None
        events = aiter(super()._serve_watch(request))
        try:
            async with asyncio.timeout(timeout):
                async for event in events:
                    if not isinstance(event, dict) or matches(event.get("object") or {}, request.params):
                        yield event
        except TimeoutError:
            return
        finally:
            await events.aclose()

    async def _collect_owned(self, request: kmock.Request) -> None:
        """Garbage collection: deleting a workload deletes the pods it owns."""
        owner = next((o.raw for (res, ns, name), o in self.objects.items() if res == request.resource
                      and ns == request.namespace and name == request.name and not o.deleted), None)
        if owner is None:
            return
        uid = owner["metadata"]["uid"]
        for (res, ns, name), obj in list(self.objects.items()):
            if res.plural != "pods" or obj.deleted:
                continue
            if any(r.get("uid") == uid for r in (obj.raw.get("metadata") or {}).get("ownerReferences") or []):
                raw = obj.raw
                obj.delete()
                self.logs.setdefault((ns, name), PodLog()).done = True
                await self._buses[res].put({"type": "DELETED", "object": raw})

    async def _serve_log(self, request: kmock.Request) -> aiohttp.web.StreamResponse:
        log = self.logs.get((request.namespace, request.name))
        if log is None:
            return await self._render_error(kmock.KubernetesError(
                status=400, reason="BadRequest",
                message=f'container in pod "{request.name}" is waiting to start'))
        follow = request.params.get("follow") == "true"
        response = aiohttp.web.StreamResponse(status=200, headers={"Content-Type": "text/plain"})
        await response.prepare(request._raw_request)
        lines = log.lines if follow else log.lines[
            -int(request.params.get("tailLines") or len(log.lines) or 1):]
        sent = 0
        while True:
            # one at a time: the pod's controller thread appends lines while a write awaits
            while sent < len(lines):
                await response.write(lines[sent].encode() + b"\n")
                sent += 1
            if not follow or (log.done and sent == len(log.lines)) or self.closing:
                break
            await asyncio.sleep(0.02)
        await response.write_eof()
        return response

    async def _serve_exec(self, request: kmock.Request) -> aiohttp.web.StreamResponse:
        raw = request._raw_request
        argv = raw.query.getall("command", [])
        self.exec_calls.append((request.namespace, request.name, argv))
        ws = aiohttp.web.WebSocketResponse(protocols=("v4.channel.k8s.io",))
        await ws.prepare(raw)
        out, code = await asyncio.to_thread(self.exec_in, request.name, raw.query.get("container", ""),
                                            argv) \
            if self.exec_in else ("", 0)
        if out:
            await ws.send_bytes(b"\x01" + out.encode())
        status = {"metadata": {}, "status": "Success"} if code == 0 else {
            "metadata": {}, "status": "Failure", "reason": "NonZeroExitCode",
            "message": f"command terminated with non-zero exit code: {code}",
            "details": {"causes": [{"reason": "ExitCode", "message": str(code)}]}}
        await ws.send_bytes(b"\x03" + json.dumps(status).encode())
        await ws.close()
        return ws


@dataclass
class Kube:
    """A running emulator: ``url`` to point clients at, ``emulator`` to inspect and steer it."""

    emulator: KubeEmulator
    url: str
    loop: asyncio.AbstractEventLoop

    def api_client(self) -> client.ApiClient:
        cfg = client.Configuration()
        cfg.host = self.url
        cfg.retries = False
        return client.ApiClient(cfg)

    def kubeconfig(self, path: Path, namespace: str = "default") -> Path:
        """A kubeconfig whose context ``kmock`` points at this server, as `aws eks update-kubeconfig` writes
        one."""
        path.write_text(json.dumps({
            "apiVersion": "v1", "kind": "Config", "current-context": "kmock",
            "clusters": [{"name": "kmock", "cluster": {"server": self.url}}],
            "users": [{"name": "tester", "user": {"token": "test-token"}}],
            "contexts": [{"name": "kmock",
                          "context": {"cluster": "kmock", "user": "tester", "namespace": namespace}}],
        }))
        return path


@contextlib.contextmanager
def running() -> Iterator[Kube]:
    loop = asyncio.new_event_loop()
    ready = threading.Event()
    box: dict[str, Any] = {}

    async def serve() -> None:
        box["stop"] = asyncio.Event()
        try:
            async with KubeEmulator() as emulator, kmock.Server(emulator, port=None) as server:
                emulator.resources.load_bundled()
                box["kube"] = Kube(emulator, f"http://{server.host}:{server.port}", loop)
                ready.set()
                await box["stop"].wait()
                emulator.closing = True
                runner = getattr(server.server, "runner", None)
                if runner is not None and hasattr(runner, "_shutdown_timeout"):
                    runner._shutdown_timeout = 0.5   # open watch/follow streams would hold it 60 s
        except BaseException as e:
            box["error"] = e
            ready.set()
            raise

    thread = threading.Thread(target=loop.run_until_complete, args=(serve(),), daemon=True, name="kmock")
    thread.start()
    if not ready.wait(10) or "error" in box:
        raise RuntimeError(f"kmock did not start: {box.get('error')!r}")
    try:
        yield box["kube"]
    finally:
        loop.call_soon_threadsafe(box["stop"].set)
        thread.join(10)
        loop.close()


class Controllers:
    """The Job controller and the kubelet, as far as the backend can see them, through the real client."""

    def __init__(self, kube: Kube, namespace: str, root: Path) -> None:
        self.kube, self.ns, self.root = kube, namespace, root
        self.api = kube.api_client()
        self.core = client.CoreV1Api(self.api)
        self.custom = client.CustomObjectsApi(self.api)
        self.pods: dict[str, LocalPod] = {}
        self.procs: list[subprocess.Popen[bytes]] = []
        self.exit_codes: dict[str, int] = {}
        self.running: dict[str, subprocess.Popen[bytes]] = {}   # pod -> its trainer's process
        self.terminating: set[str] = set()                      # pods sent SIGTERM (or never to start)
        self.outcomes: dict[str, Any] = {}                      # workload -> how its controller ended it
        self._lock = threading.Lock()
        kube.emulator.exec_in = self._exec

    def create_pods(self, job: str, workload: tuple[str, str, str] = ("batch", "v1", "jobs"),
                    failures: int = 0, hosts: dict[str, str] | None = None,
                    only: tuple[int, int] | None = None,
                    annotations: dict[str, str] | None = None) -> list[str]:
        """The pods of an Indexed Job (or a JobSet's one child job), from its template, Pending; ``only``:
        the one pod of (child Job number, completion index), as a child Job replaces a failed pod;
        ``annotations``: what its controllers add (failure counts, the JobSet's restart attempt)."""
        owner = self.custom.get_namespaced_custom_object(*workload[:2], self.ns, workload[2], job)
        spec = owner["spec"]
        jobset = "replicatedJobs" in spec
        replicated = spec["replicatedJobs"][0] if jobset else {"replicas": 1, "template": {"spec": spec}}
        child = replicated["template"]["spec"]
        template, count = child["template"], child["completions"]
        config = self.core.read_namespaced_config_map(job, self.ns).data
        secrets = self.secrets()
        names = []
        # a JobSet's child Jobs, numbered (torchft: one per replica group), each of ``count`` indexed pods
        made = itertools.product(range(replicated["replicas"]), range(count))
        for number, index in [only] if only else made:
            name = f"{job}-{number * count + index}-{uuid.uuid4().hex[:5]}"
            added = {**template["metadata"].get("annotations", {}),
                     "batch.kubernetes.io/job-completion-index": str(index),
                     **({"jobset.sigs.k8s.io/job-index": str(number)} if jobset else {}),
                     "batch.kubernetes.io/job-index-failure-count": str(failures), **(annotations or {})}
            pod = {"apiVersion": "v1", "kind": "Pod",
                   "metadata": {"name": name, "labels": {**template["metadata"]["labels"], "job-name": job},
                                "annotations": added,
                                "ownerReferences": [{"apiVersion": owner["apiVersion"], "kind": owner["kind"],
                                                     "name": job, "uid": owner["metadata"]["uid"]}]},
                   "spec": {**template["spec"], "hostname": f"{job}-{index}"},
                   "status": {"phase": "Pending"}}
            self.core.create_namespaced_pod(self.ns, pod)
            self.pods[name] = LocalPod(template, name, self.root, config, added, hosts or {}, secrets=secrets)
            names.append(name)
        return names

    def status(self, pod: str, phase: str, container: dict[str, Any] | None = None, name: str = "trainer",
               init: bool = False, **extra: Any) -> None:
        status: dict[str, Any] = {"phase": phase, **extra}
        if container is not None:
            status["initContainerStatuses" if init else "containerStatuses"] = [
                {"name": name, "image": "img", "imageID": "img@sha256:0", "restartCount": 0,
                 "ready": not init, "state": container}]
        self.core.patch_namespaced_pod_status(pod, self.ns, {"status": status})

    def pod_status(self, pod: str) -> dict[str, Any]:
        """The pod's status as stored (conditions a disruption added included)."""
        raw = self.core.read_namespaced_pod(pod, self.ns, _preload_content=False)
        return json.loads(raw.data).get("status") or {}

    def run(self, pod: str) -> None:
        self.kube.emulator.logs.setdefault((self.ns, pod), PodLog())
        self.status(pod, "Running", {"running": {"startedAt": now()}})

    def log(self, pod: str, *lines: str) -> None:
        self.kube.emulator.logs.setdefault((self.ns, pod), PodLog()).lines.extend(lines)

    def exit(self, pod: str, code: int = 0, reason: str = "Completed", message: str = "",
             container: str = "trainer", init: bool = False) -> None:
        self.kube.emulator.logs.setdefault((self.ns, pod), PodLog()).done = True
        terminated = {"exitCode": code, "reason": reason, "finishedAt": now(),
                      **({"message": message} if message else {})}
        self.status(pod, "Succeeded" if code == 0 else "Failed", {"terminated": terminated}, name=container,
                    init=init)

    def terminate(self, pod: str, evict: bool = False) -> None:
        """What the kubelet does to a pod being deleted (and, ``evict``, what the Eviction API marks first:
        the DisruptionTarget condition): SIGTERM to its container's main process, SIGKILL to all it runs
        once the pod's grace period is over. A pod not started yet never starts."""
        with self._lock:
            if pod in self.terminating:
                return
            self.terminating.add(pod)
            proc = self.running.get(pod)
        if evict:
            self.core.patch_namespaced_pod_status(pod, self.ns, {"status": {"conditions": [
                {"type": "DisruptionTarget", "status": "True", "reason": "EvictionByEvictionAPI",
                 "message": "Eviction API: evicting", "lastTransitionTime": now()}]}})
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGTERM)
        grace = self.pods[pod].template["spec"].get("terminationGracePeriodSeconds", 30)
        timer = threading.Timer(grace, lambda: proc.poll() is None and os.killpg(proc.pid, signal.SIGKILL))
        timer.daemon = True
        timer.start()

    def finish(self, job: str, condition: str = "Complete", reason: str = "", message: str = "",
               workload: tuple[str, str, str] = ("batch", "v1", "jobs")) -> None:
        self.custom.patch_namespaced_custom_object_status(*workload[:2], self.ns, workload[2], job,
                                                          {"status": {
            "conditions": [{"type": condition, "status": "True", "reason": reason, "message": message}]}})

    def secrets(self) -> dict[str, dict[str, str]]:
        """The namespace's Secrets as the kubelet would mount them: name -> key -> value."""
        out = {}
        for s in self.core.list_namespaced_secret(self.ns).items:
            data = {k: base64.b64decode(v).decode() for k, v in (s.data or {}).items()}
            out[s.metadata.name] = {**data, **(s.string_data or {})}
        return out

    def start_deployment(self, name: str, hosts: dict[str, str]) -> subprocess.Popen[bytes]:
        """Run a Deployment's one pod (a torchft job's Lighthouse) as a local process, until close()."""
        deployment = self.custom.get_namespaced_custom_object("apps", "v1", self.ns, "deployments", name)
        assert deployment["spec"]["replicas"] == 1
        template = deployment["spec"]["template"]
        pod = LocalPod(template, f"{name}-pod", self.root, {}, hosts=hosts, secrets=self.secrets())
        [container] = template["spec"]["containers"]
        self.root.mkdir(parents=True, exist_ok=True)
        proc = pod.start(container["name"], self.root / f"{name}.log")
        self.procs.append(proc)
        return proc

    def start_job(self, job: str, hosts: dict[str, str], workload: tuple[str, str, str] = JOBS,
                  retries: int | None = None) -> threading.Thread:
        """Run the workload's pods as local processes, each its init container then its trainer, as its
        controller does (:mod:`eks_controllers`: failure policies, retries, replacements, a JobSet's
        restarts). Their output becomes the pod logs (paths as the pod sees them), their exit codes the pods'
        states. ``retries``: the child Jobs' ``backoffLimitPerIndex``, where the test sets it. Returns the
        thread that ends with the workload (its outcome then in ``outcomes[job]``)."""
        def run() -> None:
            self.outcomes[job] = run_workload(self, job, workload, hosts, retries)

        done = threading.Thread(target=run, daemon=True)
        done.start()
        return done

    def run_pod(self, name: str) -> int:
        """Run a pod to its end as the kubelet does: ``prepare``, then the trainer; returns its exit code."""
        pod, log = self.pods[name], self.root / f"{name}.log"
        if name in self.terminating:
            return 143
        prepared = pod.run("prepare", timeout=120)
        if prepared.returncode:
            text = prepared.stdout + prepared.stderr
            self.log(name, *text.splitlines())
            self.exit_codes[name] = prepared.returncode
            self.exit(name, prepared.returncode, "Error", self._message(name, "prepare", text),
                      container="prepare", init=True)
            return prepared.returncode
        self.run(name)
        with self._lock:
            if name in self.terminating:   # deleted while it prepared: its trainer never starts
                self.exit(name, 143, "Error")
                return 143
            proc = pod.start("trainer", log)
            self.procs.append(proc)
            self.running[name] = proc
        with open(log, "rb") as out:
            pending = b""
            while True:
                exited = proc.poll() is not None   # before reading: whatever it wrote is then in the file
                chunk = out.read()
                pending += chunk
                *lines, pending = pending.split(b"\n")
                self.log(name, *(pod.to_pod_paths(x.decode(errors="replace")) for x in lines))
                if exited and not chunk:
                    break
                if not chunk:
                    time.sleep(0.05)
        # the container's exit code: a shell's, 128 + the signal, for a process a signal ended
        code = proc.returncode if proc.returncode >= 0 else 128 - proc.returncode
        self.exit_codes[name] = code
        self.exit(name, code, "Completed" if code == 0 else "Error",
                  self._message(name, "trainer", log.read_text(errors="replace")))
        return code

    def _message(self, pod: str, container: str, log: str) -> str:
        """The container's termination message, as the kubelet reads it: the file it wrote (at most 4 KiB),
        else, under FallbackToLogsOnError and a failure, the end of its log (80 lines, 2 KiB)."""
        written = self.pods[pod].termination_log(container)
        if written.exists() and written.read_text().strip():   # paths as the pod sees them
            return self.pods[pod].to_pod_paths(written.read_text()[:4096])
        policy = self.pods[pod].container(container).get("terminationMessagePolicy", "File")
        code = self.exit_codes.get(pod)
        if policy == "FallbackToLogsOnError" and code:
            return self.pods[pod].to_pod_paths("\n".join(log.splitlines()[-80:])[-2048:])
        return ""

    def close(self) -> None:
        """End every process the pods started (ranks and their helpers included)."""
        for proc in self.procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
        root = str(self.root)
        for proc in psutil.process_iter():
            with contextlib.suppress(psutil.Error):
                if proc.environ().get("EKSFT_JOB_DIR", "").startswith(root):
                    proc.kill()

    def _exec(self, pod: str, container: str, argv: list[str]) -> tuple[str, int]:
        done = self.pods[pod].run(container, argv, timeout=60)
        return self.pods[pod].to_pod_paths(done.stdout + done.stderr), done.returncode


@contextlib.contextmanager
def replay_cluster(tmp_path: Path, monkeypatch: Any,
                   mount_checkpoints: bool = False) -> Iterator[tuple[Kube, Any, Controllers]]:
    """A kmock API server with the controllers that run its pods here, and an EKS backend pointed at it,
    the checkpoint volume's claim made (``mount_checkpoints``: this machine mounts the volume too, so
    checkpoints are listed after the pods are gone)."""
    from eksft_nb.backends.eks import EksBackend

    with running() as kube:
        monkeypatch.setenv("KUBECONFIG", str(kube.kubeconfig(tmp_path / "kubeconfig")))
        ctl = Controllers(kube, "default", tmp_path / "cluster")
        mount = {"checkpoints_mount": str(ctl.root / "volumes" / "fsx-claim")} if mount_checkpoints else {}
        backend = EksBackend(context="kmock", **mount)
        backend._cluster().create({"apiVersion": "v1", "kind": "PersistentVolumeClaim",
                                   "metadata": {"name": "fsx-claim", "namespace": "default"},
                                   "spec": {"accessModes": ["ReadWriteMany"],
                                            "resources": {"requests": {"storage": "1200Gi"}}}})
        try:
            yield kube, backend, ctl
        finally:
            ctl.close()
