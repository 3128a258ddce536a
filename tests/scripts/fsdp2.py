"""FSDP2 (fully_shard) on CPU with gloo: no NVRx, no eksft. Writes the final loss beside the working
directory."""

import os
import sys
import time

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard


def main(steps: int, pause: float) -> None:
    dist.init_process_group("gloo")
    torch.manual_seed(1)
    blocks = [torch.nn.Linear(32, 32) for _ in range(3)]
    model = torch.nn.Sequential(*blocks)
    for block in blocks:
        fully_shard(block)
    fully_shard(model)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(steps):
        x = torch.randn(8, 32)
        loss = model(x).square().mean()
        loss.backward()
        optim.step()
        optim.zero_grad()
        time.sleep(pause)
    if dist.get_rank() == 0:  # relative to the working directory the job was launched from
        with open(os.path.join("fsdp2-out", "loss.txt"), "w") as f:
            f.write(f"{loss.item():.6f}\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]), float(sys.argv[2]))
