"""Byte counts as people write and read them: one grammar for every size flag, variable and spec field.

:func:`parse_size` reads what the sidecar's ``--chunk-size``, the loader's ``--shard-size`` and a ModelLoad's
``chunkSize`` take: a whole number of bytes with an optional unit, decimal (``500MB``, ``5G``) or binary
(``512MiB``, ``16Gi``, Kubernetes' spelling), in any case; :func:`format_size` writes a count back in that
grammar (``32MiB``, for help texts and messages). :func:`format_bytes` writes a count for logs and
terminals. Kubernetes quantities written into a pod spec (``1536Mi``, with milli-units and exponents) are
the operator's own concern (``modelload.operator.quantity``).

This module imports nothing of the project but its errors, so the loader's CLI, the sidecar and the operator
all use it.
"""

from __future__ import annotations

import re

from modelload.loader.errors import ConfigError

__all__ = ["format_bytes", "format_size", "parse_size"]

_SIZE = re.compile(r"^\s*(\d+)\s*([A-Za-z]*)\s*$")
_UNITS = {
    "": 1,
    "b": 1,
    **{prefix: 1000**power for power, prefix in enumerate("kmgt", start=1)},
    **{prefix + "b": 1000**power for power, prefix in enumerate("kmgt", start=1)},
    **{prefix + "i": 1024**power for power, prefix in enumerate("kmgt", start=1)},
    **{prefix + "ib": 1024**power for power, prefix in enumerate("kmgt", start=1)},
}


def parse_size(text: str, *, setting: str | None = None) -> int:
    """A byte count: plain bytes (``33554432``), binary units (``32MiB``, ``1Gi``) or decimal (``500MB``).

    A :class:`ConfigError` naming ``setting`` for anything else (fractions, signs, unknown units); the
    caller checks the range.

    >>> parse_size("32MiB"), parse_size("1 GiB"), parse_size("4096"), parse_size("2MB"), parse_size("16Gi")
    (33554432, 1073741824, 4096, 2000000, 17179869184)
    """
    match = _SIZE.match(text)
    unit = match.group(2).lower() if match else ""
    if match is None or unit not in _UNITS:
        raise ConfigError(
            f"expected a size such as 32MiB, 1GiB or a number of bytes, got {text!r}", setting=setting
        )
    return int(match.group(1)) * _UNITS[unit]


def format_size(count: int) -> str:
    """``count`` bytes as :func:`parse_size` reads them back, exactly: in the largest unit that divides it.

    >>> format_size(32 << 20), format_size(1 << 30), format_size(4096), format_size(1000)
    ('32MiB', '1GiB', '4KiB', '1000B')
    """
    for unit in ("TiB", "GiB", "MiB", "KiB"):
        scale = _UNITS[unit.lower()]
        if count and count % scale == 0:
            return f"{count // scale}{unit}"
    return f"{count}B"


def format_bytes(count: float) -> str:
    """``1536`` → ``"1.5 KiB"``; ``100`` → ``"100 B"``: for people, never for arithmetic.

    >>> format_bytes(1536), format_bytes(100), format_bytes(15 << 30)
    ('1.5 KiB', '100 B', '15.0 GiB')
    """
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(count) < 1024 or unit == "TiB":
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.1f} {unit}"
        count /= 1024
    raise AssertionError("unreachable")  # pragma: no cover
