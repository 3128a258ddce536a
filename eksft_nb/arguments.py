"""The one table of the commands' arguments (:data:`ARGS`), from which the CLI's and the magics' parsers are
built: each verb's arguments, the front ends that take each, what differs in the notebook, and the spec's
fields as options (their flags and help are the spec's own, :mod:`.spec_fields`). What a parsed command
line asks is done by :mod:`.dispatch`, through the command layer (:mod:`.commands`).
"""

from __future__ import annotations

import argparse
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from .commands import spec_from_options
from .control import FAULTS
from .spec import JobSpec, spec_options

CLI, MAGIC = "cli", "magic"
BOTH = frozenset({CLI, MAGIC})


@dataclass(frozen=True)
class Arg:
    """One argument: argparse's names and keywords, the front ends that take it, and what differs in
    the magics (there a job NAME may be left out: the notebook's current job is meant)."""

    names: tuple[str, ...]
    kwargs: Mapping[str, Any]
    fronts: frozenset[str] = BOTH
    magic: Mapping[str, Any] = field(default_factory=dict)

    @property
    def flags(self) -> list[str]:
        return [n for n in self.names if n.startswith("-")]

    def add_to(self, parser: argparse.ArgumentParser | Any, front: str) -> None:
        parser.add_argument(*self.names, **{**self.kwargs, **(self.magic if front == MAGIC else {})})


def arg(*names: str, fronts: frozenset[str] = BOTH, magic: Mapping[str, Any] | None = None,
        **kwargs: Any) -> Arg:
    return Arg(names, kwargs, fronts, magic or {})


@dataclass(frozen=True)
class Verb:
    """A command: ``python -m eksft_nb NAME`` and ``%ftrain NAME`` (``magic_name`` where the notebook
    says it otherwise); ``run`` is the cell magic ``%%ftrain``, and also takes every spec field."""

    name: str
    help: str
    args: tuple[Arg, ...]
    fronts: frozenset[str] = BOTH
    magic_name: str | None = None

    def name_in(self, front: str) -> str:
        return self.magic_name or self.name if front == MAGIC else self.name

    def args_in(self, front: str) -> list[Arg]:
        return [a for a in self.args if front in a.fronts]


NAME = arg("name", help="the job",
           magic={"nargs": "?", "help": "the job (default: this notebook's current job)"})
BACKEND = arg("--backend", choices=("local", "eks", "slurm"),
              help="where the job runs (default: whichever backend holds a job of that name, as it was "
                   "launched from here; else eks: the kubeconfig's current context and namespace, slurm: the "
                   "jobs under $EKSFT_SHARED_DIR)",
              magic={"help": "where the job runs (default: the current job's, or whichever backend holds a "
                             "job of that name)"})
LIST_BACKEND = arg("--backend", choices=("local", "eks", "slurm"), default="local",
                   help="whose jobs (eks: the kubeconfig's current context and namespace; slurm: the jobs "
                        "under $EKSFT_SHARED_DIR and those launched from here)")
JSON = arg("--json", action="store_true", help="print JSON instead of text")
COST = (arg("--price", metavar="PRICE", help="price the GPU time: an instance type (p5.48xlarge, "
            "p5en.48xlarge, p4d.24xlarge, p4de.24xlarge, g5/g6/g6e.48xlarge, p6-b200.48xlarge: us-east-1 "
            "on-demand), USD per instance-hour (55.04/h) or per GPU-hour (6.88/gpu-h) (default: an EKS "
            "job's --instance-type; else GPU-hours only)"),
        arg("--for", dest="run_for", metavar="DURATION", help="scale the losses to a run this long, e.g. 30d "
            "(a model: it says what it assumes)"),
        arg("--nodes", type=int, metavar="N", help="with --for: the run's nodes (default: the job's)"),
        arg("--failures-per-day", type=float, metavar="RATE", help="with --for: the run's failures a day "
            "(default: the job's own rate)"))
