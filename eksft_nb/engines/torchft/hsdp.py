"""A replica group of one rank or of N (``--nproc-per-node N``): torchft DDP, or torchft HSDP.

One rank: the group trains the whole model and torchft DDP all-reduces its gradients across the groups.
N ranks (HSDP): the group's ranks shard the model with FSDP2 (``fully_shard`` over the group's own gloo
process group, formed through the store its rank 0 hosts), and across the groups torchft all-reduces
each rank's gradient shard with the same rank of the other groups, in FSDP's all-reduce hook (every rank
runs a Manager against its group's store: rank 0's talks to the Lighthouse, the others join its quorum
and its commit vote, so a group commits or throws a step away as one). The groups shard alike: a healing
rank fetches its own shards from the same rank of a peer group (:func:`local_state`).
"""

from __future__ import annotations

import datetime
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

GROUP_PREFIX = "eksft/group"  # the group's process group's keys in the group's store (torchft has its own)


def join(store: dist.Store, local_rank: int, size: int, timeout: datetime.timedelta) -> None:
    """Form the group's process group (the default one) over its ``size`` ranks through the group's
    ``store``; a group of one forms its own alone. ``timeout``: a collective within the group (the
    supervisor, not this timeout, ends a group whose rank hangs)."""
    if size == 1:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    else:
        dist.init_process_group("gloo", store=dist.PrefixStore(GROUP_PREFIX, store), rank=local_rank,
                                world_size=size, timeout=timeout)


def replicate(manager: Any, model: nn.Module) -> nn.Module:
    """What a step runs ``model`` through so that its gradients are averaged across the groups in the
    quorum: torchft DDP around an unsharded model; a sharded one (FSDP2) itself, its reduce-scattered
    gradient shards all-reduced by ``manager`` in FSDP's all-reduce hook (set again: no change)."""
    from torch.distributed.fsdp import FSDPModule
    from torchft import DistributedDataParallel

    if not isinstance(model, FSDPModule):
        return DistributedDataParallel(manager, model)

    def across_groups(shard: torch.Tensor) -> None:
        manager.allreduce(shard).wait()   # an error is reported to the manager: the step is thrown away

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_all_reduce_hook(across_groups)
    return model


def _local(value: Any) -> Any:
    from torch.distributed.tensor import DTensor

    return value.to_local() if isinstance(value, DTensor) else value


def local_state(model: nn.Module, optim: torch.optim.Optimizer) -> dict[str, Any]:
    """The state a peer heals from: this rank's shards of the parameters and the optimizer's state, as
    plain tensors (the whole of them, unsharded)."""
    optim_state = optim.state_dict()
    return {
        "model": {name: _local(v) for name, v in model.state_dict().items()},
        "optim": {
            "state": {i: {k: _local(v) for k, v in s.items()} for i, s in optim_state["state"].items()},
            "param_groups": optim_state["param_groups"],
        },
    }


def load_local_state(model: nn.Module, optim: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    """Load :func:`local_state` from the same rank of a peer group into this rank's shards."""
    from torch.distributed.tensor import DTensor

    with torch.no_grad():
        for name, value in model.state_dict().items():
            _local(value).copy_(state["model"][name])
    params = [p for group in optim.param_groups for p in group["params"]]

    def sharded(i: int, value: Any) -> Any:
        p = params[i]
        if isinstance(p, DTensor) and isinstance(value, torch.Tensor) and value.dim() > 0:
            return DTensor.from_local(value, p.device_mesh, p.placements, run_check=False)
        return value   # a scalar (Adam's step) is not sharded

    optim.load_state_dict({
        "state": {i: {k: sharded(i, v) for k, v in s.items()} for i, s in state["optim"]["state"].items()},
        "param_groups": state["optim"]["param_groups"],
    })
