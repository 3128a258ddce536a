"""NVRx's heartbeat API, written the way its docs describe: one heartbeat per iteration, timeouts
computed once enough were seen and saved with the checkpoint (usage: --steps N --sleep S --ckpt DIR)."""

import argparse
import os
import time

import torch.distributed as dist
from nvidia_resiliency_ext.fault_tolerance import RankMonitorClient
from torch.nn.parallel import DistributedDataParallel

import toyjob

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=60)
parser.add_argument("--sleep", type=float, default=0.1)
parser.add_argument("--ckpt", default="hb-ckpt")
args = parser.parse_args()

dist.init_process_group("gloo")
rank = dist.get_rank()
ft = RankMonitorClient()
ft.init_workload_monitoring()
model, optim = toyjob.model_and_optimizer()
ddp = DistributedDataParallel(model)
os.makedirs(args.ckpt, exist_ok=True)
path = os.path.join(args.ckpt, "state.pt")
state = toyjob.load(path)
start = 0
if state is not None:
    model.load_state_dict(state["model"])
    optim.load_state_dict(state["optim"])
    ft.load_state_dict(state["ft"])
    start = state["step"]
print(f"rank {rank}: starting at step {start}", flush=True)
if state is None:
    # the data pipeline warming up before the first batch: the computed initial timeout allows
    time.sleep(1.0)
    # for it, and so for a restart's own start-up (loading the checkpoint) on a busy machine
for i in range(start, args.steps):
    loss = ddp(toyjob.batch(i, rank)).square().mean()
    optim.zero_grad()
    loss.backward()
    ft.send_heartbeat()
    optim.step()
    time.sleep(args.sleep)
    if i == start + 5 and not ft.hb_timeouts.were_calculated:
        time.sleep(1.0)  # an evaluation pass between heartbeats: the computed timeout allows for it
        ft.send_heartbeat()
        ft.calculate_and_set_hb_timeouts()
    if (i + 1) % 10 == 0:
        dist.barrier()
        if rank == 0:
            toyjob.save(path,
                        {"model": model.state_dict(), "optim": optim.state_dict(), "ft": ft.state_dict(),
                               "step": i + 1})
        dist.barrier()
print(f"rank {rank}: done, timeouts {ft.hb_timeouts}", flush=True)
ft.shutdown_workload_monitoring()
dist.destroy_process_group()