FAULT_KINDS = ", ".join(FAULTS)

ARGS: dict[str, Verb] = {v.name: v for v in (
    Verb("run", "launch a job (and follow it)", (
        arg("--spec", dest="spec_file", help="a YAML or JSON job spec; the spec options override it"),
        arg("--fault", action="append", default=[], metavar="KIND[:RANK][@STEP]",
            help=f"schedule a fault, e.g. sigkill:1@30 (kinds: {FAULT_KINDS})"),
        arg("--detach", action="store_true", fronts=frozenset({CLI}),
            help="return at once; the job keeps running"),
        arg("--dry-run", action="store_true",
            help="show what would run (EKS: the manifests); launch nothing"),
        arg("--kueue-objects", action="store_true",
            help="with --dry-run --queue NAME: also print a Kueue LocalQueue, "
            "ClusterQueue and ResourceFlavors (p5/p4d) for it, for an admin to adapt and apply"),
        arg("--json", action="store_true", fronts=frozenset({CLI}), help="print the final summary as JSON"),
    )),
    Verb("list", "jobs and their state", (LIST_BACKEND, JSON)),
    Verb("status", "state and progress of a job", (NAME, BACKEND, JSON)),
    Verb("watch",
         "follow a job: the CLI its progress, the notebook its dashboard (its whole history, then live)",
         (NAME, BACKEND), magic_name="attach"),
    Verb("summary", "steps, restarts, goodput, digest, and what the faults and checkpoints cost",
         (NAME, BACKEND, JSON, *COST)),
    Verb("ckpts", "checkpoints of a job: committed, incomplete, rejected", (NAME, BACKEND, JSON)),
    Verb("logs", "the job's log (library noise filtered unless --debug)", (
        NAME, BACKEND,
        arg("-n", "--lines", type=int, default=200, help="how many lines (the last ones)"),
        arg("--debug", action="store_true", help="show everything, launcher and library lines included"))),
    Verb("inject", "inject a fault into a running job", (
        NAME,
        arg("fault", help=f"one of: {FAULT_KINDS}"),
        BACKEND,
        arg("--rank", type=int, help="target rank (rank faults; default 0)"),
        arg("--step", type=int,
            help="fire at the start of this step (a script's: optimizer step; default: now)"),
        arg("--after", type=float, metavar="SECONDS", help="fire this many seconds from now"),
        arg("--node", type=int, default=0, help="target node (kill-launcher)"),
        arg("--delay", type=float, help="slow-rank, slow-storage: seconds added per step or write"),
        arg("--duration", type=int, help="slow-rank, disk-full, slow-storage: for this many steps"))),
    Verb("resume", "start a new job from a checkpoint of this one", (
        NAME, BACKEND,
        arg("--step", type=int,
            help="checkpoint step (default: the newest that loads; each newer one refused is said)"),
        arg("--as", dest="new_name", help="name of the new job (default: NAME-from-STEP)"),
        arg("--steps", type=int, help="train to this many steps in total"),
        arg("--detach", action="store_true", fronts=frozenset({CLI}),
            help="return at once; the job keeps running"))),
    Verb("set", "change live settings of a running job; every rank takes them at the same step, and they "
         "hold across restarts (live: ckpt-every, keep-last)", (
        NAME,
        arg("assignments", nargs="+", metavar="SETTING=VALUE", help="e.g. ckpt-every=25 keep-last=5"),
        BACKEND,
        arg("--wait", type=float, default=30.0, metavar="SECONDS",
            help="wait this long for every rank to take it (default 30; 0: return once queued)"),
        JSON)),
    Verb("stop", "stop a job; nothing of it keeps running", (NAME, BACKEND)),
    Verb("rm", "delete ended jobs (their folders or workloads; checkpoints included); each refusal is said",
         (arg("names", nargs="*", metavar="NAME", help="the jobs"), BACKEND,
          arg("--finished", action="store_true", help="every ended job of --backend (default: local)"))),
    Verb("test", "prove a job survives each fault: a fault-free reference run, then one job per fault kind, "
         "checked against expectations; a report card (exit code 1 when a case fails)", (
        arg("--spec", dest="spec_file", help="a YAML or JSON job spec; the spec options override it"),
        arg("--faults", metavar="KIND[,KIND...]", help="the fault kinds to test (default: every kind that "
            f"applies to the job; kinds: {FAULT_KINDS})"),
        arg("--expect", metavar="CLAUSES", help="what each case must show, e.g. \"level<=injob, downtime<5s, "
            "lost<=10, state=reference\" (default: state=reference)"),
        arg("--at-step", type=int, metavar="STEP", help="fire every fault at this step (default: the "
            "first step after the reference run's first committed checkpoint; a script whose saves eksft "
            "cannot see needs it)"),
        arg("--loss-tol", type=float, metavar="FRACTION", help="a job without a final digest: each step's "
            "loss within this fraction of the reference's (default 0.02)"),
        arg("--junit", metavar="FILE", help="also write the card as JUnit XML to FILE"),
        arg("--repeat", type=int, default=1, metavar="N", help="run each fault kind N times, at different "
            "steps and ranks drawn with --plan-seed; the card reports n/N per kind with the spread"),
        arg("--plan-seed", type=int, default=0, metavar="SEED",
            help="the seed of the trials' steps and ranks (default 0)"),
        arg("--manifest", metavar="FILE", help="write the campaign manifest (JSON: each injection's ground "
            "truth beside what was observed) to FILE"),
        arg("--recheck", metavar="MANIFEST", help="run a manifest's plan again (on this or a new version of "
            "the job: its spec, with the options given over it) and name what differs"),
        JSON, *COST)),
    Verb("whatif", "replay a job's failures under other settings: ETTR and time breakdown per setting, and a "
         "recommended checkpoint interval", (
        NAME, BACKEND,
        arg("--ckpt-every", metavar="N[,N...]", help="checkpoint intervals to compare, in steps (default: "
            "the job's, half and double it, and the recommendation)"),
        arg("--inprocess", action=argparse.BooleanOptionalAction, default=None,
            help="with or without in-process restart (default: as the job ran)"),
        arg("--ckpt-mode", choices=("async", "sync"), help="checkpoint mode (default: as the job ran)"),
        arg("--spares", type=int, metavar="N", help="hot spare nodes (default: as the job ran)"),
        arg("--apply", action="store_true", help="set the recommended checkpoint interval on the running "
            "job, live (as `set NAME ckpt-every=N`)"),
        JSON, *COST)),
    Verb("check", "pre-flight of a job's fault-tolerance settings: every timeout acting on it and each "
         "contradiction between them (exit code 1 when run would refuse the spec)", (
        arg("--spec", dest="spec_file", help="a YAML or JSON job spec; the spec options override it"),
        arg("--from", dest="from_job", metavar="JOB", help="size the step and save times from this job's "
            "events (what it measured)"),
        arg("--from-backend", dest="from_backend", choices=("local", "eks", "slurm"),
            help="where --from's job ran (default: whichever backend holds a job of that name)"),
        JSON)),
    Verb("doctor", "the versions found here (Python, torch, CUDA, NCCL, NVRx, torchft, EFA), what each "
         "supports, and what a spec would be refused (exit code 1 when something is)", (
        arg("--spec", dest="spec_file", help="a YAML or JSON job spec; the spec options override it"),
        arg("--on-node", action="store_true",
            help="the ranks run here (an EKS pod, a Slurm node): refuse what this node cannot run"),
        JSON)),
    Verb("metrics", "serve Prometheus metrics of jobs (all, or the ones named)", (
        arg("names", nargs="*", metavar="NAME", help="the jobs (default: all)"),
        arg("--port", type=int, default=9400),
        arg("--addr", default="127.0.0.1", help="address to listen on (default: loopback only)"),
        arg("--root", help="the jobs folder (default: $EKSFT_HOME/jobs; in an EKS pod: the shared volume)")),
        fronts=frozenset({CLI})),
)}

