"""GPU health per node from NVML: XID errors, ECC counts, clock throttling, temperature, power.

It runs in local rank 0 of every node (see :meth:`eksft_nb.runtime.session.Session`): the rank
processes are the one place of ours that runs per node on both backends (locally the launchers are
NVRx's ft_launcher and the supervisor is one per job; on EKS the supervisor does not exist and the
pod runs ft_launcher). A sampler thread waits on NVML's event set for critical XIDs and
double-bit ECC errors (reported at once, as ``gpu_fault``) and every ``interval`` seconds reads
each GPU into one ``gpu_health`` event. A node without NVML (no GPU, no driver) says so in one
``gpu_health`` event with a ``note`` and starts no thread.

NVML's answers are parsed by :func:`read_gpus`, which refuses a value it cannot trust in one line.
:class:`Replay` is a ``pynvml``-shaped object that answers with readings recorded by
:func:`record` (JSON), so the whole path (sampler, events, monitor, figure, metrics, incidents)
runs without a GPU. :class:`GpuFold` is what the monitor keeps; :func:`dcgm_metrics` exports it
under the DCGM exporter's names so Grafana can join our series with dcgm-exporter's by ``UUID``.
"""

from __future__ import annotations

import json
import re
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .errors import EksftError

# the XIDs that usually end a training job (NVIDIA's XID catalogue), named for the timeline
XID_TEXT = {13: "graphics engine exception", 31: "GPU memory page fault", 43: "GPU stopped processing",
            45: "preemptive cleanup", 48: "double-bit ECC error", 61: "internal micro-controller breakpoint",
            62: "internal micro-controller halt", 63: "ECC page retirement or row remapping",
            64: "ECC page retirement or row remapper failure", 74: "NVLink error", 79: "GPU fell off the bus",
            92: "high single-bit ECC error rate", 94: "contained ECC error", 95: "uncontained ECC error",
            119: "GSP RPC timeout", 120: "GSP error"}
# clock throttle reasons that mean trouble (NVML's bits); power capping by software is routine under load
THROTTLE_TEXT = {0x8: "hardware slowdown", 0x20: "software thermal slowdown",
                 0x40: "hardware thermal slowdown",
                 0x80: "hardware power brake"}
BAD_THROTTLE = sum(THROTTLE_TEXT)

# NVML constants used here (pynvml's names and values)
_TEMPERATURE_GPU, _UNCORRECTED, _CORRECTED, _VOLATILE = 0, 1, 0, 0
_EVENT_SBE, _EVENT_DBE, _EVENT_XID = 0x1, 0x2, 0x8
_NOT_SUPPORTED, _TIMEOUT, _GPU_IS_LOST = 3, 10, 15
_UUID = re.compile(r"(GPU|MIG)-[0-9A-Za-z-]{1,80}")
_U64 = 2**64


class GpuReadingError(EksftError):
    """An NVML reading (live or recorded) that cannot be trusted."""


def xid_text(xid: int) -> str:
    return f"XID {xid} ({XID_TEXT[xid]})" if xid in XID_TEXT else f"XID {xid}"


def throttle_text(mask: int) -> str:
    return ", ".join(text for bit, text in THROTTLE_TEXT.items() if mask & bit)


# ---- reading NVML -------------------------------------------------------------------------------
def _int(gpu: int, what: str, value: Any, low: int, high: int) -> int:
    if type(value) is not int or not low <= value < high:
        raise GpuReadingError(f"GPU {gpu}: NVML's {what} reading {str(value)[:40]!r} is not an integer in "
                              f"[{low}, {high})", "check the driver (nvidia-smi); this reading is skipped")
    return value


