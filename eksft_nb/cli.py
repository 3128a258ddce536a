"""``python -m eksft_nb``: the headless twin of the notebook magic."""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from typing import Any

from . import nvrx
from .backends import get_backend
from .control import FAULTS, parse_fault
from .errors import EksftError
from .job import Job, attach
from .spec import JobSpec, SpecOption, parse_option_value, spec_options


def add_spec_options(parser: argparse.ArgumentParser) -> None:
    """One flag per spec field (defaults are not set here: only given flags override the spec)."""
    for opt in spec_options():
        if opt.type is bool:
            parser.add_argument(opt.flag, dest=opt.path, action=argparse.BooleanOptionalAction,
                                default=argparse.SUPPRESS, help=f"{opt.help} (default: {opt.default})")
        else:
            choices = f" {{{','.join(opt.choices)}}}" if opt.choices else ""
            parser.add_argument(opt.flag, dest=opt.path, default=argparse.SUPPRESS, metavar=opt.flag[2:].upper(),
                                help=f"{opt.help}{choices} (default: {opt.default})")


def spec_from_args(args: argparse.Namespace, base: JobSpec | None = None) -> JobSpec:
    """Apply the spec flags present in ``args`` on top of ``base``; validate."""
    options: dict[str, SpecOption] = {o.path: o for o in spec_options()}
    changes = {}
    for path, opt in options.items():
        if hasattr(args, path):
            raw = getattr(args, path)
            changes[path] = raw if isinstance(raw, bool) else parse_option_value(opt, raw)
    spec = (base or JobSpec()).replace(**changes) if changes else (base or JobSpec())
    return spec.validate()


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m eksft_nb", description="Fault-tolerant FSDP training jobs, "
                                "launched, watched, broken on purpose and healed from the terminal.")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    run = sub.add_parser("run", help="launch a job (and follow it)")
    run.add_argument("--spec", dest="spec_file", help="a YAML or JSON job spec; flags override it")
    run.add_argument("--fault", action="append", default=[], metavar="KIND[:RANK][@STEP]",
                     help=f"schedule a fault, e.g. sigkill:1@30 (kinds: {', '.join(FAULTS)})")
    run.add_argument("--detach", action="store_true", help="return at once; the job keeps running")
    run.add_argument("--dry-run", action="store_true", help="print what would run (EKS: the manifests) and exit")
    run.add_argument("--kueue-objects", action="store_true", help="with --dry-run --queue NAME: also print a Kueue "
                     "LocalQueue, ClusterQueue and ResourceFlavors (p5/p4d) for it, for an admin to adapt and apply")
    run.add_argument("--json", action="store_true", help="print the final summary as JSON")
    add_spec_options(run)

    where = argparse.ArgumentParser(add_help=False)
    where.add_argument("--backend", choices=("local", "eks"), default="local",
                       help="where the job runs (eks: the kubeconfig's current context and namespace)")
    sub.add_parser("list", help="list jobs", parents=[where]).add_argument("--json", action="store_true")
    for name, helptext in (("status", "state and progress of a job"), ("summary", "steps, restarts, goodput, digest"),
                           ("ckpts", "checkpoints of a job")):
        sp = sub.add_parser(name, help=helptext, parents=[where])
        sp.add_argument("name")
        sp.add_argument("--json", action="store_true")
    watch = sub.add_parser("watch", help="follow a running job (re-attach)", parents=[where])
    watch.add_argument("name")
    logs = sub.add_parser("logs", help="the job's log (library noise filtered unless --debug)", parents=[where])
    logs.add_argument("name")
    logs.add_argument("-n", "--lines", type=int, default=200)
    logs.add_argument("--debug", action="store_true", help="show everything, launcher and library lines included")

    inj = sub.add_parser("inject", help="inject a fault into a running job", parents=[where])
    inj.add_argument("name")
    inj.add_argument("fault", help=f"one of: {', '.join(FAULTS)}")
    inj.add_argument("--rank", type=int, help="target rank (rank faults; default 0)")
    inj.add_argument("--step", type=int, help="fire at the start of this step (a script's: optimizer step; "
                     "default: now)")
    inj.add_argument("--after", type=float, metavar="SECONDS", help="fire this many seconds from now")
    inj.add_argument("--node", type=int, default=0, help="target node (kill-launcher)")
    inj.add_argument("--delay", type=float, help="slow-rank: seconds added per step")
    inj.add_argument("--duration", type=int, help="slow-rank: for this many steps")

    res = sub.add_parser("resume", help="start a new job from a checkpoint of this one", parents=[where])
    res.add_argument("name")
    res.add_argument("--step", type=int, help="checkpoint step (default: the newest committed)")
    res.add_argument("--as", dest="new_name", help="name of the new job (default: NAME-from-STEP)")
    res.add_argument("--steps", type=int, help="train to this many steps in total")
    res.add_argument("--detach", action="store_true")

    stop = sub.add_parser("stop", help="stop a job; nothing of it keeps running", parents=[where])
    stop.add_argument("name")
    rm = sub.add_parser("rm", help="delete a finished job (its folder or workload; checkpoints included)",
                        parents=[where])
    rm.add_argument("name")
    metrics = sub.add_parser("metrics", help="serve Prometheus metrics of jobs (all, or the ones named)")
    metrics.add_argument("names", nargs="*", metavar="NAME")
    metrics.add_argument("--port", type=int, default=9400)
    metrics.add_argument("--addr", default="127.0.0.1", help="address to listen on (default: loopback only)")
    metrics.add_argument("--root", help="the jobs folder (default: $EKSFT_HOME/jobs; in an EKS pod: the shared volume)")
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
    spec = spec_from_args(args, base)
    faults = [parse_fault(f).validate(spec.world_size, spec.nnodes) for f in args.fault]
    backend = get_backend(spec.backend)
    if args.dry_run:
        print(backend.render(spec, queue_objects=True) if args.kueue_objects and spec.backend == "eks"
              else backend.render(spec))
        return 0
    backend.launch(spec, faults)
    job = Job(spec.name, backend)
    print(f"launched {spec.name}: {describe(spec)}")
    if spec.backend == "local" and spec.ft.inprocess and (here := nvrx.installed()) and (note := here.inprocess_note()):
        print(f"note: {note}")  # on EKS the image's NVRx decides
    if args.detach:
        print(f"follow it with: python -m eksft_nb watch {spec.name}")
        return 0
    return follow(job, as_json=args.json)