# the verbs that take every spec field as an option
SPEC_VERBS = frozenset({"run", "test", "check", "doctor"})

# the sections of the spec options, as their help groups them
SPEC_GROUPS = {"": "job", "model.": "model", "checkpoint.": "checkpoints", "ft.": "fault tolerance",
               "eks.": "EKS",
               "slurm.": "Slurm"}


def _section(path: str) -> str:
    return path.rsplit(".", 1)[0] + "." if "." in path else ""


def add_spec_arguments(parser: argparse.ArgumentParser) -> None:
    """One option per spec field, grouped by section. No defaults are set: only the options given
    override the spec (the defaults, or a --spec file)."""
    groups: dict[str, Any] = {}
    for opt in sorted(spec_options(), key=lambda o: list(SPEC_GROUPS).index(_section(o.path))):
        title = SPEC_GROUPS[_section(opt.path)]
        group = groups.get(title) or groups.setdefault(
            title, parser.add_argument_group(f"{title} (job spec fields)"))
        if opt.type is bool:
            group.add_argument(opt.flag, dest=opt.path, action=argparse.BooleanOptionalAction,
                               default=argparse.SUPPRESS, help=f"{opt.help} (default: {opt.default})")
        else:
            choices = f" {{{','.join(opt.choices)}}}" if opt.choices else ""
            group.add_argument(opt.flag, dest=opt.path, default=argparse.SUPPRESS,
                               metavar=opt.flag[2:].upper(),
                               help=f"{opt.help}{choices} (default: {opt.default})")


