"""Kubernetes resource quantities ("16Gi", "500m", "1e3"), read exactly: one parser for the checks of
``--cpu``/``--memory`` and for the Kueue quota summed from the rendered pods."""

from __future__ import annotations

import re
from fractions import Fraction
from typing import Any

_QUANTITY = re.compile(r"^(\d+(?:\.\d*)?|\.\d+)(?:(Ki|Mi|Gi|Ti|Pi|Ei)|(n|u|m|k|M|G|T|P|E)|[eE]([+-]?\d+))?$")
BINARY = {"Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40, "Pi": 1 << 50, "Ei": 1 << 60}
_DECIMAL = {"n": -9, "u": -6, "m": -3, "k": 3, "M": 6, "G": 9, "T": 12, "P": 15, "E": 18}


def parse(value: Any) -> Fraction | None:
    """The quantity's exact value (so 50m + 50m is 100m, not a float's 0.1000...1), or None when
    ``value`` is not a Kubernetes quantity."""
    m = _QUANTITY.match(str(value).strip())
    if not m:
        return None
    number, binary, decimal, exponent = m.groups()
    scale = Fraction(BINARY[binary]) if binary else Fraction(10) ** (_DECIMAL[decimal] if decimal
                                                                     else int(exponent or 0))
    return Fraction(number) * scale