def describe(spec: JobSpec) -> str:
    """What a job runs, in one line: only what applies to it (a script has its own steps and checkpoints)."""
    ranks = f"{spec.world_size} ranks ({spec.nnodes}x{spec.nproc_per_node})"
    if spec.script:
        args = " " + " ".join(spec.script_args) if spec.script_args else ""
        return (f"{ranks} running {spec.script}{args} (its own loop: steps are its optimizer steps), "
                f"up to {spec.ft.max_injob_restarts} in-job and {spec.ft.max_job_restarts} job restarts")
    return (f"{ranks}, {spec.steps} steps, model {spec.model.preset}, {spec.checkpoint.mode} checkpoints every "
            f"{spec.checkpoint.every} steps, in-process restart {'on' if spec.ft.inprocess else 'off'}")


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
            state = job.state
            if state == "starting" and job.detail and job.detail != said:   # e.g. queued, then admitted
                said = job.detail
                bar.write(f"  . {said}")
            for f in mon.faults[seen_faults:]:
                target = (f"rank {f['rank']}" if f["rank"] is not None else
                          f"node {f['node']}" if f.get("node") is not None else "the job")
                at = f" at step {f['step']}" if f["step"] is not None else ""
                bar.write(f"  ! fault fired: {f['fault']} on {target}{at}")
            for f in mon.failures[seen_failures:]:
                bar.write(f"  ~ {f['level']} failure: {f['cause']}")
            for r in mon.restarts[seen_restarts:]:
                bar.write(f"  + recovered ({r['level']}): resumed from step {r['resumed_step']}, "
                          f"downtime {r['downtime_s']:.1f}s, {r['rolled_back_steps']} steps rolled back")
            fails = [c for c in mon.checkpoints.values() if c.state in ("failed", "rejected")]
            for c in fails[seen_ckpt_fail:]:
                bar.write(f"  ! checkpoint {c.step} {c.state}: {c.error}")
            seen_faults, seen_failures, seen_restarts = len(mon.faults), len(mon.failures), len(mon.restarts)
            seen_ckpt_fail = len(fails)
            if len(mon.steps):
                rate, unit = mon.steps.throughput()
                loss = mon.steps.loss[-1]
                bar.set_postfix_str((f"loss {loss:.3f}  " if loss is not None else "") + f"{rate:,.1f} {unit}  "
                                    f"restarts {sum(mon.restarts_by_level().values())}", refresh=False)
                bar.update(mon.last_step - bar.n)
            if state in ("succeeded", "failed", "stopped", "lost"):
                break
            time.sleep(0.3)
    except KeyboardInterrupt:
        bar.close()
        print(f"\ndetached; {job.name} keeps running. Re-attach: python -m eksft_nb watch {job.name}")
        return 0
    bar.close()
    summary = job.summary()
    print(json.dumps(summary, indent=2) if as_json else format_summary(summary))
    return 0 if summary["state"] == "succeeded" else 1


