"""The one check of a job spec (:meth:`eksft_nb.spec.JobSpec.validate`): every field has its type and a
value the job can run with, or the first that has not is refused in one line that names it and the fix."""

from __future__ import annotations

import math
import re
from typing import Any

from .errors import SpecError, closest, shown
from .shellquote import control_char
from .spec_fields import SpecOption, flag_of, options_of
from .spec_sections import MODEL_PRESETS, FaultToleranceConfig, SlurmConfig
from .states import EngineName
from .timeouts import resolved

DNS1123_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
BACKENDS = ("local", "eks", "slurm")


def validate(spec: Any) -> None:
    """Raise :class:`SpecError` on the first invalid field of ``spec``, a :class:`~eksft_nb.spec.JobSpec`
    (which this module does not import: the spec's ``validate`` calls it)."""
    defaults = type(spec)()
    for option in options_of(type(spec), "", defaults):
        _require_type(spec, option)
    n = spec.name
    if not valid_name(n):
        raise SpecError(
            f"invalid job name {shown(n)} (it must be a DNS-1123 label: lower-case letters, digits and "
            "'-', starting and ending with a letter or digit, at most 63 characters)",
            f"use e.g. --name {_suggest_name(n)}",
        )
    if spec.engine not in list(EngineName):
        raise SpecError(f"unknown engine {shown(spec.engine)}",
                        f"use {' or '.join(f'--engine {e}' for e in EngineName)}")
    if spec.backend not in BACKENDS:
        raise SpecError(f"unknown backend {shown(spec.backend)}",
                        f"use --backend {' or --backend '.join(BACKENDS)}")
    for fname, minimum in (("nnodes", 1), ("nproc_per_node", 1), ("steps", 1), ("batch", 1), ("seq", 2),
                           ("threads_per_rank", 1)):
        _require_int(spec, fname, minimum)
    _require_int(spec, "seed", 0)
    _require_int(spec, "spare_nodes", 0)
    if not isinstance(spec.lr, (int, float)) or not spec.lr > 0:
        raise SpecError(f"lr must be a positive number, got {shown(spec.lr)}", "use e.g. --lr 3e-3")
    if spec.device not in ("auto", "cpu", "cuda"):
        raise SpecError(f"unknown device {shown(spec.device)}", "use --device auto, cpu or cuda")
    m = spec.model
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
    c = spec.checkpoint
    _require_int(c, "every", 0, prefix="checkpoint.")
    _require_int(c, "keep_last", 2, prefix="checkpoint.",
                 why=" (one fewer than two could leave no loadable checkpoint while a save is in flight)")
    if c.mode not in ("async", "sync"):
        raise SpecError(f"unknown checkpoint mode {shown(c.mode)}",
                        "use --ckpt-mode async or --ckpt-mode sync")
    f = spec.ft
    for fname in ("max_injob_restarts", "max_job_restarts"):
        _require_int(f, fname, 0, prefix="ft.")
    _require_int(f, "progress_patience", 1, prefix="ft.")
    if not c.storage_mbps > 0:
        raise SpecError(f"checkpoint.storage_mbps must be a positive number, got {shown(c.storage_mbps)}",
                        "set --storage-mbps to your storage's throughput, e.g. 300")
    for fname in ("heartbeat_timeout", "initial_heartbeat_timeout", "soft_timeout", "hard_timeout",
                  "collective_timeout", "step_timeout", "checkpoint_timeout", "setup_timeout",
                  "out_of_section_timeout", "step_time", "save_time"):
        v = getattr(f, fname)
        if v is None:  # a section without a timeout, or a timeout derived for the backend (timeouts.py)
            continue
        if not isinstance(v, (int, float)) or isinstance(v, bool) or v <= 0:
            raise SpecError(f"ft.{fname} must be a positive number of seconds, got {shown(v)}",
                            f"set {flag_of(FaultToleranceConfig, fname)} to e.g. 10")
    f.sections()  # raises on a malformed --section-timeouts
    f = resolved(spec).ft   # the unset timeouts as the backend derives them, checked with the set ones
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
    r = spec.resume
    if not isinstance(r, str) or not (r in ("latest",
                                            "none") or re.fullmatch(r"step:\d+", r) or "/" in r):
        raise SpecError(f"invalid resume {shown(r)}",
                        "use --resume latest, none, step:N or a checkpoint folder path")
    if spec.script is not None and not isinstance(spec.script, str):
        raise SpecError(f"script must be a path, got {shown(spec.script)}",
                        "use --script path/to/train.py")
    if spec.workdir is not None and not isinstance(spec.workdir, str):
        raise SpecError(f"workdir must be a path, got {shown(spec.workdir)}",
                        "use --workdir path/to/folder")
    if not isinstance(spec.script_args, list) or not all(isinstance(a, str) for a in spec.script_args):
        raise SpecError("script_args must be a list of strings", "use --script-args '--foo 1 --bar 2'")
    e = spec.eks
    if e.kind not in ("job", "jobset", "pytorchjob"):
        raise SpecError(f"unknown EKS workload kind {shown(e.kind)}",
                        "use --kind job, jobset or pytorchjob")
    _require_int(e, "gpus_per_node", 0, prefix="eks.")
    if e.efa_per_node is not None:   # None: every EFA device of the instance type (backends/eks/efa.py)
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
    _validate_slurm(spec)


