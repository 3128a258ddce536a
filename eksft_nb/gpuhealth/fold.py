"""GPU health as the monitor keeps it, folded from the events wherever they are read (the kernel,
the CLI, the server): the newest reading per node and GPU, a strip point per sample, and the faults."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .readings import BAD_THROTTLE, parse_entry, throttle_text

@dataclass
class GpuFold:
    """GPU health as the monitor keeps it: the latest reading per node and GPU, one strip point per
    ``gpu_health`` event (``samples``), and the faults.

    A 32-node job samples 32 times per 10 s for as long as it runs, so only the newest ``recent``
    samples are all kept; of older ones, those where a node's status changed (and each node's first).
    Read what arrived with :meth:`since`, by the count :attr:`n_samples`."""

    # node -> {host, note, t, gpus: {i: entry}}
    nodes: dict[int, dict[str, Any]] = field(default_factory=dict)
    samples: list[dict[str, Any]] = field(default_factory=list)      # {t, node, status, text, seq, change}
    # {t, node, host, gpu, uuid, fault, detail, xid}
    faults: list[dict[str, Any]] = field(default_factory=list)
    n_samples: int = 0                                               # samples ever folded in
    recent: int = 4096
    _status: dict[int, str] = field(default_factory=dict)           # node -> status of its newest sample

    def since(self, n: int) -> list[dict[str, Any]]:
        """The samples folded in after the first ``n`` (those still kept)."""
        i = len(self.samples)
        while i and self.samples[i - 1]["seq"] >= n:
            i -= 1
        return self.samples[i:]

    def _sample(self, t: float, node: int, status: str, text: str) -> None:
        change = self._status.get(node) != status
        self._status[node] = status
        self.samples.append({"t": t, "node": node, "status": status, "text": text, "seq": self.n_samples,
                             "change": change})
        self.n_samples += 1
        if len(self.samples) > self.recent * 5 // 4:   # amortised: drop old samples that changed nothing
            old, new = self.samples[:-self.recent], self.samples[-self.recent:]
            self.samples = [x for x in old if x["change"]] + new

    def on_health(self, t: float, data: dict[str, Any]) -> None:
        node, host = data["node"], data["host"][:128]
        entries = [e for e in map(parse_entry, data["gpus"][:64]) if e is not None]
        state = self.nodes.setdefault(node, {"host": host, "note": None, "gpus": {}, "t": t})
        state["host"], state["t"] = host, t
        note = data.get("note")
        if not entries and isinstance(note, str):
            state["note"] = note[:200]
            self._sample(t, node, "none", f"{host}: {state['note']}")
            return
        for e in entries:
            state["gpus"][e["gpu"]] = e
        throttled = [f"GPU {e['gpu']}: {throttle_text(e['throttle'])}" for e in entries
                     if (e["throttle"] or 0) & BAD_THROTTLE]
        lost = [f"GPU {e['gpu']}: lost (fell off the bus)" for e in entries if e["lost"]]
        status = "fault" if lost else "throttled" if throttled else "ok"
        text = "<br>".join([f"<b>node {node} ({host}): {status}</b>", *lost, *throttled, _summary(entries)])
        self._sample(t, node, status, text)

    def on_fault(self, t: float, data: dict[str, Any]) -> None:
        fault = {"t": t, **{k: data[k] for k in ("node", "host", "gpu", "uuid", "fault", "detail")},
                 "xid": data.get("xid")}
        self.faults.append(fault)
        self.nodes.setdefault(fault["node"], {"host": fault["host"][:128], "note": None, "gpus": {}, "t": t})
        self._sample(t, fault["node"], "throttled" if fault["fault"] == "throttle" else "fault",
                     f"<b>node {fault['node']} ({fault['host'][:128]})</b><br>"
                     f"GPU {fault['gpu']} ({fault['uuid'][:96]}): {fault['detail'][:200]}")


def _summary(entries: list[dict[str, Any]]) -> str:
    """One line for all of a node's GPUs: a strip point's hover, sent for every point a live
    dashboard re-draws, stays short however many GPUs the node has (each one's figures: the metrics)."""
    def span(key: str, unit: str) -> str:
        vals = [e[key] for e in entries if e[key] is not None]
        if not vals:
            return "?"
        lo, hi = f"{min(vals):.0f}", f"{max(vals):.0f}"
        return f"{hi}{unit}" if lo == hi else f"{lo}-{hi}{unit}"

    def total(key: str) -> str:
        vals = [e[key] for e in entries if e[key] is not None]
        return str(sum(vals)) if vals else "?"

    return (f"{len(entries)} GPU{'s' if len(entries) != 1 else ''}: {span('temp_c', ' C')}, "
            f"{span('power_w', ' W')}, "
            f"ECC {total('ecc_sbe')}/{total('ecc_dbe')} (single/double)")


def fault_label(f: dict[str, Any]) -> str:
    """How a GPU fault reads on the timeline."""
    return f"{f['detail'][:80]} · node {f['node']} GPU {f['gpu']}"

