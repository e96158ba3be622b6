"""A safetensors header's JSON, parsed as the reference implementation reads it.

The subset is serde_json's: an object at the top, no ``NaN``/``Infinity``, integers only where they are due.
``json.loads`` keeps the last of repeated keys silently, where readers of the format disagree on which one
wins; a repeat is refused here instead (:class:`~modelload.loader.errors.DuplicateNameError` for a tensor
named twice). The common header, with no repeat, is parsed without a Python call per object
(:func:`_load_plain`), which a header of 100,000 tensors notices; with ``orjson`` installed (the sidecar's
extra) ``fast=True`` parses it in C, a few times faster again (see :func:`load_header_json`).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from modelload.loader.errors import DuplicateNameError, HeaderError
from modelload.loader.formats._fast_json import fast_loads

__all__ = ["FAST_JSON", "METADATA_KEY", "REWRITE", "RepeatedKeys", "load_header_json"]

FAST_JSON = fast_loads is not None
"""Whether ``load_header_json(..., fast=True)`` has a faster parser than the json module to use."""

METADATA_KEY = "__metadata__"
"""The header's one key that is not a tensor: the writer's string-to-string metadata."""

REWRITE = "re-export the file (safetensors' save_file, or modelload's writer)"


class RepeatedKeys(dict[str, Any]):
    """A JSON object that repeated a key. ``json.loads`` would keep the last value silently; the parser
    returns this marker instead, and the caller reports the key where it knows what the object is."""

    def __init__(self, pairs: list[tuple[str, Any]]) -> None:
        super().__init__(pairs)
        seen: set[str] = set()
        self.repeated = ""
        for key, _ in pairs:
            if key in seen:
                self.repeated = key
                break
            seen.add(key)


def _object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    result = dict(pairs)
    return result if len(result) == len(pairs) else RepeatedKeys(pairs)


def _no_constant(name: str) -> Any:
    raise HeaderError(
        f"the header holds the JSON extension {name}, which safetensors does not allow; {REWRITE}"
    )


def load_header_json(header: bytes | memoryview, source: str | None, *, fast: bool = False) -> dict[str, Any]:
    """The header's top object. ``fast``: parse a header without repeats with orjson where it is installed
    (:mod:`~modelload.loader.formats._fast_json`): a caller that finds anything wrong in a header parsed so
    parses it again without ``fast`` before it says what is wrong."""
    if len(header) == 0 or header[0] != 0x7B:
        first = f"0x{header[0]:02x}" if len(header) else "nothing"
        raise HeaderError(
            f"the header must start with '{{' and starts with {first}; the file is corrupt or not "
            "a safetensors file",
            source=source,
        )
    try:
        text = str(header, "utf-8")
    except UnicodeDecodeError as exc:
        raise HeaderError(
            f"the header is not valid UTF-8 (byte {exc.start}: {exc.reason}); {REWRITE}", source=source
        ) from exc
    try:
        loads = fast_loads if fast and fast_loads is not None else _plain_loads
        top = _load_plain(text, loads) or json.loads(
            text, object_pairs_hook=_object, parse_constant=_no_constant
        )
    except HeaderError as exc:
        raise HeaderError(str(exc), source=source) from None
    except json.JSONDecodeError as exc:
        raise HeaderError(f"the header is not valid JSON ({exc}); {REWRITE}", source=source) from exc
    except ValueError:  # Python's limit on integer digits (4300): no size or offset is that long
        raise HeaderError(
            f"the header holds an integer of thousands of digits, far past the 2**64 - 1 that safetensors "
            f"allows; {REWRITE}",
            source=source,
        ) from None
    except RecursionError:
        raise HeaderError(
            f"the header nests JSON deeper than any safetensors header does; {REWRITE}", source=source
        ) from None
    if not isinstance(top, dict):
        raise HeaderError(f"the header must be a JSON object; {REWRITE}", source=source)
    if isinstance(top, RepeatedKeys):
        raise DuplicateNameError(
            f"the header names {top.repeated!r} twice, and readers disagree on which one wins; {REWRITE} "
            "with unique names",
            source=source,
        )
    return top


def _plain_loads(text: str) -> Any:
    return json.loads(text, parse_constant=_no_constant)


def _load_plain(text: str, loads: Callable[[str], Any] = _plain_loads) -> dict[str, Any] | None:
    """The header parsed without a Python call per object, when that provably lost no repeated key; None
    otherwise (the caller then parses with :func:`_object`, which sees every repeat).

    Plain ``json.loads`` keeps the last of repeated keys silently. A header whose tensor objects are exactly
    ``dtype``, ``shape`` and ``data_offsets`` repeated nothing when each of those quoted words occurs in the
    text once per tensor (a repeat, of a tensor or inside one, would leave an occurrence more: inside a
    string a quote is escaped, so ``"dtype"`` cannot hide in a name), and each metadata key once.
    """
    try:
        top = loads(text)
    except (ValueError, RecursionError, HeaderError):  # the hooked parse raises it again, translated
        return None
    if not isinstance(top, dict):
        return None
    count = len(top) - (METADATA_KEY in top)
    if any(text.count(key) != count for key in ('"dtype"', '"shape"', '"data_offsets"')):
        return None
    if text.count(f'"{METADATA_KEY}"') != (METADATA_KEY in top):
        return None
    metadata = top.get(METADATA_KEY)
    if isinstance(metadata, dict) and any(
        text.count(json.dumps(key, ensure_ascii=False)) != 1 for key in metadata
    ):
        return None
    return top
