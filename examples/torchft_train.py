"""A plain torchft training script (DDP across replica groups, as in torchft's README), run by eksft-nb
with no change: each replica group is one process, launched next to a Lighthouse on loopback.

    python -m eksft_nb run --name mine --engine torchft --nnodes 2 --nproc-per-node 1 \\
        --script examples/torchft_train.py --script-args '--steps 200' --fault sigkill:1@50

Steps (those torchft commits), quorums, heals from a peer and thrown-away steps show as for the built-in
trainer, and faults fire in it. Without eksft-nb it runs as torchft's own examples do: a Lighthouse
(``torchft_lighthouse --min_replicas 1 --bind 127.0.0.1:29510``), then one torchrun per replica group:

    REPLICA_GROUP_ID=0 NUM_REPLICA_GROUPS=2 TORCHFT_LIGHTHOUSE=http://127.0.0.1:29510 \\
        torchrun --nproc-per-node 1 --master-port 29600 examples/torchft_train.py
"""

import argparse
import os
from datetime import timedelta

import torch
import torch.nn.functional as F
from torchft import DistributedDataParallel, Manager, ProcessGroupGloo
from torchft.optim import OptimizerWrapper

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=100, help="steps to commit")
args = parser.parse_args()
group = int(os.environ.get("REPLICA_GROUP_ID", 0))

torch.manual_seed(0)  # every group starts from the same weights
net = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
inner = torch.optim.AdamW(net.parameters(), lr=1e-2)


def state_dict() -> dict:
    """What a group that was lost fetches from a live peer to heal."""
    return {"model": net.state_dict(), "optim": inner.state_dict()}


def load_state_dict(state: dict) -> None:
    net.load_state_dict(state["model"])
    inner.load_state_dict(state["optim"])


manager = Manager(
    pg=ProcessGroupGloo(timeout=timedelta(seconds=10)),
    min_replica_size=1,
    load_state_dict=load_state_dict,
    state_dict=state_dict,
    replica_id=f"train_ddp_{group}",
    timeout=timedelta(seconds=10),
)
model = DistributedDataParallel(manager, net)  # gradients all-reduced across the groups in the quorum
optimizer = OptimizerWrapper(manager, inner)  # steps only when the quorum commits

w_true = torch.randn(32, 1, generator=torch.Generator().manual_seed(0))
while manager.current_step() < args.steps:
    x = torch.randn(64, 32, generator=torch.Generator().manual_seed(1000 * group + manager.current_step()))
    optimizer.zero_grad()  # starts the step's quorum; a group behind it heals from a peer
    loss = F.mse_loss(model(x), x @ w_true)
    loss.backward()
    optimizer.step()
    if manager.current_step() % 20 == 0:
        print(f"group {group} step {manager.current_step()} loss {loss.item():.4f}", flush=True)
manager.shutdown(wait=False)