def _validate_slurm(spec: Any) -> None:
    s = spec.slurm
    _require_int(s, "port", 1024, prefix="slurm.")
    if s.port > 65533:
        raise SpecError(f"slurm.port {s.port} leaves no room for the two ports after it",
                        "use e.g. --slurm-port 29500")
    if s.cpus_per_task is not None:
        _require_int(s, "cpus_per_task", 1, prefix="slurm.")
    for fname, pattern, example in _SLURM_VALUES:
        value = getattr(s, fname)
        if value is not None and not re.fullmatch(pattern, value):
            raise SpecError(f"slurm.{fname} {shown(value)} holds characters sbatch does not take there",
                            f"use {flag_of(SlurmConfig, fname)} {example}")
    image = s.container_image
    if image is not None and (not image or any(c.isspace() for c in image)):
        raise SpecError(f"--container-image {shown(s.container_image)} is not an image name",
                        "use e.g. --container-image nvcr.io#nvidia/pytorch:25.01-py3, or a .sqsh file's path")
    if (s.container_mounts or s.container_env) and not s.container_image:
        raise SpecError("--container-mounts and --container-env need --container-image",
                        "add --container-image IMAGE, or drop them")
    if spec.backend == "slurm":
        if not s.shared_dir:
            raise SpecError("a Slurm job needs a folder every node shares (its job folder and "
                            "checkpoints)",
                            "add --shared-dir /fsx/eksft (a path mounted on this machine and every node)")
        if not s.shared_dir.startswith("/"):
            raise SpecError(f"--shared-dir {shown(s.shared_dir)} is not an absolute path",
                            "use the path every node mounts, e.g. --shared-dir /fsx/eksft")
        if "\\" in s.shared_dir:
            raise SpecError(f"--shared-dir {shown(s.shared_dir)} holds a backslash, which turns off the job "
                            "id in Slurm's log file names (--output)", "use a path without one")
        if s.container_image and any(c in s.shared_dir for c in ":,"):
            raise SpecError(f"--shared-dir {shown(s.shared_dir)} holds a ':' or ',', which pyxis reads as "
                            "the end of a mount (--container-mounts)", "use a path without them")


# field, what sbatch (or pyxis) takes there, an example
_SLURM_VALUES = (
    *((f, r"[\w:.,|&*!=\[\]()+-]+", "with letters, digits and :.,-_ only")
      for f in ("partition", "account", "qos", "time", "gres", "constraint")),
    ("mem", r"\d+[KMGT]?", "1800G (a number, then K, M, G or T)"),
    ("instance_type", r"[a-z0-9][a-z0-9.-]*", "p5.48xlarge"),
    ("container_env", r"[A-Za-z_][A-Za-z0-9_]*(,[A-Za-z_][A-Za-z0-9_]*)*", "NCCL_DEBUG,HF_HOME"),
)


def valid_name(name: Any) -> bool:
    """Whether ``name`` can name a job: a DNS-1123 label (so never a path, nor a URL's path part)."""
    return isinstance(name, str) and len(name) <= 63 and DNS1123_LABEL.fullmatch(name) is not None


def _require_type(spec: Any, option: SpecOption) -> None:
    """Every field has its declared type (a spec file may hold anything YAML can express): integers
    that are not booleans, finite numbers, strings and lists of strings. A string holds no control
    character: every path and text reaches a script or a manifest (a newline in an ``#SBATCH`` line runs
    what follows it as a shell line, whatever the quoting)."""
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
        ok, what = isinstance(value, list) and all(isinstance(a, str) for a in value), "a list of strings"
    else:
        ok, what = isinstance(value, str), "a string"
    if not ok:
        example = option.default if option.default not in (None, "",
                                                           []) else ("1" if t in (int, float) else "VALUE")
        raise SpecError(f"{option.path} must be {what}"
                        + (" or null" if option.optional else "") + f", got {shown(value)}",
                        f"use e.g. {option.flag} {example}")
    for text in value if t is list else [value] if t is str else []:
        if (bad := control_char(text)) is not None:
            raise SpecError(f"{option.path} holds a control character ({bad}) in {shown(text)}: a path or "
                            "text field may hold none (it reaches a script or a manifest)",
                            f"remove it from {option.flag}")


def _require_int(obj: Any, fname: str, minimum: int, prefix: str = "", why: str = "") -> None:
    v = getattr(obj, fname)
    if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
        flag = flag_of(type(obj), fname)
        raise SpecError(f"{prefix}{fname} must be an integer >= {minimum}, got {shown(v)}{why}",
                        f"use e.g. {flag} {max(minimum, 1)}")


def _suggest_name(name: Any) -> str:
    s = re.sub(r"[^a-z0-9-]+", "-", str(name)[:256].lower()).strip("-")[:63].strip("-")
    return s or "my-job"
