"""A plain torchrun-style script that knows nothing of eksft-nb: rank 1 fails on the first attempt."""

import os
import sys

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
rank = dist.get_rank()
attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
x = torch.ones(1)
for step in range(20):
    dist.all_reduce(x)
    if rank == 1 and attempt == 0 and step == 10:
        print("rank 1: giving up with exit code 3", flush=True)
        sys.exit(3)
print(f"rank {rank} attempt {attempt} done, x={x.item():.0f}", flush=True)
dist.destroy_process_group()
