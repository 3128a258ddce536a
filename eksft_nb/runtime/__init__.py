"""Code that runs inside the ranks. User scripts get the same helpers as the built-in trainer::

    from eksft_nb.runtime import ModelState, session

    s = session()                       # configured from the job spec and the launcher's environment
    ckpt = s.checkpoints()              # CheckpointManager: the spec's folder, interval and mode
    start = ckpt.restore({"train": ModelState(model, optim)}, s.spec.resume, s.restarting)
    s.step_begin(step); ...; s.step_end(step, loss=..., tokens=..., step_time=...)
    ckpt.maybe_save(step, state, last=...)

See ``examples/custom_train.py``.

Attributes are imported lazily, so control-plane code can use ``eksft_nb.runtime.quiet`` without
importing torch.
"""

from __future__ import annotations

from typing import Any

# imported here (no torch in it) so that ``session`` is the function even once the submodule of the
# same name is loaded: a lazy attribute would be shadowed by the submodule
from .session import InjectedFault, Session, session

_EXPORTS = {"CheckpointManager": ".checkpoint", "ModelState": ".checkpoint"}
__all__ = ["CheckpointManager", "InjectedFault", "ModelState", "Session", "session"]


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(name)
    import importlib

    return getattr(importlib.import_module(_EXPORTS[name], __name__), name)
