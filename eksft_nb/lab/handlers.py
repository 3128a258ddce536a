"""The ``/eksft/`` routes: thin handlers over the command layer and the jobs manager.

Every handler is a Jupyter ``APIHandler`` and every method ``@web.authenticated``, so the server's
token and XSRF checks apply as on ``/api/``. Commands run in a worker thread (a stop takes seconds;
the server's loop never waits on a job). A refused request answers 400 (404: no such job) with
``{"error", "problem", "fix"}``, ``error`` being the line the CLI prints, and has changed nothing.
"""

from __future__ import annotations

import asyncio
import functools
import json
import re
from collections.abc import Awaitable, Callable
from typing import Any

from jupyter_server.base.handlers import APIHandler, AuthenticatedFileHandler
from jupyter_server.utils import url_path_join
from tornado import web
from tornado.iostream import StreamClosedError

from .. import commands, plotly_bundle
from ..errors import ControlError, EksftError, UnknownJobError
from . import requests, wire
from .manager import JobsManager

KEEPALIVE_S = 15.0
SETTINGS_WAIT_S = 10.0   # a change answers once every rank took it, or as queued after this long


def refusing(method: Callable[..., Awaitable[None]]) -> Callable[..., Awaitable[None]]:
    """Answer an :class:`EksftError` as a one-line refusal (400, or 404 for an unknown job)."""

    @functools.wraps(method)
    async def wrapper(self: Base, *args: str) -> None:
        try:
            await method(self, *args)
        except EksftError as e:
            self.set_status(404 if isinstance(e, UnknownJobError) else 400)
            self.finish(json.dumps({"error": str(e), "problem": e.problem, "fix": e.fix}))

    return wrapper


