"""The one dispatch under both front ends: from a command line parsed with :data:`arguments.ARGS`
(``python -m eksft_nb VERB`` or ``%ftrain VERB``) to the command layer's call and what is printed of its
answer. What differs is the :class:`Front`: which job a NAME left out means (the notebook's current job),
how a job is followed (the terminal's progress to the end, the notebook's live dashboard), a spec's cell
code and figures; everything else is said the same way in both.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from . import commands, cost, nvrx
from .engines.registry import engine_of
from .errors import EksftError
from .job import Job, attach
from .jobdir import atomic_write
from .spec import JobSpec
from .texts import format_checkpoints, format_list, format_status, format_summary, show


class Front(Protocol):
    """What a front end does its own way."""

    prog: str            # how a user writes a command there ("python -m eksft_nb", "%ftrain")
    inject_wait: float   # seconds a fault injected now is waited for before the answer

    def spec(self, args: argparse.Namespace, verb: str, base: JobSpec | None = None) -> JobSpec:
        """The spec a command's options (and, in the notebook, its cell's code) describe over ``base`` (else
        its --spec file, else the defaults), not validated."""

    def job(self, args: argparse.Namespace) -> Job:
        """The job a command acts on: the one NAME names, or (the notebook) its current job."""

    def follow(self, job: Job, args: argparse.Namespace) -> int:
        """Follow a job just launched or attached to (the CLI to its end unless ``--detach``)."""

    def figure(self, make: Callable[[], Any]) -> None:
        """Show a figure where the front end can (``make`` builds it)."""

    def card_view(self) -> Callable[[dict[str, Any]], None]:
        """What redraws a resilience test's card after each case (and once at the end)."""

    def refused(self, lines: list[str]) -> None:
        """Say what a command of many refused, one line each (the notebook: as the cell's error)."""


def dispatch(args: argparse.Namespace, front: Front) -> int:
    """Do what ``args`` ask; the exit code (0; 1 where a check or a test failed; 2 where ``rm`` refused a
    job)."""
    return HANDLERS[args.command](args, front) or 0


def _run(args: argparse.Namespace, front: Front) -> int:
    spec = front.spec(args, "run")   # validated once, with the faults, by the launch (or dry run)
    if args.dry_run:
        print(commands.dry_run(spec, queue_objects=args.kueue_objects, faults=args.fault))
        return 0
    row = commands.launch(spec, args.fault)
    print(f"launched {row['name']}: {engine_of(spec).describe(spec)}")
    for warning in row["warnings"]:
        print(f"warning: {warning}")
    if (spec.backend == "local" and spec.ft.inprocess and (here := nvrx.installed())
            and (note := here.inprocess_note())):
        print(f"note: {note}")  # on EKS the image's NVRx decides
    return front.follow(attach(row["name"], row["backend"]), args)


def _watch(args: argparse.Namespace, front: Front) -> int:
    return front.follow(front.job(args), args)


def _list(args: argparse.Namespace, front: Front) -> int:
    show(commands.list_jobs(args.backend or "local"), args.json, format_list)
    return 0


def _shown(call: Callable[..., Any], text: Callable[[Any], str], priced: bool = False) -> Callable[..., int]:
    """The handler of a verb that shows what ``call`` answers of the job (as JSON with --json); ``priced``:
    it takes the cost options (--price, --for, --nodes, --failures-per-day)."""
    def handler(args: argparse.Namespace, front: Front) -> int:
        job = front.job(args)
        show(call(job.name, job.backend.name, **(cost.options_of(args) if priced else {})), args.json, text)
        return 0
    return handler


def _logs(args: argparse.Namespace, front: Front) -> int:
    job = front.job(args)
    print(commands.logs(job.name, args.lines, args.debug, job.backend.name))
    return 0


def inject_params(args: argparse.Namespace) -> dict[str, Any]:
    return {k: v for k, v in (("delay", args.delay), ("duration", args.duration)) if v is not None}


def _inject(args: argparse.Namespace, front: Front) -> int:
    job = front.job(args)
    now = args.step is None and args.after is None
    print(commands.inject(job.name, args.fault, rank=args.rank, step=args.step, after=args.after,
                          node=args.node, params=inject_params(args), backend=job.backend.name,
                          wait=front.inject_wait if now else 0.0)["message"])
    return 0


def _resume(args: argparse.Namespace, front: Front) -> int:
    job = front.job(args)
    row = commands.resume(job.name, step=args.step, new_name=args.new_name, steps=args.steps,
                          backend=job.backend.name)
    print(row["message"])
    return front.follow(attach(row["name"], row["backend"]), args)


def _set(args: argparse.Namespace, front: Front) -> int:
    if args.name and "=" in args.name:   # no NAME (a notebook's current job): the first word is a setting
        args.assignments, args.name = [args.name, *args.assignments], None
    job = front.job(args)
    result = commands.set_settings(job.name, args.assignments, backend=job.backend.name, wait=args.wait)
    show(result, args.json, lambda r: r["message"])
    return 0


def _stop(args: argparse.Namespace, front: Front) -> int:
    job = front.job(args)
    print(commands.stop(job.name, job.backend.name)["message"])
    return 0


