"""The job spec: one dataclass that describes a training job completely.

The magic, the CLI, the local launcher and the Kubernetes manifests are all derived from
:class:`JobSpec`. Every user-settable field carries its command-line flag and help text in the
field metadata, so ``%%ftrain --help`` and ``python -m eksft_nb run --help`` list the same options.
Over 500 lines, one idea: every field, its flag and its check sit together, as the one place they are said.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import json
import math
import re
from collections.abc import Iterator
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Literal, get_args, get_origin, get_type_hints

import yaml

from .errors import SHOWN_CHARS, SpecError, closest, shown
from .states import EngineName
from .timeouts import resolved

DNS1123_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
BACKENDS = ("local", "eks", "slurm")
MAX_SPEC_BYTES = 1 << 20   # a spec is a few kB: anything this large is not one (and would be parsed whole)


def opt(default: Any, flag: str, help: str, choices: type[enum.Enum] | None = None, **kw: Any) -> Any:
    """A dataclass field with its command-line flag and help text (``choices``: the enum whose values are
    the field's only ones; the field holds the value itself, as a file names it)."""
    meta = {"flag": flag, "help": help, **({"choices": tuple(c.value for c in choices)} if choices else {})}
    if callable(default) and not isinstance(default, (str, int, float, bool)):
        return field(default_factory=default, metadata=meta, **kw)
    return field(default=default, metadata=meta, **kw)


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
                                     "section timeout for one training step, seconds (none: heartbeats only)")
    checkpoint_timeout: float | None = opt(None, "--checkpoint-timeout",
                                           "section timeout for a checkpoint save, seconds")
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
        """NVRx section name -> timeout in seconds: --step-timeout, --checkpoint-timeout,
        --section-timeouts."""
        found = {"step": self.step_timeout, "checkpoint": self.checkpoint_timeout}
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
    efa_per_node: int = opt(0, "--efa-per-node", "vpc.amazonaws.com/efa devices per pod (0: no EFA)")
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
    gres: str | None = opt(None, "--gres", "generic resources per node, e.g. gpu:8 (sbatch --gres)")
    exclusive: bool = opt(False, "--exclusive",
                          "Slurm: whole nodes, shared with no other job (sbatch --exclusive)")
    constraint: str | None = opt(None, "--constraint", "Slurm node features, e.g. p5 (sbatch --constraint)")
    efa: bool = opt(False, "--efa", "Slurm: set the EFA (libfabric) environment for NCCL, as on p4d/p5 nodes")
    port: int = opt(29500, "--slurm-port", "Slurm: the rendezvous port on the allocation's first node "
                    "(the trainer's stores use the next two)")

    @property
    def gpus_per_node(self) -> int:
        """From ``--gres gpu:N`` (or ``gpu:TYPE:N``); 0 without GPUs."""
        for item in (self.gres or "").split(","):
            parts = item.split(":")
            if parts[0] == "gpu":
                return int(parts[-1]) if len(parts) > 1 and parts[-1].isdigit() else 1
        return 0