def _read_one(nvml: Any, gpu: int, handle: Any) -> dict[str, Any]:
    """One GPU's reading, as the ``gpus`` entries of a ``gpu_health`` event carry it."""
    def call(fn: Callable[..., Any], *args: Any) -> Any:   # None: this GPU does not support the reading
        try:
            return fn(handle, *args)
        except nvml.NVMLError as e:
            if getattr(e, "value", None) == _NOT_SUPPORTED:
                return None
            raise

    uuid = call(nvml.nvmlDeviceGetUUID)
    uuid = uuid.decode(errors="replace") if isinstance(uuid, bytes) else uuid
    if not isinstance(uuid, str) or not _UUID.fullmatch(uuid):
        raise GpuReadingError(f"GPU {gpu}: NVML's UUID {str(uuid)[:40]!r} is not a GPU UUID",
                              "check the driver (nvidia-smi -L); this reading is skipped")
    reasons = getattr(nvml, "nvmlDeviceGetCurrentClocksEventReasons", None) or \
        nvml.nvmlDeviceGetCurrentClocksThrottleReasons
    temp, power = call(nvml.nvmlDeviceGetTemperature, _TEMPERATURE_GPU), call(nvml.nvmlDeviceGetPowerUsage)
    throttle = call(reasons)
    sbe = call(nvml.nvmlDeviceGetTotalEccErrors, _CORRECTED, _VOLATILE)
    dbe = call(nvml.nvmlDeviceGetTotalEccErrors, _UNCORRECTED, _VOLATILE)
    return {"gpu": gpu, "uuid": uuid,
            "temp_c": None if temp is None else _int(gpu, "temperature", temp, 0, 200),
            "power_w": None if power is None else _int(gpu, "power (mW)", power, 0, 10_000_000) / 1000.0,
            "throttle": None if throttle is None else _int(gpu, "throttle reasons", throttle, 0, _U64),
            "ecc_sbe": None if sbe is None else _int(gpu, "single-bit ECC count", sbe, 0, _U64),
            "ecc_dbe": None if dbe is None else _int(gpu, "double-bit ECC count", dbe, 0, _U64),
            "lost": False}


def read_gpus(nvml: Any, handles: list[Any], refused: Callable[[str], Any],
              uuids: dict[int, str]) -> list[dict]:
    """Read every GPU. A GPU that fell off the bus reads as ``lost``; a reading that cannot be
    trusted is refused (``refused(one line)``) and left out. ``uuids``: GPU index -> UUID, as known."""
    out = []
    for gpu, handle in enumerate(handles):
        try:
            if handle is None:   # NVML gave no handle: it was lost before we started
                raise nvml.NVMLError(_GPU_IS_LOST)
            reading = _read_one(nvml, gpu, handle)
            uuids[gpu] = reading["uuid"]
        except nvml.NVMLError as e:
            if getattr(e, "value", None) != _GPU_IS_LOST:
                refused(f"GPU {gpu}: NVML error {str(e)[:80]}: this reading is skipped")
                continue
            reading = {"gpu": gpu, "uuid": uuids.get(gpu, f"GPU-unknown-{gpu}"), "temp_c": None,
                       "power_w": None,
                       "throttle": None, "ecc_sbe": None, "ecc_dbe": None, "lost": True}
        except GpuReadingError as e:
            refused(str(e))
            continue
        out.append(reading)
    return out


def parse_entry(raw: Any) -> dict[str, Any] | None:
    """One ``gpus`` entry of a ``gpu_health`` event read back (untrusted); None if malformed."""
    if not isinstance(raw, dict) or type(raw.get("gpu")) is not int or not 0 <= raw["gpu"] < 1024 \
            or not isinstance(raw.get("uuid"),
                              str) or len(raw["uuid"]) > 96 or type(raw.get("lost")) is not bool:
        return None
    out = {"gpu": raw["gpu"], "uuid": raw["uuid"], "lost": raw["lost"], "xid": raw.get("xid", 0)}
    if type(out["xid"]) is not int or not 0 <= out["xid"] < 100_000:
        return None
    for key, types in (("temp_c", (int,)), ("power_w", (int, float)), ("throttle", (int,)),
                       ("ecc_sbe", (int,)),
                       ("ecc_dbe", (int,))):
        value = raw.get(key)
        if value is not None and (type(value) not in types or not 0 <= value < _U64):
            return None
        out[key] = value
    return out


