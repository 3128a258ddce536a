"""The connection to a cluster's API server, and its failures in words a user can act on.

It connects like kubectl (a kubeconfig context; ``$KUBECONFIG`` or ``~/.kube/config``), or with the
pod's service account when the notebook itself runs in the cluster. Objects are plain dicts, sent
through the official client's ``ApiClient``; every call has a timeout and no hidden retries.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import urllib3
from kubernetes import client, config
from kubernetes.client.rest import ApiException
from kubernetes.stream import stream as ws_stream
from kubernetes.watch.watch import iter_resp_lines

from ...errors import JobError
from .names import KINDS, Kind

IN_CLUSTER_NAMESPACE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")
CRD_INSTALL = {
    "JobSet": "install JobSet (https://jobset.sigs.k8s.io/docs/installation/) or use --kind job",
    "PyTorchJob": "install the Kubeflow training operator (v1) or use --kind job",
}


class ApiError(JobError):
    """A failed API call, explained; ``status`` is the HTTP status (None when there was no answer)."""

    def __init__(self, problem: str, fix: str, status: int | None = None) -> None:
        super().__init__(problem, fix)
        self.status = status


@dataclass
class Cluster:
    api: client.ApiClient
    namespace: str
    timeout: float = 30.0   # seconds for one API call

    @classmethod
    def connect(cls, context: str | None = None, namespace: str | None = None,
                timeout: float = 30.0) -> Cluster:
        cfg = client.Configuration()
        if context or kubeconfig_files():
            default_ns = _load_kubeconfig(context, cfg)
        elif os.environ.get("KUBERNETES_SERVICE_HOST"):
            try:
                config.load_incluster_config(client_configuration=cfg)
            except config.ConfigException as e:
                raise JobError(f"cannot use this pod's service account: {e}",
                               "mount its token (automountServiceAccountToken), or use a "
                               "kubeconfig") from None
            default_ns = (IN_CLUSTER_NAMESPACE.read_text().strip() if IN_CLUSTER_NAMESPACE.exists()
                          else "default")
        else:
            raise JobError("no Kubernetes configuration: no kubeconfig ($KUBECONFIG or ~/.kube/config) and "
                           "not in a pod",
                           "run `aws eks update-kubeconfig --name CLUSTER --region REGION` (or "
                           "pass --context)")
        cfg.retries = False  # one attempt per call: failures surface at once, with their cause
        return cls(client.ApiClient(cfg), namespace or default_ns, timeout)

    @property
    def server(self) -> str:
        return self.api.configuration.host

    @property
    def core(self) -> client.CoreV1Api:
        return client.CoreV1Api(self.api)

    # ---- objects as dicts ------------------------------------------------------------------------
    def request(self, method: str, path: str, what: str, body: Any = None,
                query: dict[str, Any] | None = None,
                content_type: str = "application/json") -> Any:
        """One API call; raises :class:`ApiError` explaining what went wrong with ``what``."""
        headers = {"Accept": "application/json", "Content-Type": content_type}
        params = self.api.param_serialize(method, path, query_params=list((query or {}).items()),
                                          header_params=headers, body=body, auth_settings=["BearerToken"])
        try:
            response = self.api.call_api(*params, _request_timeout=(min(5.0, self.timeout), self.timeout))
            response.read()
            return self.api.response_deserialize(response, {"2XX": "object"}).data
        except ApiException as e:
            raise explain(e, what, self) from None
        except (urllib3.exceptions.HTTPError, OSError) as e:
            raise unreachable(e, self) from None

    def lines(self, path: str, what: str, query: dict[str, Any], read_timeout: float) -> Iterator[str]:
        """The lines of a streamed answer (a watch, a followed log) as they arrive.

        It goes through the client's request path, as :meth:`request` does, and none of its generated API
        methods: those validate their arguments in compiled code (pydantic-core), and a daemon thread waiting
        for an answer inside compiled code aborts the whole process (SIGABRT) if the answer arrives while
        Python shuts down. A refusal raises :class:`ApiError` with its status; a connection lost, or quiet
        for ``read_timeout``, raises urllib3's own error: the caller tells a quiet stream from a lost one.
        """
        params = self.api.param_serialize("GET", path, query_params=list(query.items()),
                                          header_params={"Accept": "*/*"}, auth_settings=["BearerToken"])
        try:
            answer = self.api.call_api(*params, _request_timeout=(min(5.0, self.timeout), read_timeout))
        except ApiException as e:
            raise explain(e, what, self) from None
        try:
            if not 200 <= answer.status <= 299:
                answer.read()
                try:
                    self.api.response_deserialize(answer, {"2XX": "object"})
                except ApiException as e:
                    raise explain(e, what, self) from None
            yield from iter_resp_lines(answer.response)
        finally:
            answer.response.close()
            answer.response.release_conn()

    def create(self, obj: dict[str, Any]) -> dict[str, Any]:
        kind, meta = KINDS[obj["kind"]], obj["metadata"]
        return self.request("POST", kind.path(meta.get("namespace", self.namespace)),
                            f"create {_describe(obj)}", obj)

    def get(self, kind: Kind, name: str) -> dict[str, Any] | None:
        """The object, or None when it does not exist."""
        try:
            return self.request("GET", kind.path(self.namespace, name), f"read {kind.kind} {name}")
        except ApiError as e:
            if e.status == 404:
                return None
            raise

    def list(self, kind: Kind, selector: str) -> list[dict[str, Any]]:
        return self.request("GET", kind.path(self.namespace), f"list {kind.plural}",
                            query={"labelSelector": selector}).get("items", [])

    def patch(self, kind: Kind, name: str, patch: dict[str, Any]) -> dict[str, Any]:
        return self.request("PATCH", kind.path(self.namespace, name), f"update {kind.kind} {name}", patch,
                            content_type="application/merge-patch+json")

    def delete(self, kind: Kind, name: str, propagation: str = "Foreground",
               grace: int | None = None) -> bool:
        """Delete; False when it was already gone."""
        body: dict[str, Any] = {"propagationPolicy": propagation}
        if grace is not None:
            body["gracePeriodSeconds"] = grace
        try:
            self.request("DELETE", kind.path(self.namespace, name), f"delete {kind.kind} {name}", body)
            return True
        except ApiError as e:
            if e.status == 404:
                return False
            raise

    # ---- inside pods -----------------------------------------------------------------------------
    def exec(self, pod: str, container: str, argv: list[str]) -> tuple[int, str]:
        """Run ``argv`` in a pod's container (like ``kubectl exec``); returns (exit code, stdout+stderr)."""
        try:
            ws = ws_stream(self.core.connect_get_namespaced_pod_exec, pod, self.namespace,
                           container=container,
                           command=argv, stdout=True, stderr=True, stdin=False, tty=False,
                           _preload_content=False, _request_timeout=self.timeout)
            ws.run_forever(timeout=self.timeout)
            out = ws.read_stdout() + ws.read_stderr()
            code = ws.returncode
            ws.close()
        except ApiException as e:
            raise explain(e, f"exec into pod {pod}", self) from None
        except (urllib3.exceptions.HTTPError, OSError) as e:
            raise unreachable(e, self) from None
        if code is None:
            raise ApiError(f"the command in pod {pod} did not finish within {self.timeout:g}s",
                           "check the pod with `kubectl describe pod`, then retry")
        return code, out


