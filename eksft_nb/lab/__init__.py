"""The Jupyter server extension behind the JupyterLab panel: REST routes under ``/eksft/`` for the
command layer and one server-sent event stream of every job (see :mod:`.handlers`, :mod:`.manager`).

Enabled on install by ``jupyter-config/jupyter_server_config.d/eksft_nb.json``; by hand:
``jupyter server --ServerApp.jpserver_extensions='{"eksft_nb.lab": True}'``.
"""

from __future__ import annotations

from typing import Any


def _jupyter_server_extension_points() -> list[dict[str, str]]:
    return [{"module": "eksft_nb.lab"}]


def _load_jupyter_server_extension(serverapp: Any) -> None:
    from .handlers import setup

    setup(serverapp)
    serverapp.log.info("eksft_nb: /eksft/ routes and job stream enabled")


def _unload_jupyter_server_extension(serverapp: Any) -> None:
    manager = serverapp.web_app.settings.pop("eksft_manager", None)
    if manager is not None:
        manager.close()
