"""A model and its optimizer as one checkpointable object."""

from __future__ import annotations

import contextlib
from typing import Any

import torch


class ModelState:
    """A model and its optimizer as one checkpointable object (FSDP2, DDP or plain modules):
    sharded state dicts on save, resharding loads on restore."""

    def __init__(self, model: torch.nn.Module, optim: torch.optim.Optimizer) -> None:
        self.model, self.optim = model, optim
        self._key: list[Any] = []
        self._info: Any = None
        self._fqns: dict[tuple, frozenset[str]] = {}  # torch's name -> FQNs walk, remembered with _info
        self._kept = True   # False once this torch lacks the private helpers the kept path calls

    def state_dict(self) -> dict[str, Any]:
        """What ``get_state_dict`` returns, without its per-call cost: it works out every parameter's
        name and the model's wrapping (most of the time a save blocks training at ~100 MB), which
        stays the same while the parameters are the same objects, so that is done once and kept.
        That uses torch's private helpers (measured on torch 2.13); where a torch release has other
        ones, the public ``get_state_dict`` does it all, every save, as before."""
        from torch.distributed.checkpoint import state_dict as sd

        if self._kept:
            try:
                return self._kept_state_dict(sd)
            except (AttributeError, TypeError):
                self._kept = False
        msd, osd = sd.get_state_dict(self.model, self.optim)
        return {"model": msd, "optim": osd}

    def _kept_state_dict(self, sd: Any) -> dict[str, Any]:
        key = [self.optim, *self.model.parameters()]  # the objects the kept work is about
        with sd._gc_context(), self._kept_fqns(sd):
            if self._info is None or len(key) != len(self._key) or any(
                    a is not b for a, b in zip(key, self._key)):
                self._fqns.clear()
                self._info = sd._verify_options(self.model, (self.optim,), optim_only=False)
                self._key = key
            msd = sd._get_model_state_dict(self.model, self._info)
            osd = sd._get_optim_state_dict(self.model, (self.optim,), self._info)
            sd._verify_state_dict(msd, osd, self._info)
        return {"model": msd, "optim": osd}

    @contextlib.contextmanager
    def _kept_fqns(self, sd: Any) -> Any:
        """Within it, torch's walk from a state-dict name to its FQNs (module by module, once per
        tensor per save: half the rest of the time) answers from what it found before, while the
        parameters are the same objects."""
        walk, memo = sd._get_fqns, self._fqns

        def kept(model: Any, name: str, *args: Any, **kwargs: Any) -> set[str]:
            key = (id(model), name, args, tuple(sorted(kwargs.items())))
            if key not in memo:
                memo[key] = frozenset(walk(model, name, *args, **kwargs))
            return set(memo[key])
        sd._get_fqns = kept
        try:
            yield
        finally:
            sd._get_fqns = walk

    def load_state_dict(self, state: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import set_state_dict

        set_state_dict(self.model, self.optim, model_state_dict=state["model"],
                       optim_state_dict=state["optim"])
