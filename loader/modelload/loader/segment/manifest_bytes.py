"""The segment's manifest as bytes (SPEC.md, "Manifest"): its length for any slot offsets, without encoding
it, and its encoding in batches of tensors, from the layout's columns.

The layout needs the manifest's length before it knows where the data starts (the data follows the
manifest), and the offsets the manifest lists depend on that start: :class:`ManifestLength` answers the
length for any offsets by arithmetic over digit counts, so ``plan_layout`` encodes the manifest once, at the
start it settles on.

Both work from the same texts. A tensor's entry is six of them: the opening, its name (escaped), the text of
its kind (:mod:`.kinds`: dtype and shape) up to the offset, the offset's digits, the text of its kind after
(its size) and the closing (its hash and file when it has them). Only the name and the offset are a text per
tensor; the rest are a text per kind or per file, gathered with numpy. A batch of tensors is its columns of
texts joined row by row and encoded once: a model of 100,000 tensors costs a few batches, never a Python
format or a write per tensor.
"""

from __future__ import annotations

import array
import json
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt

from modelload.loader.formats import Names

if TYPE_CHECKING:
    from modelload.loader.segment.kinds import Kinds
    from modelload.loader.segment.slots import SlotTable

__all__ = ["ManifestLength", "manifest_pieces"]


_POWERS = np.array([10**k for k in range(1, 19)], dtype=np.int64)


class ManifestLength:
    """The manifest's length for any slot offsets, without encoding it (see :func:`manifest_pieces`).

    The bytes are exactly ``json.dumps(document, separators=(",", ":"), ensure_ascii=False)`` of
    ``{"tensors": [...], "metadata": ..., "files": ...}`` (each tensor's members in the order name, dtype,
    shape, offset, nbytes, sha256, file), as every earlier writer wrote them.

    ``slots``' offsets are not read (:meth:`length` takes them): the layout asks before it places the slots.
    """

    def __init__(self, slots: SlotTable, metadata: Mapping[str, str], files: tuple[str, ...]) -> None:
        count = len(slots)
        before, after = _kind_texts(slots.kinds)
        per_kind = np.array([len(b) + len(a) for b, a in zip(before, after, strict=True)], dtype=np.int64)
        self._fixed = (
            len(_HEAD) + len(_tail(metadata, files))
            + count * len(_OPEN) - (1 if count else 0)  # the first opening has no comma
            + _names_bytes(slots.names)
            + int(per_kind @ slots.kinds.counts())
            + _closings_bytes(slots.sha256, slots.files)
        )  # fmt: skip

    def length(self, offsets: npt.NDArray[np.int64]) -> int:
        """The manifest's length in bytes with the slots at ``offsets`` (non-negative)."""
        return self._fixed + _digits(offsets)


def manifest_pieces(slots: SlotTable, metadata: Mapping[str, str], files: tuple[str, ...]) -> Iterator[bytes]:
    """The manifest's bytes, in pieces of :data:`_BATCH` tensors or so each: a piece per tensor cost a
    write and a CRC call per tensor (100,000 of each for a mixture of experts)."""
    before, after = (np.array(texts, dtype=object) for texts in _kind_texts(slots.kinds))
    yield _HEAD
    # Every column is made a batch at a time: the whole manifest's texts at once were 100,000 names and
    # offsets' digits (about 20 MiB at 100,000 tensors) held while it was written.
    for first in range(0, len(slots), _BATCH):
        end = min(first + _BATCH, len(slots))
        kinds = slots.kinds.of[first:end]
        opening = [_OPEN] * (end - first)
        if not first:
            opening[0] = _OPEN[1:]  # no comma before the first entry
        rows = _rows(
            opening,
            _between_quotes(slots.names[first:end]),
            before[kinds].tolist(),
            list(map(str, slots.offsets[first:end].tolist())),
            after[kinds].tolist(),
            _closings(slots.sha256[first:end], slots.files[first:end]),
        )
        yield rows.encode()
    yield _tail(metadata, files)


_BATCH = 4096
_HEAD = b'{"tensors":['
_OPEN = ',{"name":"'


