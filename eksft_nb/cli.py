"""``python -m eksft_nb``: the headless twin of the notebook magic."""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

from . import commands, cost, nvrx, reasons
from .ckpt_floor import floor_text
from .commands import CLI
from .engines.registry import engine_of
from .errors import EksftError, closest
from .fault_registry import target_text
from .goodput import CATEGORIES
from .incidents import phases_text
from .job import Job, attach
from .spec import JobSpec
from .states import CheckpointState, JobState


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
            verb = next((w for w in self.words if w in commands.ARGS), None)
            if unknown:
                known = commands.flags(CLI, [verb] if verb else None)
                message += f" (did you mean {closest(unknown.split('=')[0], known)}?)"
        super().error(message)


def build_parser() -> argparse.ArgumentParser:
    """The CLI's parser, built from :data:`commands.ARGS` (the magics build theirs from it too)."""
    p = _Parser(prog="python -m eksft_nb", description="Fault-tolerant FSDP training jobs, "
                                "launched, watched, broken on purpose and healed from the terminal.")
    commands.add_verbs(p.add_subparsers(dest="command", required=True, metavar="COMMAND"), CLI)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return COMMANDS[args.command](args) or 0
    except EksftError as e:
        print(f"eksft: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


# ---- commands -----------------------------------------------------------------------------------

def cmd_run(args: argparse.Namespace) -> int:
    base = JobSpec.load(args.spec_file) if args.spec_file else None
    spec = commands.spec_from_args(args, base, validate=False)   # the launch (or dry run) validates it
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
    if args.detach:
        print(f"follow it with: python -m eksft_nb watch {spec.name}")
        return 0
    return follow(attach(spec.name, spec.backend), as_json=args.json)


def cmd_watch(args: argparse.Namespace) -> int:
    return follow(attach(args.name, args.backend))


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


def format_summary(s: dict[str, Any]) -> str:
    steps = (f"{s['steps_done']}/{s['total_steps']}" if s["total_steps"]
             else f"{s['steps_done']} (optimizer steps seen)")
    lines = [f"job {s['name']}: {s['state']}" + (f" ({s['reason']})" if s["reason"] else ""),
             f"steps done: {steps}   final parameters digest: {s['digest'] or '-'}",
             "restarts: " + ", ".join(f"{k} {v}" for k, v in s["restarts"].items())]
    if s.get("resumed_from"):   # where it started, and each checkpoint refused before that one
        lines.insert(1, f"resumed {s['resumed_from']}")
    if s["restart_events"]:
        lines.append(f"  {'level':<10}{'cause':<44}{'blamed':>7}{'detect':>8}{'downtime':>10}{'lost':>6}")
        for r in s["restart_events"]:
            blamed = "-" if r["blame_rank"] is None else str(r["blame_rank"])
            lines.append(f"  {r['level']:<10}{r['cause'][:43]:<44}{blamed:>7}{r['detection_s']:>7.1f}s"
                         f"{r['downtime_s']:>9.1f}s{r['rolled_back_steps']:>6}"
                         + ("  failed before a step" if r.get("recovered") is False else ""))
            if r.get("phases"):
                lines.append(f"    phases: {phases_text(r['phases'])}")
    for lost in s.get("events_lost", []):  # what the events file lacks: say so, never hide it
        kinds = ", ".join(f"{n} {k}" for k, n in (lost["kinds"] or {}).items())
        lines.append(f"events lost: {lost['count']} of rank {lost['rank']} ({kinds}): {lost['error']}")
    lines += [f"warning: {w}" for w in s.get("warnings", [])]
    g = s["goodput"]
    lines.append(f"goodput: {100 * g['goodput']:.1f}% of {g['wall_s']:.1f}s wall time")
    for key in CATEGORIES:
        sec = g[f"{key}_s"]
        pct = 100 * sec / g["wall_s"] if g["wall_s"] else 0.0
        lines.append(f"  {key.replace('_', ' '):<24}{sec:8.1f}s {pct:6.1f}%"
                     + (f"  {cost.text(s['cost']['terms'][key])}" if s.get("cost") else ""))
    lines += cost.account_text(s["cost"]) if s.get("cost") else []
    lines += floor_text(s["checkpoint_floor"]) if s.get("checkpoint_floor") else []
    return "\n".join(lines)


def format_list(rows: list[commands.JobRow]) -> str:
    if not rows:
        return "no jobs yet: launch one with `python -m eksft_nb run`"
    lines = []
    for r in rows:
        if r["backend"] != "local":  # a listing reads no remote job's logs: its state only
            lines.append(f"{r['name']:<32}{r['state']:<11}{r['detail']}")
        else:
            lines.append(f"{r['name']:<32}{r['state']:<11}{r['step']:>7}/{r['total_steps'] or '-':<7}"
                         f"restarts {sum(r['restarts'].values())}"
                         + (f"  {r['detail']}" if r["detail"] else ""))
    return "\n".join(lines)


def format_status(r: commands.JobRow) -> str:
    goodput = "-" if r["goodput"] is None else f"{100 * r['goodput']:.1f}%"
    said = reasons.line(r) or r["detail"]   # why it failed, what it waits for and since when
    return (f"{r['name']}: {r['state']}  step {r['step']}/{r['total_steps'] or '-'}  restarts "
            f"{r['restarts']}  "
            f"last checkpoint {r['last_checkpoint']}  goodput {goodput}"
            + (f"  ({said})" if said else ""))


def format_checkpoints(infos: list[dict[str, Any]]) -> str:
    if not infos:
        return "no checkpoints yet"
    lines = []
    for i in infos:
        when = time.strftime("%H:%M:%S", time.localtime(i["time"])) if i["time"] else "-"
        note = f"  ({i['reason']})" if i["reason"] else ""
        lines.append(f"step {i['step']:>7}  {i['state']:<10} {i['bytes'] / 2**20:8.2f} MiB  {when}  "
                     f"{i['path']}{note}")
    return "\n".join(lines)


def show(value: Any, as_json: bool, text: Callable[[Any], str]) -> None:
    print(json.dumps(value, indent=2) if as_json else text(value))


def cmd_list(args: argparse.Namespace) -> int:
    show(commands.list_jobs(args.backend), args.json, format_list)
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    show(commands.status(args.name, args.backend), args.json, format_status)
    return 0


def cmd_summary(args: argparse.Namespace) -> int:
    show(commands.summary(args.name, args.backend, **cost.options_of(args)), args.json, format_summary)
    return 0


def cmd_ckpts(args: argparse.Namespace) -> int:
    show(commands.checkpoints(args.name, args.backend), args.json, format_checkpoints)
    return 0


def cmd_logs(args: argparse.Namespace) -> int:
    print(commands.logs(args.name, args.lines, args.debug, args.backend))
    return 0


def inject_params(args: argparse.Namespace) -> dict[str, Any]:
    return {k: v for k, v in (("delay", args.delay), ("duration", args.duration)) if v is not None}


def cmd_inject(args: argparse.Namespace) -> int:
    now = args.step is None and args.after is None
    print(commands.inject(args.name, args.fault, rank=args.rank, step=args.step, after=args.after,
                          node=args.node,
                          params=inject_params(args), backend=args.backend,
                          wait=10.0 if now else 0.0)["message"])
    return 0


def cmd_resume(args: argparse.Namespace) -> int:
    row = commands.resume(args.name, step=args.step, new_name=args.new_name, steps=args.steps,
                          backend=args.backend)
    print(row["message"])
    return 0 if args.detach else follow(attach(row["name"], args.backend))


def cmd_set(args: argparse.Namespace) -> int:
    result = commands.set_settings(args.name, args.assignments, backend=args.backend, wait=args.wait)
    show(result, args.json, lambda r: r["message"])
    return 0


def cmd_stop(args: argparse.Namespace) -> int:
    print(commands.stop(args.name, args.backend)["message"])
    return 0


def cmd_rm(args: argparse.Namespace) -> int:
    """Each job removed or refused on its own: 0 when every one went, 2 when one was refused."""
    results = removals(args.names, args.finished, args.backend)
    if not results:
        print(f"no ended job to remove on {args.backend}")
    for r in results:
        print(r["message"] if r["removed"] else f"eksft: error: {r['message']}",
              file=sys.stdout if r["removed"] else sys.stderr)
    return 0 if all(r["removed"] for r in results) else 2


def removals(names: list[str], finished: bool, backend: str) -> list[commands.Removal]:
    """``rm NAME...`` or ``rm --finished``, as the CLI and the magic take them."""
    if bool(names) == finished:
        raise EksftError("rm takes the NAME of each job to delete, or --finished (not both)",
                         "e.g. rm my-job other-job, or rm --finished")
    if finished and not (names := commands.finished_jobs(backend)):
        return []
    return commands.remove_jobs([(n, backend) for n in names])


def cmd_test(args: argparse.Namespace) -> int:
    from pathlib import Path

    from .resilience import manifest as manifests
    from .resilience.card import junit, table

    junit_path = Path(args.junit).expanduser() if args.junit else None
    if junit_path is not None and not junit_path.parent.is_dir():   # found out now, not after the test's jobs
        raise EksftError(f"--junit {args.junit}: folder {junit_path.parent} does not exist",
                         "create it first")
    base, manifest = manifests.test_base(args)
    spec = commands.spec_from_args(args, base)
    say = (lambda text: print(text, file=sys.stderr, flush=True)) if args.json else print
    card = commands.resilience_test(spec, args.faults, args.expect, at_step=args.at_step,
                                    loss_tolerance=args.loss_tol, repeat=args.repeat,
                                    plan_seed=args.plan_seed,
                                    manifest=args.manifest, recheck=manifest, say=say,
                                    **cost.options_of(args))
    if junit_path is not None:
        try:
            junit_path.write_text(junit(card))   # type: ignore[arg-type]
        except OSError as e:
            raise EksftError(f"cannot write --junit {junit_path} ({e.strerror})",
                             "pick a writable file") from None
    show(card, args.json, table)
    return 0 if card["passed"] else 1


def cmd_whatif(args: argparse.Namespace) -> int:
    from .resilience.whatif_cost import text

    report = commands.whatif(args.name, ckpt_every=args.ckpt_every, inprocess=args.inprocess,
                             ckpt_mode=args.ckpt_mode, spares=args.spares, backend=args.backend,
                             **cost.options_of(args))
    show(report, args.json, text)
    if args.apply:
        print(commands.apply_whatif(args.name, backend=args.backend, wait=30.0)["message"])
    return 0


def cmd_check(args: argparse.Namespace) -> int:
    base = JobSpec.load(args.spec_file) if args.spec_file else None
    report = commands.check(commands.spec_from_args(args, base, validate=False), args.from_job,
                            args.from_backend)
    show(report, args.json, lambda r: r["message"])
    return 1 if any(f["refuse"] for f in report["findings"]) else 0


def cmd_doctor(args: argparse.Namespace) -> int:
    base = JobSpec.load(args.spec_file) if args.spec_file else None
    report = commands.doctor(commands.spec_from_args(args, base, validate=False), on_node=args.on_node)
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


def cmd_metrics(args: argparse.Namespace) -> int:
    from pathlib import Path

    from .backends.local import LocalBackend
    from .metrics import serve

    root = Path(args.root) if args.root else None
    for name in args.names:
        LocalBackend(root).spec(name)  # unknown names fail before anything listens
    serve(args.names, args.port, args.addr, root)
    return 0


COMMANDS = {"run": cmd_run, "watch": cmd_watch, "list": cmd_list, "status": cmd_status,
            "summary": cmd_summary,
            "ckpts": cmd_ckpts, "logs": cmd_logs, "inject": cmd_inject, "resume": cmd_resume,
            "stop": cmd_stop,
            "rm": cmd_rm, "set": cmd_set, "metrics": cmd_metrics, "test": cmd_test, "whatif": cmd_whatif,
            "check": cmd_check, "doctor": cmd_doctor}