# ---- sampling -----------------------------------------------------------------------------------
class GpuSampler:
    """Samples one node's GPUs: ``tick()`` reads them all and emits ``gpu_health`` (and a
    ``gpu_fault`` per onset); ``drain(ms)`` waits that long for NVML's XID and ECC events. ``start()``
    runs both in a daemon thread. ``emit(kind, **fields)`` writes an event."""

    def __init__(self, nvml: Any, emit: Callable[..., Any], node: int, host: str,
                 interval: float = 10.0) -> None:
        self.nvml, self.emit, self.node, self.host, self.interval = nvml, emit, node, host, interval
        self.handles = handles(nvml)
        self.uuids: dict[int, str] = {}
        self.prev: dict[int, dict[str, Any]] = {}
        self.last_xid: dict[int, int] = {}
        self.ecc_told: set[int] = set()
        self._said: set[str] = set()
        self._halt = threading.Event()
        self._thread: threading.Thread | None = None
        self.events = None
        try:   # XID and ECC notifications; without them (not supported, a VM) the counters still show ECC
            self.events = nvml.nvmlEventSetCreate()
            for handle in filter(None, self.handles):
                nvml.nvmlDeviceRegisterEvents(handle, _EVENT_XID | _EVENT_DBE, self.events)
        except nvml.NVMLError as e:
            self._refused(f"NVML cannot deliver XID events here ({str(e)[:80]}): only counters are sampled")

    def _refused(self, line: str) -> None:
        """Say a problem once (on stderr: the rank's log), never again."""
        if line not in self._said:
            self._said.add(line)
            print(f"eksft: gpu health on node {self.node}: {line}", file=sys.stderr, flush=True)

    def _fault(self, gpu: int, fault: str, detail: str, **extra: Any) -> None:
        self.emit("gpu_fault", node=self.node, host=self.host, gpu=gpu,
                  uuid=self.uuids.get(gpu, f"GPU-unknown-{gpu}"),
                  fault=fault, detail=detail, **extra)

    def tick(self) -> list[dict[str, Any]]:
        readings = read_gpus(self.nvml, self.handles, self._refused, self.uuids)
        for r in readings:
            gpu, before = r["gpu"], self.prev.get(r["gpu"])
            if r["lost"] and not (before and before["lost"]) and self.last_xid.get(gpu) != 79:
                self.last_xid[gpu] = 79
                self._fault(gpu, "xid", f"{xid_text(79)}: NVML says the GPU is lost", xid=79)
            if before is not None and r["ecc_dbe"] is not None and before["ecc_dbe"] is not None \
                    and r["ecc_dbe"] > before["ecc_dbe"] and gpu not in self.ecc_told:
                n = r["ecc_dbe"] - before["ecc_dbe"]
                self._fault(gpu, "ecc", f"{n} double-bit ECC error{'s' if n > 1 else ''} "
                            f"({r['ecc_dbe']} since the driver loaded)", count=r["ecc_dbe"])
            new = (r["throttle"] or 0) & BAD_THROTTLE & ~((before or {}).get("throttle") or 0)
            if new:
                self._fault(gpu, "throttle", f"clocks throttled: {throttle_text(new)} at "
                            f"{r['temp_c'] if r['temp_c'] is not None else '?'} C", throttle=r["throttle"])
            r["xid"] = self.last_xid.get(gpu, 0)
            self.ecc_told.discard(gpu)
            if not r["lost"]:
                self.prev[gpu] = r
            else:
                self.prev[gpu] = {**(before or r), "lost": True}
        self.emit("gpu_health", node=self.node, host=self.host, gpus=readings, interval_s=self.interval)
        return readings

    def drain(self, timeout_ms: int) -> None:
        """Report the XID and ECC events NVML delivers within ``timeout_ms`` (then returns)."""
        deadline = time.monotonic() + timeout_ms / 1000.0
        while self.events is not None and not self._halt.is_set():
            left = int((deadline - time.monotonic()) * 1000)
            if left <= 0:
                return
            try:
                data = self.nvml.nvmlEventSetWait(self.events, min(left, 1000))
            except self.nvml.NVMLError as e:
                if getattr(e, "value", None) != _TIMEOUT:
                    self._refused(
                        f"waiting for NVML events failed ({str(e)[:80]}): only counters are sampled")
                    self.events = None
                continue
            try:
                gpu = self.nvml.nvmlDeviceGetIndex(data.device)
            except self.nvml.NVMLError:
                gpu = None
            kind, value = data.eventType, data.eventData
            if type(gpu) is not int or not 0 <= gpu < len(self.handles) or type(kind) is not int or type(
                value) is not int or not 0 <= value < 100_000:
                self._refused(f"an NVML event that names no GPU of this node or no XID ({str(kind)[:20]}, "
                              f"{str(value)[:20]}) is ignored")
            elif kind & _EVENT_XID:
                self.last_xid[gpu] = value
                self._fault(gpu, "xid", xid_text(value), xid=value)
            elif kind & _EVENT_DBE:
                self.ecc_told.add(gpu)   # reported now: the counter's rise at the next reading is not news
                self._fault(gpu, "ecc", "double-bit ECC error (NVML event)")
        if self.events is None:
            self._halt.wait(timeout_ms / 1000.0)

    def start(self) -> GpuSampler:
        def loop() -> None:
            try:
                while not self._halt.is_set():
                    self.tick()
                    self.drain(int(self.interval * 1000))
            except Exception as e:  # noqa: BLE001 - GPU health never takes the rank down
                self._refused(f"sampling stopped: {type(e).__name__}: {str(e)[:120]}")
        self._thread = threading.Thread(target=loop, daemon=True, name="eksft-gpu-health")
        self._thread.start()
        return self

    def stop(self) -> None:
        self._halt.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        try:
            if self.events is not None:
                self.nvml.nvmlEventSetFree(self.events)
            self.nvml.nvmlShutdown()
        except self.nvml.NVMLError:
            pass