def format_summary(s: dict[str, Any]) -> str:
    steps = f"{s['steps_done']}/{s['total_steps']}" if s["total_steps"] else f"{s['steps_done']} (optimizer steps seen)"
    lines = [f"job {s['name']}: {s['state']}" + (f" ({s['reason']})" if s["reason"] else ""),
             f"steps done: {steps}   final parameters digest: {s['digest'] or '-'}",
             "restarts: " + ", ".join(f"{k} {v}" for k, v in s["restarts"].items())]
    if s["restart_events"]:
        lines.append(f"  {'level':<10}{'cause':<44}{'blamed':>7}{'detect':>8}{'downtime':>10}{'lost':>6}")
        for r in s["restart_events"]:
            blamed = "-" if r["blame_rank"] is None else str(r["blame_rank"])
            lines.append(f"  {r['level']:<10}{r['cause'][:43]:<44}{blamed:>7}{r['detection_s']:>7.1f}s"
                         f"{r['downtime_s']:>9.1f}s{r['rolled_back_steps']:>6}")
    for lost in s.get("events_lost", []):  # what the events file lacks: say so, never hide it
        kinds = ", ".join(f"{n} {k}" for k, n in (lost["kinds"] or {}).items())
        lines.append(f"events lost: {lost['count']} of rank {lost['rank']} ({kinds}): {lost['error']}")
    g = s["goodput"]
    lines.append(f"goodput: {100 * g['goodput']:.1f}% of {g['wall_s']:.1f}s wall time")
    for key in ("productive", "checkpoint_stall", "restart_downtime", "recomputed", "startup", "other"):
        sec = g[f"{key}_s"]
        pct = 100 * sec / g["wall_s"] if g["wall_s"] else 0.0
        lines.append(f"  {key.replace('_', ' '):<18}{sec:8.1f}s {pct:6.1f}%")
    return "\n".join(lines)


def cmd_list(args: argparse.Namespace) -> int:
    jobs = get_backend(args.backend).jobs()
    if args.json:
        print(json.dumps([j.__dict__ for j in jobs], indent=2))
    elif not jobs:
        print("no jobs yet: launch one with `python -m eksft_nb run`")
    for j in jobs if not args.json else []:
        if args.backend != "local":  # reading every remote job's logs would take long: state only
            print(f"{j.name:<32}{j.state:<11}{j.detail}")
            continue
        job = attach(j.name)
        mon = job.refresh()
        print(f"{j.name:<32}{job.state:<11}{mon.max_step:>7}/{mon.total_steps or job.spec.steps:<7}"
              f"restarts {sum(mon.restarts_by_level().values())}")
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    job = attach(args.name, args.backend)
    s = job.summary()
    committed = job.monitor.last_committed
    s["last_checkpoint"] = committed.step if committed else None
    s["detail"] = job.detail
    if args.json:
        print(json.dumps(s, indent=2))
    else:
        print(f"{s['name']}: {s['state']}  step {s['steps_done']}/{s['total_steps']}  "
              f"restarts {s['restarts']}  last checkpoint {s['last_checkpoint']}  "
              f"goodput {100 * s['goodput']['goodput']:.1f}%" + (f"  ({job.detail})" if job.detail else ""))
    return 0


