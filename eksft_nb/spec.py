"""The job spec: one dataclass that describes a training job completely.

The magic, the CLI, the local launcher and the Kubernetes manifests are all derived from
:class:`JobSpec`. Every user-settable field carries its command-line flag and help text in the
field metadata (:mod:`.spec_fields`), so ``%%ftrain --help`` and ``python -m eksft_nb run --help`` list the
same options (:func:`spec_options`). Its sections are :mod:`.spec_sections`; its one check
:mod:`.spec_checks`; this module holds the spec itself, read from and written to YAML and JSON.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Literal

import yaml

from .errors import PATH_CHARS, SpecError, closest, shown
from . import spec_checks
from .spec_fields import SpecOption, opt, options_of
from .spec_sections import CheckpointConfig, EksConfig, FaultToleranceConfig, ModelConfig, SlurmConfig
from .states import EngineName

MAX_SPEC_BYTES = 1 << 20   # a spec is a few kB: anything this large is not one (and would be parsed whole)


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

    def validate(self) -> JobSpec:
        """Raise :class:`SpecError` on the first invalid field (:func:`.spec_checks.validate`); return self
        when all is well."""
        spec_checks.validate(self)
        return self

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
        said = str(p) if len(str(p)) <= PATH_CHARS and str(p).isprintable() else shown(str(p), PATH_CHARS)
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


def spec_options() -> list[SpecOption]:
    """Every user-settable spec field, in declaration order: the option table the CLI and the magic share."""
    return list(options_of(JobSpec, "", JobSpec()))


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


def fsx_specs(presets: tuple[str, ...] = ("gpt2-125m", "gpt-1b", "gpt-8b")) -> dict[str, JobSpec]:
    """The model presets the README's FSx throughput table is computed for (``timeouts.fsx_table``)."""
    return {p: JobSpec(model=ModelConfig(preset=p)) for p in presets}
