"""What a load is: the source, the version of each of its files, and the settings that change its bytes.

A segment records the identity of the load that wrote it in its manifest's metadata, under the key
``load`` (SPEC.md, "Writers and loads"), so that a writer can tell whether a segment it finds is the very
load it is asked for (a restarted sidecar then reuses it instead of reading the model again) and anyone
can read what a segment holds. The identity is:

- ``source``: the model's URI as shown (no credentials, no query string);
- ``files``: every weight file's name, size and *version*: the origin's own name for that content (an HTTP
  or S3 ETag, a GCS generation, a Hub commit, an OCI digest, a local file's size and modification time),
  a plain string the source chooses, or None when the origin gives none (such a load is never reused);
- ``format``: the format asked for (``auto``, ``tensorizer``, ``safetensors``);
- ``memory_mode`` and ``ring_size``: what the writer does with consumed pages (layout versions 3 and 4);
- ``slots``: where the slots were asked to start (``auto``, ``packed``, ``paged``): a segment packed for one
  load is not what a load asking for pages wants (its apps' loaders may not read layout version 5). An
  identity an older writer recorded, without it, reads as ``auto``; in memory modes release and ring, which
  never pack, the sidecar records ``paged``;
- ``key``: a fingerprint of the decryption key or password (never the key): a load with another key is
  another load, even of the same file, so a wrong key fails instead of reusing what the right one opened.

The fingerprint is the key's own (:meth:`~modelload.loader.formats.tensorizer.DecryptionKey.fingerprint`):
SHA-256 of a raw key, Argon2id of a password, so that it gives away neither.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

__all__ = ["IDENTITY_KEY", "FileVersion", "KeyLike", "LoadIdentity", "key_matches"]

IDENTITY_KEY = "load"
"""The manifest metadata key holding a load's identity (compact JSON)."""
MAX_IDENTITY_LENGTH = 1 << 24
"""A recorded identity longer than this is not read (the manifest's own cap is 64 MiB)."""


class KeyLike(Protocol):
    """A decryption key as the identity needs it (``DecryptionKey`` of the tensorizer format)."""

    def fingerprint(self) -> str: ...

    def matches(self, fingerprint: str) -> bool: ...


@dataclass(frozen=True)
class FileVersion:
    """One weight file of a load: its name in the model (``""`` for a single file), size and version."""

    name: str
    size: int
    version: str | None


@dataclass(frozen=True)
class LoadIdentity:
    """The identity of one load (see the module's docstring); :meth:`metadata` is how a segment holds it."""

    source: str
    files: tuple[FileVersion, ...]
    format: str = "auto"
    memory_mode: str = "full"
    ring_size: int = 0
    key: str | None = None
    """The key's fingerprint (``DecryptionKey.fingerprint``); None when no key was given."""
    slots: str = "auto"

    @property
    def versioned(self) -> bool:
        """Every file has a version: only then can another load be told to be this one."""
        return bool(self.files) and all(f.version is not None for f in self.files)

    def encode(self) -> str:
        """The compact JSON a segment's metadata holds under :data:`IDENTITY_KEY` (keys sorted)."""
        document = {
            "source": self.source,
            "files": [{"name": f.name, "size": f.size, "version": f.version} for f in self.files],
            "format": self.format,
            "memory_mode": self.memory_mode,
            "ring_size": self.ring_size,
            "slots": self.slots,
            "key": self.key,
        }
        return json.dumps(document, separators=(",", ":"), sort_keys=True, ensure_ascii=False)

    def metadata(self) -> dict[str, str]:
        return {IDENTITY_KEY: self.encode()}

    @classmethod
    def from_metadata(cls, metadata: Mapping[str, str]) -> LoadIdentity | None:
        """The identity a segment records; None when it records none, or one this reader cannot read (a
        segment of an older writer, or a hostile one): such a segment is never taken for another load."""
        text = metadata.get(IDENTITY_KEY)
        if not isinstance(text, str) or len(text) > MAX_IDENTITY_LENGTH:
            return None
        try:
            doc = json.loads(text)
            files = tuple(_file(entry) for entry in doc["files"])
            key = doc["key"]
            identity = cls(
                source=_text(doc["source"]),
                files=files,
                format=_text(doc["format"]),
                memory_mode=_text(doc["memory_mode"]),
                ring_size=_count(doc["ring_size"]),
                slots=_text(doc.get("slots", "auto")),
                key=None if key is None else _text(key),
            )
        except (ValueError, KeyError, TypeError):
            return None
        return identity

    def same_load(self, other: LoadIdentity, *, key: KeyLike | None) -> bool:
        """Whether ``other`` (a segment's recorded identity) is this load: same source, files, versions,
        format, memory and slot settings, both versioned, and ``key`` (the key this load would use, or None)
        matching the fingerprint ``other`` recorded. This load's own ``key`` field is not compared: a
        password's fingerprint differs at every load (its salt is random)."""
        if not (self.versioned and other.versioned):
            return False
        same = (self.source, self.files, self.format, self.memory_mode, self.ring_size, self.slots) == (
            other.source,
            other.files,
            other.format,
            other.memory_mode,
            other.ring_size,
            other.slots,
        )
        return same and key_matches(other.key, key)


def key_matches(fingerprint: str | None, key: KeyLike | None) -> bool:
    """Whether ``key`` is the key ``fingerprint`` was taken of (both None: no key either time)."""
    if fingerprint is None or key is None:
        return fingerprint is None and key is None
    return key.matches(fingerprint)


def _text(value: object) -> str:
    if not isinstance(value, str):
        raise TypeError("not a string")
    return value


def _count(value: object) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise TypeError("not a count")
    return value


def _file(entry: object) -> FileVersion:
    if not isinstance(entry, dict):
        raise TypeError("not a file")
    version = entry["version"]
    return FileVersion(
        name=_text(entry["name"]),
        size=_count(entry["size"]),
        version=None if version is None else _text(version),
    )