def add_verb_arguments(parser: argparse.ArgumentParser, verb: str, front: str) -> None:
    """The arguments of ``verb`` that ``front`` takes (``run``: the spec options too)."""
    for a in ARGS[verb].args_in(front):
        a.add_to(parser, front)
    if verb in SPEC_VERBS:
        add_spec_arguments(parser)


def add_verbs(subparsers: Any, front: str, **kwargs: Any) -> None:
    """One sub-parser per verb ``front`` takes, but ``run`` (the cell magic is a parser of its own)."""
    for verb in ARGS.values():
        if front in verb.fronts and (front == CLI or verb.name != "run"):
            add_verb_arguments(subparsers.add_parser(verb.name_in(front), help=verb.help, **kwargs),
                               verb.name, front)


def flags(front: str, verbs: Iterable[str] | None = None) -> list[str]:
    """Every option flag ``front`` takes (of ``verbs``; default: all), for "did you mean"."""
    chosen = [ARGS[v] for v in verbs] if verbs is not None else list(ARGS.values())
    out = ["-h", "--help"]
    for verb in chosen:
        if front in verb.fronts:
            out += [f for a in verb.args_in(front) for f in a.flags]
            if verb.name in SPEC_VERBS:
                out += [o.flag for o in spec_options()] + [f"--no-{o.flag[2:]}"
                                                           for o in spec_options() if o.type is bool]
    return list(dict.fromkeys(out))


def positionals(verb: str, front: str) -> str:
    """The words a verb takes, as its usage line writes them: ``[NAME] FAULT``."""
    words = []
    for a in ARGS[verb].args_in(front):
        if not a.flags:
            kw = {**a.kwargs, **(a.magic if front == MAGIC else {})}
            word = kw.get("metavar") or a.names[0].upper()
            words.append(f"[{word}]" if kw.get("nargs") in ("?", "*") else word)
    return " ".join(words)


def spec_from_args(args: argparse.Namespace, base: JobSpec | None = None, validate: bool = True) -> JobSpec:
    """Apply the spec options present in ``args`` (parsed with :func:`add_spec_arguments`) to ``base``."""
    return spec_from_options({o.path: getattr(args, o.path) for o in spec_options() if hasattr(args, o.path)},
                             base,
                             validate)