def load_nvml() -> tuple[Any, str]:
    """pynvml, initialised, with the number of GPUs; or (None, why not)."""
    try:
        with warnings.catch_warnings():   # the deprecated `pynvml` wrapper package warns on import
            warnings.simplefilter("ignore", FutureWarning)
            import pynvml
    except ImportError:
        return None, "nvidia-ml-py is not installed"
    try:
        pynvml.nvmlInit()
        count = pynvml.nvmlDeviceGetCount()
    except pynvml.NVMLError as e:
        return None, f"NVML: {e}"
    if not count:
        pynvml.nvmlShutdown()
        return None, "NVML sees no GPU"
    return pynvml, ""


def start(emit: Callable[..., Any], node: int, host: str, *, first: bool, interval: float = 10.0,
          nvml: Any = None) -> GpuSampler | None:
    """Start sampling this node's GPUs; None where there is no NVML or GPU, which the node's first
    incarnation (``first``) says in one ``gpu_health`` event."""
    why = ""
    if nvml is None:
        nvml, why = load_nvml()
    if nvml is None:
        if first:
            emit("gpu_health", node=node, host=host, gpus=[], note=f"no GPU health: {why}")
        return None
    try:
        return GpuSampler(nvml, emit, node, host, interval).start()
    except nvml.NVMLError as e:   # GPU health never takes the rank down
        print(f"eksft: gpu health on node {node}: NVML failed ({str(e)[:80]}): not sampled", file=sys.stderr)
        return None


def handles(nvml: Any) -> list[Any]:
    """A handle per GPU; None for a GPU NVML says is lost (it fell off the bus)."""
    out = []
    for i in range(nvml.nvmlDeviceGetCount()):
        try:
            out.append(nvml.nvmlDeviceGetHandleByIndex(i))
        except nvml.NVMLError as e:
            if getattr(e, "value", None) != _GPU_IS_LOST:
                raise
            out.append(None)
    return out


# ---- recording and replaying NVML readings ------------------------------------------------------
RECORDING = "eksft-nvml-recording"


