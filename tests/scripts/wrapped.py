"""A training function the user wrapped in NVRx's inprocess.Wrapper: exceptions restart it inside the
process; it re-creates its process group on a fresh store every iteration (usage: STEPS PAUSE).

Its timeouts leave room for CI's two busy cores (with a 4 s soft timeout and a 3 s gloo timeout, CI
once saw two restarts after one fault) and stay under the launcher's heartbeat timeout."""

import datetime
import os
import sys
import time
from typing import Optional

import torch
import torch.distributed as dist
import nvidia_resiliency_ext.inprocess as inprocess

seconds = datetime.timedelta


@inprocess.Wrapper(store_kwargs={"port": int(os.environ["MASTER_PORT"]) + 1}, soft_timeout=seconds(seconds=8),
                   hard_timeout=seconds(seconds=12), heartbeat_timeout=seconds(seconds=14),
                   barrier_timeout=seconds(seconds=60), completion_timeout=seconds(seconds=60))
def train(steps: int, pause: float, call_wrapper: Optional[inprocess.CallWrapper] = None) -> None:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = dist.TCPStore(os.environ["MASTER_ADDR"],
                          int(os.environ["MASTER_PORT"]) + 2 + call_wrapper.iteration,
                          world, is_master=rank == 0, multi_tenant=True, wait_for_workers=False,
                          use_libuv=True)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=seconds(seconds=10))
    torch.manual_seed(7)
    model = torch.nn.Linear(6, 6)
    optim = torch.optim.SGD(model.parameters(), lr=0.05)
    for _ in range(steps):
        loss = model(torch.randn(6, 6)).square().mean()
        optim.zero_grad()
        loss.backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)
        optim.step()
        call_wrapper.ping()
        time.sleep(pause)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    train(int(sys.argv[1]), float(sys.argv[2]))
