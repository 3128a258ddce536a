"""Says how it was run (argv, __file__, __name__, sys.path[0], working directory), imports a module
beside it, takes STEPS optimizer steps, then waits WAIT seconds (where a fault "now" lands)."""

import json
import os
import sys
import time

import toyjob  # noqa: F401  (beside this script)
import torch

model = torch.nn.Linear(2, 1)
second = torch.nn.Linear(2, 1)
optim, other = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(second.parameters(), lr=0.1)
for _ in range(int(sys.argv[1])):
    (model(torch.ones(1, 2)) + second(torch.ones(1, 2))).sum().backward()
    optim.step()
    other.step()  # a second optimizer: its steps are not counted again
    time.sleep(0.02)
print(json.dumps({"argv": sys.argv, "file": __file__, "name": __name__, "path0": sys.path[0],
                  "cwd": os.getcwd()}),
      flush=True)
try:
    time.sleep(float(sys.argv[2]))
except BaseException as e:
    print(f"main thread got {type(e).__name__}: {e}", flush=True)
    raise
