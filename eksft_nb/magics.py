"""``%%ftrain`` (launch a job and show its dashboard) and ``%ftrain`` (act on jobs), for IPython.

``%load_ext eksft_nb`` registers them. The cell magic's options are the job spec's fields (the same
flags as ``python -m eksft_nb run``); an empty cell runs the built-in trainer, a cell with Python
code runs that code as the training script on every rank. Mistakes show as one line (what is
wrong, what to write instead) and launch nothing.
"""

from __future__ import annotations

import argparse
import hashlib
import re
import shlex
from collections.abc import Callable
from pathlib import Path
from typing import Any

from IPython.core.error import UsageError
from IPython.core.magic import Magics, line_cell_magic, magics_class
from IPython.core.magic_arguments import MagicArgumentParser, argument, argument_group, magic_arguments
from IPython.display import display

from . import cli
from .backends import get_backend
from .control import FAULTS, FaultCommand, parse_fault
from .errors import EksftError
from .job import Job, attach, launch
from .jobdir import atomic_write, eksft_home
from .spec import JobSpec, _closest, spec_options

GROUPS = {"": "job", "model.": "model", "checkpoint.": "checkpoints", "ft.": "fault tolerance", "eks.": "EKS"}
LINE_USAGE = """\
%ftrain list                          jobs and their state
%ftrain attach NAME [--backend eks]   show the dashboard of a job (its whole history, then live)
%ftrain inject [NAME] FAULT [--rank R] [--step S | --after SECONDS] [--node N] [--delay D] [--duration N]
%ftrain ckpts [NAME]                  checkpoints: committed, incomplete, rejected
%ftrain resume [NAME] [--step S] [--as NEW] [--steps N]   a new job from a checkpoint, with its dashboard
%ftrain logs [NAME] [-n LINES] [--debug]
%ftrain summary [NAME]                restarts, goodput, final digest
%ftrain stop [NAME]                   stop a job; nothing of it keeps running
NAME defaults to the job this notebook launched, attached or resumed last; --backend eks (any command)
reaches jobs on the cluster of the kubeconfig's current context."""


def _spec_arguments(func: Callable[..., Any]) -> Callable[..., Any]:
    """One ``magic_arguments`` option per job-spec field (grouped by section), after the run options."""
    decorators: list[Callable[[Any], Any]] = [
        argument("--spec", dest="spec_file", help="a YAML or JSON job spec; the options below override it"),
        argument("--fault", action="append", default=[], metavar="KIND[:RANK][@STEP]",
                 help=f"schedule a fault, e.g. sigkill:1@30 (kinds: {', '.join(FAULTS)})"),
        argument("--dry-run", action="store_true", help="show what would run (EKS: the manifests); launch nothing"),
    ]
    group = None
    for opt in sorted(spec_options(), key=lambda o: list(GROUPS).index(_section(o.path))):
        if GROUPS[_section(opt.path)] != group:
            group = GROUPS[_section(opt.path)]
            decorators.append(argument_group(f"{group} (job spec fields)"))
        if opt.type is bool:
            decorators.append(argument(opt.flag, dest=opt.path, action=argparse.BooleanOptionalAction,
                                       default=argparse.SUPPRESS, help=f"{opt.help} (default: {opt.default})"))
        else:
            choices = f" {{{','.join(opt.choices)}}}" if opt.choices else ""
            decorators.append(argument(opt.flag, dest=opt.path, default=argparse.SUPPRESS,
                                       metavar=opt.flag[2:].upper(), help=f"{opt.help}{choices} (default: {opt.default})"))
    for deco in reversed(decorators):  # magic_arguments reads them bottom-up
        func = deco(func)
    return func


def _section(path: str) -> str:
    return path.rsplit(".", 1)[0] + "." if "." in path else ""


