"""Which NVRx ``pip install eksft-nb`` gives on a platform, from the wheels PyPI publishes.

eksft-nb asks for ``nvidia-resiliency-ext>=0.4.1,<0.8``; NVRx publishes binary wheels only (checked
with ``pip index versions --python-version --platform --only-binary=:all:``, 2026-12): 0.4.1 for
CPython 3.10-3.12 on glibc >= 2.31 (``manylinux_2_31``); 0.5.0 and 0.6.0 for 3.10-3.12 and 0.7.0 for
3.12 and 3.14 on glibc >= 2.39 (``manylinux_2_39``); x86_64 and aarch64 alike. So pip resolves 0.4.1
on an older glibc, 0.6.0 on Python 3.10-3.11 with a newer one, 0.7.0 on 3.12 and 3.14 with a newer
one, and nothing on Python 3.13 (nor on glibc < 2.31, nor 3.14 with glibc < 2.39).
"""

from __future__ import annotations

import os
import platform
import re

# (the newest release) -> (pythons it has wheels for, the oldest glibc its wheels run on)
WHEELS = (
    ("0.7.0", ((3, 12), (3, 14)), (2, 39)),
    ("0.6.0", ((3, 10), (3, 11), (3, 12)), (2, 39)),
    ("0.4.1", ((3, 10), (3, 11), (3, 12)), (2, 31)),
)


def resolves(python: tuple[int, int], glibc: tuple[int, int] | None) -> str | None:
    """The NVRx release pip resolves for eksft-nb on this Python and glibc; None: none can be installed."""
    if glibc is None:
        return None  # no glibc (musl, macOS, Windows): NVRx publishes manylinux wheels only
    return next(
        (version for version, pythons, oldest in WHEELS if python in pythons and glibc >= oldest), None
    )


def glibc() -> tuple[int, int] | None:
    """This machine's glibc version; None where the C library is not glibc."""
    try:
        text = os.confstr("CS_GNU_LIBC_VERSION") or ""
    except (ValueError, OSError, AttributeError):
        text = ""
    m = re.search(r"glibc (\d+)\.(\d+)", text)
    return (int(m.group(1)), int(m.group(2))) if m else None


def here() -> tuple[tuple[int, int], tuple[int, int] | None]:
    major, minor = (int(x) for x in platform.python_version_tuple()[:2])
    return (major, minor), glibc()


def said(python: tuple[int, int], libc: tuple[int, int] | None) -> str:
    """One line: what pip gives here, or why nothing, and what to do then."""
    where = f"Python {python[0]}.{python[1]}, " + (f"glibc {libc[0]}.{libc[1]}" if libc else "no glibc")
    release = resolves(python, libc)
    if release is not None:
        return f"pip install gives NVRx {release} here ({where})"
    if libc is None:
        why = "NVRx publishes Linux (glibc) wheels only"
    elif python == (3, 13) or python > (3, 14) or python < (3, 10):
        why = "NVRx publishes wheels for Python 3.10-3.12 and 3.14 only"
    else:
        why = f"NVRx's wheels for Python {python[0]}.{python[1]} need glibc >= " + (
            "2.31" if python <= (3, 12) else "2.39"
        )
    return (
        f"no NVRx can be installed here ({where}): {why}; run local jobs with Python 3.12 on glibc >= 2.39 "
        "(Ubuntu 24.04) for NVRx 0.7, or 2.31 for 0.4.1; EKS and Slurm jobs need NVRx only in their image "
        "or on their nodes"
    )
