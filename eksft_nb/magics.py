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
from pathlib import Path
from collections.abc import Callable
from typing import Any

from IPython.core.error import UsageError
from IPython.core.magic import Magics, line_cell_magic, magics_class
from IPython.core.magic_arguments import MagicArgumentParser
from IPython.display import display

from . import arguments, commands
from .arguments import ARGS, MAGIC
from .dispatch import dispatch
from .control import FaultCommand
from .dashboard import Dashboard
from .errors import EksftError, closest, shown
from .job import Job, attach
from .jobdir import atomic_write, eksft_home
from .spec import JobSpec

LINE_USAGE = """\
%ftrain list [--json]                 jobs and their state
%ftrain attach NAME [--backend B]     show the dashboard of a job (its whole history, then live)
%ftrain status [NAME] [--json]        state, step, restarts, newest checkpoint, goodput
%ftrain inject [NAME] FAULT [--rank R] [--step S | --after SECONDS] [--node N] [--delay D] [--duration N]
%ftrain ckpts [NAME] [--json]         checkpoints: committed, incomplete, rejected
%ftrain resume [NAME] [--step S] [--as NEW] [--steps N]   a new job from a checkpoint, with its dashboard
%ftrain logs [NAME] [-n LINES] [--debug]
%ftrain summary [NAME] [--json] [--price p5.48xlarge] [--for 30d --nodes 16]
                                      restarts, goodput, digest, and what faults and checkpoints cost
%ftrain set [NAME] ckpt-every=25 keep-last=5   change live settings; every rank takes them at one step
%ftrain stop [NAME]                   stop a job; nothing of it keeps running
%ftrain rm NAME... | --finished       delete ended jobs (their checkpoints too); each refusal is said
%ftrain test [--faults K,K] [--expect "level<=injob, lost<=10"] [--repeat N] [--manifest F | --recheck F]
             [spec options]           a resilience report card (n/N per kind with --repeat)
%ftrain whatif [NAME] [--ckpt-every 5,10,20] [--no-inprocess] [--ckpt-mode sync] [--spares N] [--apply]
                                      the job's failures replayed under other settings (--apply: set
                                      the recommended interval live; --price, --for: in dollars)
%ftrain check [spec options] [--from JOB]   every timeout acting on a job, and what contradicts
%ftrain doctor [spec options]         versions here, what each supports, what a spec would be refused
%%ftrain test [options] + code        resilience test of the cell's code
NAME defaults to the job this notebook launched, attached or resumed last; a NAME finds its job on
whichever backend holds it (local, Slurm, EKS where a kubeconfig is set); --backend picks one."""

CELL_DOC = """Launch a fault-tolerant training job and show its live dashboard (the cell returns at once).

An empty cell runs the built-in trainer; Python code in the cell is the training script, run on
every rank under ft_launcher (``from eksft_nb.runtime import session`` gives it heartbeats, step
telemetry and fault commands; a script that knows nothing of eksft-nb runs too)."""


def _line_parser() -> MagicArgumentParser:
    """``%ftrain``'s parser, built from :data:`arguments.ARGS` like the CLI's."""
    p = MagicArgumentParser(prog="%ftrain", add_help=False)
    arguments.add_verbs(p.add_subparsers(dest="command", parser_class=MagicArgumentParser), MAGIC)
    return p


def _cell_parser() -> MagicArgumentParser:
    """``%%ftrain``'s parser: the options of ``python -m eksft_nb run`` that a notebook takes."""
    p = MagicArgumentParser(prog="%ftrain", description=CELL_DOC)   # its help writes the cell magic's %%
    arguments.add_verb_arguments(p, "run", MAGIC)
    return p


def _test_parser() -> MagicArgumentParser:
    """``%ftrain test``'s and ``%%ftrain test``'s parser: the test verb's options and the spec's."""
    p = MagicArgumentParser(prog="%%ftrain test", add_help=False)
    arguments.add_verb_arguments(p, "test", MAGIC)
    return p


@magics_class
class FtrainMagics(Magics):
    """``%%ftrain [options]`` launches; ``%ftrain COMMAND`` lists, attaches, injects, resumes, stops."""

    def __init__(self, shell: Any) -> None:
        super().__init__(shell)
        self.job: Job | None = None          # the job the line magic acts on when no NAME is given
        self.line_parser = _line_parser()
        self.cell_parser = _cell_parser()
        self.test_parser = _test_parser()

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
        if line.split()[:1] == ["test"]:
            args = _parse(self.test_parser, line.split(None, 1)[1] if len(line.split()) > 1 else "",
                          "%%ftrain test")
            args.command = "test"
        elif {"-h", "--help"} & set(line.split()):
            print(self.cell_parser.format_help())
            return
        else:
            args = _parse(self.cell_parser, line, "%%ftrain")
            args.command = "run"
        dispatch(args, Notebook(self, cell))

    # ---- %ftrain -----------------------------------------------------------------------------
    def _line(self, line: str) -> None:
        tokens = line.split()
        if not tokens or tokens[0] in ("-h", "--help", "help"):
            print(LINE_USAGE)
            return
        args = _parse(self.line_parser, line, "%ftrain")
        if args.command is None:
            raise UsageError(f"unknown command {shown(tokens[0])}\n{LINE_USAGE}")
        args.command = next(v.name for v in ARGS.values() if v.name_in(MAGIC) == args.command)
        dispatch(args, Notebook(self, ""))


