"""Plain DDP, no NVRx and no eksft: a user's torchrun script as it is (run: --steps N --sleep S)."""

import argparse
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=60)
parser.add_argument("--sleep", type=float, default=0.1)
args = parser.parse_args()

dist.init_process_group("gloo")
torch.manual_seed(0)
model = DistributedDataParallel(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(),
                                                    torch.nn.Linear(16, 1)))
optim = torch.optim.SGD(model.parameters(), lr=0.01)
for _ in range(args.steps):
    x = torch.randn(16, 8)
    loss = (model(x) - x.sum(dim=1, keepdim=True)).pow(2).mean()
    optim.zero_grad()
    loss.backward()
    optim.step()
    time.sleep(args.sleep)
print(f"rank {dist.get_rank()}: {args.steps} steps, loss {loss.item():.3f}", flush=True)
dist.destroy_process_group()
