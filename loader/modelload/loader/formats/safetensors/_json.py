"""A safetensors header's JSON, parsed as the reference implementation reads it.

The subset is serde_json's: an object at the top, no ``NaN``/``Infinity``, integers only where they are due.
``json.loads`` keeps the last of repeated keys silently, where readers of the format disagree on which one
wins; a repeat is refused here instead (:class:`~modelload.loader.errors.DuplicateNameError` for a tensor
named twice). The common header, with no repeat, is parsed without a Python call per object
(:func:`plain_header_json`, in C with ``orjson``, the sidecar's extra), which a header of 100,000 tensors
notices, and one count of its quotes proves that the parse dropped no repeated key
(:func:`kept_every_key`); anything else is read again carefully (:func:`load_header_json`), which says
what is wrong.
"""

from __future__ import annotations

import json
from typing import Any

from modelload.loader.errors import DuplicateNameError, HeaderError
from modelload.loader.formats._fast_json import fast_loads

__all__ = [
    "FAST_JSON", "METADATA_KEY", "REWRITE", "RepeatedKeys", "kept_every_key", "load_header_json",
    "plain_header_json",
]  # fmt: skip

FAST_JSON = fast_loads is not None
"""Whether ``plain_header_json(..., fast=True)`` has a faster parser than the json module to use."""

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


def load_header_json(header: bytes | memoryview, source: str | None) -> dict[str, Any]:
    """The header's top object, read so that every repeated key is seen, or the error that says what is
    wrong with it. This is the careful reading (a Python call per object); a header with nothing wrong is
    read by :func:`plain_header_json` instead."""
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
        top = json.loads(text, object_pairs_hook=_object, parse_constant=_no_constant)
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


def plain_header_json(header: bytes | memoryview, *, fast: bool) -> tuple[dict[str, Any], bytes] | None:
    """The header's top object as a plain parser reads it, in one C-level pass (orjson where ``fast`` and
    it is installed, else the json module), and the header's bytes; None where that reading finds anything
    wrong (then :func:`load_header_json` says what).

    A plain parser keeps the last of repeated keys silently, so what it returns is trusted only once
    :func:`kept_every_key` proves that no key repeated; orjson also reads an integer past 2**64 - 1 as a
    float, which the caller's checks refuse (integers only) and the careful reading then names."""
    if len(header) == 0 or header[0] != 0x7B:  # a plain parser would skip leading whitespace
        return None
    data = bytes(header)
    try:
        if fast and fast_loads is not None:
            top = fast_loads(data)
        else:
            top = json.loads(data.decode("utf-8"), parse_constant=_no_constant)
    except (ValueError, RecursionError, HeaderError):  # UnicodeDecodeError and JSONDecodeError among them
        return None
    return (top, data) if isinstance(top, dict) else None


def kept_every_key(text: bytes, *, tensors: int, metadata: dict[str, str] | None) -> bool:
    """Whether the plain reading of the header ``text`` (:func:`plain_header_json`) dropped no repeated key,
    given what the caller checked it read: ``tensors`` objects of exactly ``dtype`` (a string), ``shape``
    and ``data_offsets`` (lists of integers), and ``metadata`` (strings to strings; None: no
    ``__metadata__`` key).

    Such a reading holds 5 strings a tensor (its name, three keys, the dtype), and with metadata 1 for its
    key and 2 a pair. A key the parser dropped left its string in the text besides, so the text then holds
    more strings than the reading.
    Without a backslash in the text, every ``"`` delimits a string (a quote inside one is escaped), and one
    count of them proves it. With one, each key's quoted form is counted instead: a repeat, of a tensor or
    inside an object, leaves one occurrence more (``"dtype"`` cannot hide in a name, whose quotes are
    escaped; a name that shows it anyway only sends the header to the careful reading).
    """
    strings = 5 * tensors + (0 if metadata is None else 1 + 2 * len(metadata))
    if b"\\" not in text:
        return text.count(b'"') == 2 * strings
    decoded = text.decode("utf-8")
    if any(decoded.count(key) != tensors for key in ('"dtype"', '"shape"', '"data_offsets"')):
        return False
    if decoded.count(f'"{METADATA_KEY}"') != (metadata is not None):
        return False
    return not metadata or all(decoded.count(json.dumps(key, ensure_ascii=False)) == 1 for key in metadata)
