"""Kubernetes resource quantities, as far as memory sizing needs them: parse to bytes, and format.

The webhook computes the pod's volume ``sizeLimit`` and the sidecar's memory from a model's byte count, and
compares users' overrides with what the model needs, so both directions are exact integers (no floats).
These are the values written into a pod spec, so the grammar is Kubernetes' own (``1.5Gi``, ``500m``,
``2e9``; not ``1GB``); the project's other sizes (``chunkSize``, flags) use :mod:`modelload.loader.sizes`.
"""

from __future__ import annotations

import math
import re
from decimal import Decimal, InvalidOperation

from modelload.loader.errors import ConfigError

__all__ = ["MAX_BYTES", "MIB", "format_mib", "parse_bytes"]

MIB = 1 << 20

_BINARY = {"Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40, "Pi": 1 << 50, "Ei": 1 << 60}
_DECIMAL = {
    "n": Decimal("1e-9"),
    "u": Decimal("1e-6"),
    "m": Decimal("1e-3"),
    "": Decimal(1),
    "k": Decimal(10**3),
}
_DECIMAL.update({"M": Decimal(10**6), "G": Decimal(10**9), "T": Decimal(10**12), "P": Decimal(10**15)})
_DECIMAL["E"] = Decimal(10**18)
MAX_BYTES = (1 << 63) - 1
"""A quantity's value is a signed 64-bit integer in the API server: a larger one cannot size a pod."""
MAX_QUANTITY = "8Ei"
_QUANTITY = re.compile(r"^([+-]?[0-9.]+)(Ki|Mi|Gi|Ti|Pi|Ei|[numkMGTPE]|[eE][+-]?[0-9]+)?$")


def parse_bytes(value: str | int) -> int:
    """A memory quantity (``512Mi``, ``1G``, ``2e9``, ``1048576``) in bytes, rounded up to a whole byte."""
    if isinstance(value, int) and not isinstance(value, bool):
        if value < 0:
            raise ConfigError(f"a memory quantity cannot be negative: {value}")
        if value > MAX_BYTES:
            raise ConfigError(f"{value} is above {MAX_QUANTITY}, the largest quantity Kubernetes holds")
        return value
    text = str(value).strip()
    match = _QUANTITY.match(text)
    if match is None:
        raise ConfigError(f"{text!r} is not a Kubernetes quantity (e.g. 512Mi, 2Gi, 1G)")
    number, suffix = match.group(1), match.group(2) or ""
    try:
        amount = Decimal(number)
    except InvalidOperation as exc:
        raise ConfigError(f"{text!r} is not a Kubernetes quantity (e.g. 512Mi, 2Gi, 1G)") from exc
    too_large = ConfigError(f"{text!r} is above {MAX_QUANTITY}, the largest quantity Kubernetes holds")
    try:
        if suffix in _BINARY:
            total = amount * _BINARY[suffix]
        elif suffix in _DECIMAL:  # "E" alone is exa; "E3" an exponent
            total = amount * _DECIMAL[suffix]
        else:
            total = amount * (Decimal(10) ** int(suffix[1:]))
    except ArithmeticError:  # decimal's Overflow: an exponent past what any context holds
        raise too_large from None
    if total < 0:
        raise ConfigError(f"a memory quantity cannot be negative: {text!r}")
    if total > MAX_BYTES:
        raise too_large
    return math.ceil(total)


def format_mib(nbytes: int) -> str:
    """``nbytes`` rounded up to whole MiB, as a quantity (``1536Mi``): exact, and readable in a pod spec."""
    return f"{max(1, math.ceil(nbytes / MIB))}Mi"