@dataclass
class JobSpec:
    """Everything needed to run one fault-tolerant FSDP training job."""

    name: str = opt("ftrain", "--name",
                    "job name: a DNS-1123 label, since it becomes a Kubernetes name and a folder")
    backend: Literal["local", "eks", "slurm"] = opt("local", "--backend",
                                                    "local (ranks on this machine), eks or slurm")
    engine: str = opt(
        EngineName.NVRX.value, "--engine",
        "nvrx: restart the group (in-process, in-job, job) and resume from a checkpoint; "
        "torchft: replica groups (one per --nnodes) train on through a per-step quorum, a lost one heals "
        "from a peer", choices=EngineName)
    nnodes: int = opt(1, "--nnodes", "nodes (one ft_launcher each); with --engine torchft, replica groups")
    nproc_per_node: int = opt(2, "--nproc-per-node", "ranks per node")
    spare_nodes: int = opt(0, "--spare-nodes",
                           "extra nodes that wait in the rendezvous as hot spares: one takes a "
                           "lost node's place with an in-job restart instead of a job restart")
    steps: int = opt(100, "--steps", "training steps")
    model: ModelConfig = opt(ModelConfig, "", "")
    batch: int = opt(8, "--batch", "sequences per rank per step")
    seq: int = opt(64, "--seq", "tokens per sequence")
    lr: float = opt(3e-3, "--lr", "AdamW learning rate")
    seed: int = opt(0, "--seed", "seed for weights and data (same seed, same result)")
    device: Literal["auto", "cpu", "cuda"] = opt("auto", "--device",
                                                 "auto: CUDA+NCCL when GPUs exist, else CPU+gloo")
    threads_per_rank: int = opt(1, "--threads-per-rank", "CPU threads per rank (torch.set_num_threads)")
    checkpoint: CheckpointConfig = opt(CheckpointConfig, "", "")
    ft: FaultToleranceConfig = opt(FaultToleranceConfig, "", "")
    resume: str = opt("latest", "--resume", "latest | none | step:N | a checkpoint (step_N folder) | "
                      "a job's checkpoint folder (its newest that loads)")
    script: str | None = opt(None, "--script", "a training script to run instead of the built-in trainer")
    script_args: list[str] = opt(list, "--script-args", "arguments for --script (one string, shell-split)")
    workdir: str | None = opt(None, "--workdir",
                              "working directory of the script on every rank (local default: the folder "
                              "the job is launched from, for a notebook cell the notebook's folder; EKS: "
                              "the image's)")
    eks: EksConfig = opt(EksConfig, "", "")
    slurm: SlurmConfig = opt(SlurmConfig, "", "")

    # ---- validation -------------------------------------------------------------------------
    def validate(self) -> JobSpec:
        """Raise :class:`SpecError` on the first invalid field; return self when all is well."""
        for option in spec_options():
            _require_type(self, option)
        n = self.name
        if not valid_name(n):
            raise SpecError(
                f"invalid job name {shown(n)} (it must be a DNS-1123 label: lower-case letters, digits and "
                "'-', starting and ending with a letter or digit, at most 63 characters)",
                f"use e.g. --name {_suggest_name(n)}",
            )
        if self.engine not in list(EngineName):
            raise SpecError(f"unknown engine {shown(self.engine)}",
                            f"use {' or '.join(f'--engine {e}' for e in EngineName)}")
        if self.backend not in BACKENDS:
            raise SpecError(f"unknown backend {shown(self.backend)}",
                            f"use --backend {' or --backend '.join(BACKENDS)}")
        for fname, minimum in (("nnodes", 1), ("nproc_per_node", 1), ("steps", 1), ("batch", 1), ("seq", 2),
                               ("threads_per_rank", 1)):
            _require_int(self, fname, minimum)
        _require_int(self, "seed", 0)
        _require_int(self, "spare_nodes", 0)
        if not isinstance(self.lr, (int, float)) or not self.lr > 0:
            raise SpecError(f"lr must be a positive number, got {shown(self.lr)}", "use e.g. --lr 3e-3")
        if self.device not in ("auto", "cpu", "cuda"):
            raise SpecError(f"unknown device {shown(self.device)}", "use --device auto, cpu or cuda")
        m = self.model
        if m.preset not in MODEL_PRESETS:
            raise SpecError(f"unknown model preset {shown(m.preset)}",
                            f"use --model {closest(m.preset, MODEL_PRESETS)}")
        for fname in ("vocab", "d_model", "n_layers", "n_heads"):
            if getattr(m, fname) is not None:
                _require_int(m, fname, 1, prefix="model.")
        vocab, d, _, h = m.dims()
        if d % h:
            raise SpecError(f"d_model {d} is not divisible by n_heads {h}",
                            "choose --n-heads that divides --d-model")
        if vocab < 16:
            raise SpecError(f"vocab {vocab} is too small for the built-in data (needs >= 16)",
                            "use --vocab 16 or more")
        c = self.checkpoint
        _require_int(c, "every", 0, prefix="checkpoint.")
        _require_int(c, "keep_last", 2, prefix="checkpoint.",
                     why=" (one fewer than two could leave no loadable checkpoint while a save is in flight)")
        if c.mode not in ("async", "sync"):
            raise SpecError(f"unknown checkpoint mode {shown(c.mode)}",
                            "use --ckpt-mode async or --ckpt-mode sync")
        f = self.ft
        for fname in ("max_injob_restarts", "max_job_restarts"):
            _require_int(f, fname, 0, prefix="ft.")
        _require_int(f, "progress_patience", 1, prefix="ft.")
        if not c.storage_mbps > 0:
            raise SpecError(f"checkpoint.storage_mbps must be a positive number, got {shown(c.storage_mbps)}",
                            "set --storage-mbps to your storage's throughput, e.g. 300")
        for fname in ("heartbeat_timeout", "initial_heartbeat_timeout", "soft_timeout", "hard_timeout",
                      "collective_timeout", "step_timeout", "checkpoint_timeout"):
            v = getattr(f, fname)
            if v is None:  # a section without a timeout, or a timeout derived for the backend (timeouts.py)
                continue
            if not isinstance(v, (int, float)) or isinstance(v, bool) or v <= 0:
                raise SpecError(f"ft.{fname} must be a positive number of seconds, got {shown(v)}",
                                f"set {_flag_of(FaultToleranceConfig, fname)} to e.g. 10")
        f.sections()  # raises on a malformed --section-timeouts
        f = resolved(self).ft   # the unset timeouts as the backend derives them, checked with the set ones
        if f.inprocess and not f.soft_timeout < f.hard_timeout:
            raise SpecError(f"soft timeout ({f.soft_timeout}s) must be shorter than hard timeout "
                            f"({f.hard_timeout}s)",
                            "raise --hard-timeout or lower --soft-timeout")
        if f.inprocess and f.collective_timeout >= f.hard_timeout:
            raise SpecError(
                f"collective timeout ({f.collective_timeout}s) must be shorter than the in-process "
                "hard timeout "
                f"({f.hard_timeout}s), or a rank waiting on a failed peer is killed instead of "
                "restarted in place",
                "lower --collective-timeout or raise --hard-timeout")
        if f.inprocess and f.hard_timeout >= f.heartbeat_timeout:
            raise SpecError(
                f"in-process hard timeout ({f.hard_timeout}s) must be shorter than the heartbeat timeout "
                f"({f.heartbeat_timeout}s), or ft_launcher restarts the group before in-process "
                "restart can act",
                "raise --heartbeat-timeout or lower --hard-timeout")
        r = self.resume
        if not isinstance(r, str) or not (r in ("latest",
                                                "none") or re.fullmatch(r"step:\d+", r) or "/" in r):
            raise SpecError(f"invalid resume {shown(r)}",
                            "use --resume latest, none, step:N or a checkpoint folder path")
        if self.script is not None and not isinstance(self.script, str):
            raise SpecError(f"script must be a path, got {shown(self.script)}",
                            "use --script path/to/train.py")
        if self.workdir is not None and not isinstance(self.workdir, str):
            raise SpecError(f"workdir must be a path, got {shown(self.workdir)}",
                            "use --workdir path/to/folder")
        if not isinstance(self.script_args, list) or not all(isinstance(a, str) for a in self.script_args):
            raise SpecError("script_args must be a list of strings", "use --script-args '--foo 1 --bar 2'")
        e = self.eks
        if e.kind not in ("job", "jobset", "pytorchjob"):
            raise SpecError(f"unknown EKS workload kind {shown(e.kind)}",
                            "use --kind job, jobset or pytorchjob")
        _require_int(e, "gpus_per_node", 0, prefix="eks.")
        _require_int(e, "efa_per_node", 0, prefix="eks.")
        _require_int(e, "port", 1024, prefix="eks.")
        for fname in ("queue", "priority"):
            value = getattr(e, fname)
            if value is not None and not (isinstance(value, str) and valid_name(value)):
                raise SpecError(f"--{fname} {shown(value)} is not a Kubernetes name (a DNS-1123 label)",
                                f"use --{fname} {_suggest_name(str(value))}")
        if e.priority and not e.queue:
            raise SpecError("--priority needs --queue (Kueue reads the priority class of queued "
                            "workloads only)",
                            "add --queue NAME, or drop --priority")
        if e.topology is not None and not (isinstance(e.topology, str)
                                           and re.fullmatch(r"(required|preferred)(:[123])?", e.topology)):
            raise SpecError(f"--topology {shown(e.topology)} is not a placement",
                            "use --topology required, preferred, or either with :LAYER, e.g. required:2")
        if e.topology and not e.queue:
            raise SpecError("--topology needs --queue (Kueue places queued workloads only)",
                            "add --queue NAME, or drop --topology")
        if e.topology and e.kind == "pytorchjob":
            raise SpecError("--topology places one pod set, but a PyTorchJob's master and workers are two",
                            "use --kind job or jobset with --topology")
        if not (isinstance(e.prometheus_namespace, str) and valid_name(e.prometheus_namespace)):
            raise SpecError(f"--prometheus-namespace {shown(e.prometheus_namespace)} is not a Kubernetes "
                            "namespace name",
                            f"use --prometheus-namespace {_suggest_name(str(e.prometheus_namespace))}")
        self._validate_slurm()
        return self

    def _validate_slurm(self) -> None:
        s = self.slurm
        _require_int(s, "port", 1024, prefix="slurm.")
        if s.port > 65533:
            raise SpecError(f"slurm.port {s.port} leaves no room for the two ports after it",
                            "use e.g. --slurm-port 29500")
        for fname in ("partition", "account", "qos", "time", "gres", "constraint"):
            value = getattr(s, fname)
            if value is not None and not re.fullmatch(r"[\w:.,|&*!=\[\]()+-]+", value):
                raise SpecError(f"slurm.{fname} {shown(value)} holds characters sbatch does not take there",
                                f"use {_flag_of(SlurmConfig, fname)} with letters, digits and :.,-_ only")
        if self.backend == "slurm":
            if not s.shared_dir:
                raise SpecError("a Slurm job needs a folder every node shares (its job folder and "
                                "checkpoints)",
                                "add --shared-dir /fsx/eksft (a path mounted on this machine and every node)")
            if not s.shared_dir.startswith("/"):
                raise SpecError(f"--shared-dir {shown(s.shared_dir)} is not an absolute path",
                                "use the path every node mounts, e.g. --shared-dir /fsx/eksft")

    @property
    def world_size(self) -> int:
        return self.nnodes * self.nproc_per_node

    @property
    def resume_step(self) -> int | None:
        """N for ``resume="step:N"``, else None."""
        return int(self.resume.split(":", 1)[1]) if self.resume.startswith("step:") else None

    def digest(self) -> str:
        """A short content hash: two specs with the same digest train the same thing."""
        return hashlib.sha256(json.dumps(self.to_dict(), sort_keys=True).encode()).hexdigest()[:12]

    # ---- serialisation ----------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> JobSpec:
        """Build a spec from a (possibly partial) dict; unknown keys are an error."""
        return _from_dict(cls, data, "")

    @classmethod
    def from_json(cls, text: str) -> JobSpec:
        _require_size(len(text), "the job spec", "characters")
        try:
            data = json.loads(text)
        except (ValueError, RecursionError) as e:
            raise SpecError(f"the job spec is not valid JSON ({str(e)[:120]})",
                            "fix the JSON, or write the spec as YAML") \
                from None
        return cls.from_dict(data)

    @classmethod
    def from_yaml(cls, text: str) -> JobSpec:
        _require_size(len(text), "the job spec", "characters")
        try:
            data = yaml.load(text, Loader=_SpecLoader) or {}
        except (yaml.YAMLError, ValueError, RecursionError) as e:
            where = getattr(e, "problem_mark", None)
            at = f" at line {where.line + 1}, column {where.column + 1}" if where else ""
            raise SpecError(f"the job spec is not valid YAML{at} "
                            f"({getattr(e, 'problem', None) or type(e).__name__})",
                            "fix the YAML (`key: value` lines, nested by indentation)") from None
        if not isinstance(data, dict):
            raise SpecError("a job spec file must hold a mapping", "write it as 'key: value' lines")
        return cls.from_dict(data)

    @classmethod
    def load(cls, path: str | Path) -> JobSpec:
        p = Path(path)
        said = str(p) if len(str(p)) <= SHOWN_CHARS else shown(str(p))
        try:
            if not p.is_file():
                raise SpecError(f"spec file {said} does not exist", "check the path")
            with open(p, "rb") as f:
                data = f.read(MAX_SPEC_BYTES + 1)   # a file of any size costs no more than the cap
            _require_size(max(len(data), p.stat().st_size), f"spec file {said}")
            text = data.decode()
        except (OSError, ValueError) as e:
            raise SpecError(f"cannot read spec file {said} ({type(e).__name__})",
                            "check that it is a readable UTF-8 text file") \
                from None
        return cls.from_json(text) if p.suffix == ".json" else cls.from_yaml(text)

    def replace(self, **changes: Any) -> JobSpec:
        """A copy with dotted-path changes applied, e.g. ``replace(**{"checkpoint.every": 5})``."""
        data = self.to_dict()
        for path, value in changes.items():
            node = data
            *parents, leaf = path.split(".")
            for p in parents:
                node = node[p]
            node[leaf] = value
        return JobSpec.from_dict(data)


