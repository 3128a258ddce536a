"""Code that runs inside the ranks. User scripts get the same helpers as the built-in trainer::

    from eksft_nb.runtime import session, CheckpointManager

Attributes are imported lazily, so control-plane code can use ``eksft_nb.runtime.quiet`` without
importing torch.
"""

from __future__ import annotations

from typing import Any

_EXPORTS = {"CheckpointManager": ".checkpoint", "InjectedFault": ".session", "Session": ".session",
            "session": ".session"}
__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(name)
    import importlib

    return getattr(importlib.import_module(_EXPORTS[name], __name__), name)
