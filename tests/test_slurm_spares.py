"""Hot spares on a real Slurm (three node daemons on this machine, see slurm_cluster.py), on NVRx 0.7.0:
two nodes train, the third waits as NVRx's standby node; a lost node's launcher is an in-job restart
with the spare in its place, not a requeue, and the job ends bit-identical to the fault-free run."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator

import pytest
from slurm_cluster import SlurmCluster, free_base, slurm_cluster

import nvrx_releases as releases
from eksft_nb.events import read_all
from jobs import BASE

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmCluster]:
    with slurm_cluster(tmp_path_factory.mktemp("slurm-spares"), nodes=3) as c:
        # the jobs it runs (sbatch passes the submitter's environment on) import NVRx 0.7.0; three "nodes" on
        # one machine share an address, which NVRx 0.7 allows only when told it is a simulation
        c.env.update(releases.env(releases.NEWEST, {"PYTHONPATH": c.env.get("PYTHONPATH", "")}))
        c.env["NVRX_ENABLE_MULTI_LAUNCHERS_PER_NODE"] = "1"
        yield c


def run(c: SlurmCluster, name: str, *args: str) -> dict:
    env = {k: v for k, v in c.env.items() if k != "EKSFT_SHARED_DIR"}
    argv = ["run", "--backend", "slurm", "--shared-dir", str(c.shared), "--name", name, *BASE, *args,
            "--slurm-port", str(free_base()), "--json"]
    proc = subprocess.run([sys.executable, "-m", "eksft_nb", *argv], capture_output=True, text=True,
                          timeout=900, env=env)
    assert "{" in proc.stdout, proc.stderr[-3000:]
    return json.loads(proc.stdout[proc.stdout.index("{"):])


def test_a_hot_spare_takes_a_lost_nodes_place_on_slurm(cluster: SlurmCluster, reference_digest: str) -> None:
    # in-job restart without in-process: a lost peer fails the survivors' collectives at once (with the
    # Wrapper they would wait for their heartbeat timeout: nothing on the other nodes sees a launcher go)
    summary = run(cluster, "spare", "--nnodes", "2", "--nproc-per-node", "1", "--spare-nodes", "1",
                  "--no-inprocess", "--fault", "kill-launcher:1@40")
    folder = cluster.shared / "spare"
    logs = folder / "logs"
    story = "\n".join(p.read_text(errors="replace")[-3000:] for p in sorted(logs.glob("*.log")))
    assert summary["state"] == "succeeded", story
    [restart] = summary["restart_events"]
    assert restart["level"] == "injob", (restart, story)
    assert restart["cause"] == ("injected kill-launcher on node 1: its ft_launcher was lost; a hot spare "
                                "took its place"), restart
    assert summary["digest"] == reference_digest   # as the fault-free 2-rank run
    assert not list(logs.glob("launcher-1-*.log")), "no requeue: the spare took the node's place"
    assert len(list(logs.glob("launcher-0-*.log"))) == 3   # srun ran a launcher on each of the three nodes
    control = (logs / "nvrx-control-0.log").read_text(errors="replace")
    assert "nnodes=2:3" in control, control[-2000:]
    events = read_all(folder / "events.jsonl")
    cycles = {e["cycle"]: e for e in events if e.kind == "nvrx_cycle"}   # NVRx's records, the last word
    assert sorted(cycles) == [0, 1] and cycles[0]["end"] is not None, cycles
    [recovered] = [e for e in events if e.kind == "restart"]
    assert recovered["fault_time"] <= cycles[1]["start"] <= recovered.t