class Notebook:
    """The notebook's ways (see :class:`.dispatch.Front`): a NAME left out means the notebook's current
    job, the one it launched, attached or resumed last; a job followed is shown in its dashboard."""

    prog = "%ftrain"
    inject_wait = 0.0   # a cell returns at once: the dashboard shows the fault once it fired

    def __init__(self, magics: FtrainMagics, cell: str) -> None:
        self.magics, self.cell = magics, cell

    def spec(self, args: argparse.Namespace, verb: str, base: JobSpec | None = None) -> JobSpec:
        return _cell_spec(args, self.cell, verb, base)

    def job(self, args: argparse.Namespace) -> Job:
        if args.name:
            return attach(args.name, args.backend)
        if self.magics.job is None:
            raise UsageError("no job yet in this notebook\n  → launch one with %%ftrain, or name it: "
                             "%ftrain attach NAME")
        return self.magics.job

    def follow(self, job: Job, args: argparse.Namespace) -> int:
        """Make ``job`` the notebook's current job and display its dashboard."""
        self.magics.job = job
        display(Dashboard(job))
        return 0

    def figure(self, make: Callable[[], Any]) -> None:
        display(make())

    def card_view(self) -> Callable[[dict[str, Any]], None]:
        """The card's figure, shown now and redrawn after each case (its JavaScript by reference)."""
        from .dashboard.figure import FigureWidget
        from .resilience.figures import card_figure

        live = FigureWidget()
        display(live)

        def redraw(card: dict[str, Any]) -> None:
            card_figure(card, live)
            live.settle()   # a notebook saved now redraws the whole card, not the empty figure first shown
        return redraw

    def refused(self, lines: list[str]) -> None:
        raise UsageError("\n".join(lines))


def parse_cell(line: str, cell: str, parser: MagicArgumentParser | None = None
               ) -> tuple[JobSpec, list[FaultCommand], bool]:
    """What a ``%%ftrain`` cell asks for: the validated spec, the scheduled faults, and whether it is a
    dry run (what its backend refuses, and what must exist here, is the launch's to check).

    Raises :class:`UsageError` or :class:`EksftError` with one line that says what to write instead.
    """
    args = _parse(parser or _cell_parser(), line, "%%ftrain")
    spec = _cell_spec(args, cell, "run").validate()
    return spec, commands.faults_for(spec, args.fault), args.dry_run


def _cell_spec(args: argparse.Namespace, cell: str, verb: str, base: JobSpec | None = None) -> JobSpec:
    """The spec a cell's options describe (over ``base``: a test's --recheck manifest's spec; else its --spec
    file), not yet validated; code in the cell becomes the job's script."""
    base = base or (JobSpec.load(args.spec_file) if args.spec_file else None)
    spec = arguments.spec_from_args(args, base, validate=False)
    if cell.strip():
        if spec.script:
            raise UsageError("the cell has code and --script names a script too\n"
                             f"  → leave the cell empty to {verb} --script, or drop --script to "
                             f"{verb} the cell")
        spec = spec.replace(script=str(save_script(cell)))
    return spec


def _parse(parser: MagicArgumentParser, line: str, prog: str) -> argparse.Namespace:
    """Parse a magic line; argparse's complaints become one line that says what to write instead."""
    try:
        words = shlex.split(line)  # as in a shell: quotes group words and go away
    except ValueError as e:
        raise UsageError(f"cannot split the {prog} line {shown(line.strip())}: {e}\n"
                         "  → close the quote") from None
    verb = next((v.name for v in ARGS.values() if prog == "%ftrain" and words[:1] == [v.name_in(MAGIC)]),
                None)
    verbs = ["run"] if prog == "%%ftrain" else ["test"] if prog == "%%ftrain test" else \
        [verb] if verb else [v for v in ARGS if v != "run"]
    try:
        return parser.parse_args(words)
    except UsageError as e:
        message = str(e)
        if "unrecognized arguments:" in message:
            bad = message.split("unrecognized arguments:", 1)[1].split()
            unknown = next((b for b in bad if b.startswith("-")), bad[0] if bad else "")
            if unknown.startswith("-"):
                hint = f"did you mean {closest(unknown.split('=')[0], arguments.flags(MAGIC, verbs))}?"
                raise UsageError(f"{prog} does not understand {shown(unknown)}\n  → {hint} ({prog} --help "
                                 "lists every option)") from None
            if verb:
                raise UsageError(f"{words[0]} takes {arguments.positionals(verb, MAGIC)}, not "
                                 f"{shown(unknown)} too\n"
                                 f"  → quote values that contain spaces ({prog} --help lists every "
                                 "command)") from None
            raise UsageError(f"{prog} does not understand {shown(unknown)}\n  → quote values that contain "
                             f"spaces ({prog} --help lists every option)") from None
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


FtrainMagics.ftrain.__doc__ = f"{CELL_DOC}\n\nLine magic:\n{LINE_USAGE}"
