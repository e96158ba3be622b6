"""What proves each weight file's bytes, decided in one place, and the proof by the store's own checksum.

:func:`decide` picks, per file, the strongest proof available:

``checksum``
    the store keeps a checksum of the object (``ObjectInfo.checksums``): a composable CRC (CRC64NVME,
    CRC32C, CRC32) is preferred, since each range's CRC is taken as it lands and the file's is combined from
    them (:func:`~modelload.sidecar.sources.crc_combine`): nothing is read twice. A digest that needs the
    bytes in order (SHA-256, SHA-1, MD5) is taken over the file's landed bytes once the file is complete (a
    second pass over memory, not over the network), only in the ``full`` memory mode and for unencrypted
    files (in the others the bytes are gone, or decrypted in place, by then).
``samples``
    no checksum: the end-of-load re-read of sampled bytes (:mod:`.integrity`) guards against a replacement
    that kept the validator; what a load without a checksum has always had.
``validator``
    no checksum, and no samples needed: the origin's ETag follows the content (S3).
``digest``
    the origin names the file by a digest it publishes (the Hugging Face Hub's SHA-256 of an LFS file, an
    OCI blob's digest; :func:`~modelload.sidecar.sources.checksum_of`): :mod:`.digests` hashes the landed
    bytes in file order as they arrive, in every memory mode, and the load is not COMPLETE before they match.

Bytes a file's checksum does not cover as chunks (a tensorizer file's metadata and padding, a safetensors
header) are read from the origin, pinned to the same version, when the file is proven. A file whose bytes
do not match is read again once (when none of its tensors was published yet), then fails with
HashMismatchError naming it. Issue 20 (samples per range) plugs in here: :func:`decide` is the one place.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from modelload.loader.errors import HashMismatchError
from modelload.sidecar.planner import Chunk, LoadPlan
from modelload.sidecar.sources import (
    COMPOSABLE,
    STREAMED,
    OpenedModel,
    RetryPolicy,
    Source,
    StoreChecksum,
    checksum_of,
    crc,
    crc_available,
    crc_combine,
    crc_width,
    new_hash,
    read_range,
)

__all__ = ["FileProof", "Prover", "decide"]

log = logging.getLogger(__name__)

Region = Callable[[int, int], memoryview]
"""The segment's bytes ``[offset, offset + length)`` (a writer's ``region``)."""


@dataclass
class FileProof:
    """How one weight file's bytes are proven, and how far the proof got."""

    file: int
    uri: str
    method: str
    """``checksum``, ``samples``, ``validator`` or ``digest`` (see the module's docstring)."""
    checksum: StoreChecksum | None = None
    state: str = "pending"
    """``pending``, ``proven`` (checksum matched), ``sampled`` (samples compared), ``failed``."""

    @property
    def label(self) -> str:
        """What the segment's metadata and ``/status`` record for the file."""
        if self.checksum is not None:
            return f"{self.checksum.describe()} (the store's)"
        if self.method == "digest":
            return (
                "the digest the origin publishes (a Hub file's SHA-256, an OCI blob's), over the landed bytes"
            )
        if self.method == "samples":
            return "no checksum kept by the store: sampled bytes re-read at the end of the load"
        if "://" not in self.uri or self.uri.startswith("file://"):
            return "a local file: its size and modification time checked around every read"
        return "no checksum kept by the store: its version (ETag or generation) pinned on every range"


def decide(
    model: OpenedModel, *, memory_mode: str, encrypted: bool, needs_samples: Callable[[int], bool]
) -> list[FileProof]:
    """The proof of every weight file of ``model``: a checksum the store keeps when there is a usable one,
    else samples or the validator (``needs_samples(file)`` tells which)."""
    proofs = []
    for file, info in enumerate(model.infos):
        checksum = _best(info.checksums, streamed_ok=memory_mode == "full" and not encrypted)
        if checksum_of(model.sources[file]) is not None and not encrypted:
            method, checksum = "digest", None
        elif checksum is not None:
            method = "checksum"
        else:
            method = "samples" if needs_samples(file) else "validator"
        proofs.append(FileProof(file, model.display(file), method, checksum))
    return proofs


