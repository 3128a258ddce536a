"""A user script using eksft-nb's runtime helpers (steps are slowed so checkpoints land between faults)."""

import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from eksft_nb.runtime import ModelState, session


def main() -> None:
    s = session()
    dist.init_process_group("gloo")
    torch.manual_seed(s.spec.seed)
    model = torch.nn.Linear(16, 1)
    optim = torch.optim.SGD(model.parameters(), lr=0.05)
    ckpt = s.checkpoints()
    state = {"train": ModelState(model, optim)}
    start = ckpt.restore(state, s.spec.resume, s.restarting)
    s.rank_start(start)
    w = torch.arange(16.0).unsqueeze(1) / 16
    for step in range(start + 1, s.spec.steps + 1):
        s.step_begin(step)
        t0 = time.perf_counter()
        x = torch.randn(32, 16, generator=torch.Generator().manual_seed(step * 7 + dist.get_rank()))
        loss = F.mse_loss(model(x), x @ w)
        optim.zero_grad()
        loss.backward()
        for p in model.parameters():  # plain data parallel: average the gradients
            dist.all_reduce(p.grad)
            p.grad /= dist.get_world_size()
        optim.step()
        time.sleep(0.05)
        s.step_end(step, loss=loss.item(), tokens=32, step_time=time.perf_counter() - t0)
        ckpt.maybe_save(step, state, last=step == s.spec.steps)
    ckpt.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
