"""``python -m eksft_nb``: the headless twin of the notebook magic. Its commands go through the one
dispatch (:mod:`.dispatch`); what is the terminal's own is here: the parser's "did you mean" and following
a job's progress to its end."""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

from . import arguments
from .arguments import CLI
from .dispatch import dispatch
from .errors import EksftError, closest
from .fault_registry import target_text
from .incidents import phases_text
from .job import Job, attach
from .spec import JobSpec
from .states import CheckpointState, JobState
from .texts import format_summary


class _Parser(argparse.ArgumentParser):
    """argparse, with a "did you mean" for a mistyped option: the closest of the verb's own flags, from the
    argument table (as the magics say it)."""

    words: list[str] = []

    def parse_args(self, args: Sequence[str] | None = None, namespace: Any = None) -> Any:  # type: ignore[override]
        self.words = list(sys.argv[1:] if args is None else args)
        return super().parse_args(args, namespace)

    def error(self, message: str) -> NoReturn:
        if "unrecognized arguments:" in message:
            unknown = next((w for w in message.split("unrecognized arguments:", 1)[1].split()
                            if w.startswith("-")), "")
            verb = next((w for w in self.words if w in arguments.ARGS), None)
            if unknown:
                known = arguments.flags(CLI, [verb] if verb else None)
                message += f" (did you mean {closest(unknown.split('=')[0], known)}?)"
        super().error(message)


def build_parser() -> argparse.ArgumentParser:
    """The CLI's parser, built from :data:`arguments.ARGS` (the magics build theirs from it too)."""
    p = _Parser(prog="python -m eksft_nb", description="Fault-tolerant FSDP training jobs, "
                                "launched, watched, broken on purpose and healed from the terminal.")
    arguments.add_verbs(p.add_subparsers(dest="command", required=True, metavar="COMMAND"), CLI)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return dispatch(args, Terminal())
    except EksftError as e:
        print(f"eksft: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


class Terminal:
    """The CLI's ways (see :class:`.dispatch.Front`)."""

    prog = "python -m eksft_nb"
    inject_wait = 10.0   # a fault fired now is said fired, or queued

    def spec(self, args: argparse.Namespace, verb: str, base: JobSpec | None = None) -> JobSpec:
        base = base or (JobSpec.load(args.spec_file) if args.spec_file else None)
        return arguments.spec_from_args(args, base, validate=False)

    def job(self, args: argparse.Namespace) -> Job:
        return attach(args.name, args.backend)

    def follow(self, job: Job, args: argparse.Namespace) -> int:
        if getattr(args, "detach", False):
            if args.command == "run":
                print(f"follow it with: {self.prog} watch {job.name}")
            return 0
        return follow(job, as_json=getattr(args, "json", False) and args.command == "run")

    def figure(self, make: Callable[[], Any]) -> None:
        """A terminal draws no figure."""

    def card_view(self) -> Callable[[dict[str, Any]], None]:
        return lambda card: None

    def refused(self, lines: list[str]) -> None:
        for line in lines:
            print(f"eksft: error: {line}", file=sys.stderr)


def follow(job: Job, as_json: bool = False) -> int:
    """Print progress and recoveries until the job ends (Ctrl-C detaches; the job keeps running)."""
    from tqdm import tqdm

    mon = job.monitor
    total = None if job.spec.script else job.spec.steps
    seen_restarts = seen_faults = seen_failures = seen_ckpt_fail = 0
    said = ""
    # a live bar on a terminal; in a log (CI, make demo | tee) a line every few seconds instead
    tty = sys.stderr.isatty()
    bar = tqdm(total=total, unit="step", dynamic_ncols=True, file=sys.stderr, disable=as_json,
               mininterval=0.5 if tty else 5.0, ascii=not tty,
               bar_format="{l_bar}{bar}| {n_fmt}/{total_fmt} [{elapsed}] {postfix}")
    try:
        while True:
            state, detail = job.status()
            if state == JobState.STARTING and detail and detail != said:   # e.g. queued, then admitted
                said = detail
                bar.write(f"  . {said}")
            for f in mon.faults[seen_faults:]:
                at = f" at step {f['step']}" if f["step"] is not None else ""
                bar.write(f"  ! fault fired: {f['fault']} on {target_text(f['rank'], f.get('node'))}{at}")
            for f in mon.failures[seen_failures:]:
                bar.write(f"  ~ {f['level']} failure: {f['cause']}")
            for r in mon.restarts[seen_restarts:]:
                if r.get("recovered") is False:
                    bar.write(f"  x {r['level']} restart failed before its first step (after: {r['cause']})")
                    continue
                bar.write(f"  + recovered ({r['level']}): resumed from step {r['resumed_step']}, "
                          f"downtime {r['downtime_s']:.1f}s, {r['rolled_back_steps']} steps rolled back"
                          + (f" ({phases_text(r['phases'])})" if r.get("phases") else ""))
            fails = [c for c in mon.checkpoints.values()
                     if c.state in (CheckpointState.FAILED, CheckpointState.REJECTED)]
            for c in fails[seen_ckpt_fail:]:
                bar.write(f"  ! checkpoint {c.step} {c.state}: {c.error}")
            seen_faults, seen_failures, seen_restarts = len(mon.faults), len(mon.failures), len(mon.restarts)
            seen_ckpt_fail = len(fails)
            if len(mon.steps):
                rate, unit = mon.steps.throughput()
                loss = mon.steps.loss[-1]
                bar.set_postfix_str((f"loss {loss:.3f}  " if loss is not None else "")
                                    + f"{rate:,.1f} {unit}  "
                                    f"restarts {sum(mon.restarts_by_level().values())}", refresh=False)
                bar.update(mon.last_step - bar.n)
            if state.ended:
                break
            time.sleep(0.3)
    except KeyboardInterrupt:
        bar.close()
        print(f"\ndetached; {job.name} keeps running. Re-attach: python -m eksft_nb watch {job.name}")
        return 0
    bar.close()
    summary = job.summary()
    print(json.dumps(summary, indent=2) if as_json else format_summary(summary))
    return 0 if summary["state"] == JobState.SUCCEEDED else 1