# ---- option table shared by the CLI and the magic ------------------------------------------

@dataclass(frozen=True)
class SpecOption:
    """One command-line option and the spec field it sets."""

    path: str           # dotted path in the spec, e.g. "checkpoint.every"
    flag: str           # e.g. "--ckpt-every"
    type: type          # int, float, str or bool
    optional: bool      # None is an accepted value
    choices: tuple[str, ...] | None
    help: str
    default: Any


def spec_options() -> list[SpecOption]:
    """Every user-settable spec field, in declaration order."""
    return list(_walk_options(JobSpec, "", JobSpec()))


def _walk_options(cls: type, prefix: str, instance: Any) -> Iterator[SpecOption]:
    hints = get_type_hints(cls)
    for f in fields(cls):
        value = getattr(instance, f.name)
        if dataclasses.is_dataclass(value):
            yield from _walk_options(type(value), f"{prefix}{f.name}.", value)
            continue
        base, optional, choices = _unwrap(hints[f.name])
        choices = f.metadata.get("choices", choices)
        yield SpecOption(f"{prefix}{f.name}", f.metadata["flag"], base, optional, choices, f.metadata["help"],
                         value)


def _unwrap(tp: Any) -> tuple[type, bool, tuple[str, ...] | None]:
    optional = False
    args = get_args(tp)
    if get_origin(tp) is not None and type(None) in args and get_origin(tp) is not Literal:
        optional = True
        tp = next(a for a in args if a is not type(None))
    if get_origin(tp) is Literal:
        return str, optional, tuple(get_args(tp))
    if get_origin(tp) is list:
        return list, optional, None
    return tp, optional, None


