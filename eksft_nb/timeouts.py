"""Timeouts sized for where a job runs: CPU defaults for a laptop, GPU-scale ones from the state size.

A GPU job's state can take minutes to save or restore: the 8B preset's ~90 GB (fp32 weights and
AdamW's two moments) at FSx's ~300 MB/s. Timeouts tuned for the CPU demo (a 15 s heartbeat) would
kill every restore. On a GPU backend each timeout the user leaves unset is derived from the state
size and ``--storage-mbps``, never below AWS's NVRx-on-EKS figures; one the user sets wins, and the
derived ones are fitted around it. Every value carries the reason it has, for ``--dry-run``.

One heartbeat timeout must outlast the slowest save and restore, so alone it finds a hang in a step
only after many minutes. NVRx's sections bound each phase apart, as its own Slurm deployment does
(``setup:900,step:60,checkpointing:300``, out-of-section 90): on GPUs the built-in trainer gets them,
the step's from its measured time (``--step-time``) where known, the save's from the state size at
the storage throughput, start-up and restore as long as the initial heartbeat; a hang in a step is
then found in about a minute while a long save or restore runs on.
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# a JobSpec (spec.py imports this module to check the resolved timeouts, so this one takes it as Any)
JobSpec = Any

BYTES_PER_PARAM = 12   # fp32 weights + AdamW's exp_avg and exp_avg_sq
# AWS's NVRx-on-EKS manifests (awsome-distributed-training, 3.test_cases/pytorch/nvrx/kubernetes)
GPU_FLOORS = {"soft": 300.0, "hard": 600.0, "heartbeat": 900.0, "initial": 1200.0, "collective": 60.0,
              "checkpoint_group": 600.0, "grace": 120.0}
# what the CPU demo and the tests run with (the local backend without CUDA)
CPU_VALUES = {"soft": 4.0, "hard": 8.0, "heartbeat": 15.0, "initial": 120.0, "collective": 3.0,
              "checkpoint_group": 600.0, "grace": 60.0}
# a Slurm job without ``--gres gpu:N``: the GPUs its batch shell counted on the node (see
# eksft_nb.backends.slurm.gpus), for the watcher and every rank there
NODE_GPUS_ENV = "EKSFT_NODE_GPUS"
# NVRx's own Slurm deployment (examples/fault_tolerance/deployment/slurm): each phase bounded apart
SECTION_FLOORS = {"setup": 900.0, "step": 60.0, "checkpointing": 300.0, "out_of_section": 90.0}
STEP_FACTOR = 5.0   # a step's bound: this many times its measured time (NVRx's own safety factor)
# spec field (in spec.ft) -> name here
SPEC_FIELDS = {"soft_timeout": "soft", "hard_timeout": "hard", "heartbeat_timeout": "heartbeat",
               "initial_heartbeat_timeout": "initial", "collective_timeout": "collective"}
# the built-in trainer's NVRx sections (and the time outside them): spec field -> name here
SECTION_FIELDS = {"setup_timeout": "setup", "step_timeout": "step", "checkpoint_timeout": "checkpointing",
                  "out_of_section_timeout": "out_of_section"}


@dataclass(frozen=True)
class Timeout:
    seconds: float
    reason: str


@dataclass(frozen=True)
class Timeouts:
    """Every timeout of a job, in seconds, each with why it has that value."""

    gpu: bool
    state_bytes: int
    save_s: float        # one save's write at the storage throughput
    restore_s: float     # one restore: every file hashed, then loaded (read twice)
    soft: Timeout        # in-process: no progress for this long interrupts a rank
    hard: Timeout        # in-process: ... kills it
    heartbeat: Timeout   # ft_launcher: no heartbeat for this long restarts the group
    initial: Timeout     # ft_launcher: start-up (and restore) before the first heartbeat
    collective: Timeout  # the training process group (NCCL on GPUs) while in-process restart is on
    # the gloo group of the checkpoint collectives (ranks wait there for peers' I/O)
    checkpoint_group: Timeout
    grace: Timeout       # SIGTERM to exit: finish the save in flight, then save and commit once more
    # NVRx sections of the built-in trainer (None: off): start-up, restore and the first step; one step;
    # a save; and the time outside any section
    setup: Timeout | None = None
    step: Timeout | None = None
    checkpointing: Timeout | None = None
    out_of_section: Timeout | None = None
    own_sections: tuple[tuple[str, float], ...] = ()   # the user's (--section-timeouts, --step-timeout...)

    def sections(self) -> dict[str, float]:
        """What ft_launcher's ``--ft-rank-section-timeouts`` gets: section name -> seconds."""
        built_in = {name: t.seconds for name in ("setup", "step", "checkpointing")
                    if (t := getattr(self, name)) is not None}
        return {**built_in, **dict(self.own_sections)}

    def lines(self) -> list[str]:
        """One line per timeout with its reason (``--dry-run`` prints them)."""
        where = "GPU" if self.gpu else "CPU"
        head = (f"timeouts ({where}; state {self.state_bytes / 1e9:.3g} GB: a save ~{self.save_s:.0f} s, "
                f"a restore ~{self.restore_s:.0f} s):")
        names = ("initial", "heartbeat", "setup", "step", "checkpointing", "out_of_section", "soft", "hard",
                 "collective", "checkpoint_group", "grace")
        return [head] + [f"  {name} {t.seconds:g} s: {t.reason}" for name in names
                         if (t := getattr(self, name)) is not None]


