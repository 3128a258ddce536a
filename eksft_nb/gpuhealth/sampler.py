"""The sampler, in local rank 0 of every node (see :meth:`eksft_nb.runtime.session.Session`): the rank
processes are the one place of ours that runs per node on both backends (locally the launchers are
NVRx's ft_launcher and the supervisor is one per job; on EKS the supervisor does not exist and the
pod runs ft_launcher). A thread waits on NVML's event set for critical XIDs and double-bit ECC errors
(reported at once, as ``gpu_fault``) and every ``interval`` seconds reads each GPU into one
``gpu_health`` event. A node without NVML (no GPU, no driver) says so in one ``gpu_health`` event with
a ``note`` and starts no thread. NVML's answers are parsed by :func:`read_gpus`, which refuses a value
it cannot trust in one line."""

from __future__ import annotations

import re
import sys
import threading
import time
import warnings
from collections.abc import Callable
from typing import Any

from .readings import BAD_THROTTLE, U64, GpuReadingError, throttle_text, xid_text

# NVML constants used here (pynvml's names and values)
_UUID = re.compile(r"(GPU|MIG)-[0-9A-Za-z-]{1,80}")
_TEMPERATURE_GPU, _UNCORRECTED, _CORRECTED, _VOLATILE = 0, 1, 0, 0
_EVENT_SBE, _EVENT_DBE, _EVENT_XID = 0x1, 0x2, 0x8
_NOT_SUPPORTED, _TIMEOUT, _GPU_IS_LOST = 3, 10, 15


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
            "throttle": None if throttle is None else _int(gpu, "throttle reasons", throttle, 0, U64),
            "ecc_sbe": None if sbe is None else _int(gpu, "single-bit ECC count", sbe, 0, U64),
            "ecc_dbe": None if dbe is None else _int(gpu, "double-bit ECC count", dbe, 0, U64),
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

