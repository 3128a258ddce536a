"""What a GPU reading means, shared by the sampler that makes it and the fold that reads it back:
NVML's XID and throttle codes in words, and a ``gpus`` entry of a ``gpu_health`` event, checked."""

from __future__ import annotations

from typing import Any

from ..errors import EksftError

# the XIDs that usually end a training job (NVIDIA's XID catalogue), named for the timeline
XID_TEXT = {13: "graphics engine exception", 31: "GPU memory page fault", 43: "GPU stopped processing",
            45: "preemptive cleanup", 48: "double-bit ECC error", 61: "internal micro-controller breakpoint",
            62: "internal micro-controller halt", 63: "ECC page retirement or row remapping",
            64: "ECC page retirement or row remapper failure", 74: "NVLink error", 79: "GPU fell off the bus",
            92: "high single-bit ECC error rate", 94: "contained ECC error", 95: "uncontained ECC error",
            119: "GSP RPC timeout", 120: "GSP error"}
# clock throttle reasons that mean trouble (NVML's bits); power capping by software is routine under load
THROTTLE_TEXT = {0x8: "hardware slowdown", 0x20: "software thermal slowdown",
                 0x40: "hardware thermal slowdown", 0x80: "hardware power brake"}
BAD_THROTTLE = sum(THROTTLE_TEXT)

U64 = 2**64


class GpuReadingError(EksftError):
    """An NVML reading (live or recorded) that cannot be trusted."""


def xid_text(xid: int) -> str:
    return f"XID {xid} ({XID_TEXT[xid]})" if xid in XID_TEXT else f"XID {xid}"


def throttle_text(mask: int) -> str:
    return ", ".join(text for bit, text in THROTTLE_TEXT.items() if mask & bit)



def parse_entry(raw: Any) -> dict[str, Any] | None:
    """One ``gpus`` entry of a ``gpu_health`` event read back (untrusted); None if malformed."""
    if not isinstance(raw, dict) or type(raw.get("gpu")) is not int or not 0 <= raw["gpu"] < 1024 \
            or not isinstance(raw.get("uuid"), str) or len(raw["uuid"]) > 96 \
            or type(raw.get("lost")) is not bool:
        return None
    out = {"gpu": raw["gpu"], "uuid": raw["uuid"], "lost": raw["lost"], "xid": raw.get("xid", 0)}
    if type(out["xid"]) is not int or not 0 <= out["xid"] < 100_000:
        return None
    for key, types in (("temp_c", (int,)), ("power_w", (int, float)), ("throttle", (int,)),
                       ("ecc_sbe", (int,)), ("ecc_dbe", (int,))):
        value = raw.get(key)
        if value is not None and (type(value) not in types or not 0 <= value < U64):
            return None
        out[key] = value
    return out