def _describe(obj: dict[str, Any]) -> str:
    meta = obj["metadata"]
    where = f" in namespace {meta['namespace']}" if meta.get("namespace") else ""
    return f"{obj['kind']} {meta['name']}{where}"


def explain(e: ApiException, what: str, cluster: Cluster) -> ApiError:
    """An API error as one line: what failed, why, and what to do."""
    try:
        status = json.loads(e.body or "{}")
    except ValueError:
        status = {}
    message = status.get("message") or e.reason or ""
    code = e.status
    if code == 401:
        problem, fix = (f"cannot {what}: the cluster did not accept your credentials (401)",
                        "refresh them (`aws sso login`, then `aws eks update-kubeconfig ...`)")
    elif code == 403:
        problem, fix = (f"cannot {what}: forbidden (403: {message})",
                        "ask a cluster admin to apply the eksft-control Role and bind it to you "
                        "(shown by `run --backend eks --dry-run`), or use a --namespace you may write to")
    elif code == 404 and what.startswith("create"):
        kind = what.split()[1]
        if (status.get("details") or {}).get("kind") == "namespaces" or "namespaces" in message:
            problem, fix = (f"cannot {what}: namespace {cluster.namespace!r} does not exist",
                            f"create it (`kubectl create namespace {cluster.namespace}`) or use "
                            "another --namespace")
        elif kind in CRD_INSTALL:
            problem, fix = (f"cannot {what}: the {kind} API is not installed on this cluster (404)",
                            CRD_INSTALL[kind])
        else:
            problem, fix = (f"cannot {what}: not found (404: {message})", "check --namespace and --context")
    elif code == 409:
        problem, fix = (f"cannot {what}: it already exists (409)",
                        "choose another --name, or stop and remove that job")
    elif code == 422:
        problem, fix = (f"cannot {what}: the API server rejected it (422: {message})",
                        "fix the option behind the field it names (see --help); if none does, "
                        "please report it")
    elif code == 429 or (code and code >= 500):
        problem, fix = (f"cannot {what}: the API server failed ({code}: {message or 'no detail'})",
                        "this is on the cluster's side: retry in a minute; if it persists, check the "
                        "control plane")
    else:
        problem, fix = (f"cannot {what}: {code} {message}", "check --namespace and --context")
    return ApiError(problem, fix, code)


