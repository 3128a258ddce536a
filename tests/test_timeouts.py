"""Timeouts sized for where a job runs: the CPU values the local backend keeps, GPU-scale ones derived
from the state size and the storage throughput (never below AWS's NVRx-on-EKS figures), the user's
own values winning, and what an EKS job on 4 x p5.48xlarge is rendered with."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from jobs import cli

from eksft_nb.backends.eks import EksBackend
from eksft_nb.errors import SpecError
from eksft_nb.spec import JobSpec, fsx_specs
from eksft_nb.timeouts import GPU_FLOORS, derive, fsx_table, resolved, state_bytes
from test_eks_render import IMAGE, eks_spec, pod_template

P5 = {"eks.instance_type": "p5.48xlarge", "eks.efa_per_node": 32, "model.preset": "gpt-8b"}


def test_the_cpu_backend_keeps_its_values() -> None:
    t = resolved(JobSpec(), gpu=False).ft
    assert (t.initial_heartbeat_timeout, t.heartbeat_timeout, t.soft_timeout, t.hard_timeout,
            t.collective_timeout) == (120, 15, 4, 8, 3)


def test_a_small_model_on_gpus_gets_the_aws_floors() -> None:
    t = derive(JobSpec(), gpu=True)
    got = {name: getattr(t, name).seconds for name in GPU_FLOORS}
    assert got == GPU_FLOORS
    assert "floor 900 s (AWS)" in t.heartbeat.reason


def test_the_8b_preset_at_300_mbps_is_sized_from_its_state() -> None:
    spec = JobSpec().replace(**{"model.preset": "gpt-8b"})
    assert 89e9 < state_bytes(spec) < 91e9        # 7.5B parameters x 12 bytes (fp32 weights, AdamW moments)
    t = derive(spec, gpu=True)
    assert t.save_s == pytest.approx(300, rel=0.01) and t.restore_s == pytest.approx(600, rel=0.01)
    assert (t.soft.seconds, t.hard.seconds, t.heartbeat.seconds, t.initial.seconds) == (600, 1200, 1500, 1800)
    assert (t.collective.seconds, t.checkpoint_group.seconds, t.grace.seconds) == (60, 1200, 660)
    assert "89.9 GB at 300 MB/s" in t.soft.reason and "89.9 GB at 300 MB/s" in t.initial.reason
    # faster storage, shorter timeouts; slower, longer
    assert derive(spec.replace(**{"checkpoint.storage_mbps": 1000.0}), gpu=True).initial.seconds == 1200
    assert derive(spec.replace(**{"checkpoint.storage_mbps": 125.0}), gpu=True).grace.seconds == 1500


def test_the_users_values_win_and_the_derived_ones_fit_around_them() -> None:
    spec = JobSpec().replace(**{"model.preset": "gpt-8b", "ft.heartbeat_timeout": 7200.0,
                                "ft.soft_timeout": 900.0})
    t = derive(spec, gpu=True)
    assert (t.heartbeat.seconds, t.heartbeat.reason) == (7200, "set by the user")
    assert (t.soft.seconds, t.soft.reason) == (900, "set by the user")
    assert t.hard.seconds == 1800 and "set by the user" in t.hard.reason   # still above the soft one
    assert t.initial.seconds == 7200                                        # never below the heartbeat
    small = derive(JobSpec().replace(**{"ft.soft_timeout": 4.0, "ft.hard_timeout": 9.0}), gpu=True)
    assert small.collective.seconds == 4.5 < small.hard.seconds           # a peer's wait ends before the kill
    # a pair the user set that cannot work is refused in one line
    with pytest.raises(SpecError, match=r"must be shorter than the heartbeat timeout \(900"):
        JobSpec(backend="eks").replace(**{"ft.hard_timeout": 950.0, "ft.heartbeat_timeout": 900.0}).validate()
    with pytest.raises(SpecError, match="storage_mbps must be a positive number"):
        JobSpec().replace(**{"checkpoint.storage_mbps": 0.0}).validate()


def test_4_x_p5_renders_the_derived_launcher_args_and_grace_period() -> None:
    spec = eks_spec("llm", nnodes=4, gpus=8, **P5)
    manifests = EksBackend().manifests(spec)
    workload = manifests.job[-1]
    pod = pod_template(workload)["spec"]
    args = pod["containers"][0]["args"]
    assert "--ft-initial-rank-heartbeat-timeout=1800" in args and "--ft-rank-heartbeat-timeout=1500" in args
    assert "--term-timeout=660" in args   # SIGTERM reaches the ranks, which save before the SIGKILL
    assert pod["terminationGracePeriodSeconds"] == 660 + 30
    config = next(m for m in manifests.job if m["kind"] == "ConfigMap")
    ft = json.loads(config["data"]["spec.json"])["ft"]          # what the ranks read
    assert (ft["soft_timeout"], ft["hard_timeout"], ft["collective_timeout"]) == (600, 1200, 60)
    # the user's value wins over the derived one
    mine = pod_template(EksBackend().manifests(eks_spec("llm", nnodes=4, gpus=8, **P5, **{
        "ft.heartbeat_timeout": 3600.0})).job[-1])["spec"]["containers"][0]["args"]
    assert "--ft-rank-heartbeat-timeout=3600" in mine


def test_dry_run_prints_each_timeout_with_its_reason() -> None:
    done = cli("run", "--backend", "eks", "--dry-run", "--name", "llm", "--image", IMAGE, "--nnodes", "4",
               "--nproc-per-node", "8", "--gpus-per-node", "8", "--efa-per-node", "32", "--instance-type",
               "p5.48xlarge", "--model", "gpt-8b", "--storage-mbps", "300", timeout=120)
    assert done.returncode == 0, done.stderr
    head = [line for line in done.stdout.splitlines() if line.startswith("#")]
    assert head[0].startswith("# timeouts (GPU; state 89.9 GB")
    assert any(line.startswith("#   heartbeat 1500 s: the hard timeout + 300 s") for line in head)
    assert any(line.startswith("#   grace 660 s: ") for line in head)
    assert [d for d in yaml.safe_load_all(done.stdout) if d]   # still valid YAML
    local = cli("run", "--dry-run", "--name", "cpu", "--device", "cpu", timeout=120)
    assert local.returncode == 0, local.stderr
    assert "#   heartbeat 15 s: CPU default (no GPU)" in local.stdout
    assert "--ft-rank-heartbeat-timeout=15" in local.stdout


def test_the_fsx_table_is_computed() -> None:
    table = fsx_table(fsx_specs()).splitlines()
    assert table[0].startswith("| model | state |") and len(table) == 5
    assert "| gpt-8b | 89.9 GB | 720 s / 1439 s | 300 s / 600 s | 90 s / 180 s |" in table
    eks = (Path(__file__).resolve().parents[1] / "docs" / "eks.md").read_text()
    assert "<!-- eksft:generate fsx-table -->" in eks   # the docs' table is this one, built from it


@pytest.mark.slow
def test_a_save_longer_than_the_checkpoint_interval_is_warned_about_in_one_line() -> None:
    # rank 1's writes start 2 s late for steps 5-14: the async save of step 6 is still being written
    # when step 8's is due, so that one is deferred
    from jobs import events, run_job

    name = "slow-saves"
    summary = run_job(name, "--steps", "30", "--ckpt-every", "2", "--fault", "slow-storage:1@5")
    assert summary["state"] == "succeeded", summary
    [warning] = events(name, "warning")
    assert warning.rank == 0 and warning["what"] == "slow-save"
    assert "saves take longer than the checkpoint interval" in warning["message"]
    assert "\n" not in warning["message"]
    assert summary["warnings"] == [warning["message"]]
    assert f"warning: {warning['message']}" in cli("summary", name).stdout
