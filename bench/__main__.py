"""``python -m bench [--quick | --smoke] [--only PART ...]``: run the benchmarks, print the tables, write
JSON."""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from .common import FULL, QUICK, RESULTS, SMOKE, machine, private_home

PARTS = ("ckpt", "recovery", "goodput", "overhead", "dashboard", "scale", "whatif", "compare", "spares")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    sizes = p.add_mutually_exclusive_group()
    sizes.add_argument("--quick", dest="size", action="store_const", const=QUICK, default=FULL,
                       help="short jobs, fewer repeats, 100 MB only (a few minutes)")
    sizes.add_argument("--smoke", dest="size", action="store_const", const=SMOKE,
                       help="each part on its smallest input: proves it runs and computes, no figure to "
                            "quote (the tests' run; part 8's plan is notebooks/07_engines.ipynb's)")
    p.add_argument("--only", nargs="+", choices=PARTS, default=list(PARTS), metavar="PART",
                   help=f"run only these parts ({', '.join(PARTS)})")
    p.add_argument("--goodput-window", nargs=2, type=float, metavar=("SECONDS", "FAULT_EVERY_S"),
                   help="part 3: run each configuration this long with a fault this often (default 600 120)")
    p.add_argument("--whatif-order", choices=("side-by-side", "sequential"), default="side-by-side",
                   help="part 7: run each A and B pair at once (a loaded machine) or one after the "
                        "other (quiet)")
    p.add_argument("--out", type=Path, default=RESULTS,
                   help="folder for the JSON results (default bench/results/, where the runs are kept)")
    args = p.parse_args(argv)
    if args.goodput_window and not 0 < args.goodput_window[1] <= args.goodput_window[0]:
        p.error("--goodput-window needs 0 < FAULT_EVERY_S <= SECONDS, e.g. --goodput-window 180 45")

    args.out.mkdir(parents=True, exist_ok=True)
    tag = "" if args.size == FULL else f"{args.size}-"
    path = args.out / f"bench-{tag}{time.strftime('%Y%m%d-%H%M%S')}.json"
    results: dict[str, Any] = {"size": args.size, "machine": machine(), "parts": {}, "errors": {}}
    t0 = time.time()
    try:
        with private_home() as home:
            results["home"] = str(home)
            for name in args.only:
                options: dict[str, Any] = {}
                if name == "goodput" and args.goodput_window:
                    options["window_s"] = tuple(args.goodput_window)
                if name == "whatif":
                    options["order"] = args.whatif_order
                run_part(name, args.size, results, **options)
                write(path, results)  # what was measured survives a later crash
    except Exception as e:  # noqa: BLE001 - stopping the jobs failed: said, and the results are still written
        traceback.print_exc()
        results["errors"]["cleanup"] = f"{type(e).__name__}: {e}"
    results["wall_s"] = round(time.time() - t0, 1)
    results["machine_after"] = {"load_avg": machine()["load_avg"]}
    write(path, results)
    print(f"results: {path}  ({results['wall_s']:.0f} s)")
    return 1 if results["errors"] else 0


def run_part(name: str, size: str, results: dict[str, Any], **options: Any) -> None:
    print(f"== {name} ...", flush=True)
    started = time.time()
    try:
        part = importlib.import_module(f"bench.{name}")
        result = part.run(size, **options)
    except Exception as e:  # noqa: BLE001 - reported in the output and the JSON; the other parts still run
        traceback.print_exc()
        results["errors"][name] = f"{type(e).__name__}: {e}"
        return
    result["wall_s"] = round(time.time() - started, 1)
    results["parts"][name] = result
    print(part.report(result), flush=True)


def write(path: Path, results: dict[str, Any]) -> None:
    path.write_text(json.dumps(results, indent=1, allow_nan=False, default=str))


if __name__ == "__main__":
    sys.exit(main())
