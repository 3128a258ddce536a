"""Part 8, engines side by side: one seeded fault plan run at once on NVRx, on torchft and on plain
``torchrun`` resubmitted from its last checkpoint (:func:`eksft_nb.resilience.compare.compare`), so every
engine meets the same faults at the same steps under the same load. Per engine: ETTR (productive / wall,
the samples torchft's rejoining groups skipped counted as lost) and its breakdown, each fault's recovery
and its phases, steps lost, samples skipped, final loss.

Run at once on two cores, the engines share the machine: one job's downtime gives the others CPU, so a
step time is each one's under that load, not alone.
"""

from __future__ import annotations

from typing import Any

from eksft_nb.errors import EksftError
from eksft_nb.resilience.compare import FaultPlan, compare, plan, text
from eksft_nb.spec import JobSpec

from .common import FULL, QUICK, SMOKE

SEED = 7
EVERY = 20
# size -> (model, steps, faults). Two faults: a second sigkill while torchft's first killed group still
# restarts (27 s under load) could take the other group too, and every group lost is a failed job until the
# torchft engine checkpoints. --quick and --smoke run notebooks/07_engines.ipynb's plan (the sigkill at 64,
# the exception at 124, on 300 steps: the rest is room for the killed torchft group to come back however fast
# the steps): the tests run it once, in the notebook, and check both the notebook's and this part's figures
# on that one run
RUNS = {FULL: ("tiny", 600, 2), QUICK: ("tiny", 300, 2), SMOKE: ("tiny", 300, 2)}


def fault_plan(size: str) -> FaultPlan:
    _, steps, n = RUNS[size]
    return plan(SEED, steps, n, EVERY)


def run(size: str) -> dict[str, Any]:
    result = compare(fault_plan(size), JobSpec().replace(**{"model.preset": RUNS[size][0], "seed": 0}),
                     name="cmp", say=lambda line: print(f"   {line}", flush=True))
    ended = [f"{e['label']} {e['state']} ({e['reason']})" for e in result["engines"].values()
             if e["state"] != "succeeded"]
    if ended:
        raise EksftError(f"bench jobs did not succeed: {'; '.join(ended)}", "run the part again alone")
    return result


def report(result: dict[str, Any]) -> str:
    return (f"8. engines side by side: {result['model']} model, {result['world_size']} ranks, run at once "
            f"(load {result['load_avg_before'][0]}->{result['load_avg_after'][0]}); seconds per term\n"
            + text(result) + "\n")