PROCESS_GROUP_S = 600.0   # the trainer's process group without in-process restart (torch's default)


def wrapper_barrier(hard: float) -> float:
    """The in-process Wrapper's barrier and completion timeouts: every rank reaches the restart barrier
    once interrupted, or is killed at the hard timeout; a minute past that is room enough."""
    return max(hard + 60, 120.0)


def state_bytes(spec: JobSpec) -> int:
    """Bytes of one checkpoint of the built-in trainer's model: weights and optimizer state."""
    return spec.model.n_params() * BYTES_PER_PARAM


def on_gpu(spec: JobSpec) -> bool:
    """Whether the job's ranks run on GPUs: EKS pods or Slurm nodes (``--gres gpu:N``, or without it the
    GPUs counted on the node, :data:`NODE_GPUS_ENV`) that request them, or a local job on CUDA (a cheap
    probe of the driver, so the command line need not import torch)."""
    if spec.backend == "eks":
        return spec.eks.gpus_per_node > 0
    if spec.backend == "slurm":
        counted = os.environ.get(NODE_GPUS_ENV, "")
        return spec.slurm.gpus_per_node > 0 or (counted.isdigit() and int(counted) > 0)
    if spec.device != "auto":
        return spec.device == "cuda"
    gpus = Path("/proc/driver/nvidia/gpus")
    return gpus.is_dir() and any(gpus.iterdir())


def counted_where_it_runs(spec: JobSpec) -> bool:
    """A Slurm job without ``--gres`` seen off its nodes: whether its ranks have GPUs is known only where
    they run (its batch shell counts them there, :data:`NODE_GPUS_ENV`)."""
    return spec.backend == "slurm" and not spec.slurm.gpus_per_node and NODE_GPUS_ENV not in os.environ


def derive(spec: JobSpec, gpu: bool | None = None) -> Timeouts:
    """The job's timeouts: the user's where set, else derived (GPU) or today's CPU values."""
    gpu = on_gpu(spec) if gpu is None else gpu
    size = state_bytes(spec)
    mbps = spec.checkpoint.storage_mbps
    save_s = size / (mbps * 1e6)
    restore_s = 2 * save_s
    at = f"{size / 1e9:.3g} GB at {mbps:g} MB/s"
    if gpu:
        base = {
            "soft": (max(GPU_FLOORS["soft"], 2 * save_s), f"2 x a blocking save ({at}), floor 300 s (AWS)"),
            "hard": (max(GPU_FLOORS["hard"], 4 * save_s), "2 x the soft timeout, floor 600 s (AWS)"),
            "heartbeat": (max(GPU_FLOORS["heartbeat"], 4 * save_s + 300),
                          "the hard timeout + 300 s (in-process restart acts first), floor 900 s (AWS)"),
            "initial": (max(GPU_FLOORS["initial"], 2 * restore_s + 600),
                        f"2 x a restore (hash and load: {at}, twice) + 600 s start-up, floor 1200 s (AWS)"),
            "collective": (GPU_FLOORS["collective"],
                           "NCCL collectives wait on peers, not storage: 60 s (AWS)"),
            "checkpoint_group": (max(GPU_FLOORS["checkpoint_group"], 2 * restore_s),
                                 "2 x a restore: a rank waits there for its peers' reads, floor 600 s"),
            "grace": (max(GPU_FLOORS["grace"], 2 * save_s + 60),
                      f"the save in flight and one more ({at} each) + 60 s to commit, floor 120 s"),
        }
        base = {k: (float(math.ceil(v)), why) for k, (v, why) in base.items()}   # whole seconds
    else:
        base = {k: (v, "CPU default (no GPU)") for k, v in CPU_VALUES.items()}
        base["grace"] = (max(CPU_VALUES["grace"], 2 * save_s + 30),
                         f"the save in flight and one more ({at} each) + 30 s, floor 60 s")
    ft = spec.ft
    mine = {name: getattr(ft, field) for field, name in SPEC_FIELDS.items()}
    out: dict[str, Timeout] = {}

    def pick(name: str, derived: float, reason: str) -> None:
        given = mine.get(name)
        out[name] = Timeout(float(given),
                            "set by the user") if given is not None else Timeout(derived, reason)

    pick("soft", *base["soft"])
    # the derived ones fit around what the user set: soft < hard < heartbeat <= initial, collective < hard
    soft = out["soft"].seconds
    hard, why = base["hard"]
    pick("hard", *((2 * soft, "2 x the soft timeout (set by the user)") if mine["soft"] and 2 * soft > hard
                   else (hard, why)))
    hard = out["hard"].seconds
    beat, why = base["heartbeat"]
    pick("heartbeat", *((hard * 1.25, "1.25 x the hard timeout (in-process restart acts first)")
                        if mine["hard"] and hard * 1.25 > beat else (beat, why)))
    first, why = base["initial"]
    pick("initial", *((out["heartbeat"].seconds, "the heartbeat timeout")
                      if mine["heartbeat"] and out["heartbeat"].seconds > first else (first, why)))
    coll, why = base["collective"]
    pick("collective",
         *((hard / 2, "half the hard timeout (set by the user)") if coll >= hard else (coll, why)))
    for name in ("checkpoint_group", "grace"):
        out[name] = Timeout(*base[name])
    sections = _sections(spec, gpu, out["initial"], max(save_s, ft.save_time or 0.0))
    own = tuple(ft.sections().items())   # the user's, by any name (a script's step too)
    return Timeouts(gpu, size, save_s, restore_s, **out, **sections, own_sections=own)


