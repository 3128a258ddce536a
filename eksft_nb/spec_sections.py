"""The sections of a job spec (``model``, ``checkpoint``, ``ft``, ``eks``, ``slurm``): each a dataclass
whose fields carry their flags (:func:`~eksft_nb.spec_fields.opt`), nested in :class:`~eksft_nb.spec.JobSpec`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

from .errors import SpecError, shown
from .spec_fields import opt

# name -> (vocab, d_model, n_layers, n_heads)
MODEL_PRESETS: dict[str, tuple[int, int, int, int]] = {
    "tiny": (512, 64, 2, 4),          # ~0.1M params: tests, seconds per run
    "small": (2048, 128, 2, 4),       # ~0.9M params: the CPU demo
    "medium": (8192, 256, 4, 8),      # ~7M params
    "gpt2-125m": (50304, 768, 12, 12),
    "gpt-1b": (50304, 2048, 16, 16),
    "gpt-8b": (128256, 4096, 32, 32),
}


@dataclass
class ModelConfig:
    """A GPT-style decoder: a preset, optionally with explicit dimensions on top."""

    preset: str = opt("small", "--model", f"model preset: {', '.join(MODEL_PRESETS)}")
    vocab: int | None = opt(None, "--vocab", "vocabulary size (overrides the preset)")
    d_model: int | None = opt(None, "--d-model", "hidden size (overrides the preset)")
    n_layers: int | None = opt(None, "--n-layers", "number of decoder blocks (overrides the preset)")
    n_heads: int | None = opt(None, "--n-heads", "attention heads (overrides the preset)")

    def dims(self) -> tuple[int, int, int, int]:
        """(vocab, d_model, n_layers, n_heads) after applying the overrides to the preset."""
        v, d, n, h = MODEL_PRESETS[self.preset]
        return (self.vocab or v, self.d_model or d, self.n_layers or n, self.n_heads or h)

    def n_params(self) -> int:
        v, d, n, _ = self.dims()
        return v * d + n * (12 * d * d + 13 * d) + 2 * d + d * v


@dataclass
class CheckpointConfig:
    dir: str | None = opt(None, "--ckpt-dir",
                          "checkpoint folder (default: <job folder>/ckpt; /checkpoints/<name>/ckpt on EKS)")
    every: int = opt(10, "--ckpt-every", "save every N steps (0: never)")
    mode: Literal["async", "sync"] = opt("async", "--ckpt-mode",
                                         "async: overlap saving with training; sync: block")
    keep_last: int = opt(3, "--keep-last",
                         "committed checkpoints to keep (>= 2, so a bad save never leaves none)")
    storage_mbps: float = opt(300.0, "--storage-mbps",
                              "checkpoint storage throughput in MB/s (FSx for Lustre's "
                              "default ~300): GPU jobs size their timeouts and SIGTERM grace period from it")


@dataclass
class FaultToleranceConfig:
    inprocess: bool = opt(True, "--inprocess",
                          "in-process restart (inprocess.Wrapper) for exceptions and hangs; deprecated by "
                          "NVRx 0.6+, and in-job restart takes over where an NVRx has none")
    warm_ranks: bool = opt(True, "--warm-ranks",
                           "fork ranks from a per-node (per-pod on EKS) process that has already imported "
                           "torch and NVRx, so a restart skips seconds of start-up")
    max_injob_restarts: int = opt(3, "--max-injob-restarts", "ft_launcher worker-group restarts per launch")
    max_job_restarts: int = opt(2, "--max-job-restarts", "times the supervisor relaunches a dead launcher")
    heartbeat_timeout: float | None = opt(None, "--heartbeat-timeout",
                                          "seconds without a rank heartbeat before ft_launcher restarts the "
                                          "group (default: 15 on CPU; on GPUs derived from the state size "
                                          "and --storage-mbps, see --dry-run)")
    initial_heartbeat_timeout: float | None = opt(None, "--initial-heartbeat-timeout",
                                                  "seconds allowed for start-up before the first heartbeat "
                                                  "(default: 120 on CPU; derived on GPUs)")
    step_timeout: float | None = opt(None, "--step-timeout",
                                     "NVRx section timeout for one training step, seconds: a hang inside a "
                                     "step is found this fast (default: none on CPU; on GPUs 60, or 5 x "
                                     "--step-time)")
    checkpoint_timeout: float | None = opt(None, "--checkpoint-timeout",
                                           "NVRx section timeout for a checkpoint save ('checkpointing'), "
                                           "seconds (default on GPUs: 2 x a save at --storage-mbps + 60, "
                                           "at least 300)")
    setup_timeout: float | None = opt(None, "--setup-timeout",
                                      "NVRx section timeout for start-up, restore and the first step "
                                      "('setup'), seconds (default: the initial heartbeat timeout)")
    out_of_section_timeout: float | None = opt(None, "--out-of-section-timeout",
                                               "NVRx timeout for code outside any section, seconds "
                                               "(default: none on CPU; 90 on GPUs for the built-in trainer)")
    step_time: float | None = opt(None, "--step-time",
                                  "seconds one training step takes, as measured by an earlier run (`check "
                                  "--from JOB` prints it; a resume takes it from its job): sizes the step "
                                  "section's timeout")
    save_time: float | None = opt(None, "--save-time",
                                  "seconds one checkpoint save takes (blocking and background), as measured "
                                  "by an earlier run: the checkpointing section's timeout covers the slower "
                                  "of it and the state size at --storage-mbps")
    cfg_path: str | None = opt(None, "--ft-cfg-path",
                               "an NVRx fault-tolerance config (YAML with a fault_tolerance section) for "
                               "ft_launcher, e.g. a script's own section timeouts; the spec's timeouts win "
                               "where both set one")
    section_timeouts: str | None = opt(None, "--section-timeouts",
                                       "timeouts of a script's own NVRx sections, e.g. "
                                       "init:60,eval:30 (seconds; NVRx refuses sections it has no "
                                       "timeout for)")
    soft_timeout: float | None = opt(None, "--soft-timeout",
                                     "in-process: seconds without progress before a rank is interrupted "
                                     "(default: 4 on CPU; derived on GPUs)")
    hard_timeout: float | None = opt(None, "--hard-timeout",
                                     "in-process: seconds without progress before a rank is killed (default: "
                                     "8 on CPU; derived on GPUs)")
    collective_timeout: float | None = opt(None, "--collective-timeout",
                                           "process-group timeout while in-process restart is on: the "
                                           "fallback bound on a peer's wait for a rank that failed (a "
                                           "failure in-process shuts down its gloo connections, so peers "
                                           "learn at once; default: 3 on CPU, 60 on GPUs)")
    progress_patience: int = opt(3, "--progress-patience",
                                 "give up after this many restarts in a row that resume from the "
                                 "same checkpoint")

    def sections(self) -> dict[str, float]:
        """NVRx section name -> timeout in seconds: --setup-timeout, --step-timeout, --checkpoint-timeout
        (the built-in trainer's sections, named as NVRx's own deployment and Megatron name them),
        --section-timeouts (a script's own)."""
        found = {"setup": self.setup_timeout, "step": self.step_timeout,
                 "checkpointing": self.checkpoint_timeout}
        found = {k: v for k, v in found.items() if v is not None}
        text = self.section_timeouts or ""
        if not isinstance(text, str):
            raise SpecError(f"ft.section_timeouts must be text, got {shown(text)}",
                            "write e.g. --section-timeouts init:60")
        for item in text.split(","):
            name, _, seconds = item.strip().partition(":")
            if not item.strip():
                continue
            try:
                value = float(seconds)
            except ValueError:
                value = -1.0
            if not re.fullmatch(r"[A-Za-z_][\w.-]*", name) or not value > 0:
                raise SpecError(f"cannot read section timeout {shown(item.strip())}",
                                "write --section-timeouts NAME:SECONDS[,NAME:SECONDS...], e.g. "
                                "init:60,eval:30")
            found[name] = value
        return found


@dataclass
class EksConfig:
    """Where and how the job runs on Amazon EKS (ignored by the local backend)."""

    namespace: str = opt("default", "--namespace", "Kubernetes namespace")
    image: str = opt("", "--image", "container image with eksft-nb installed")
    kind: Literal["job", "jobset", "pytorchjob"] = opt("job", "--kind",
                                                       "workload kind: job (Indexed Job), jobset "
                                                       "or pytorchjob")
    gpus_per_node: int = opt(8, "--gpus-per-node", "nvidia.com/gpu per pod (0: CPU pods)")
    efa_per_node: int | None = opt(None, "--efa-per-node",
                                   "vpc.amazonaws.com/efa devices per pod (default: every EFA device a known "
                                   "--instance-type has, on GPU pods; 0: no EFA)")
    instance_type: str | None = opt(None, "--instance-type",
                                    "node.kubernetes.io/instance-type to schedule on")
    checkpoint_pvc: str = opt("fsx-claim", "--pvc",
                              "PersistentVolumeClaim (FSx for Lustre) mounted at /checkpoints")
    create_pvc: bool = opt(False, "--create-pvc", "also render the FSx for Lustre PVC and StorageClass")
    storage_class: str = opt("fsx-sc", "--storage-class", "StorageClass of the checkpoint PVC")
    storage_size: str = opt("1200Gi", "--storage-size", "size of the checkpoint PVC")
    fsx_subnet: str | None = opt(None, "--fsx-subnet",
                                 "subnet of the FSx file system the StorageClass provisions (--create-pvc)")
    fsx_security_groups: str | None = opt(None, "--fsx-security-groups",
                                          "comma-separated security groups for FSx (--create-pvc; must allow "
                                          "Lustre, TCP 988)")
    shm_size: str | None = opt(None, "--shm-size",
                               "memory-backed /dev/shm size (default: sized for checkpoint staging)")
    cpu: str | None = opt(None, "--cpu", "CPU request per pod")
    memory: str | None = opt(None, "--memory", "memory request per pod")
    context: str | None = opt(None, "--context", "kubeconfig context (default: current, or in-cluster)")
    k8s_version: str = opt("1.33", "--k8s-version", "Kubernetes version the manifests are validated against")
    port: int = opt(29500, "--rdzv-port", "rendezvous port on rank 0's pod")
    queue: str | None = opt(None, "--queue",
                            "Kueue LocalQueue to submit to: the workload waits there, suspended, "
                            "until Kueue admits it")
    priority: str | None = opt(None, "--priority",
                               "Kueue WorkloadPriorityClass of the workload (with --queue)")
    topology: str | None = opt(None, "--topology",
                               "Kueue topology-aware scheduling (with --queue): required or "
                               "preferred[:LAYER], all pods under one node of EKS's "
                               "topology.k8s.aws/network-node-layer-"
                               "LAYER (1 broadest .. 3 closest, the default)")
    fsx_throughput: int | None = opt(None, "--fsx-throughput",
                                     "FSx for Lustre throughput per TiB (MB/s/TiB: 125, 250, 500 or 1000) of "
                                     "the file system --create-pvc provisions (default: the least that "
                                     "delivers --storage-mbps at --storage-size)")
    run_as_user: int = opt(1000, "--run-as-user",
                           "UID (and group) the pods run as: non-root, so Pod Security \"restricted\" admits "
                           "them; 0: the image's root, for images that need it (Pod Security \"baseline\")")
    hyperpod: bool = opt(False, "--hyperpod",
                         "SageMaker HyperPod nodes (implied by an ml.* --instance-type): schedule only on "
                         "nodes HyperPod reports Schedulable")
    join_timeout: int = opt(1800, "--rdzv-join-timeout",
                            "seconds the pods wait in the rendezvous for all nodes: covers a pod's "
                            "scheduling (a new GPU node takes minutes); without --queue (Kueue admits all "
                            "pods at once) a pod that never schedules fails the others after it")
    allow_latest: bool = opt(False, "--allow-latest-image",
                             "accept an image tagged :latest (the pods of one job, and its replacements, "
                             "could run different builds)")
    prometheus_release: str = opt("kube-prometheus-stack", "--prometheus-release",
                                  "the `release` label on the PodMonitor: what your Prometheus operator's "
                                  "podMonitorSelector matches (kube-prometheus-stack: its Helm release name)")
    prometheus_namespace: str = opt("monitoring", "--prometheus-namespace",
                                    "namespace of the Prometheus that may "
                                    "scrape the pods' metrics port (the job's NetworkPolicy admits "
                                    "no one else)")


@dataclass
class SlurmConfig:
    """Where and how the job runs on a Slurm cluster (ignored by the other backends)."""

    shared_dir: str | None = opt(None, "--shared-dir",
                                 "Slurm: a folder every node and this machine mount at the same "
                                 "path (FSx for Lustre, NFS): the job folder and its checkpoints go there")
    partition: str | None = opt(None, "--partition", "Slurm partition (sbatch --partition)")
    account: str | None = opt(None, "--account", "Slurm account to charge (sbatch --account)")
    qos: str | None = opt(None, "--qos", "Slurm quality of service (sbatch --qos)")
    time: str | None = opt(None, "--time", "Slurm time limit, e.g. 4:00:00 (sbatch --time)")
    gres: str | None = opt(None, "--gres",
                           "generic resources per node, e.g. gpu:8 (sbatch --gres); without it the GPUs are "
                           "counted on the node where the job runs")
    exclusive: bool = opt(True, "--exclusive",
                          "Slurm: whole nodes, shared with no other job (sbatch --exclusive; "
                          "--no-exclusive to share them)")
    cpus_per_task: int | None = opt(None, "--cpus-per-task",
                                    "Slurm: CPUs of each node's launcher and its ranks (sbatch and srun "
                                    "--cpus-per-task; default: the node's allocated CPUs)")
    mem: str | None = opt(None, "--mem", "Slurm: memory per node, e.g. 1800G (sbatch --mem; default: all "
                          "of it with --exclusive)")
    constraint: str | None = opt(None, "--constraint", "Slurm node features, e.g. p5 (sbatch --constraint)")
    instance_type: str | None = opt(None, "--slurm-instance-type",
                                    "Slurm: the nodes' EC2 instance type, e.g. p5.48xlarge: EFA by default "
                                    "where it has EFA, device RDMA where its EFA reads RDMA")
    efa: bool | None = opt(None, "--efa",
                           "Slurm: set the EFA (libfabric) environment for NCCL (default: on for an "
                           "--slurm-instance-type with EFA)")
    container_image: str | None = opt(None, "--container-image",
                                      "Slurm with pyxis: run each node's launcher and ranks in this image "
                                      "(srun --container-image; eksft-nb and NVRx installed in it)")
    container_mounts: str | None = opt(None, "--container-mounts",
                                       "Slurm with pyxis: SRC:DST[,SRC:DST...] (srun --container-mounts; the "
                                       "--shared-dir is always mounted at its own path)")
    container_env: str | None = opt(None, "--container-env",
                                    "Slurm with pyxis: NAME[,NAME...] whose host values win over the "
                                    "image's (srun --container-env; the job's own environment always does)")
    port: int = opt(29500, "--slurm-port", "Slurm: the rendezvous port on the allocation's first node "
                    "(the trainer's stores use the next two)")

    @property
    def gpus_per_node(self) -> int:
        """From ``--gres gpu:N`` (or ``gpu:TYPE:N``); 0 without them (the node's are counted where the job
        runs: see :mod:`eksft_nb.backends.slurm.gpus`)."""
        for item in (self.gres or "").split(","):
            parts = item.split(":")
            if parts[0] == "gpu":
                return int(parts[-1]) if len(parts) > 1 and parts[-1].isdigit() else 1
        return 0
