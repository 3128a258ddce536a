"""A script that knows nothing of eksft-nb and takes a second a step, training one weight: a running job
that costs the machine almost nothing once started (the lab panel's test keeps one beside its real job)."""

import time

import torch

weight = torch.nn.Parameter(torch.zeros(1))
optimizer = torch.optim.SGD([weight], lr=0.1)
while True:
    optimizer.zero_grad()
    (weight - 1.0).pow(2).sum().backward()
    optimizer.step()   # eksft's hook counts it and sends the launcher's heartbeat
    time.sleep(1.0)