def _rm(args: argparse.Namespace, front: Front) -> int:
    """``rm NAME...`` (each on whichever backend holds it, unless --backend) or ``rm --finished`` (the
    backend's ended jobs; default local), never the notebook's current job unless named: each job removed or
    refused on its own; 0 when every one went, 2 when one was refused."""
    if bool(args.names) == args.finished:
        raise EksftError("rm takes the NAME of each job to delete, or --finished (not both)",
                         f"e.g. {front.prog} rm my-job other-job, or {front.prog} rm --finished")
    if args.finished:
        backend = args.backend or "local"
        jobs = [(n, backend) for n in commands.finished_jobs(backend)]
        if not jobs:
            print(f"no ended job to remove on {backend}")
            return 0
    else:
        jobs = [(n, args.backend) for n in args.names]
    results = commands.remove_jobs(jobs)
    for r in results:
        if r["removed"]:
            print(r["message"])
    refused = [r["message"] for r in results if not r["removed"]]
    if refused:
        front.refused(refused)
    return 2 if refused else 0


def _test(args: argparse.Namespace, front: Front) -> int:
    """A resilience test: the narration as it runs (on stderr with --json), then the report card (and its
    JUnit XML with --junit); exit code 1 when a case failed."""
    from .resilience import manifest as manifests
    from .resilience.card import junit, table

    junit_path = Path(args.junit).expanduser() if args.junit else None
    if junit_path is not None and not junit_path.parent.is_dir():   # found out now, not after the test's jobs
        raise EksftError(f"--junit {args.junit}: folder {junit_path.parent} does not exist",
                         "create it first")
    base, manifest = manifests.test_base(args)   # a --recheck's spec under the options given
    spec = front.spec(args, "test", base).validate()
    say = (lambda text: print(text, file=sys.stderr, flush=True)) if args.json else print
    view = front.card_view()
    card = commands.resilience_test(spec, args.faults, args.expect, at_step=args.at_step,
                                    loss_tolerance=args.loss_tol, repeat=args.repeat,
                                    plan_seed=args.plan_seed, manifest=args.manifest, recheck=manifest,
                                    say=say, on_row=view,
                                    **cost.options_of(args))
    view(card)
    if junit_path is not None:
        try:
            atomic_write(junit_path, junit(card))   # type: ignore[arg-type]
        except OSError as e:
            raise EksftError(f"cannot write --junit {junit_path} ({e.strerror})",
                             "pick a writable file") from None
    show(card, args.json, table)
    return 0 if card["passed"] else 1


def _whatif(args: argparse.Namespace, front: Front) -> int:
    from .resilience.whatif_cost import text

    job = front.job(args)
    report = commands.whatif(job.name, ckpt_every=args.ckpt_every, inprocess=args.inprocess,
                             ckpt_mode=args.ckpt_mode, spares=args.spares, backend=job.backend.name,
                             **cost.options_of(args))
    show(report, args.json, text)
    if not args.json:
        front.figure(lambda: _whatif_figure(report))
    if args.apply:
        print(commands.apply_whatif(job.name, backend=job.backend.name, wait=30.0)["message"])
    return 0


def _whatif_figure(report: dict[str, Any]) -> Any:
    from .resilience.figures import whatif_figure

    return whatif_figure(report)


def _check(args: argparse.Namespace, front: Front) -> int:
    report = commands.check(front.spec(args, "check"), args.from_job, args.from_backend)
    show(report, args.json, lambda r: r["message"])
    return 1 if any(f["refuse"] for f in report["findings"]) else 0


def _doctor(args: argparse.Namespace, front: Front) -> int:
    report = commands.doctor(front.spec(args, "doctor"), on_node=args.on_node)
    refused = [f for f in report["findings"] if f["refuse"]]
    if args.on_node and not args.json:   # a gate in a pod's or batch job's log: one line, why it stops
        env = report["environment"]
        for f in refused:
            print(f"eksft: error: {f['problem']} → {f['fix']}", file=sys.stderr)
        if not refused:
            print(f"doctor: NVRx {env['nvrx']}, torch {env['torch']}, {env['gpus']} GPU(s): nothing refused")
    else:
        show(report, args.json, lambda r: r["message"])
    return 1 if refused else 0


def _metrics(args: argparse.Namespace, front: Front) -> int:
    from .backends.local import LocalBackend
    from .metrics import serve

    root = Path(args.root) if args.root else None
    for name in args.names:
        LocalBackend(root).spec(name)  # unknown names fail before anything listens
    serve(args.names, args.port, args.addr, root)
    return 0


# one handler per verb of the argument table (tests/test_commands.py holds them to it)
HANDLERS: dict[str, Callable[[argparse.Namespace, Front], int]] = {
    "run": _run, "list": _list, "watch": _watch, "status": _shown(commands.status, format_status),
    "summary": _shown(commands.summary, format_summary, priced=True),
    "ckpts": _shown(commands.checkpoints, format_checkpoints),
    "logs": _logs, "inject": _inject, "resume": _resume, "set": _set, "stop": _stop, "rm": _rm,
    "test": _test, "whatif": _whatif, "check": _check, "doctor": _doctor, "metrics": _metrics}
