"""A script whose restore opens an NVRx section ("restore") that ft_launcher has no timeout for: its first
run trains and saves; after a fault, every start finds the save and opens the section, which NVRx 0.4.1
refuses (``Unknown section: restore``) and 0.5+ does not bound. The name is a variable, as a config
would give it, so the pre-flight (which reads literal names) cannot tell it beforehand: the failure is
the ranks' to report (usage: --steps N --ckpt FILE)."""

import argparse
import os
import time

import torch
import torch.distributed as dist
from nvidia_resiliency_ext.fault_tolerance import RankMonitorClient

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=40)
parser.add_argument("--ckpt", required=True)
args = parser.parse_args()
RESTORE = "restore"

ft = RankMonitorClient()
ft.init_workload_monitoring()
dist.init_process_group("gloo")
torch.manual_seed(5)
model = torch.nn.Linear(4, 4)
optim = torch.optim.SGD(model.parameters(), lr=0.1)
if os.path.exists(args.ckpt):
    ft.start_section(RESTORE)
    model.load_state_dict(torch.load(args.ckpt))
    ft.end_section(RESTORE)
for step in range(args.steps):
    ft.start_section("step")
    model(torch.randn(4, 4)).abs().mean().backward()
    optim.step()
    optim.zero_grad()
    ft.end_section("step")
    if dist.get_rank() == 0 and step % 5 == 0:
        torch.save(model.state_dict(), args.ckpt + ".tmp")
        os.replace(args.ckpt + ".tmp", args.ckpt)
    ft.send_heartbeat()
    time.sleep(0.1)
ft.shutdown_workload_monitoring()
dist.destroy_process_group()
