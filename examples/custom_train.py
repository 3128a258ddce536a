"""A training script of your own, run by eksft-nb's launcher with the runtime helpers:

    python -m eksft_nb run --name mine --script examples/custom_train.py --steps 60

Heartbeats, step telemetry, fault commands and checkpoints come from ``eksft_nb.runtime``; the
model, data and loop are yours. Run outside eksft-nb it still trains (helpers become no-ops).
"""

import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.fsdp import fully_shard

from eksft_nb.runtime import ModelState, session

s = session()  # this rank's helpers, configured from the job spec
dist.init_process_group("gloo")
torch.manual_seed(s.spec.seed)
model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
fully_shard(model)
optim = torch.optim.AdamW(model.parameters(), lr=1e-2)

ckpt = s.checkpoints()  # the spec's folder, interval, mode and retention
state = {"train": ModelState(model, optim)}
start = ckpt.restore(state, s.spec.resume, s.restarting)  # 0 on a fresh start
s.rank_start(start)

g = torch.Generator().manual_seed(1000 + dist.get_rank())
w_true = torch.randn(32, 1, generator=torch.Generator().manual_seed(0))
for step in range(start + 1, s.spec.steps + 1):
    s.step_begin(step)  # fires fault commands aimed at this rank and step
    t0 = time.perf_counter()
    x = torch.randn(64, 32, generator=g)
    loss = F.mse_loss(model(x), x @ w_true)
    optim.zero_grad()
    loss.backward()
    optim.step()
    s.step_end(step, loss=loss.item(), tokens=64, step_time=time.perf_counter() - t0)
    ckpt.maybe_save(step, state, last=step == s.spec.steps)
ckpt.finish()
dist.destroy_process_group()
