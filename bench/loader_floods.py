"""How long the checkpoint loader takes to refuse a ``.metadata`` crafted to work it without bound
(issue 34, item 3), and to read genuine ones (standalone: ``python -m bench.loader_floods``).

Each shape of ``tests/ckpt_craft.FLOODS`` at its largest size replaces the ``.metadata`` of a genuine
checkpoint, once beside its own few KB of data (the size cap answers) and once with 8 MiB of listed
padding (what an attacker adds so that the unpickler itself must answer); ``read_metadata`` runs as a
restore and the lab's resume route run it. Before the fix, the issue's 1.3 MB of 100,000 int keys took
80-111 s, and 10,000 MetadataIndex keys of one hash 11 s (quadratic: 100,000 would take about 18
minutes). Now the work is linear in the file: the target is every refusal within 2 s, or 1 s per MB of
``.metadata`` for a larger one (a padded folder lets a file of 2 KiB per KiB of padding through to the
unpickler, and reading a genuine one takes about as long per MB: the genuine rows).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from .common import REPO, machine, stat, table

sys.path.insert(0, str(REPO / "tests"))  # the crafted inputs are the loader tests' own (tests/ckpt_craft.py)

TARGET_S, TARGET_S_PER_MB = 2.0, 1.0
SIZES = {"int-keys": 100_000, "index-keys": 100_000, "repeated-keys": 100_000, "chunk-offsets": 100_000,
         "shared-list": 100_000, "deep-marks": 100_000, "deep-lists": 100_000, "many-dicts": 100_000,
         "long-size": 100_000, "long-path": 1_000}


def _genuine(folder: Path, tensors: int, name_len: int) -> None:
    """A DCP save of ``tensors`` one-element tensors with names of ``name_len`` characters (the densest
    metadata per byte of data) and its commit.json."""
    import torch
    import torch.distributed.checkpoint as dcp

    state = {"m" * name_len + f".{i}": torch.zeros(1) for i in range(tensors)}
    dcp.save(state, checkpoint_id=str(folder), no_dist=True)
    files = {p.name: {"size": p.stat().st_size, "sha256": hashlib.sha256(p.read_bytes()).hexdigest()}
             for p in folder.iterdir()}
    commit = {"step": 10, "world_size": 1, "bytes": sum(f["size"] for f in files.values()),
              "time": time.time(), "files": files}
    (folder / "commit.json").write_text(json.dumps(commit))


def _timed(folder: Path, repeats: int) -> tuple[list[float], str]:
    from eksft_nb.errors import JobError
    from eksft_nb.runtime.checkpoint import read_metadata

    times, answer = [], "loaded"
    for _ in range(repeats):
        t0 = time.perf_counter()
        try:
            read_metadata(folder)
        except JobError as e:
            answer = e.problem.split(".metadata: ", 1)[-1]
        times.append(time.perf_counter() - t0)
    return times, answer


def run(repeats: int = 3) -> dict[str, Any]:
    from ckpt_craft import FLOODS, flood, rewrite

    out: dict[str, Any] = {"machine": machine(), "target_s": TARGET_S, "genuine": {}, "floods": {}}
    with tempfile.TemporaryDirectory(prefix="eksft-bench-floods-") as tmp:
        for tensors, name_len in ((1000, 10), (1000, 400), (10_000, 40)):
            folder = Path(tmp) / f"genuine-{tensors}-{name_len}" / "step_00000010"
            folder.mkdir(parents=True)
            _genuine(folder, tensors, name_len)
            times, answer = _timed(folder, repeats)
            size = (folder / ".metadata").stat().st_size
            out["genuine"][f"{tensors} tensors, {name_len}-char names"] = {
                "metadata_bytes": size, "seconds": stat(times), "answer": answer}
        base = Path(tmp) / "step_00000010"
        base.mkdir()
        _genuine(base, 4, 10)
        for shape in FLOODS:
            data = flood(shape, SIZES[shape])
            for padded in (False, True):
                folder = Path(tmp) / f"{shape}-{padded}" / "step_00000010"
                folder.parent.mkdir()
                folder.mkdir()
                for p in base.iterdir():
                    (folder / p.name).write_bytes(p.read_bytes())
                if padded:
                    rewrite(folder, "padding.distcp", bytes(8 << 20))
                rewrite(folder, ".metadata", data)
                times, answer = _timed(folder, repeats)
                out["floods"][f"{shape} x{SIZES[shape]}{' padded' if padded else ''}"] = {
                    "metadata_bytes": len(data), "seconds": stat(times), "answer": answer,
                    "within_target": max(times) <= max(TARGET_S, TARGET_S_PER_MB * len(data) / 1e6)}
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.loader_floods", description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, help="write the results as JSON here")
    args = parser.parse_args(argv)
    results = run(args.repeats)
    rows = [[k, f"{v['metadata_bytes']:,}", f"{v['seconds']['median']:.3f}", v["answer"][:70]]
            for k, v in results["genuine"].items()]
    print(table("genuine .metadata, read", ["save", "bytes", "median s", "answer"], rows))
    rows = [[k, f"{v['metadata_bytes']:,}", f"{v['seconds']['median']:.3f}", f"{v['seconds']['max']:.3f}",
             v["answer"][:70]] for k, v in results["floods"].items()]
    title = f"crafted .metadata, refused (target: {TARGET_S:.0f} s, or {TARGET_S_PER_MB:.0f} s per MB)"
    print(table(title, ["shape", "bytes", "median s", "max s", "answer"], rows))
    if args.out:
        args.out.write_text(json.dumps(results, indent=1))
        print(f"results: {args.out}")
    return 0 if all(v["within_target"] for v in results["floods"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