def parse_option_value(option: SpecOption, raw: str) -> Any:
    """Convert a command-line string to the field's type, with a clear error."""
    if option.optional and raw.lower() in ("none", "null", ""):
        return None
    try:
        if option.type is bool:
            if raw.lower() in ("1", "true", "yes", "on"):
                return True
            if raw.lower() in ("0", "false", "no", "off"):
                return False
            raise ValueError(raw)
        if option.type is list:
            import shlex
            return shlex.split(raw)
        value = option.type(raw)
    except ValueError:
        raise SpecError(f"{option.flag} expects {option.type.__name__}, got {shown(raw)}",
                        f"write e.g. {option.flag} "
                        f"{option.default if option.default is not None else 1}") from None
    if option.choices and value not in option.choices:
        raise SpecError(f"{option.flag} must be one of {', '.join(option.choices)}, got {shown(raw)}",
                        f"use {option.flag} {closest(raw, option.choices)}")
    return value


# ---- helpers --------------------------------------------------------------------------------

class _SpecLoader(yaml.SafeLoader):
    """The safe loader without aliases: a spec needs none, and a few hundred bytes of nested aliases
    (a "billion laughs") expand to billions of nodes in whatever walks the result."""

    def compose_node(self, parent: Any, index: Any) -> Any:
        if self.check_event(yaml.AliasEvent):
            raise yaml.composer.ComposerError(None, None, "aliases (*name) are not allowed in a job spec",
                                              self.peek_event().start_mark)
        return super().compose_node(parent, index)


