"""Finishing a tensor: from bytes landed in its slot to READY in the segment, one way for every writer.

Whatever lands the bytes (the sidecar's range readers, ``modelload stage`` from a local file, bytes taken
from peers), a tensor is finished by :meth:`TensorFinisher.finish`:

1. a meta tensor (no data in the file) gets its zeros where the slot's bytes may hold an older tensor's
   (a ring segment reuses its pages; a new file is zeros already);
2. a tensorizer record's header (landed beside the slot, or read apart) is parsed and checked against the
   tensor's index entry;
3. an encrypted tensor is decrypted in place in its slot, and proves the key right (one
   :class:`~modelload.loader.formats.tensorizer.record.KeyState` per load, shared by its threads);
4. its fastest stored hash is checked when the load verifies (CRC32 with ISA-L where installed);
5. the caller's own last check runs (the sidecar re-reads samples of a tensor nothing else verified);
6. the slot's CRC-32 is recorded and the tensor published READY, with its verified and decrypted flags.

A tensor that fails authentication before any other proved the key is held, neither READY nor failed,
until a second encrypted tensor decides between a wrong key and corrupt bytes; :meth:`TensorFinisher.settle`
at the end of the load raises a verdict still open. Nothing is published half-checked: every step before 6
raises instead.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from modelload.loader.errors import WrongKeyError
from modelload.loader.formats._index import TensorEntry
from modelload.loader.formats.tensorizer.hashes import crc32 as crc32_of
from modelload.loader.formats.tensorizer.keys import DecryptionKey
from modelload.loader.formats.tensorizer.record import KeyState, open_record
from modelload.loader.segment.geometry import place
from modelload.loader.segment.layout import MemoryMode
from modelload.loader.segment.writer import SegmentWriter

__all__ = ["TensorFinisher"]


class TensorFinisher:
    """Finishes the tensors of one load into ``writer``. Thread-safe: readers finish tensors concurrently.

    >>> finisher = TensorFinisher(writer, key=key, encrypted=index.encrypted, verify=True)  # doctest: +SKIP
    >>> # ... land tensor 3's data in writer.slot(3), its record header in `header` ...
    >>> finisher.finish(3, entry=index.tensors[3], header=header, source=uri)
    True
    >>> finisher.settle()                     # after the last tensor: raises a wrong key nothing disproved
    """

    def __init__(
        self, writer: SegmentWriter, *, key: DecryptionKey | None, encrypted: bool, verify: bool
    ) -> None:
        self.writer = writer
        self.keys = KeyState(key)
        self._encrypted = encrypted
        self._verify = verify
        self._ring = writer.layout.memory_mode == MemoryMode.RING

    def finish(
        self,
        tensor: int,
        *,
        entry: TensorEntry,
        header: bytes | bytearray | memoryview | None,
        source: str,
        check: Callable[[bool], None] | None = None,
        crc32: int | None = None,
    ) -> bool:
        """Finish slot ``tensor``, whose ``entry.data_length`` bytes are landed at its start.

        ``header`` is a tensorizer record's header bytes (None for a format without one: nothing to
        decrypt or verify); ``check(verified)`` runs last before publishing and may raise to refuse. True
        when the tensor is READY, False when held (its verdict waits for another encrypted tensor).

        ``crc32`` is the CRC-32 of the slot's bytes when the caller computed it already (the peers' check
        does): recorded as is, instead of a second pass over the bytes. Only for a tensor this method leaves
        as landed: one without a record header (nothing to decrypt) and no zeros to write.
        """
        writer = self.writer
        if crc32 is not None and (
            header is not None or entry.data_length != writer.layout.slots[tensor].nbytes
        ):
            raise ValueError(f"a CRC-32 given for tensor {entry.name!r}, whose bytes this finish changes")
        verified = decrypted = False
        unlanded = place(writer.layout.slots[tensor], entry).unlanded
        if self._ring and unlanded[1] > 0:
            zeros = np.frombuffer(writer.region(*unlanded), dtype=np.uint8)
            zeros[:] = 0
            del zeros  # no export of the mapping left behind
        if header is not None:
            data = writer.slot(tensor)[: entry.data_length]
            try:
                parsed = open_record(
                    header,
                    data,
                    entry=entry,
                    encrypted_file=self._encrypted,
                    keys=self.keys,
                    hashes="fastest" if self._verify else "none",
                    source=source,
                )
            except WrongKeyError as exc:
                if self.keys.doubt(entry.name, source, exc):
                    return False
                raise
            decrypted = parsed.encrypted
            verified = self._verify and bool(parsed.hashes)
        if check is not None:
            check(verified)
        # The CRC-32 of the bytes as they lie in the segment: what `inspect --verify` checks later.
        if crc32 is None:
            crc32 = crc32_of(writer.slot(tensor))
        writer.mark_ready(tensor, verified=verified, decrypted=decrypted, crc32=crc32)
        return True

    def settle(self) -> None:
        """After the last tensor: a tensor still held was the only encrypted one, so its wrong key stands."""
        self.keys.settle()
