"""--backend slurm without a cluster: what the sbatch script says (GPUs, EFA, resources, signals, containers),
what the command layer refuses of a Slurm spec, the one quoting helper every script value goes through,
and the watcher's word on the network NCCL took (a real process, a stand-in for the srun step)."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from eksft_nb import commands, shellquote
from eksft_nb.backends.eks.render import nccl_env as eks_nccl_env
from eksft_nb.backends.slurm.carried import take_carried
from eksft_nb.backends.slurm.checks import time_limit_s
from eksft_nb.backends.slurm.render import grace_s
from eksft_nb.errors import SpecError
from eksft_nb.events import read_all
from eksft_nb.jobdir import JobDir
from eksft_nb.nccl import network_of
from eksft_nb.spec import MAX_SPEC_BYTES, JobSpec, spec_options
from eksft_nb.timeouts import NODE_GPUS_ENV


def slurm_spec(**changes: object) -> JobSpec:
    return JobSpec().replace(backend="slurm", nnodes=2, **{"slurm.shared_dir": "/fsx/eksft", **changes})


def exports(script: str) -> dict[str, str]:
    """The variables the script exports before it picks a launch line (outside the GPU branch)."""
    head = script[:script.index("if [ \"$EKSFT_NODE_GPUS\"")] if "EKSFT_NODE_GPUS\" !=" in script else script
    return dict(line.removeprefix("export ").split("=", 1) for line in head.splitlines()
                if line.startswith("export ") and "$(" not in line)


def branches(script: str) -> tuple[str, str]:
    """The GPU nodes' lines and the CPU nodes' lines of a script without --gres."""
    choice = script[script.index('if [ "$EKSFT_NODE_GPUS" != 0 ]'):]
    gpu, _, rest = choice.partition("\nelse\n")
    return gpu, rest[:rest.index("\nfi\n")]


# ---- GPUs ---------------------------------------------------------------------------------------------

def test_without_gres_the_script_counts_the_gpus_on_the_node_and_picks_the_gpu_or_cpu_values() -> None:
    script = commands.dry_run(slurm_spec(nproc_per_node=8, **{"model.preset": "gpt-8b"}))
    assert f"export {NODE_GPUS_ENV}=$(python -m eksft_nb.backends.slurm.gpus)" in script
    gpu, cpu = branches(script)
    # GPU nodes: GPU-scale timeouts (a gpt-8b restore is minutes) and NCCL's environment; CPU nodes: neither
    assert "--ft-rank-heartbeat-timeout=900" not in cpu and "--term-timeout=5 " in cpu
    heartbeat = int(gpu.split("--ft-rank-heartbeat-timeout=")[1].split()[0])
    initial = int(gpu.split("--ft-initial-rank-heartbeat-timeout=")[1].split()[0])
    assert heartbeat >= 900 and initial >= 1200, gpu
    assert "export NCCL_DEBUG=INFO" in gpu and "NCCL_DEBUG" not in exports(script)
    # the drain before the time limit starts the grace of the GPU values ahead (the larger)
    assert f"#SBATCH --signal=B:USR1@{grace_s(slurm_spec(nproc_per_node=8, **{'model.preset': 'gpt-8b'}))}" \
        in script.splitlines()
    assert subprocess.run(["bash", "-n"], input=script, text=True).returncode == 0


def test_check_reads_the_signal_lead_and_the_gpu_values_a_node_without_gres_takes() -> None:
    """check's table is the script's: its --signal (the drain before the time limit); a gpt-8b without
    --gres is checked at the GPU values its GPU nodes take (at the CPU ones its restore is refused)."""
    spec = slurm_spec(nproc_per_node=8, **{"model.preset": "gpt-8b"})
    report = commands.check(spec)
    [lead] = [r for r in report["rows"] if r["name"] == "Slurm --signal lead"]
    assert report["gpu"] and lead["seconds"] == grace_s(spec), report
    assert not any(f["refuse"] for f in report["findings"]), report["findings"]


@pytest.mark.parametrize("changes, refused", [
    ({"slurm.gres": "gpu:4", "nproc_per_node": 8}, "8 ranks per node but --gres gpu:4 gives 4 GPUs per node"),
    ({"slurm.instance_type": "p5.48xlarge", "nproc_per_node": 16}, "a p5.48xlarge gives 8 GPUs per node"),
    ({"slurm.instance_type": "p5.48xlarge", "slurm.gres": "gpu:16", "nproc_per_node": 8},
     "--gres gpu:16 but a p5.48xlarge has 8 GPUs"),
    ({"slurm.gres": "gpu:8", "device": "cpu"}, "--device cpu with --gres gpu wastes the GPUs"),
    ({"slurm.time": "4"}, "--time 4 leaves no room to train"),
    ({"slurm.mem": "lots"}, "slurm.mem 'lots' holds characters sbatch does not take"),
    ({"slurm.cpus_per_task": 0}, "slurm.cpus_per_task must be an integer >= 1"),
    ({"slurm.container_env": "A B"}, "slurm.container_env 'A B'"),
    ({"slurm.container_mounts": "/a:/a"}, "--container-mounts and --container-env need --container-image"),
    ({"slurm.shared_dir": "/fsx/a\\b"}, "holds a backslash"),
])
def test_a_slurm_spec_that_cannot_run_as_asked_is_refused_in_one_line(changes: dict, refused: str) -> None:
    with pytest.raises(SpecError) as e:
        commands.dry_run(slurm_spec(**changes))
    assert refused in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_ranks_that_fit_their_gpus_are_taken() -> None:
    for changes in ({"slurm.gres": "gpu:8", "nproc_per_node": 8},
                    {"slurm.gres": "gpu:h100:8", "nproc_per_node": 4}, {"slurm.time": "1-00:00:00"}):
        assert commands.dry_run(slurm_spec(**changes)).startswith("#!/bin/bash")


def test_sbatch_time_formats() -> None:
    texts = ("30", "30:15", "4:00:00", "2-3", "2-3:04", "2-3:04:05", "UNLIMITED")
    assert [time_limit_s(t) for t in texts] == [1800, 1815, 14400, 183600, 183840, 183845, None]


# ---- EFA ----------------------------------------------------------------------------------------------

def test_efa_follows_the_instance_type_and_device_rdma_only_where_its_efa_reads_rdma() -> None:
    def env(**changes: object) -> dict[str, str]:
        return exports(commands.dry_run(slurm_spec(nproc_per_node=8, **{"slurm.gres": "gpu:8", **changes})))

    p5 = env(**{"slurm.instance_type": "p5.48xlarge"})   # EFA by default where the instance type has it
    assert (p5["FI_PROVIDER"], p5["FI_EFA_USE_DEVICE_RDMA"], p5["FI_EFA_USE_HUGE_PAGE"]) == ("efa", "1", "0")
    # AWS's EFA cheatsheet: never rdma-core's fork-safety (it breaks newer kernels), libfabric's own
    assert "RDMAV_FORK_SAFE" not in p5 and p5["FI_EFA_FORK_SAFE"] == "1"
    for g in ("g5.48xlarge", "g6.48xlarge"):   # one EFA without RDMA read: libfabric aborts on device RDMA
        e = env(**{"slurm.instance_type": g, "slurm.efa": True})
        assert e["FI_PROVIDER"] == "efa" and "FI_EFA_USE_DEVICE_RDMA" not in e, g
    assert "FI_PROVIDER" not in env(**{"slurm.instance_type": "p5.48xlarge", "slurm.efa": False})
    unknown = env(**{"slurm.efa": True})   # an instance type not named: EFA, device RDMA left to libfabric
    assert unknown["FI_PROVIDER"] == "efa" and "FI_EFA_USE_DEVICE_RDMA" not in unknown
    assert "FI_PROVIDER" not in env()


def test_nccl_log_lines_name_the_network() -> None:
    lines = {"ip-10-0-0-1:1234:1234 [0] NCCL INFO Using network AWS Libfabric": "efa",
             "node1:77:77 [3] NCCL INFO Using network Libfabric": "efa",
             "node1:77:77 [3] NCCL INFO NET/OFI Selected Provider is efa (found 4 nics)": "efa",
             "node1:77:77 [3] NCCL INFO NET/OFI Selected provider is tcp": "socket",
             "node1:77:77 [0] NCCL INFO Using network Socket": "socket",
             "node1:77:77 [0] NCCL INFO Using network IB": "ib",
             "node1:77:77 [0] NCCL INFO NET/Socket : Using [0]eth0:10.0.0.1<0>": None,
             "[2026-01-01 00:00:00,000] [INFO] step 3": None}
    assert {line: network_of(line) for line in lines} == lines


# ---- resources, containers ----------------------------------------------------------------------------

def test_whole_nodes_by_default_and_every_rank_gets_the_nodes_cpus() -> None:
    lines = commands.dry_run(slurm_spec()).splitlines()
    assert {"#SBATCH --exclusive", "#SBATCH --mem=0", "#SBATCH --requeue"} <= set(lines)
    srun = next(line for line in lines if " srun " in line)
    # Slurm 22.05's srun does not inherit --cpus-per-task: without it the launcher and its ranks share one CPU
    assert '--cpus-per-task="$SLURM_CPUS_ON_NODE"' in srun and "--mem=0" in srun
    shared = commands.dry_run(slurm_spec(nproc_per_node=4, threads_per_rank=2, **{"slurm.exclusive": False}))
    assert "#SBATCH --exclusive" not in shared and "#SBATCH --cpus-per-task=9" in shared.splitlines()
    assert "#SBATCH --mem" not in shared
    mine = commands.dry_run(slurm_spec(**{"slurm.cpus_per_task": 96, "slurm.mem": "1800G"})).splitlines()
    assert {"#SBATCH --cpus-per-task=96", "#SBATCH --mem=1800G"} <= set(mine)
    assert "--cpus-per-task=96" in next(line for line in mine if " srun " in line)


def test_container_options_go_to_srun_with_the_shared_folder_and_the_jobs_environment() -> None:
    script = commands.dry_run(slurm_spec(**{"slurm.container_image": "nvcr.io#nvidia/pytorch:25.01-py3",
                                            "slurm.container_mounts": "/data:/data",
                                            "slurm.container_env": "HF_HOME"}))
    srun = next(line for line in script.splitlines() if " srun " in line)
    assert "--container-image=nvcr.io#nvidia/pytorch:25.01-py3" in srun
    assert "--container-mounts=/fsx/eksft:/fsx/eksft,/data:/data" in srun
    names = srun.split("--container-env=")[1].split()[0].split(",")
    assert {"EKSFT_JOB_DIR", "EKSFT_JOB_UID", "EKSFT_NODE_GPUS", "NCCL_DEBUG", "HF_HOME"} <= set(names)


# ---- one quoting helper: every path and text -----------------------------------------------------------

def test_a_control_character_in_any_path_or_text_field_is_refused_in_one_line() -> None:
    fields = [o for o in spec_options() if o.type in (str, list)]
    assert {"slurm.shared_dir", "checkpoint.dir", "script_args", "eks.image", "slurm.container_image"} <= {
        o.path for o in fields}
    for option in fields:
        for bad in ("/fsx/a\nrm -rf ~", "x\r", "a\x1bb", "a\u2028b", "a\x00b"):
            value = [bad] if option.type is list else bad
            with pytest.raises(SpecError) as e:
                slurm_spec().replace(**{option.path: value}).validate()
            text = str(e.value)
            assert option.path in text and "\n" not in text and "control character" in text, text
    proc = subprocess.run([sys.executable, "-m", "eksft_nb", "run", "--dry-run", "--backend", "slurm",
                           "--shared-dir", "/fsx/x\necho owned"], capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0 and "owned" not in proc.stdout and "Traceback" not in proc.stderr
    assert "slurm.shared_dir holds a control character (\\n)" in proc.stderr, proc.stderr


def test_a_path_with_spaces_quotes_and_dollars_reaches_bash_and_sbatch_as_it_is(tmp_path: Path) -> None:
    odd = "/fsx/it's a \"dir\" $HOME `id` %j;&|"
    script = commands.dry_run(slurm_spec(**{"slurm.shared_dir": odd}))
    lines = script.splitlines()
    # sbatch's own reading of an #SBATCH line: quotes group, a backslash escapes, % starts a file name's field
    assert '#SBATCH --output="/fsx/it\'s a \\"dir\\" $HOME `id` %%j;&|/ftrain/logs/slurm-%j.out"' in lines
    # bash: the exports and the watcher's argument are the path itself
    export = next(line for line in lines if line.startswith("export EKSFT_JOB_DIR="))
    shown = subprocess.run(["bash", "-c", f'{export}\nprintf %s "$EKSFT_JOB_DIR"'], capture_output=True,
                           text=True)
    assert shown.stdout == f"{odd}/ftrain"


@given(st.text(st.characters(blacklist_categories=("Cc", "Cs", "Zl", "Zp")), max_size=40))
def test_every_word_is_read_back_by_bash_as_written(text: str) -> None:
    expanding = shellquote.expanding(f"$SLURM_JOB_ID-{text}-${{RDZV_HOST}}", ["SLURM_JOB_ID", "RDZV_HOST"])
    line = f"printf '%s\\0' {shellquote.word(text)} {expanding}"
    out = subprocess.run(["bash", "-c", line], capture_output=True, text=True,
                         env={"SLURM_JOB_ID": "7", "RDZV_HOST": "n1", "PATH": os.environ["PATH"]})
    assert out.stdout.split("\0")[:2] == [text, f"7-{text}-n1"]


def test_the_quoting_helper_refuses_what_no_quoting_makes_safe() -> None:
    for write in (shellquote.word, lambda t: shellquote.directive("--output", t)):
        with pytest.raises(ValueError):
            write("/fsx\nid")


# ---- a script submitted by hand ----------------------------------------------------------------------

def test_a_script_carries_its_spec_and_makes_its_job_folder_where_run_did_not(tmp_path: Path) -> None:
    spec = slurm_spec(**{"slurm.shared_dir": str(tmp_path)}).validate()
    script = commands.dry_run(spec)
    assert f"mkdir -p {tmp_path}/ftrain/logs && sbatch THIS_FILE" in script   # the one thing to prepare
    carried = script.split("<<'EKSFT_SPEC'\n")[1].split("\nEKSFT_SPEC\n")[0]
    jd = JobDir(tmp_path / "ftrain")
    assert take_carried(jd, io.StringIO(carried), MAX_SPEC_BYTES, JobSpec) is None
    assert jd.spec().digest() == spec.digest() and jd.logs.is_dir() and jd.pending.is_dir()
    assert take_carried(jd, io.StringIO(carried), MAX_SPEC_BYTES, JobSpec) is None   # a requeue: the same
    other = spec.replace(steps=7).to_json()
    refused = take_carried(jd, io.StringIO(other), MAX_SPEC_BYTES, JobSpec)
    assert refused and "is another job's" in refused and jd.spec().digest() == spec.digest()
    assert "is refused" in take_carried(jd, io.StringIO('{"steps": -1}'), MAX_SPEC_BYTES, JobSpec)


# ---- the watcher's word on the network NCCL took ----------------------------------------------------

@pytest.mark.parametrize("efa", [True, False], ids=["efa-asked", "no-efa"])
def test_nccl_on_sockets_fails_a_job_that_asked_for_efa_and_warns_one_that_did_not(tmp_path: Path,
                                                                                    efa: bool) -> None:
    """The watcher (a real process) with a stand-in for its srun step that writes what NCCL logs on a node
    where aws-ofi-nccl did not load, then would run on."""
    # --device cpu: the GPUs are said (EKSFT_NODE_GPUS below), not there: doctor's gate lets it through
    spec = slurm_spec(**{"slurm.shared_dir": str(tmp_path), "slurm.efa": efa, "device": "cpu"}).validate()
    jd = JobDir(tmp_path / spec.name)
    jd.create(spec)
    log = jd.logs / "launcher-0-0.log"
    nccl = "n1:5:5 [0] NCCL INFO Using network Socket"
    step = ["bash", "-c", f"printf '%s\\n' '{nccl}' >> {shellquote.word(str(log))}; sleep 2; exit 0"]
    (tmp_path / "slurm.conf").write_text("")   # no cluster: Slurm's commands fail at once
    env = {**os.environ, NODE_GPUS_ENV: "8", "SLURM_CONF": str(tmp_path / "slurm.conf")}   # GPU nodes
    t0 = time.time()
    watcher = [sys.executable, "-m", "eksft_nb.backends.slurm.allocation", str(jd.path), "--", *step]
    done = subprocess.run(watcher, capture_output=True, text=True, timeout=120, env=env,
                          stdin=subprocess.DEVNULL)
    events = read_all(jd.events_path)
    ends = [e for e in events if e.kind == "job_end"]
    assert len(ends) == 1, done.stderr
    [end] = ends
    assert done.returncode == 1 and end["state"] == "failed", done.stderr
    if efa:
        assert "fell back to sockets (TCP) although EFA was asked for" in end["reason"], end.data
        assert time.time() - t0 < 60
    else:
        [warning] = [e for e in events if e.kind == "warning" and e["what"] == "nccl-socket"]
        assert "uses sockets (TCP), not EFA" in warning["message"]
        assert "before training finished" in end["reason"]   # exit 0 short of the last step: never succeeded
    assert json.loads(json.dumps(end.data))["final_step"] == 0


# ---- the sbatch script (no cluster needed) ---------------------------------------------------------

def test_the_dry_run_is_an_sbatch_script_with_one_ft_launcher_per_node() -> None:
    spec = slurm_spec(**{"slurm.partition": "gpu", "slurm.account": "ml", "slurm.qos": "high",
                         "slurm.time": "4:00:00",
                         "slurm.gres": "gpu:8", "slurm.exclusive": True, "slurm.constraint": "p5",
                         "slurm.efa": True, "slurm.instance_type": "p5.48xlarge",
                         "slurm.port": 31000})
    script = commands.dry_run(spec)
    lines = script.splitlines()
    assert lines[0] == "#!/bin/bash"
    for directive in ("--nodes=2", "--ntasks-per-node=1", "--partition=gpu", "--account=ml", "--qos=high",
                      "--time=4:00:00", "--gres=gpu:8", "--exclusive", "--constraint=p5", "--requeue",
                      "--output=/fsx/eksft/ftrain/logs/slurm-%j.out"):
        assert f"#SBATCH {directive}" in lines, directive
    # the rendezvous at the allocation's first node, found the cluster way, with no sleep or poll
    assert 'export RDZV_HOST=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1)' in lines
    assert '"--rdzv-endpoint=${RDZV_HOST}:31000"' in script and "sleep" not in script
    # --gres gpu:8: one launch line, with the GPU values; srun runs it on every node with its node rank
    [launch] = [line for line in lines if line.startswith("LAUNCH=(")]
    assert launch.startswith("LAUNCH=(ft_launcher ") and "--ft-rank-heartbeat-timeout=900" in launch
    srun = script[script.index("srun"):script.index("<<'EKSFT_SPEC'")]
    assert srun.split()[1] == "--ntasks-per-node=1" and '--node-rank="$SLURM_NODEID"' in srun
    assert srun.rstrip().endswith('"${LAUNCH[@]}"')
    assert "export EKSFT_JOB_DIR=/fsx/eksft/ftrain" in lines and "export EKSFT_STORE_PORT=31001" in lines
    # the NCCL/EFA environment of a p5 node, as an EKS pod with the same GPUs and EFA gets it
    eks = eks_nccl_env(JobSpec().replace(**{"eks.gpus_per_node": 8, "eks.efa_per_node": 32,
                                            "eks.instance_type": "p5.48xlarge"}))
    assert eks["FI_PROVIDER"] == "efa"
    for k, v in eks.items():
        assert any(line in (f"export {k}={v}", f"export {k}='{v}'") for line in lines), k
    # bash parses it
    assert subprocess.run(["bash", "-n"], input=script, text=True).returncode == 0


def test_every_launch_of_a_slurm_job_has_its_own_id() -> None:
    """A relaunch under the same name and spec (or a second sbatch of a printed script) commits under
    another id, so it never takes an earlier launch's checkpoints for its own; a requeue keeps the id
    (the Slurm job id is part of it)."""
    marks = [[line for line in commands.dry_run(slurm_spec()).splitlines() if "EKSFT_JOB_UID" in line]
             for _ in range(2)]
    assert all(len(m) == 1 and m[0].endswith('-$SLURM_JOB_ID"') for m in marks), marks
    assert marks[0] != marks[1]


def test_a_slurm_spec_needs_a_shared_folder_and_plain_sbatch_values() -> None:
    with pytest.raises(SpecError, match="--shared-dir"):
        JobSpec().replace(backend="slurm").validate()
    with pytest.raises(SpecError, match="absolute"):
        slurm_spec(**{"slurm.shared_dir": "fsx"}).validate()
    with pytest.raises(SpecError, match="slurm.partition"):
        slurm_spec(**{"slurm.partition": "gpu; rm -rf /"}).validate()


def test_a_slurm_jobs_huge_log_line_is_answered_bounded(tmp_path: Path) -> None:
    """The job folder on the shared disk is anyone-in-the-job's to grow: logs read only the end of each
    file."""
    from eksft_nb.backends.slurm.backend import SlurmBackend
    from eksft_nb.tails import MAX_LOG_BYTES

    job = tmp_path / "big"
    (job / "logs").mkdir(parents=True)
    (job / "spec.json").write_text(JobSpec(name="big").to_json())
    (job / "logs" / "launcher-0.log").write_text("x" * (20 << 20) + "\nthe last line\n")
    answer = SlurmBackend(shared_dir=tmp_path).logs("big", debug=True)
    assert len(answer) < 2 * MAX_LOG_BYTES and answer.endswith("the last line")
    assert f"only its last {MAX_LOG_BYTES} of" in answer.splitlines()[0]