def _line_parser() -> MagicArgumentParser:
    p = MagicArgumentParser(prog="%ftrain", add_help=False)
    sub = p.add_subparsers(dest="command", parser_class=MagicArgumentParser)
    where = MagicArgumentParser(add_help=False)
    where.add_argument("--backend", choices=("local", "eks"), default=None,
                       help="where the job runs (default: local, or the current job's)")
    sub.add_parser("list", parents=[where])
    sub.add_parser("attach", parents=[where]).add_argument("name")
    for name in ("stop", "ckpts", "summary"):
        sub.add_parser(name, parents=[where]).add_argument("name", nargs="?")
    inj = sub.add_parser("inject", parents=[where])
    inj.add_argument("target", nargs="+", metavar="[NAME] FAULT")
    inj.add_argument("--rank", type=int)
    inj.add_argument("--step", type=int)
    inj.add_argument("--after", type=float)
    inj.add_argument("--node", type=int, default=0)
    inj.add_argument("--delay", type=float)
    inj.add_argument("--duration", type=int)
    res = sub.add_parser("resume", parents=[where])
    res.add_argument("name", nargs="?")
    res.add_argument("--step", type=int)
    res.add_argument("--as", dest="new_name")
    res.add_argument("--steps", type=int)
    logs = sub.add_parser("logs", parents=[where])
    logs.add_argument("name", nargs="?")
    logs.add_argument("-n", "--lines", type=int, default=200)
    logs.add_argument("--debug", action="store_true")
    return p


@magics_class
class FtrainMagics(Magics):
    """``%%ftrain [options]`` launches; ``%ftrain COMMAND`` lists, attaches, injects, resumes, stops."""

    def __init__(self, shell: Any) -> None:
        super().__init__(shell)
        self.job: Job | None = None          # the job the line magic acts on when no NAME is given
        self.line_parser = _line_parser()

    @line_cell_magic
    def ftrain(self, line: str, cell: str | None = None) -> None:
        try:
            if cell is None:
                self._line(line)
            else:
                self._cell(line, cell)
        except EksftError as e:
            raise UsageError(f"{e.problem}\n  → {e.fix}" if e.fix else e.problem) from None

    # ---- %%ftrain ----------------------------------------------------------------------------
    def _cell(self, line: str, cell: str) -> None:
        if {"-h", "--help"} & set(line.split()):
            print(_cell_magic.parser.format_help())
            return
        spec, faults, dry_run = parse_cell(line, cell)
        if dry_run:
            print(get_backend(spec.backend).render(spec))
            return
        self.job = launch(spec, faults)
        display(self.job.dashboard())

    # ---- %ftrain -----------------------------------------------------------------------------
    def _line(self, line: str) -> None:
        tokens = line.split()
        if not tokens or tokens[0] in ("-h", "--help", "help"):
            print(LINE_USAGE)
            return
        args = _parse(self.line_parser, line, "%ftrain")
        if args.command is None:
            raise UsageError(f"unknown command {tokens[0]!r}\n{LINE_USAGE}")
        cmd = args.command
        if cmd == "list":
            cli.cmd_list(argparse.Namespace(json=False, backend=args.backend or "local"))
        elif cmd == "attach":
            self.job = attach(args.name, args.backend or "local")
            display(self.job.dashboard())
        elif cmd == "inject":
            if len(args.target) > 2:
                raise UsageError("inject takes [NAME] FAULT\n  → e.g. %ftrain inject sigkill --rank 1")
            job = self._job(args.target[0] if len(args.target) == 2 else None, args.backend)
            params = {k: v for k, v in (("delay", args.delay), ("duration", args.duration)) if v is not None}
            c = job.inject(args.target[-1], rank=args.rank, step=args.step, node=args.node, after=args.after,
                           **params)
            print(cli.injected(job, c))
        elif cmd == "resume":
            changes = {"steps": args.steps} if args.steps else {}
            self.job = self._job(args.name, args.backend).resume(step=args.step, name=args.new_name, **changes)
            display(self.job.dashboard())
        elif cmd == "stop":
            job = self._job(args.name, args.backend)
            job.stop()
            print(f"stopped {job.name}; nothing of it keeps running")
        elif cmd == "logs":
            print(self._job(args.name, args.backend).logs(args.lines, args.debug))
        else:  # ckpts, summary
            job = self._job(args.name, args.backend)
            getattr(cli, f"cmd_{cmd}")(argparse.Namespace(name=job.name, json=False, backend=job.backend.name))

    def _job(self, name: str | None, backend: str | None = None) -> Job:
        if name:
            return attach(name, backend or "local")
        if self.job is None:
            raise UsageError("no job yet in this notebook\n  → launch one with %%ftrain, or name it: %ftrain attach NAME")
        return self.job


