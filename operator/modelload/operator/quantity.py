"""Kubernetes resource quantities, as far as memory sizing needs them: parse to bytes, format, humanize.

The webhook computes the pod's volume ``sizeLimit`` and the sidecar's memory from a model's byte count, and
compares users' overrides with what the model needs, so both directions are exact integers (no floats).
"""

from __future__ import annotations

import math
import re
from decimal import Decimal, InvalidOperation

from modelload.loader.errors import ConfigError

__all__ = ["MIB", "format_mib", "humanize_bytes", "parse_bytes", "parse_size"]

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
_QUANTITY = re.compile(r"^([+-]?[0-9.]+)(Ki|Mi|Gi|Ti|Pi|Ei|[numkMGTPE]|[eE][+-]?[0-9]+)?$")


def parse_bytes(value: str | int) -> int:
    """A memory quantity (``512Mi``, ``1G``, ``2e9``, ``1048576``) in bytes, rounded up to a whole byte."""
    if isinstance(value, int) and not isinstance(value, bool):
        if value < 0:
            raise ConfigError(f"a memory quantity cannot be negative: {value}")
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
    if suffix in _BINARY:
        total = amount * _BINARY[suffix]
    elif suffix[:1] in ("e", "E"):
        total = amount * (Decimal(10) ** int(suffix[1:]))
    else:
        total = amount * _DECIMAL[suffix]
    if total < 0:
        raise ConfigError(f"a memory quantity cannot be negative: {text!r}")
    return math.ceil(total)


def parse_size(text: str) -> int:
    """A chunk size as the ModelLoad spec writes it (``32MiB``, ``65536``, ``1GiB``, ``512B``) in bytes."""
    match = re.fullmatch(r"([1-9][0-9]*)(B|KiB|MiB|GiB)?", text.strip())
    if match is None:
        raise ConfigError(
            f"{text!r} is not a size: use a number of bytes with an optional B, KiB, MiB or GiB"
        )
    unit = {"": 1, "B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}[match.group(2) or ""]
    return int(match.group(1)) * unit


def format_mib(nbytes: int) -> str:
    """``nbytes`` rounded up to whole MiB, as a quantity (``1536Mi``): exact, and readable in a pod spec."""
    return f"{max(1, math.ceil(nbytes / MIB))}Mi"


def humanize_bytes(nbytes: int) -> str:
    """``15.0 GiB``: for the status column people read, never for arithmetic."""
    size = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            return f"{int(size)} B" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")  # pragma: no cover
