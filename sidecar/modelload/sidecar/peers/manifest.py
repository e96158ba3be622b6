"""A peer's manifest: what it holds, written by its server and read by every other sidecar of the model.

The document, at ``GET /peer/v1/manifest``::

    {"id": "3f2a...",                      16 to 64 lower-case hex digits, the sidecar's id for this load
     "phase": "loading",                   starting | loading | complete | failed | unshared
     "bytes_done": 123456,                 tensor bytes landed so far (shown; never trusted as progress)
     "files": [{"etag": "\"5f..\"", "size": 67108864}, ...],     one per weight file, as the origin said
     "ready": "<base64 bitmap>",           tensor i READY is bit i % 8 of byte i // 8
     "crc32": [3735928559, 0, ...]}        one per tensor: the CRC-32 of its record, 0 while not READY

``files``, ``ready`` and ``crc32`` come together, once the peer has a load plan. A reader checks the whole
document against this schema (:func:`parse_manifest`) before using any of it: sizes and depth first (a
manifest's size follows from the model's tensor and file counts), then every type, length and range. A
manifest that breaks it is a peer to drop, never a reason to fail the load.
"""

from __future__ import annotations

import base64
import binascii
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from modelload.loader.peerwire import load_json
from modelload.sidecar.sources import ObjectInfo

__all__ = ["PHASES", "Manifest", "bitmap", "manifest_limit", "parse_manifest", "unbitmap"]

PHASES = frozenset({"starting", "loading", "complete", "failed", "unshared"})
MAX_DEPTH = 3
"""The document, its files list, one file: nothing nests deeper."""
_ID = re.compile(r"^[0-9a-f]{16,64}$")
_KEYS = frozenset({"id", "phase", "bytes_done", "files", "ready", "crc32"})
_PLAN_KEYS = frozenset({"files", "ready", "crc32"})
_MAX_ETAG = 1024
_MAX_INT = (1 << 63) - 1


@dataclass(frozen=True)
class Manifest:
    """A manifest that passed the schema. ``files``/``ready``/``crc32`` are empty before the peer's plan."""

    id: str
    phase: str
    bytes_done: int
    files: tuple[tuple[str, int], ...] = ()
    ready: tuple[bool, ...] = ()
    crc32: tuple[int, ...] = ()

    @property
    def planned(self) -> bool:
        return bool(self.files)


def manifest_limit(*, files: int, tensors: int) -> int:
    """The most bytes an honest manifest of a model of ``files`` weight files and ``tensors`` tensors takes:
    a CRC-32 is at most 10 digits and a comma, the bitmap's base64 4 characters per 3 bytes, a file's ETag at
    most 1 KiB; with room for the keys."""
    return 4096 + 11 * tensors + 4 * (tensors // 24 + 1) + (_MAX_ETAG + 64) * files


def parse_manifest(body: bytes, *, infos: Sequence[ObjectInfo], tensors: int) -> Manifest:
    """The manifest in ``body``, checked for a model of ``infos`` weight files and ``tensors`` tensors.
    Raises ValueError naming the first thing wrong."""
    doc = load_json(body, max_bytes=manifest_limit(files=len(infos), tensors=tensors), max_depth=MAX_DEPTH)
    if not isinstance(doc, dict):
        raise ValueError("the manifest is not an object")
    unknown = set(doc) - _KEYS
    if unknown:
        raise ValueError(f"the manifest has unknown keys ({', '.join(sorted(unknown)[:3])})")
    peer_id, phase, done = doc.get("id"), doc.get("phase"), doc.get("bytes_done")
    if not isinstance(peer_id, str) or not _ID.match(peer_id):
        raise ValueError("the manifest's id is not 16 to 64 hex digits")
    if phase not in PHASES:
        raise ValueError("the manifest's phase is not one of the protocol's")
    if not _count(done):
        raise ValueError("the manifest's bytes_done is not a byte count")
    assert isinstance(done, int)
    plan = _PLAN_KEYS & set(doc)
    if not plan:
        return Manifest(peer_id, str(phase), int(done))
    if plan != _PLAN_KEYS:
        raise ValueError("the manifest has some of files, ready and crc32 but not all")
    files = _files(doc["files"], len(infos))
    ready = unbitmap(doc["ready"], tensors)
    crcs = doc["crc32"]
    if not isinstance(crcs, list) or len(crcs) != tensors:
        raise ValueError(f"the manifest's crc32 is not a list of {tensors} checksums")
    if not all(type(c) is int and 0 <= c <= 0xFFFFFFFF for c in crcs):
        raise ValueError("the manifest's crc32 holds something that is not a CRC-32")
    return Manifest(peer_id, str(phase), int(done), files, tuple(ready), tuple(crcs))


def _count(value: Any) -> bool:
    return type(value) is int and 0 <= value <= _MAX_INT


def _files(value: Any, count: int) -> tuple[tuple[str, int], ...]:
    if not isinstance(value, list) or len(value) != count:
        raise ValueError(f"the manifest's files is not a list of {count} files")
    out = []
    for entry in value:
        if not isinstance(entry, dict) or set(entry) != {"etag", "size"}:
            raise ValueError("a file of the manifest is not {etag, size}")
        etag, size = entry["etag"], entry["size"]
        if not isinstance(etag, str) or len(etag) > _MAX_ETAG or not _count(size):
            raise ValueError("a file of the manifest has a malformed ETag or size")
        out.append((etag, int(size)))
    return tuple(out)


def bitmap(ready: Sequence[bool]) -> str:
    """READY flags as base64 of a little-endian bitmap (tensor i is bit i % 8 of byte i // 8)."""
    out = bytearray((len(ready) + 7) // 8)
    for i, flag in enumerate(ready):
        if flag:
            out[i // 8] |= 1 << (i % 8)
    return base64.b64encode(bytes(out)).decode("ascii")


def unbitmap(text: Any, count: int) -> list[bool]:
    """The inverse of :func:`bitmap`; ValueError for anything but a bitmap of exactly ``count`` bits (its
    padding bits zero)."""
    if not isinstance(text, str) or len(text) > 4 * ((count + 7) // 8 // 3 + 1):
        raise ValueError(f"the manifest's ready is not a bitmap of {count} tensors")
    try:
        data = base64.b64decode(text.encode("ascii"), validate=True)
    except (UnicodeEncodeError, binascii.Error):
        raise ValueError("the manifest's ready is not base64") from None
    if len(data) != (count + 7) // 8 or (count % 8 and data[-1] >> (count % 8)):
        raise ValueError(f"the manifest's ready is a bitmap of {len(data)} bytes for {count} tensors")
    return [bool(data[i // 8] >> (i % 8) & 1) for i in range(count)]
