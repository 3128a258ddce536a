"""``doctor``: the versions this environment has, what each supports, and what it would refuse of a spec.

Run anywhere (``python -m eksft_nb doctor``, ``%ftrain doctor``) it advises; run where the ranks run
(``--on-node``: an EKS pod's prepare step, a Slurm allocation's batch shell, any local job) it is a gate:
a node whose NVRx (or torch, torchft, GPUs) cannot run the spec stops with that line before training
starts. A local job's ranks run here, so for it both are the same.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypedDict

from ..engines.registry import engine_of
from ..nvrx import OLDEST
from ..spec import JobSpec
from ..timeouts import on_gpu
from . import platforms
from .check import Finding, FindingDict, check
from .environment import Environment, probe


class DoctorResult(TypedDict):
    environment: dict[str, object]
    supports: dict[str, str]
    findings: list[FindingDict]  # for the spec: refusals first
    message: str


@dataclass(frozen=True)
class Diagnosis:
    env: Environment
    supports: dict[str, str]
    findings: list[Finding]
    on_node: bool

    @property
    def refusals(self) -> list[Finding]:
        return [f for f in self.findings if f.refuse]

    def text(self) -> str:
        e = self.env
        versions = {
            "Python": f"{e.python} (glibc {'.'.join(map(str, e.glibc)) if e.glibc else 'none'})",
            "torch": e.torch or "not installed",
            "CUDA": (e.cuda or "none (a CPU build of torch)")
            if e.asked_torch
            else "not asked (--on-node asks)",
            "NCCL": (".".join(map(str, e.nccl)) if e.nccl else "none") if e.asked_torch else "not asked",
            "GPUs": str(e.gpus) if e.asked_torch else "not asked",
            "NVRx": e.nvrx.describe() if e.nvrx else "not installed",
            "torchft": e.torchft or "not installed",
            "libfabric": e.libfabric or "not found",
            "EFA plugin (aws-ofi-nccl)": e.efa_plugin or "not found",
        }
        lines = ["found:"] + [f"  {k:<27}{v}" for k, v in versions.items()]
        lines += ["supports:"] + [f"  {k:<27}{v}" for k, v in self.supports.items()]
        lines += [f"note: {n}" for n in e.notes]
        where = "on this node" if self.on_node else "here"
        lines += [f.line() for f in self.findings] or [f"nothing refused {where} for this spec"]
        return "\n".join(lines)

    def to_dict(self) -> DoctorResult:
        return {
            "environment": self.env.to_dict(),
            "supports": dict(self.supports),
            "findings": [{"refuse": f.refuse, "problem": f.problem, "fix": f.fix} for f in self.findings],
            "message": self.text(),
        }


def supports(env: Environment) -> dict[str, str]:
    """What each thing found can do, as eksft uses it."""
    out = {"pip install": platforms.said(env.pythons, env.glibc)}
    x = env.nvrx
    if x is None:
        out["NVRx"] = "none: local jobs cannot run here"
        return out
    out["hot spares"] = {
        "standby": "yes, NVRx's own standby nodes (--nnodes N:N+S) on every backend, with 2 nodes or more",
        "handover": "local jobs only (eksft's handover in the legacy rendezvous); EKS and Slurm need 0.6+",
        None: f"no: {x.spares_refused}",
    }[x.spares]
    out["in-process restart"] = {
        "available": "yes (inprocess.Wrapper)",
        "deprecated": "yes, deprecated since NVRx 0.6 (in-job restart is its way forward)",
        "missing": "no inprocess.Wrapper: exceptions and hangs restart in-job",
    }[x.inprocess]
    out["cycle records"] = (
        "yes (--ft-cycle-info-dir: the restart timeline reads them)"
        if x.cycle_records
        else "no (0.6+): the restart timeline is eksft's own"
    )
    out["sections"] = "yes; a section without a timeout " + (
        "fails the rank that opens it"
        if x.unknown_section_fails
        else "is left unbounded (its time counts as out-of-section)"
    )
    out["rendezvous"] = x.rendezvous
    nccl = x.nccl_problem(env.nccl, inprocess=True)
    out["NCCL with in-process"] = nccl or ("fine" if env.nccl else "no NCCL (CPU: gloo)")
    return out


def diagnose(
    spec: JobSpec | None = None, *, on_node: bool = False, env: Environment | None = None
) -> Diagnosis:
    """``spec``'s diagnosis in this environment (``env``: probed when not given). ``on_node``: the ranks run
    here (an EKS pod, a Slurm node): their NVRx, torch and GPUs are these, and what cannot run is refused."""
    spec = spec or JobSpec()
    here = on_node or spec.backend == "local"
    if env is None:  # a gate on a CPU pod or node skips torch's import (seconds): what it tells needs GPUs
        env = probe(import_torch=not on_node or (on_gpu(spec) and spec.device != "cpu"))
    found: list[Finding] = []
    if here:
        found += _refusals(spec, env)
        found += check(spec, release=env.nvrx, slurm_config=None).findings
    else:
        found.append(
            Finding(
                False,
                f"the {spec.backend} job's ranks run the NVRx of their "
                f"{'image' if spec.backend == 'eks' else 'nodes'}, not this machine's",
                "its prepare step (EKS) or Slurm watcher runs doctor there and stops the job "
                "if it cannot run; `check` says what its settings contradict",
            )
        )
    if here and env.nvrx is not None and spec.ft.inprocess and env.nccl:
        if problem := env.nvrx.nccl_problem(env.nccl, inprocess=True):
            found.append(
                Finding(False, problem, "use another NCCL (another torch or image), or --no-inprocess")
            )
    found.sort(key=lambda f: not f.refuse)
    return Diagnosis(env, supports(env), found, on_node)


def _refusals(spec: JobSpec, env: Environment) -> list[Finding]:
    """What the ranks' own environment cannot run of ``spec``."""
    found = []
    if env.torch is None:
        found.append(
            Finding(True, "torch is not installed where the ranks run", "pip install eksft-nb there")
        )
    if engine_of(spec).node_process != "ft_launcher":  # an engine without ft_launcher needs no NVRx
        if env.torchft is None:
            found.append(
                Finding(
                    True,
                    f"--engine {spec.engine} needs torchft, which is not installed here",
                    "pip install 'torchft>=0.2,<0.3' (Linux x86_64 wheels)",
                )
            )
        return found
    x = env.nvrx
    oldest = ".".join(map(str, OLDEST))
    if x is None or x.release < OLDEST:
        problem = (
            f"NVRx {x.version} is older than {oldest}"
            if x
            else f"NVRx (nvidia-resiliency-ext) is not installed where the ranks run, need {oldest}+"
        )
        release = platforms.resolves(env.pythons, env.glibc)
        fix = (
            f"pip install 'nvidia-resiliency-ext>={oldest},<0.8' (gives {release} here)"
            if release
            else platforms.said(env.pythons, env.glibc)
        )
        found.append(Finding(True, problem, fix))
        return found
    if (refused := x.cannot_run(spec)) is not None:  # the one check of what a release cannot run
        found.append(Finding(True, refused.problem, refused.fix))
    if spec.ft.inprocess and x.inprocess == "missing":
        found.append(Finding(False, x.inprocess_note() or "", "--no-inprocess says so in the spec"))
    if on_gpu(spec) and spec.device != "cpu" and env.gpus == 0 and env.torch is not None:
        found.append(
            Finding(
                True,
                "the spec asks for GPUs but torch sees none here"
                + (f" ({env.notes[0]})" if env.notes else " (a CPU build, or no driver)"),
                "run on a GPU node with a CUDA build of torch, or ask for none (--gpus-per-node 0, "
                "--device cpu)",
            )
        )
    return found


def refusal(spec: JobSpec) -> str | None:
    """The first thing this node cannot run of ``spec``, in one line with its fix (the gate of an EKS pod's
    prepare step and of a Slurm allocation's watcher); None when it can."""
    found = diagnose(spec, on_node=True).refusals
    return f"{found[0].problem} → {found[0].fix}" if found else None