def cmd_summary(args: argparse.Namespace) -> int:
    s = attach(args.name, args.backend).summary()
    print(json.dumps(s, indent=2) if args.json else format_summary(s))
    return 0


def cmd_ckpts(args: argparse.Namespace) -> int:
    infos = attach(args.name, args.backend).checkpoints()
    if args.json:
        print(json.dumps([i.to_dict() for i in infos], indent=2))
        return 0
    if not infos:
        print("no checkpoints yet")
    for i in infos:
        when = time.strftime("%H:%M:%S", time.localtime(i.time)) if i.time else "-"
        note = f"  ({i.reason})" if i.reason else ""
        print(f"step {i.step:>7}  {i.state:<10} {i.bytes / 2**20:8.2f} MiB  {when}  {i.path}{note}")
    return 0


def cmd_logs(args: argparse.Namespace) -> int:
    print(attach(args.name, args.backend).logs(args.lines, args.debug))
    return 0


def cmd_inject(args: argparse.Namespace) -> int:
    params = {k: v for k, v in (("delay", args.delay), ("duration", args.duration)) if v is not None}
    job = attach(args.name, args.backend)
    cmd = job.inject(args.fault, rank=args.rank, step=args.step, node=args.node, after=args.after, **params)
    print(injected(job, cmd, wait=10.0 if cmd.when == "now" else 0.0) + f"; id {cmd.id}")
    return 0


def injected(job: Job, cmd: Any, wait: float = 0.0) -> str:
    """What became of a queued fault: fired (the rank reported it, within ``wait`` seconds) or queued."""
    target = f"rank {cmd.rank}" if cmd.rank is not None else f"node {cmd.node}"
    fired = job.fired(cmd, timeout=wait)
    if fired is not None:
        at = f" at step {fired['step']}" if fired["step"] is not None else ""
        return f"fired {cmd.fault} on {target} of {job.name}{at}"
    return f"queued {cmd.fault} for {target} of {job.name} ({cmd.when}); it shows as fired when the rank fires it"


def cmd_resume(args: argparse.Namespace) -> int:
    changes = {"steps": args.steps} if args.steps else {}
    job = attach(args.name, args.backend).resume(step=args.step, name=args.new_name, **changes)
    print(f"launched {job.name} from {args.name}'s checkpoint")
    return 0 if args.detach else follow(job)


def cmd_stop(args: argparse.Namespace) -> int:
    attach(args.name, args.backend).stop()
    print(f"stopped {args.name}; no process of it is left")
    return 0


def cmd_rm(args: argparse.Namespace) -> int:
    get_backend(args.backend).remove(args.name)  # type: ignore[attr-defined]
    print(f"removed {args.name}")
    return 0


def cmd_metrics(args: argparse.Namespace) -> int:
    from pathlib import Path

    from .backends.local import LocalBackend
    from .metrics import serve

    root = Path(args.root) if args.root else None
    for name in args.names:
        LocalBackend(root).spec(name)  # unknown names fail before anything listens
    serve(args.names, args.port, args.addr, root)
    return 0


COMMANDS = {"run": cmd_run, "watch": cmd_watch, "list": cmd_list, "status": cmd_status, "summary": cmd_summary,
            "ckpts": cmd_ckpts, "logs": cmd_logs, "inject": cmd_inject, "resume": cmd_resume, "stop": cmd_stop,
            "rm": cmd_rm, "metrics": cmd_metrics}