@magic_arguments(name="%ftrain")
@_spec_arguments
def _cell_magic(line: str) -> None:
    """Launch a fault-tolerant training job and show its live dashboard (the cell returns at once).

    An empty cell runs the built-in trainer; Python code in the cell is the training script, run on
    every rank under ft_launcher (``from eksft_nb.runtime import session`` gives it heartbeats, step
    telemetry and fault commands; a script that knows nothing of eksft-nb runs too).
    """


def parse_cell(line: str, cell: str) -> tuple[JobSpec, list[FaultCommand], bool]:
    """What a ``%%ftrain`` cell asks for: the validated spec, the scheduled faults, and whether it is a dry run.

    Raises :class:`UsageError` or :class:`EksftError` with one line that says what to write instead.
    """
    args = _parse(_cell_magic.parser, line, "%%ftrain")
    base = JobSpec.load(args.spec_file) if args.spec_file else None
    spec = cli.spec_from_args(args, base)
    if cell.strip():
        if spec.script:
            raise UsageError("the cell has code and --script names a script too\n"
                             "  → leave the cell empty to run --script, or drop --script to run the cell")
        spec = spec.replace(script=str(save_script(cell))).validate()
    faults = [parse_fault(f).validate(spec.world_size, spec.nnodes) for f in args.fault]
    return spec, faults, args.dry_run


def _parse(parser: MagicArgumentParser, line: str, prog: str) -> argparse.Namespace:
    """Parse a magic line; argparse's complaints become one line that says what to write instead."""
    try:
        return parser.parse_args(shlex.split(line))  # as in a shell: quotes group words and go away
    except ValueError as e:
        raise UsageError(f"cannot split the {prog} line {line.strip()!r}: {e}\n  → close the quote") from None
    except UsageError as e:
        message = str(e)
        subparsers = parser._subparsers._group_actions[0].choices.values() if parser._subparsers else ()
        flags = [f for p in (parser, *subparsers) for f in p._option_string_actions]
        if "unrecognized arguments:" in message:
            bad = message.split("unrecognized arguments:", 1)[1].split()
            unknown = next((b for b in bad if b.startswith("-")), bad[0] if bad else "")
            hint = f"did you mean {_closest(unknown.split('=')[0], flags)}?" if unknown.startswith("-") else \
                "quote values that contain spaces"
            raise UsageError(f"{prog} does not understand {unknown!r}\n  → {hint} ({prog} --help lists every option)") from None
        raise UsageError(f"{message}\n  → {prog} --help lists every option") from None


def save_script(code: str) -> Path:
    """Write a cell's code where every rank can read it; the file is named by its content, so
    re-running a cell never rewrites the script of a job that is still running."""
    root = eksft_home() / "scripts"
    root.mkdir(parents=True, exist_ok=True, mode=0o700)
    path = root / f"cell-{hashlib.sha256(code.encode()).hexdigest()[:16]}.py"
    if not path.exists():
        atomic_write(path, code)
    return path


def blank_body(lines: list[str]) -> list[str]:
    """Input transformer: IPython refuses a cell magic with an empty body, but ``%%ftrain`` alone
    means "the built-in trainer", so such a cell gets a blank body."""
    if lines and re.match(r"%%ftrain(\s|$)", lines[0]) and not "".join(lines[1:]).strip():
        return [lines[0].rstrip("\n") + "\n", "\n"]
    return lines


def register(ipython: Any) -> None:
    ipython.register_magics(FtrainMagics)
    if blank_body not in ipython.input_transformers_cleanup:
        ipython.input_transformers_cleanup.append(blank_body)


FtrainMagics.ftrain.__doc__ = f"{_cell_magic.__doc__}\n\nLine magic:\n{LINE_USAGE}"
