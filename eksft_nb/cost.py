"""What time costs: seconds of a job's GPUs as GPU-hours and, with a price, dollars; and the model that
scales a job's measured losses to a run the user names (``--for 30d --nodes 16``).

Every rank of a job holds one GPU (the built-in trainer and ft_launcher run one rank per GPU), so a second
lost by the whole job costs ``ranks`` GPU-seconds: a restart's downtime, a recomputed step and a save's stall
stop every rank. A price is per GPU-hour: ``--price p5.48xlarge`` (the table below), ``--price 55.04/h``
(per instance-hour: divided by the instance's GPUs, or the job's ranks per node) or ``--price 6.88/gpu-h``.
Without one, an EKS job priced by its ``--instance-type`` where the table knows it; else GPU-hours only.

The scaling is a model, and says what it assumes: the job's measured times carry over to the run (the
same step time, save stall and recovery per failure), a failure stops the whole run for its downtime and
its recomputed steps, checkpoints cost the share of steady training time they took here, and failures come
at the rate the user gives (``--failures-per-day``) or the job's own, per node. A failure rate measured on
a test job is its injected faults' rate: far above a cluster's, and said so.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .errors import EksftError, shown

# Linux on-demand prices in us-east-1, USD per instance-hour: as AWS publishes them, read from
# instances.vantage.sh's listing of 2026-01-21 (p4d, p4de and p5 the same in another listing of
# 2026-11-09). p5e.48xlarge has none: it is sold in Capacity Blocks only.
PRICES_AS_OF = "2026-01-21"
PRICES_REGION = "us-east-1"


@dataclass(frozen=True)
class Instance:
    usd_per_hour: float
    gpus: int
    gpu: str


PRICES: Mapping[str, Instance] = {
    "p6-b200.48xlarge": Instance(113.9328, 8, "B200"),
    "p5en.48xlarge": Instance(63.296, 8, "H200"),
    "p5.48xlarge": Instance(55.04, 8, "H100"),
    "p4de.24xlarge": Instance(27.44705, 8, "A100 80GB"),
    "p4d.24xlarge": Instance(21.957642, 8, "A100 40GB"),
    "g6e.48xlarge": Instance(30.13118, 8, "L40S"),
    "g5.48xlarge": Instance(16.288, 8, "A10G"),
    "g6.48xlarge": Instance(13.3504, 8, "L4"),
}
MAX_USD_PER_HOUR = 10_000.0
MAX_RUN_S = 10 * 365 * 86400.0      # ten years
MAX_NODES = 100_000
MAX_FAILURES_PER_DAY = 100_000.0
PRICE_EXAMPLE = "write e.g. --price p5.48xlarge, --price 55.04/h (per instance) or --price 6.88/gpu-h"
PRICE = re.compile(r"(\d{1,7}(?:\.\d{0,6})?|\.\d{1,6})\s*(/h|/hr|/gpu-h|/gpu-hr|/gpu)?")
DURATION = re.compile(r"(\d{1,7}(?:\.\d{0,6})?)\s*(s|m|min|h|d|w)")
UNITS = {"s": 1.0, "m": 60.0, "min": 60.0, "h": 3600.0, "d": 86400.0, "w": 7 * 86400.0}


@dataclass(frozen=True)
class Price:
    """A price as given: USD an hour per GPU or per instance, the instance's GPUs where the table has it,
    and where it came from, as the output says it."""

    usd: float
    per_gpu: bool
    gpus: int | None
    said: str


@dataclass(frozen=True)
class Run:
    """The run the user names for the scaled model: its length, its nodes (None: the job's) and the
    failures a day it meets (None: the job's own rate)."""

    seconds: float
    nodes: int | None
    failures_per_day: float | None
    said: str


@dataclass(frozen=True)
class Pricing:
    """What a command prices a job with: USD per GPU-hour (None: GPU-hours only), said; the GPUs of one
    node (the priced instance's, else the job's ranks per node); a run to scale to (None: none)."""

    usd_per_gpu_hour: float | None = None
    said: str = ""
    gpus_per_node: int = 1
    run: Run | None = None
    instance: str = ""     # the instance type of the table it was priced as ("" otherwise)

    def cost(self, seconds: float | None, gpus: int) -> dict[str, float | None]:
        """``seconds`` of ``gpus`` GPUs: GPU-hours, and dollars where there is a price (None otherwise)."""
        if seconds is None:
            return {"gpu_h": None, "usd": None}
        gpu_h = max(0.0, seconds) * gpus / 3600.0
        return {"gpu_h": round(gpu_h, 6), "usd": self.usd(gpu_h)}

    def delta(self, gpu_h: float) -> dict[str, float | None]:
        """A difference of GPU-hours (signed: negative saves), with its dollars."""
        return {"gpu_h": round(gpu_h, 6), "usd": self.usd(gpu_h)}

    def usd(self, gpu_h: float) -> float | None:
        return None if self.usd_per_gpu_hour is None else round(gpu_h * self.usd_per_gpu_hour, 4)

    def to_dict(self) -> dict[str, Any]:
        r = self.run
        return {"usd_per_gpu_hour": self.usd_per_gpu_hour, "price": self.said or None,
                "gpus_per_node": self.gpus_per_node, "instance": self.instance or None,
                "run": None if r is None else {"seconds": r.seconds, "nodes": r.nodes,
                                               "failures_per_day": r.failures_per_day, "said": r.said}}


def parse_price(text: str) -> Price:
    """``--price``: an instance type of the table, or USD per instance-hour (``55.04`` or ``55.04/h``) or
    per GPU-hour (``6.88/gpu-h``)."""
    if not isinstance(text, str) or not text.strip():
        raise EksftError(f"--price {shown(text)} names no price", PRICE_EXAMPLE)
    word = text.strip().lower().removeprefix("ml.")
    if word in PRICES:
        i = PRICES[word]
        return Price(i.usd_per_hour, False, i.gpus,
                     f"{word} on-demand ${i.usd_per_hour:,.2f}/h ({i.gpus} x {i.gpu}), {PRICES_REGION}, "
                     f"as of {PRICES_AS_OF}")
    m = PRICE.fullmatch(word.removeprefix("$"))
    if m is None:
        raise EksftError(f"--price {shown(text)} is neither a price nor an instance type of the table",
                         f"{PRICE_EXAMPLE} (the table: {', '.join(PRICES)})")
    usd = float(m.group(1))
    if not 0 < usd <= MAX_USD_PER_HOUR:
        raise EksftError(f"--price {shown(text)} is out of range",
                         f"give more than 0 and at most {MAX_USD_PER_HOUR:,.0f} USD an hour")
    if (m.group(2) or "/h").startswith("/gpu"):
        return Price(usd, True, None, f"${usd:,.4g} per GPU-hour (given)")
    return Price(usd, False, None, f"${usd:,.2f} per instance-hour (given)")


def parse_duration(text: str) -> float:
    """``--for``: a run's length, e.g. ``30d``, ``12h``, ``2w`` (s, m, h, d, w)."""
    m = DURATION.fullmatch(text.strip().lower()) if isinstance(text, str) else None
    seconds = float(m.group(1)) * UNITS[m.group(2)] if m else math.nan
    if not 0 < seconds <= MAX_RUN_S:
        raise EksftError(f"--for {shown(text)} is not a run length up to ten years",
                         "write e.g. --for 30d, --for 12h or --for 2w")
    return seconds


def pricing(spec: Any, price: str | None = None, run_for: str | None = None, nodes: int | None = None,
            failures_per_day: float | None = None) -> Pricing:
    """The command layer's one check of the cost options, resolved for ``spec``'s job: without ``--price``,
    an EKS job's ``--instance-type`` where the table has it; a price per instance-hour of no instance of the
    table is divided by the job's ranks per node (each rank holds one GPU)."""
    if nodes is not None and (isinstance(nodes, bool) or not isinstance(nodes, int)
                              or not 1 <= nodes <= MAX_NODES):
        raise EksftError(f"--nodes {shown(nodes)} is not a number of nodes", "write e.g. --nodes 16")
    if failures_per_day is not None and not (isinstance(failures_per_day, (int, float))
                                             and not isinstance(failures_per_day, bool)
                                             and 0 <= failures_per_day <= MAX_FAILURES_PER_DAY):
        raise EksftError(f"--failures-per-day {shown(failures_per_day)} is not a rate",
                         "write e.g. --failures-per-day 2.5 (for the whole run)")
    if run_for is None and (nodes is not None or failures_per_day is not None):
        raise EksftError("--nodes and --failures-per-day describe a run to scale to",
                         "give its length too, e.g. --for 30d --nodes 16")
    chosen = parse_price(price) if price is not None else None
    instance = getattr(getattr(spec, "eks", None), "instance_type", None) if spec.backend == "eks" else None
    if chosen is None and instance and instance.removeprefix("ml.") in PRICES:
        chosen = parse_price(instance)
    run = None
    if run_for is not None:
        rate = None if failures_per_day is None else float(failures_per_day)
        run = Run(parse_duration(run_for), nodes, rate, run_for.strip())
    node_gpus = (chosen.gpus if chosen is not None and chosen.gpus else max(1, int(spec.nproc_per_node)))
    if chosen is None:
        return Pricing(None, "", node_gpus, run)
    if chosen.per_gpu:
        return Pricing(chosen.usd, chosen.said, node_gpus, run)
    if chosen.gpus:
        return Pricing(chosen.usd / node_gpus, chosen.said, node_gpus, run, chosen.said.split(" ")[0])
    said = f"{chosen.said}, {node_gpus} GPU(s) a node as the job runs"
    return Pricing(chosen.usd / node_gpus, said, node_gpus, run)


def options_of(args: Any) -> dict[str, Any]:
    """The cost options of a parsed command line (``arguments.COST``), for the operations that price."""
    return {k: getattr(args, k, None) for k in ("price", "run_for", "nodes", "failures_per_day")}


def text(cost: Mapping[str, float | None]) -> str:
    """``1.23 GPU-h ($6.77)``; ``-`` where nothing was measured."""
    if cost.get("gpu_h") is None:
        return "-"
    usd = cost.get("usd")
    return f"{gpu_hours_text(cost['gpu_h'])}" + (f" ({money(usd)})" if usd is not None else "")


def gpu_hours_text(gpu_h: float) -> str:
    if gpu_h >= 100:
        return f"{gpu_h:,.0f} GPU-h"
    return f"{gpu_h:.3g} GPU-h" if gpu_h >= 0.001 else f"{gpu_h * 3600:.3g} GPU-s"


def money(usd: float) -> str:
    """Dollars as a person says them: ~$3,400, $12.35, $0.004."""
    if abs(usd) >= 1000:
        return f"${usd:,.0f}"
    if abs(usd) >= 0.01:
        return f"${usd:,.2f}"
    return f"${usd:.2g}"


# ---- the scaled model -------------------------------------------------------------------------


@dataclass(frozen=True)
class Losses:
    """What a job (or a what-if setting of it) loses, in the units the model scales: the share of steady
    training time its checkpoints take, and the seconds of the whole job each failure costs."""

    ckpt_share: float
    per_failure_s: float | None   # downtime + recomputed steps per failure (None: no failure to learn from)
    failures: int                 # the failures the job showed (its own rate)
    wall_s: float
    nodes: int
    detail: str = ""              # how per_failure_s was found, for the assumptions


def project(losses: Losses, p: Pricing) -> dict[str, Any]:
    """``losses`` scaled to ``p.run`` (on its nodes, else the job's, of ``p.gpus_per_node`` GPUs each): the
    run's GPU-hours, what its checkpoints and failures cost of them, and what the model assumes, said."""
    run = p.run
    assert run is not None
    nodes = run.nodes or losses.nodes
    gpus = nodes * p.gpus_per_node
    days = run.seconds / 86400.0
    assumes = ["the job's measured times carry over to the run (step time, save stall, recovery)"]
    if run.failures_per_day is not None:
        rate, how = run.failures_per_day, f"{run.failures_per_day:g} failures a day (given)"
    elif losses.failures and losses.wall_s > 0:
        rate = losses.failures / losses.wall_s * 86400.0 * nodes / max(1, losses.nodes)
        how = (f"{rate:,.4g} failures a day: the job's own rate ({losses.failures} in {losses.wall_s:.0f}s "
               f"on {losses.nodes} node(s)) per node, for {nodes}; a test's injected faults come far more "
               "often than a cluster's: give --failures-per-day")
    else:
        rate, how = 0.0, "no failure: the job showed none and --failures-per-day was not given"
    failures = rate * days
    if losses.per_failure_s is None and failures:
        assumes.append("each failure's cost is unknown (the job showed no recovery): not counted")
    per_failure = losses.per_failure_s or 0.0
    down_s = min(run.seconds, failures * per_failure)
    ckpt_s = (run.seconds - down_s) * losses.ckpt_share
    assumes += [how, f"a failure stops all {gpus} GPUs for {per_failure:.1f}s"
                + (f" ({losses.detail})" if losses.detail else ""),
                f"checkpoints take {100 * losses.ckpt_share:.2f}% of steady training time, as here"]
    total = p.cost(run.seconds, gpus)
    return {"model": f"a model of a {run.said} run on {nodes} node(s), {gpus} GPUs", "gpus": gpus,
            "nodes": nodes, "seconds": run.seconds, "total": total, "failures_expected": round(failures, 3),
            "checkpoints": p.cost(ckpt_s, gpus), "failures": p.cost(down_s, gpus),
            "lost": p.cost(ckpt_s + down_s, gpus), "assumes": assumes}


def projection_text(proj: Mapping[str, Any]) -> list[str]:
    """The projection as lines: what it costs, then what it assumes."""
    return [f"{proj['model']} ({text(proj['total'])} in all): checkpoints {text(proj['checkpoints'])}, "
            f"{proj['failures_expected']:,.3g} failures {text(proj['failures'])}",
            "  assumes: " + "; ".join(proj["assumes"])]


# ---- a job's own account ----------------------------------------------------------------------

LOST_TERMS = ("checkpoint_stall", "checkpoint_interference", "restart_downtime", "recomputed", "skipped",
              "startup", "other")


def account(seconds: Mapping[str, float], restarts: int, gpus: int, nodes: int, p: Pricing) -> dict[str, Any]:
    """What a job's wall time cost, term by term (goodput's seconds on every one of its ``gpus``), what
    its faults (downtime, recomputed and skipped work) and its checkpoints (stall and interference) cost,
    and, with a run to scale to, the model's projection of it."""
    terms = {t: p.cost(s, gpus) for t, s in seconds.items()}
    faults_s = sum(seconds.get(t, 0.0) for t in ("restart_downtime", "recomputed", "skipped"))
    ckpt_s = seconds.get("checkpoint_stall", 0.0) + seconds.get("checkpoint_interference", 0.0)
    wall = sum(seconds.values())
    out = {"gpus": gpus, "pricing": p.to_dict(), "terms": terms, "wall": p.cost(wall, gpus),
           "lost": p.cost(sum(seconds.get(t, 0.0) for t in LOST_TERMS), gpus),
           "faults": p.cost(faults_s, gpus), "checkpoints": p.cost(ckpt_s, gpus), "projection": None}
    if p.run is not None:
        steady = seconds.get("productive", 0.0) + ckpt_s + seconds.get("other", 0.0)
        per = faults_s / restarts if restarts else None
        out["projection"] = project(Losses(ckpt_s / steady if steady else 0.0, per, restarts, wall, nodes,
                                           f"this job's {restarts} recover{'y' if restarts == 1 else 'ies'}"
                                           if restarts else ""), p)
    return out


def account_text(a: Mapping[str, Any]) -> list[str]:
    """A job's account as lines (``summary``)."""
    price = a["pricing"]["price"] or "no price: GPU-hours only (give --price INSTANCE or USD/h for dollars)"
    lines = [f"cost: {text(a['wall'])} on {a['gpus']} GPU(s) (one per rank; {price}); lost "
             f"{text(a['lost'])}: faults {text(a['faults'])}, checkpoints {text(a['checkpoints'])}"]
    if a.get("projection"):
        lines += projection_text(a["projection"])
    return lines