def _from_dict(cls: type, data: dict[str, Any], prefix: str) -> Any:
    if not isinstance(data, dict):
        raise SpecError(f"{prefix.rstrip('.') or 'spec'} must be a mapping, got {type(data).__name__}",
                        "write it as nested keys")
    known = {f.name: f for f in fields(cls)}
    kwargs = {}
    for key, value in data.items():
        if key not in known:
            raise SpecError(f"unknown spec field {prefix}{shown(key)}",
                            f"did you mean {prefix}{closest(key, known)}? (see --help for all fields)")
        default = known[key].default_factory() if known[
            key].default_factory is not dataclasses.MISSING else None
        if dataclasses.is_dataclass(default):
            value = _from_dict(type(default), value or {}, f"{prefix}{key}.")
        kwargs[key] = value
    return cls(**kwargs)


def _require_size(size: int, what: str, unit: str = "bytes") -> None:
    if size > MAX_SPEC_BYTES:
        raise SpecError(f"{what} is {size:,} {unit}, over the {MAX_SPEC_BYTES:,} a job spec may hold",
                        "a spec is a few kB of `key: value` lines: check that it is the spec file you meant")


def valid_name(name: Any) -> bool:
    """Whether ``name`` can name a job: a DNS-1123 label (so never a path, nor a URL's path part)."""
    return isinstance(name, str) and len(name) <= 63 and DNS1123_LABEL.fullmatch(name) is not None


