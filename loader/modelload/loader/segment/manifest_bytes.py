"""The segment's manifest as bytes (SPEC.md, "Manifest"): its length for any slot offsets, without encoding
it, and its encoding in batches of tensors, from the layout's columns.

The layout needs the manifest's length before it knows where the data starts (the data follows the
manifest), and the offsets the manifest lists depend on that start: :class:`ManifestLength` answers the
length for any offsets by arithmetic over digit counts, so ``plan_layout`` encodes the manifest once, at the
start it settles on. A model of 100,000 tensors costs a few batches of text, never a Python object or a
write per tensor.
"""

from __future__ import annotations

import json
import operator
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from modelload.loader.formats import Names

if TYPE_CHECKING:
    from modelload.loader.segment.layout import TensorSpecs
    from modelload.loader.segment.slots import SlotTable

__all__ = ["ManifestLength", "manifest_pieces"]


_POWERS = np.array([10**k for k in range(1, 19)], dtype=np.int64)


class ManifestLength:
    """The manifest's length for any slot offsets, without encoding it (see :func:`manifest_pieces`).

    The bytes are exactly ``json.dumps(document, separators=(",", ":"), ensure_ascii=False)`` of
    ``{"tensors": [...], "metadata": ..., "files": ...}`` (each tensor's members in the order name, dtype,
    shape, offset, nbytes, sha256, file), as every earlier writer wrote them.
    """

    def __init__(
        self, specs: TensorSpecs, nbytes: list[int], metadata: Mapping[str, str], files: tuple[str, ...]
    ) -> None:
        shapes = _shape_texts(specs.shapes)
        extras = sum(map(len, _extra_parts(specs.sha256, specs.files)))
        count = len(specs)
        self._fixed = (
            len(_HEAD) + max(count - 1, 0) + len(_tail(metadata, files))
            + count * len(_ENTRY % ("", "", "", 0, 0, "")) - count * 2  # the two zeros' digits
            + _text_bytes(specs.names)
            + sum(map(len, map(_NAME, specs.dtypes)))
            + sum(map(len, map(shapes.__getitem__, specs.shapes)))
            + _digits(np.asarray(nbytes, dtype=np.int64))
            + extras
        )  # fmt: skip

    def length(self, offsets: np.ndarray[Any, np.dtype[np.int64]]) -> int:
        """The manifest's length in bytes with the slots at ``offsets`` (non-negative)."""
        return self._fixed + _digits(offsets)


def manifest_pieces(slots: SlotTable, metadata: Mapping[str, str], files: tuple[str, ...]) -> Iterator[bytes]:
    """The manifest's bytes, in pieces of :data:`_BATCH` tensors or so each: a piece per tensor cost a
    write and a CRC call per tensor (100,000 of each for a mixture of experts); a batch is made as text,
    from the slots' columns, and encoded once."""
    shapes = _shape_texts(slots.shapes)
    yield _HEAD
    entry = _ENTRY
    # Every column is sliced a batch at a time: the whole manifest's texts at once were 100,000 quoted
    # names, shape texts and Python ints (about 20 MiB at 100,000 tensors) held while it was written.
    for first in range(0, len(slots), _BATCH):
        end = first + _BATCH
        texts = map(entry.__mod__, zip(
            map(_encode_text, slots.names[first:end]),
            map(_NAME, slots.dtypes[first:end]),
            map(shapes.__getitem__, slots.shapes[first:end]),
            slots.offsets[first:end].tolist(),
            slots.nbytes[first:end].tolist(),
            _extra_parts(slots.sha256[first:end], slots.files[first:end]),
            strict=True,
        ))  # fmt: skip
        joined = ",".join(texts).encode()
        yield b"," + joined if first else joined
    yield _tail(metadata, files)


_BATCH = 4096
_NAME = operator.attrgetter("name")


def _shape_texts(shapes: Iterable[tuple[int, ...]]) -> dict[tuple[int, ...], str]:
    return {shape: "[" + ",".join(str(int(d)) for d in shape) + "]" for shape in set(shapes)}


def _extra_parts(shas: Sequence[str | None], files: Sequence[int | None]) -> list[str]:
    """Each tensor's optional members (``sha256``, ``file``), empty for a model of one file without hashes.
    ASCII (a SHA-256 is hex): as many bytes as characters."""
    if set(shas) == {None}:  # no hashes (the usual case): one text per file, not one per tensor
        texts = {file: f',"file":{file}' if file is not None else "" for file in set(files)}
        return list(map(texts.__getitem__, files))
    return [
        (',"sha256":' + _encode_text(sha) if sha is not None else "")
        + (f',"file":{file}' if file is not None else "")
        for sha, file in zip(shas, files, strict=True)
    ]


def _tail(metadata: Mapping[str, str], files: tuple[str, ...]) -> bytes:
    document = json.dumps(dict(metadata), separators=(",", ":"), ensure_ascii=False)
    listed = json.dumps(list(files), separators=(",", ":"), ensure_ascii=False)
    return b'],"metadata":' + document.encode() + (b',"files":' + listed.encode() if files else b"") + b"}"


_HEAD = b'{"tensors":['
_ENTRY = '{"name":%s,"dtype":"%s","shape":%s,"offset":%d,"nbytes":%d%s}'


def _digits(values: np.ndarray[Any, np.dtype[np.int64]]) -> int:
    """The decimal digits of all ``values`` (non-negative) together."""
    return int((np.searchsorted(_POWERS, values, side="right") + 1).sum())


def _text_bytes(texts: Sequence[str]) -> int:
    """The UTF-8 bytes of all ``texts`` as JSON strings, quotes included."""
    joined = texts.text if isinstance(texts, Names) else "".join(texts)
    if joined.isascii() and joined.isprintable() and '"' not in joined and "\\" not in joined:
        return len(joined) + 2 * len(texts)  # nothing to escape: each is itself in quotes
    return sum(len(_encode_text(text).encode()) for text in texts)


_encode_text = json.encoder.encode_basestring
"""A JSON string as ``json.dumps(..., ensure_ascii=False)`` writes it, quotes included."""
