"""A ``pynvml``-shaped stand-in answering with readings recorded on a machine with GPUs (:func:`record`),
so the whole GPU health path (sampler, events, monitor, figure, metrics, incidents) runs without one."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eksft_nb.gpuhealth.readings import GpuReadingError
from eksft_nb.gpuhealth.sampler import (_CORRECTED, _EVENT_DBE, _EVENT_XID, _GPU_IS_LOST, _NOT_SUPPORTED,
                                        _TEMPERATURE_GPU, _TIMEOUT,
                                        _UNCORRECTED, _VOLATILE, handles, load_nvml)

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
        frame: dict[str, Any] = {
            "gpus": [{"uuid": raw(nvml.nvmlDeviceGetUUID, h),
                      "temperature": raw(nvml.nvmlDeviceGetTemperature, h, _TEMPERATURE_GPU),
                      "power_mw": raw(nvml.nvmlDeviceGetPowerUsage, h), "throttle": raw(reasons, h),
                      "ecc_sbe": raw(nvml.nvmlDeviceGetTotalEccErrors, h, _CORRECTED, _VOLATILE),
                      "ecc_dbe": raw(nvml.nvmlDeviceGetTotalEccErrors, h, _UNCORRECTED, _VOLATILE)}
                     if h is not None else {"uuid": {"nvml_error": _GPU_IS_LOST}} for h in gpus],
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
        fix = f"record it again with tests/nvml_replay.py's record, or fix {path}"
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
            gpus, events = ((frame.get("gpus"), frame.get("events", [])) if isinstance(frame, dict)
                            else (None, None))
            if not isinstance(gpus, list) or not all(isinstance(g, dict) for g in gpus) or len(gpus) > 64 \
                    or (i and len(gpus) != len(frames[0]["gpus"])) or not isinstance(events, list) \
                    or not all(isinstance(ev, dict) and type(ev.get("gpu")) is int
                               and 0 <= ev["gpu"] < len(gpus) and ev.get("type") in ("xid", "ecc_dbe")
                               for ev in events):
                raise GpuReadingError(f"{path}: frame {i} is not a list of GPU readings and events on "
                                      "those GPUs", fix)
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