def _best(checksums: Sequence[StoreChecksum], *, streamed_ok: bool) -> StoreChecksum | None:
    by_algorithm = {c.algorithm: c for c in checksums}
    for algorithm in COMPOSABLE:
        if algorithm in by_algorithm and crc_available(algorithm):
            return by_algorithm[algorithm]
    if streamed_ok:
        for algorithm in STREAMED:
            if algorithm in by_algorithm:
                return by_algorithm[algorithm]
    return None


@dataclass
class _Piece:
    """Bytes ``[offset, offset + length)`` of the file and where they are: a CRC, or where to hash them."""

    offset: int
    length: int
    crc: int = 0
    dst: int | None = None
    """The segment offset of these bytes (a chunk), or None for bytes read from the origin (a gap)."""
    data: bytes | None = None


@dataclass
class _FileState:
    proof: FileProof
    size: int
    chunks: list[Chunk]
    left: int
    cuts: tuple[int, ...]
    pieces: list[_Piece] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)


class Prover:
    """Proves the files of one load whose proof is ``checksum``, as their chunks land.

    :meth:`landed` runs on the reader that landed a chunk (it takes the chunk's CRC when the checksum is a
    CRC) and returns True when that chunk was its file's last: the caller then runs :meth:`prove`.
    """

    def __init__(
        self, proofs: list[FileProof], plan: LoadPlan, sources: Sequence[Source], sizes: Sequence[int]
    ) -> None:
        self.proofs = proofs
        self._sources = sources
        self._pieces = plan.pieces
        self._files: dict[int, _FileState] = {}
        by_file: dict[int, list[Chunk]] = {}
        for chunk in plan.chunks:
            by_file.setdefault(chunk.file, []).append(chunk)
        for proof in proofs:
            if proof.method != "checksum" or proof.checksum is None:
                continue
            chunks = by_file.get(proof.file, [])
            cuts, total = [], 0
            for size, _ in proof.checksum.parts:
                total += size
                cuts.append(total)
            self._files[proof.file] = _FileState(
                proof, sizes[proof.file], chunks, len(chunks), tuple(cuts[:-1])
            )

    def proves(self, file: int) -> bool:
        return file in self._files

    def landed(self, chunk: Chunk, region: Region) -> bool:
        """Account for a landed chunk; True when its file now has every chunk in."""
        state = self._files.get(chunk.file)
        if state is None:
            return False
        checksum = state.proof.checksum
        assert checksum is not None
        pieces = []
        landed = self._pieces
        for at in chunk.pieces:  # the chunk's bytes are contiguous in the file, each piece at its own slot
            src, dst = int(landed.src[at]), int(landed.dst[at])
            for offset, length in _split(src, int(landed.length[at]), state.cuts):
                piece = _Piece(offset, length, dst=dst + offset - src)
                if checksum.composable:
                    piece.crc = crc(checksum.algorithm, region(piece.dst or 0, length))
                pieces.append(piece)
        with state.lock:
            state.pieces.extend(pieces)
            state.left -= 1
            return state.left == 0

    def no_chunks(self, file: int) -> bool:
        """Whether ``file`` has no chunk (an empty or all-header file): it is proven at once."""
        state = self._files.get(file)
        return state is not None and not state.chunks

    def prove(self, file: int, region: Region, *, policy: RetryPolicy) -> None:
        """Check ``file``'s bytes against the store's checksum; HashMismatchError when they differ."""
        state = self._files[file]
        checksum = state.proof.checksum
        assert checksum is not None
        pieces = sorted(state.pieces, key=lambda p: p.offset) + self._gaps(state, policy)
        pieces.sort(key=lambda p: p.offset)
        digests = self._digests(checksum, pieces, state, region)
        expected = [value for _, value in checksum.parts] if checksum.parts else [checksum.value]
        if digests != expected:
            state.proof.state = "failed"
            pairs = enumerate(zip(digests, expected, strict=False))
            bad = next((i for i, (got, want) in pairs if got != want), min(len(digests), len(expected)))
            where = f" (part {bad + 1} of {len(expected)})" if checksum.parts else ""
            raise HashMismatchError(
                f"the bytes read do not match the {checksum.algorithm} checksum the store keeps{where}: the "
                "transfer corrupted them, or the object changed; the load is not published",
                source=state.proof.uri,
            )
        if checksum.parts and _composite(checksum) != checksum.value:
            state.proof.state = "failed"
            raise HashMismatchError(
                f"the store's list of parts does not add up to its {checksum.algorithm} composite checksum: "
                "the object changed while it was being read; the load is not published",
                source=state.proof.uri,
            )
        state.proof.state = "proven"

    def reset(self, file: int) -> list[Chunk]:
        """Forget what was taken of ``file`` (before reading it again); its chunks, to land again."""
        state = self._files[file]
        with state.lock:
            state.pieces.clear()
            state.left = len(state.chunks)
        return state.chunks

    def _gaps(self, state: _FileState, policy: RetryPolicy) -> list[_Piece]:
        """The file's bytes no chunk covers, read from the origin (pinned to the load's version)."""
        covered = sorted((p.offset, p.offset + p.length) for p in state.pieces)
        gaps, at = [], 0
        for start, end in covered:
            if start > at:
                gaps.append((at, start - at))
            at = max(at, end)
        if at < state.size:
            gaps.append((at, state.size - at))
        checksum = state.proof.checksum
        assert checksum is not None
        source = getattr(self._sources[state.proof.file], "origin", self._sources[state.proof.file])
        pieces = []
        for start, length in gaps:
            for offset, piece_length in _split(start, length, state.cuts):
                data = bytearray(piece_length)
                read_range(source, offset, memoryview(data), policy=policy)
                piece = _Piece(offset, piece_length, data=bytes(data))
                if checksum.composable:
                    piece.crc = crc(checksum.algorithm, data)
                pieces.append(piece)
        return pieces

    @staticmethod
    def _digests(
        checksum: StoreChecksum, pieces: list[_Piece], state: _FileState, region: Region
    ) -> list[bytes]:
        """The digest of the whole file, or of each part of a composite, from the pieces in file order."""
        bounds = [*state.cuts, state.size]
        digests: list[bytes] = []
        running = _Running(checksum)
        for piece in pieces:
            running.add(piece, region)
            if len(digests) < len(bounds) - 1 and piece.offset + piece.length == bounds[len(digests)]:
                digests.append(running.digest())
                running = _Running(checksum)
        digests.append(running.digest())
        return digests