class Base(APIHandler):
    @property
    def manager(self) -> JobsManager:
        return self.settings["eksft_manager"]

    def backend(self) -> str:
        return self.get_query_argument("backend", "local")

    async def call(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``fn(*args, **kwargs)`` in a worker thread."""
        return await asyncio.get_running_loop().run_in_executor(None, functools.partial(fn, *args, **kwargs))

    async def reply(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
        self.finish(json.dumps(await self.call(fn, *args, **kwargs)))


class JobsHandler(Base):
    @web.authenticated
    @refusing
    async def get(self) -> None:
        """Every local job (from the manager's folds), and those of each cluster set up here (EKS: a
        kubeconfig; Slurm: a shared folder, or a job launched here); a failing cluster is reported, never
        fails the list."""
        listed = await self.manager.listing()
        self.finish(json.dumps(wire.jobs_reply(listed["jobs"], listed["backends"])))

    @web.authenticated
    @refusing
    async def post(self) -> None:
        spec, faults = requests.launch_args(requests.body(self.request.body, requests.LAUNCH))
        await self.reply(commands.launch, spec, faults)


class RemoveHandler(Base):
    @web.authenticated
    @refusing
    async def post(self) -> None:
        """``{"jobs": [{"name": "a", "backend": "local"}, ...]}``: the ``rm`` of each (the panel's "clear
        finished"), each removed or refused with its own line (commands.remove_jobs)."""
        jobs = requests.remove_args(requests.body(self.request.body, requests.REMOVE))
        results = await self.call(commands.remove_jobs, jobs)
        self.finish(json.dumps(wire.removals_reply(results)))


class CheckHandler(Base):
    @web.authenticated
    @refusing
    async def post(self) -> None:
        """The pre-flight of a spec (commands.check): the timeouts acting on it, each contradiction. A
        launch (POST jobs) refuses what it refuses and answers its warnings with the new job's row."""
        spec, from_job, backend = requests.check_args(requests.body(self.request.body, requests.CHECK))
        await self.reply(commands.check, spec, from_job, backend)


class JobHandler(Base):
    @web.authenticated
    @refusing
    async def get(self, name: str) -> None:
        await self.reply(commands.status, name, backend=self.backend())


class InjectHandler(Base):
    @web.authenticated
    @refusing
    async def post(self, name: str) -> None:
        command, backend = requests.inject_args(requests.body(self.request.body, requests.INJECT))
        await self.reply(commands.inject_command, name, command, backend=backend)


class SettingsHandler(Base):
    @web.authenticated
    @refusing
    async def get(self, name: str) -> None:
        """The live settings in force: seq, values, and the step they took effect at (null: the spec's)."""
        await self.reply(commands.settings_in_force, name, backend=self.backend())

    @web.authenticated
    @refusing
    async def post(self, name: str) -> None:
        """``{"values": {"ckpt-every": 25}}`` or ``{"whatif": true}``: see commands.set_settings."""
        data = requests.body(self.request.body, requests.SETTINGS)
        backend = data.get("backend", "local")
        if data.get("whatif") and "values" not in data:
            await self.reply(commands.apply_whatif, name, backend=backend, wait=SETTINGS_WAIT_S)
            return
        if "values" not in data or data.get("whatif"):
            raise ControlError("the request needs values or whatif, not both nor neither",
                               'send e.g. {"values": {"ckpt-every": 25}} or {"whatif": true}')
        await self.reply(commands.set_settings, name, data["values"], backend=backend, wait=SETTINGS_WAIT_S)


class StopHandler(Base):
    @web.authenticated
    @refusing
    async def post(self, name: str) -> None:
        data = requests.body(self.request.body, requests.STOP)
        await self.reply(commands.stop, name, backend=data.get("backend", "local"))


class ResumeHandler(Base):
    @web.authenticated
    @refusing
    async def post(self, name: str) -> None:
        data = requests.body(self.request.body, requests.RESUME)
        await self.reply(commands.resume, name, step=data.get("step"), new_name=data.get("as"),
                         steps=data.get("steps"),
                         backend=data.get("backend", "local"))


class CheckpointsHandler(Base):
    @web.authenticated
    @refusing
    async def get(self, name: str) -> None:
        rows = await self.call(commands.checkpoints, name, backend=self.backend())
        self.finish(json.dumps(wire.checkpoints_reply(rows)))


class SummaryHandler(Base):
    @web.authenticated
    @refusing
    async def get(self, name: str) -> None:
        await self.reply(commands.summary, name, backend=self.backend())


class LogsHandler(Base):
    @web.authenticated
    @refusing
    async def get(self, name: str) -> None:
        lines = requests.query_int(self.get_query_argument("lines", None), "lines", 200, 1,
                                   requests.MAX_LOG_LINES)
        debug = requests.query_bool(self.get_query_argument("debug", None), "debug")
        # read (only the files' ends), cut and encoded in a worker thread: the server's loop only sends it
        self.finish(await self.call(_logs_reply, name, lines, debug, self.backend()))


def _logs_reply(name: str, lines: int, debug: bool, backend: str) -> str:
    return json.dumps({"text": commands.logs(name, lines=lines, debug=debug, backend=backend)})


class FigureHandler(Base):
    @web.authenticated
    @refusing
    async def get(self, name: str) -> None:
        """The dashboard's figure (plotly JSON), built in the manager's thread from the job's fold."""
        self.finish(await self.manager.figure(name, self.backend()))


class WhatIfHandler(Base):
    @web.authenticated
    @refusing
    async def get(self, name: str) -> None:
        """The job view's what-if tab: the recommendation, the table's cells, the plot (plotly JSON)."""
        self.finish(await self.call(_whatif_reply, name, self.backend()))


def _whatif_reply(name: str, backend: str) -> str:
    from ..resilience.whatif_view import view

    return json.dumps(wire.whatif_reply(view(commands.whatif(name, backend=backend))))


class StreamHandler(Base):
    """Server-sent events: ``jobs`` first and on every change, ``restart`` and ``failure`` as they
    happen, a ``: keepalive`` comment every 15 s."""

    @web.authenticated
    async def get(self) -> None:
        self.set_header("Content-Type", "text/event-stream")
        self.set_header("Cache-Control", "no-cache")
        self.set_header("X-Accel-Buffering", "no")    # no proxy buffering of the stream
        self._queue = queue = self.manager.subscribe()
        try:
            while True:
                try:
                    message = await asyncio.wait_for(queue.get(), KEEPALIVE_S)
                except asyncio.TimeoutError:
                    self.write(": keepalive\n\n")
                else:
                    if message is None:       # the server is shutting down, or the client left
                        break
                    kind, data = message
                    self.write(f"event: {kind}\ndata: {json.dumps(data)}\n\n")
                await self.flush()
        except StreamClosedError:
            pass
        finally:
            self.manager.unsubscribe(queue)
        if not self._finished:
            self.finish(set_content_type="text/event-stream")

    def on_connection_close(self) -> None:
        queue = getattr(self, "_queue", None)
        if queue is not None:
            queue.put_nowait(None)


class BundleHandler(AuthenticatedFileHandler):
    """plotly's widget bundle, imported by the dashboard figure's loader. That import comes from a module the
    widget manager made from a blob, so it has no Referer for Jupyter's XSRF check of a GET; a read of this
    one public library file changes nothing, so the check is skipped here (the login is still required)."""

    def check_xsrf_cookie(self) -> None:
        return None


ROUTES: list[tuple[str, type[Base]]] = [
    ("jobs", JobsHandler),
    ("rm", RemoveHandler),
    ("check", CheckHandler),
    ("jobs/([^/]+)", JobHandler),
    ("jobs/([^/]+)/inject", InjectHandler),
    ("jobs/([^/]+)/settings", SettingsHandler),
    ("jobs/([^/]+)/stop", StopHandler),
    ("jobs/([^/]+)/resume", ResumeHandler),
    ("jobs/([^/]+)/checkpoints", CheckpointsHandler),
    ("jobs/([^/]+)/summary", SummaryHandler),
    ("jobs/([^/]+)/logs", LogsHandler),
    ("jobs/([^/]+)/figure", FigureHandler),
    ("jobs/([^/]+)/whatif", WhatIfHandler),
    ("stream", StreamHandler),
]


def setup(serverapp: Any) -> JobsManager:
    """Add the routes to a Jupyter server; return the manager they share."""
    web_app = serverapp.web_app
    manager = JobsManager()
    web_app.settings["eksft_manager"] = manager
    base = url_path_join(web_app.settings["base_url"], "eksft")
    web_app.add_handlers(".*$", [(url_path_join(base, path), handler) for path, handler in ROUTES])
    # the dashboard figure's JavaScript (see plotly_bundle): plotly's own file, to the logged-in browser
    route = url_path_join(base, "plotly", f"({re.escape(plotly_bundle.BUNDLE)})")
    web_app.add_handlers(".*$", [(route, BundleHandler, {"path": str(plotly_bundle.bundle_dir())})])
    return manager