def _sections(spec: JobSpec, gpu: bool, initial: Timeout, save_s: float) -> dict[str, Timeout | None]:
    """The built-in trainer's sections: off on CPU unless the user sets one, on by default on GPUs. Once
    one is on, all three are (NVRx 0.4.1 fails a rank that opens a section it has no timeout for), each
    the user's or derived; the out-of-section timeout only where the user or a GPU asks for it. A user's
    script opens its own sections (``--section-timeouts``): it gets only the ones the user sets."""
    ft = spec.ft
    mine = {name: getattr(ft, field) for field, name in SECTION_FIELDS.items()}
    if spec.script:
        return {name: Timeout(float(v), "set by the user") if v is not None else None
                for name, v in mine.items()}
    if not gpu and all(v is None for v in mine.values()):
        return dict.fromkeys(SECTION_FIELDS.values())
    floors = SECTION_FLOORS
    step_time = ft.step_time
    derived = {
        "setup": (initial.seconds, "start-up, restore and the first step: as long as the initial heartbeat"),
        "step": ((max(floors["step"], STEP_FACTOR * step_time),
                  f"{STEP_FACTOR:g} x the measured step ({step_time:g} s), at least 60 s (NVRx's deployment)")
                 if step_time else (floors["step"], "NVRx's deployment (no step time measured: --step-time)")
                 ),
        "checkpointing": (max(floors["checkpointing"], 2 * save_s + 60),
                          f"2 x a save ({save_s:.0f} s) + 60 s, at least 300 s (NVRx's deployment)"),
        "out_of_section": (floors["out_of_section"], "NVRx's deployment"),
    }
    if not gpu:   # the user asked for sections on CPU: the others bound nothing they did not ask for
        derived["step"] = (None, "")
        derived["out_of_section"] = (None, "")
        derived["checkpointing"] = (2 * save_s + 60, f"2 x a save ({save_s:.0f} s) + 60 s")
    out: dict[str, Timeout | None] = {}
    for name, (value, why) in derived.items():
        given = mine[name]
        out[name] = (Timeout(float(given), "set by the user") if given is not None
                     else Timeout(float(math.ceil(value)), why) if value is not None else None)
    return out


def resolved(spec: JobSpec, gpu: bool | None = None) -> JobSpec:
    """The spec with every timeout filled in (what the ranks and launchers read)."""
    t = derive(spec, gpu)
    values = {field: getattr(t, name).seconds for field, name in SPEC_FIELDS.items()}
    values.update({field: t_.seconds if (t_ := getattr(t, name)) is not None else None
                   for field, name in SECTION_FIELDS.items()})
    return dataclasses.replace(spec, ft=dataclasses.replace(spec.ft, **values))


def fsx_table(specs: dict[str, JobSpec], mbps: tuple[float, ...] = (125, 300, 1000)) -> str:
    """A Markdown table: each spec's (model preset's) state, then its save and restore time per FSx
    throughput (the README's, from ``spec.fsx_specs()``)."""
    head = "| model | state | " + " | ".join(f"save / restore at {m:g} MB/s" for m in mbps) + " |"
    rows = [head, "|" + " --- |" * (2 + len(mbps))]
    for preset, spec in specs.items():
        size = state_bytes(spec)
        cells = [f"{size / (m * 1e6):.0f} s / {2 * size / (m * 1e6):.0f} s" for m in mbps]
        rows.append(f"| {preset} | {size / 1e9:.3g} GB | " + " | ".join(cells) + " |")
    return "\n".join(rows)