def unreachable(e: BaseException, cluster: Cluster) -> ApiError:
    cause = getattr(e, "reason", None) if isinstance(e, urllib3.exceptions.MaxRetryError) else e
    cause = cause or e
    if isinstance(cause, urllib3.exceptions.NewConnectionError) or isinstance(cause, ConnectionRefusedError):
        return ApiError(f"cannot connect to the Kubernetes API at {cluster.server} ({_root(cause)})",
                        "check the cluster endpoint and your network (VPN, private endpoint): `kubectl "
                        "cluster-info`")
    if isinstance(cause, (urllib3.exceptions.TimeoutError, TimeoutError)):
        return ApiError(f"the Kubernetes API at {cluster.server} did not answer within {cluster.timeout:g}s",
                        "the control plane may be overloaded or the network slow: retry, or check `kubectl "
                        "get --raw /readyz`")
    return ApiError(f"lost the connection to the Kubernetes API at {cluster.server} ({_root(cause)})",
                    "retry; if it persists check your network and `kubectl cluster-info`")


def _root(e: BaseException) -> str:
    text = str(e)
    return text.split(": ", 1)[1] if text.startswith("<") and ": " in text else text


def kubeconfig_files() -> list[Path]:
    paths = os.environ.get("KUBECONFIG") or "~/.kube/config"
    return [Path(p).expanduser() for p in paths.split(os.pathsep) if p and Path(p).expanduser().is_file()]


def _load_kubeconfig(context: str | None, cfg: client.Configuration) -> str:
    where = os.environ.get("KUBECONFIG") or "~/.kube/config"   # read now: the client reads it at import
    if not kubeconfig_files():
        raise JobError(f"--context {context} needs a kubeconfig, and none was found at {where}",
                       "run `aws eks update-kubeconfig --name CLUSTER --region REGION`")
    try:
        contexts, current = config.list_kube_config_contexts(config_file=where)
    except config.ConfigException as e:
        raise JobError(f"cannot read kubeconfig {where}: {e}",
                       "fix it, or regenerate it with `aws eks update-kubeconfig`") from None
    available = {c["name"]: c for c in contexts}
    chosen = available.get(context) if context else current
    if chosen is None:
        raise JobError(f"kubeconfig {where} has no context {context!r}" if context else f"kubeconfig {where} "
                       "has no current context",
                       f"use --context with one of: {', '.join(available) or '(none)'}")
    try:
        config.load_kube_config(config_file=where, context=chosen["name"], client_configuration=cfg,
                                persist_config=False)
    except (config.ConfigException, OSError) as e:
        raise JobError(f"cannot use context {chosen['name']!r} of {where}: {e}",
                       "check it with `kubectl --context CONTEXT get ns`") from None
    return chosen.get("context", {}).get("namespace") or "default"
