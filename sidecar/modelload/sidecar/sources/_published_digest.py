"""The digest an origin publishes for a whole object, and where a file's bytes sit inside that object.

The Hugging Face Hub publishes each large file's SHA-256 (and each small file's git blob id), an OCI registry
names every blob by its SHA-256 digest. A file of a model is either that object itself or, for a file inside
an uncompressed tar layer, a window of it: :class:`PublishedDigest` says which object, which digest, and
where the file's bytes start in it, so the bytes that land can be proved against the origin's own word.
(A store's own checksum of an object, CRC or MD5 as S3, GCS and Azure report it, is
:class:`~._checksums.StoreChecksum`.)

Whole-object hashes need the bytes in order; they are computed over the landed bytes
(:mod:`modelload.sidecar.load.digests`), not by reading the object twice. The few bytes of the object a load
does not land (a safetensors header, a tar header) are read from ``object_source``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from modelload.loader.errors import HashMismatchError

from ._base import Source
from ._checksums import new_hash

__all__ = ["ALGORITHMS", "PublishedDigest", "checksum_of", "new_hasher", "verify_bytes"]

ALGORITHMS = ("sha256", "git-sha1")
"""``sha256``: the object's SHA-256. ``git-sha1``: git's blob id, SHA-1 over ``blob <size>\\0`` and the
bytes."""


def new_hasher(algorithm: str, size: int) -> Any:
    """A fresh hash object for ``algorithm`` over an object of ``size`` bytes, fed its prefix if any (git's
    blob header); the hashes themselves are the stores' (:func:`~._checksums.new_hash`)."""
    if algorithm == "sha256":
        return new_hash("sha256")
    if algorithm == "git-sha1":
        hasher = new_hash("sha1")
        hasher.update(f"blob {size}\0".encode())
        return hasher
    raise ValueError(f"unknown checksum algorithm {algorithm!r}")


@dataclass(frozen=True)
class PublishedDigest:
    """The digest of the object a file belongs to, and the file's place in it."""

    algorithm: str
    """One of :data:`ALGORITHMS`."""
    expected: str
    """The digest the origin published, lower-case hex."""
    object_id: str
    """The object's identity (a blob digest, a pinned file URI): files of one object share it."""
    object_size: int
    """Bytes of the whole object."""
    offset: int = 0
    """Where the file's first byte sits in the object (a tar member's data offset; 0 for the object
    itself)."""
    where: str = ""
    """The object, for messages (``oci://registry/repo@sha256:...``, ``hf://org/name@commit/file``)."""
    object_source: Source | None = field(default=None, compare=False, repr=False)
    """The whole object, read by ranges: for the bytes a load does not land (None: the file's own source,
    when the object is the file)."""

    def covers_file(self, size: int) -> bool:
        """Whether the checksum is of exactly the file (not of a larger object holding it)."""
        return self.offset == 0 and self.object_size == size

    def mismatch(self, actual: str, *, what: str = "the bytes loaded") -> HashMismatchError:
        return HashMismatchError(
            f"{what} do not match the {self.algorithm} digest the origin publishes ({self.expected}, got "
            f"{actual}): the object is corrupt at the origin or was corrupted on the way; nothing is "
            "published "
            "complete. Retry the load; if it fails again, re-upload the model",
            source=self.where,
        )


def checksum_of(source: object) -> PublishedDigest | None:
    """The checksum a source knows for its object, when it has one (``hf://`` and ``oci://`` sources)."""
    origin = getattr(source, "origin", source)  # a peer-aware wrapper: the origin's word
    known = getattr(origin, "checksum", None)
    return known() if callable(known) else None


def verify_bytes(data: bytes, checksum: PublishedDigest) -> None:
    """Check a whole object held in memory (a small file) against its checksum."""
    hasher = new_hasher(checksum.algorithm, len(data))
    hasher.update(data)
    actual = hasher.hexdigest()
    if actual != checksum.expected:
        raise checksum.mismatch(actual, what=f"the {len(data)} bytes fetched")
