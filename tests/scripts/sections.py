"""NVRx's sections API: an "init" section around set-up and a "step" section around every iteration,
no heartbeats (usage: --steps N --sleep S)."""

import argparse
import time

import torch.distributed as dist
from nvidia_resiliency_ext.fault_tolerance import RankMonitorClient
from torch.nn.parallel import DistributedDataParallel

import toyjob   # a module beside it (run as a notebook cell: beside the notebook)

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=60)
parser.add_argument("--sleep", type=float, default=0.1)
args = parser.parse_args()

ft = RankMonitorClient()
ft.init_workload_monitoring()
ft.start_section("init")
dist.init_process_group("gloo")
model, optim = toyjob.model_and_optimizer()
model = DistributedDataParallel(model)
ft.end_section("init")
for i in range(args.steps):
    ft.start_section("step")
    loss = model(toyjob.batch(i, dist.get_rank())).abs().mean()
    optim.zero_grad()
    loss.backward()
    optim.step()
    ft.end_section("step")
    time.sleep(args.sleep)
ft.shutdown_workload_monitoring()
dist.destroy_process_group()