def record(path: str | Path, frames: int = 3, interval: float = 1.0, nvml: Any = None) -> Path:
    """Record this machine's NVML readings (``frames`` of them, ``interval`` apart) for :class:`Replay`."""
    nvml = nvml or load_nvml()[0]
    if nvml is None:
        raise GpuReadingError("no NVML here", "record on a machine with an NVIDIA driver and GPU")
    gpus = handles(nvml)
    reasons = getattr(nvml, "nvmlDeviceGetCurrentClocksEventReasons", None) or \
        nvml.nvmlDeviceGetCurrentClocksThrottleReasons

    def raw(fn: Callable[..., Any], *args: Any) -> Any:
        try:
            value = fn(*args)
            return value.decode() if isinstance(value, bytes) else value
        except nvml.NVMLError as e:
            return {"nvml_error": e.value}

    events = None
    try:
        events = nvml.nvmlEventSetCreate()
        for h in filter(None, gpus):
            nvml.nvmlDeviceRegisterEvents(h, _EVENT_XID | _EVENT_DBE, events)
    except nvml.NVMLError:
        pass
    out: list[dict[str, Any]] = []
    for _ in range(frames):
        frame: dict[str, Any] = {"gpus": [{"uuid": raw(nvml.nvmlDeviceGetUUID, h),
                                           "temperature": raw(nvml.nvmlDeviceGetTemperature, h,
                                                              _TEMPERATURE_GPU),
                                           "power_mw": raw(nvml.nvmlDeviceGetPowerUsage, h),
                                           "throttle": raw(reasons, h),
                                           "ecc_sbe": raw(nvml.nvmlDeviceGetTotalEccErrors, h, _CORRECTED,
                                                          _VOLATILE),
                                           "ecc_dbe": raw(nvml.nvmlDeviceGetTotalEccErrors, h, _UNCORRECTED,
                                                          _VOLATILE)}
                                          if h is not None
                                          else {"uuid": {"nvml_error": _GPU_IS_LOST}} for h in gpus],
                                 "events": []}
        deadline = time.monotonic() + interval
        while (left := int((deadline - time.monotonic()) * 1000)) > 0:
            if events is None:
                time.sleep(left / 1000)
                continue
            try:
                data = nvml.nvmlEventSetWait(events, left)
            except nvml.NVMLError:
                continue
            frame["events"].append({"gpu": nvml.nvmlDeviceGetIndex(data.device),
                                    "type": "xid" if data.eventType & _EVENT_XID else "ecc_dbe",
                                    "data": data.eventData})
        out.append(frame)
    path = Path(path)
    path.write_text(json.dumps({"format": RECORDING, "version": 1, "frames": out}, indent=1))
    return path


@dataclass
class _EventData:
    device: Any
    eventType: Any
    eventData: Any


