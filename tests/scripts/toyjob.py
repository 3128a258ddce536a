"""A helper module beside heartbeats.py and sections.py: a script that imports its neighbours needs its folder
on sys.path (a notebook cell, the notebook's)."""

import os

import torch


def model_and_optimizer() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(3)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    return model, torch.optim.Adam(model.parameters(), lr=1e-3)


def batch(i: int, rank: int) -> torch.Tensor:
    return torch.randn(16, 8, generator=torch.Generator().manual_seed(1000 * rank + i))


def save(path: str, state: dict) -> None:
    tmp = path + ".tmp"
    torch.save(state, tmp)
    os.replace(tmp, path)


def load(path: str) -> dict | None:
    return torch.load(path, weights_only=False) if os.path.exists(path) else None