def _kind_texts(kinds: Kinds) -> tuple[list[str], list[str]]:
    """Each kind's text from the end of the name to the offset, and from the offset to the closing."""
    before = [
        f'","dtype":"{dtype.name}","shape":[{",".join(map(str, map(int, shape)))}],"offset":'
        for dtype, shape in zip(kinds.dtypes, kinds.shapes, strict=True)
    ]
    return before, [f',"nbytes":{nbytes}' for nbytes in kinds.nbytes]


def _rows(*columns: Sequence[str]) -> str:
    """The columns' texts row by row: every column's first, then every column's second, and so on."""
    parts = [""] * (len(columns) * len(columns[0]))
    for at, column in enumerate(columns):
        parts[at :: len(columns)] = column
    return "".join(parts)


def _between_quotes(names: Sequence[str]) -> Sequence[str]:
    """Each name as it stands between its quotes in JSON: itself, unless some name holds a quote, a
    backslash or a control character (then each escaped)."""
    if _plain("".join(names).encode()):
        return names
    return [_encode_text(name)[1:-1] for name in names]


def _plain(encoded: bytes) -> bool:
    """Whether UTF-8 text needs no JSON escape: no quote, backslash or control character (a byte below
    0x20 is one, as no byte of a multi-byte character is)."""
    if b'"' in encoded or b"\\" in encoded:
        return False
    return not encoded or int(np.frombuffer(encoded, dtype=np.uint8).min()) >= 0x20


def _names_bytes(names: Sequence[str]) -> int:
    """The UTF-8 bytes of all ``names`` as they stand between their quotes."""
    encoded = (names.text if isinstance(names, Names) else "".join(names)).encode()
    if _plain(encoded):
        return len(encoded)
    return sum(len(_encode_text(name).encode()) - 2 for name in names)


def _closings(shas: Sequence[str | None], files: Sequence[int | None]) -> list[str]:
    """Each tensor's optional members (``sha256``, ``file``) and its closing brace. ASCII (a SHA-256 is hex):
    as many bytes as characters."""
    numbers = _file_numbers(shas, files)
    if numbers is not None:  # no hashes (the usual case): one text per file, not one per tensor
        texts = [_file_closing(file) for file in range(int(numbers.max(initial=-1)) + 1)]
        return np.array(texts, dtype=object)[numbers].tolist()
    if shas.count(None) == len(shas) and files.count(None) == len(files):
        return ["}"] * len(files)
    return [
        (',"sha256":' + _encode_text(sha) if sha is not None else "") + _file_closing(file)
        for sha, file in zip(shas, files, strict=True)
    ]


def _closings_bytes(shas: Sequence[str | None], files: Sequence[int | None]) -> int:
    """The bytes of every tensor's :func:`_closings` text together."""
    numbers = _file_numbers(shas, files)
    if numbers is None:
        return sum(map(len, _closings(shas, files)))
    counts = np.bincount(numbers).tolist()
    return sum(len(_file_closing(file)) * n for file, n in enumerate(counts) if n)


def _file_numbers(shas: Sequence[str | None], files: Sequence[int | None]) -> npt.NDArray[np.int32] | None:
    """The file numbers as an array where the closings are a text per file: no hashes, and the file numbers a
    column of them (what ``plan_layout`` makes: valid, as it checked); else None."""
    if not isinstance(files, array.array) or shas.count(None) != len(shas):
        return None
    numbers = np.asarray(files, dtype=np.int32)
    return numbers if not len(numbers) or int(numbers.min()) >= 0 else None


def _file_closing(file: int | None) -> str:
    return "}" if file is None else f',"file":{file}}}'


def _tail(metadata: Mapping[str, str], files: tuple[str, ...]) -> bytes:
    document = json.dumps(dict(metadata), separators=(",", ":"), ensure_ascii=False)
    listed = json.dumps(list(files), separators=(",", ":"), ensure_ascii=False)
    return b'],"metadata":' + document.encode() + (b',"files":' + listed.encode() if files else b"") + b"}"


def _digits(values: npt.NDArray[np.int64]) -> int:
    """The decimal digits of all ``values`` (non-negative) together."""
    return int((np.searchsorted(_POWERS, values, side="right") + 1).sum())


_encode_text = json.encoder.encode_basestring
"""A JSON string as ``json.dumps(..., ensure_ascii=False)`` writes it, quotes included."""