class Replay:
    """A ``pynvml``-shaped object answering with recorded readings, one frame per sampling period: a
    frame's readings, then its events (handed out by ``nvmlEventSetWait``, which then times out
    like NVML's); the first reading after a timeout moves to the next frame (the last one repeats).
    ``frames_done`` counts the frames whose events have all been handed out."""

    class NVMLError(Exception):
        def __init__(self, value: int) -> None:
            self.value = value
            super().__init__(f"NVML error {value}")

    def __init__(self, frames: list[dict[str, Any]]) -> None:
        self.frames, self.frame, self.frames_done = frames, 0, 0
        self.pending = list(frames[0]["events"])
        self._dry = False   # the current frame's events are all out: the next reading starts the next frame
        self.ngpus = len(frames[0]["gpus"])

    @classmethod
    def load(cls, path: str | Path) -> Replay:
        """Read a recording; a malformed one is refused in one line."""
        fix = f"record it again with eksft_nb.gpuhealth.record, or fix {path}"
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, ValueError, RecursionError) as e:
            raise GpuReadingError(f"cannot read the NVML recording {path} ({type(e).__name__})",
                                  fix) from None
        if not isinstance(data, dict) or data.get("format") != RECORDING or data.get("version") != 1:
            raise GpuReadingError(f"{path} is not a version-1 {RECORDING}", fix)
        frames = data.get("frames")
        if not isinstance(frames, list) or not frames or len(frames) > 100_000:
            raise GpuReadingError(f"{path} has no frames", fix)
        for i, frame in enumerate(frames):
            gpus, events = (frame.get("gpus"),
                            frame.get("events", [])) if isinstance(frame, dict) else (None, None)
            if not isinstance(gpus, list) or not all(isinstance(g, dict) for g in gpus) or len(gpus) > 64 \
                    or (i and len(gpus) != len(frames[0]["gpus"])) or not isinstance(events, list) \
                    or not all(isinstance(ev, dict) and type(ev.get("gpu")) is int
                               and 0 <= ev["gpu"] < len(gpus)
                               and ev.get("type") in ("xid", "ecc_dbe") for ev in events):
                raise GpuReadingError(f"{path}: frame {i} is not a list of GPU readings and events "
                                      "on those GPUs",
                                      fix)
            frame["events"] = events
        return cls(frames)

    # the pynvml functions the sampler calls
    def nvmlInit(self) -> None:
        pass

    def nvmlShutdown(self) -> None:
        pass

    def nvmlDeviceGetCount(self) -> int:
        return self.ngpus

    def nvmlDeviceGetHandleByIndex(self, i: int) -> int:
        return i

    def _value(self, handle: int, key: str) -> Any:
        if self._dry and self.frame + 1 < len(self.frames):
            self.frame += 1
            self.pending = list(self.frames[self.frame]["events"])
        self._dry = False
        value = self.frames[self.frame]["gpus"][handle].get(key, {"nvml_error": _NOT_SUPPORTED})
        if isinstance(value, dict):
            raise self.NVMLError(value.get("nvml_error"))
        return value

    def nvmlDeviceGetIndex(self, h: int) -> int:
        return h

    def nvmlDeviceGetUUID(self, h: int) -> Any:
        return self._value(h, "uuid")

    def nvmlDeviceGetTemperature(self, h: int, sensor: int) -> Any:
        return self._value(h, "temperature")

    def nvmlDeviceGetPowerUsage(self, h: int) -> Any:
        return self._value(h, "power_mw")

    def nvmlDeviceGetCurrentClocksThrottleReasons(self, h: int) -> Any:
        return self._value(h, "throttle")

    def nvmlDeviceGetTotalEccErrors(self, h: int, error_type: int, counter: int) -> Any:
        return self._value(h, "ecc_dbe" if error_type == _UNCORRECTED else "ecc_sbe")

    def nvmlEventSetCreate(self) -> str:
        return "events"

    def nvmlDeviceRegisterEvents(self, h: int, types: int, events: str) -> None:
        pass

    def nvmlEventSetFree(self, events: str) -> None:
        pass

    def nvmlEventSetWait(self, events: str, timeout_ms: int) -> _EventData:
        if self.pending:
            ev = self.pending.pop(0)
            kind = _EVENT_XID if ev["type"] == "xid" else _EVENT_DBE
            return _EventData(ev["gpu"], kind, ev.get("data", 0))
        self._dry = True
        self.frames_done = max(self.frames_done, self.frame + 1)
        time.sleep(timeout_ms / 1000.0)   # nothing happens until the timeout, as with NVML
        raise self.NVMLError(_TIMEOUT)


# ---- folding the events (the monitor's part) ----------------------------------------------------
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


def dcgm_metrics(jobs: Iterable[tuple[str, GpuFold]]) -> Iterator[Any]:
    """The newest readings under dcgm-exporter's metric names and labels (``gpu``, ``UUID``,
    ``Hostname``), plus ``job``. All gauges, as a ``_total`` suffix would break the names."""
    from prometheus_client.core import GaugeMetricFamily

    labels = ["gpu", "UUID", "Hostname", "job"]
    families = {
        "xid": GaugeMetricFamily("DCGM_FI_DEV_XID_ERRORS", "Value of the last XID error encountered",
                                 labels=labels),
        "ecc_dbe": GaugeMetricFamily("DCGM_FI_DEV_ECC_DBE_VOL_TOTAL",
                                     "Total number of double-bit volatile ECC errors",
                                     labels=labels),
        "ecc_sbe": GaugeMetricFamily("DCGM_FI_DEV_ECC_SBE_VOL_TOTAL",
                                     "Total number of single-bit volatile ECC errors",
                                     labels=labels),
        "temp_c": GaugeMetricFamily("DCGM_FI_DEV_GPU_TEMP", "GPU temperature (in C)", labels=labels),
        "power_w": GaugeMetricFamily("DCGM_FI_DEV_POWER_USAGE", "Power draw (in W)", labels=labels),
        "throttle": GaugeMetricFamily("DCGM_FI_DEV_CLOCK_THROTTLE_REASONS", "Current clock throttle reasons",
                                      labels=labels),
    }
    for job, fold in jobs:
        for state in fold.nodes.values():
            for gpu, e in sorted(state["gpus"].items()):
                for key, family in families.items():
                    if e[key] is not None:
                        family.add_metric([str(gpu), e["uuid"], state["host"], job], float(e[key]))
    yield from families.values()