def _require_type(spec: JobSpec, option: SpecOption) -> None:
    """Every field has its declared type (a spec file may hold anything YAML can express): integers
    that are not booleans, finite numbers, strings and lists of strings without NUL characters."""
    value: Any = spec
    for part in option.path.split("."):
        value = getattr(value, part)
    if value is None and option.optional:
        return
    t = option.type
    if t is bool:
        ok, what = isinstance(value, bool), "true or false"
    elif t is int:
        ok, what = isinstance(value, int) and not isinstance(value, bool), "an integer"
    elif t is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        what = "a finite number"
    elif t is list:
        ok, what = isinstance(value, list) and all(isinstance(a, str) and "\0" not in a for a in value), \
            "a list of strings"
    else:
        ok, what = isinstance(value, str) and "\0" not in value, "a string"
    if not ok:
        example = option.default if option.default not in (None, "",
                                                           []) else ("1" if t in (int, float) else "VALUE")
        raise SpecError(f"{option.path} must be {what}"
                        + (" or null" if option.optional else "") + f", got {shown(value)}",
                        f"use e.g. {option.flag} {example}")


def _require_int(obj: Any, fname: str, minimum: int, prefix: str = "", why: str = "") -> None:
    v = getattr(obj, fname)
    if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
        flag = _flag_of(type(obj), fname)
        raise SpecError(f"{prefix}{fname} must be an integer >= {minimum}, got {shown(v)}{why}",
                        f"use e.g. {flag} {max(minimum, 1)}")


def _flag_of(cls: type, fname: str) -> str:
    return next(f.metadata["flag"] for f in fields(cls) if f.name == fname)


def _suggest_name(name: Any) -> str:
    s = re.sub(r"[^a-z0-9-]+", "-", str(name).lower()).strip("-")[:63].strip("-")
    return s or "my-job"


def fsx_specs(presets: tuple[str, ...] = ("gpt2-125m", "gpt-1b", "gpt-8b")) -> dict[str, JobSpec]:
    """The model presets the README's FSx throughput table is computed for (``timeouts.fsx_table``)."""
    return {p: JobSpec(model=ModelConfig(preset=p)) for p in presets}
