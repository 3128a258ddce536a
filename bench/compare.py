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
from eksft_nb.resilience.compare import compare, plan, text
from eksft_nb.spec import JobSpec

SEED = 7
EVERY = 20
# (model, steps, faults). Two faults: a second sigkill while torchft's first killed group still restarts (27 s
# under load) could take the other group too, and every group lost is a failed job until the torchft engine
# checkpoints. --quick is the tests' (CI time): it proves the part runs, one fault (the sigkill, at step 87)
# on 300 steps, the 213 after it room for the killed torchft group to come back (the test requires it)
# however fast the steps; notebooks/07_engines.ipynb (its test checks every fault's level) runs both kinds
FULL, QUICK = ("tiny", 600, 2), ("tiny", 300, 1)


def run(quick: bool) -> dict[str, Any]:
    model, steps, n = QUICK if quick else FULL
    fault_plan = plan(SEED, steps, n, EVERY)
    result = compare(fault_plan, JobSpec().replace(**{"model.preset": model, "seed": 0}), name="cmp",
                     say=lambda line: print(f"   {line}", flush=True))
    ended = [f"{e['label']} {e['state']} ({e['reason']})" for e in result["engines"].values()
             if e["state"] != "succeeded"]
    if ended:
        raise EksftError(f"bench jobs did not succeed: {'; '.join(ended)}", "run the part again alone")
    return result


def report(result: dict[str, Any]) -> str:
    return (f"8. engines side by side: {result['model']} model, {result['world_size']} ranks, run at once "
            f"(load {result['load_avg_before'][0]}->{result['load_avg_after'][0]}); seconds per term\n"
            + text(result) + "\n")