class _Running:
    """The digest of consecutive pieces: CRCs combined, or a hash fed the bytes in order."""

    def __init__(self, checksum: StoreChecksum) -> None:
        self._algorithm = checksum.algorithm
        self._crc: int | None = None
        self._hash: Any = None if checksum.composable else new_hash(checksum.algorithm)

    def add(self, piece: _Piece, region: Region) -> None:
        if self._hash is not None:
            self._hash.update(piece.data if piece.data is not None else region(piece.dst or 0, piece.length))
        elif self._crc is None:
            self._crc = piece.crc
        else:
            self._crc = crc_combine(self._algorithm, self._crc, piece.crc, piece.length)

    def digest(self) -> bytes:
        if self._hash is not None:
            return bytes(self._hash.digest())
        return (self._crc or 0).to_bytes(crc_width(self._algorithm) // 8, "big")


def _composite(checksum: StoreChecksum) -> bytes:
    """A multipart checksum: the digest of the parts' digests, concatenated."""
    joined = b"".join(value for _, value in checksum.parts)
    if checksum.composable:
        return crc(checksum.algorithm, joined).to_bytes(len(checksum.value), "big")
    digest = new_hash(checksum.algorithm)
    digest.update(joined)
    return bytes(digest.digest())


def _split(offset: int, length: int, cuts: Sequence[int]) -> list[tuple[int, int]]:
    """``[offset, offset + length)`` cut at the part boundaries inside it."""
    pieces, start, end = [], offset, offset + length
    for cut in cuts:
        if start < cut < end:
            pieces.append((start, cut - start))
            start = cut
    pieces.append((start, end - start))
    return pieces
