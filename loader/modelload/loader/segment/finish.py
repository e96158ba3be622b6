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
5. the caller's own last check runs (the sidecar re-reads samples of a range nothing else verified);
6. the slot's CRC-32 is recorded and the tensor published READY, with its verified and decrypted flags.

Tensors landed together (the tensors of one range) are finished together by
:meth:`TensorFinisher.finish_many`: steps 1-4 per tensor, the caller's check once, and one write of their
state entries.

A tensor that fails authentication before any other proved the key is held, neither READY nor failed,
until a second encrypted tensor decides between a wrong key and corrupt bytes; :meth:`TensorFinisher.settle`
at the end of the load raises a verdict still open. Nothing is published half-checked: every step before 6
raises instead.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

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
        headers = None if header is None else [header]
        crcs = None if crc32 is None else [crc32]
        done = self.finish_many(
            [tensor], entries=[entry], headers=headers, source=source, check=check, crcs=crcs
        )
        return bool(done)

    def finish_many(
        self,
        tensors: Sequence[int],
        *,
        entries: Sequence[TensorEntry],
        headers: Sequence[bytes | bytearray | memoryview] | None,
        source: str,
        check: Callable[[bool], None] | None = None,
        crcs: Sequence[int | None] | None = None,
    ) -> list[int]:
        """:meth:`finish` for tensors landed together (the tensors of one range, of one weight file
        ``source``), published together: steps 1-5 per tensor, then one :meth:`SegmentWriter.mark_ready_many`.

        ``headers`` and ``crcs`` pair with ``tensors`` (None: a format without record headers; CRCs to take
        here, all of them or those given as None). ``check(verified)`` runs once, before anything is
        published, with whether every one of them was verified by its stored hash. Returns the tensors
        published (in order): all of them, less any held for a key verdict.
        """
        writer = self.writer
        slots = writer.layout.slots
        if crcs is not None and any(
            crc is not None and (headers is not None or e.data_length != slots[t].nbytes)
            for t, e, crc in zip(tensors, entries, crcs, strict=True)
        ):
            raise ValueError("CRC-32s given for tensors whose bytes this finish changes")
        published: list[int] = []
        verified: list[bool] = []
        decrypted: list[bool] = []
        given: list[int | None] = []
        for number, (tensor, entry) in enumerate(zip(tensors, entries, strict=True)):
            # Only a ring reuses pages: elsewhere a slot's bytes past its data are the new file's zeros.
            if self._ring and slots[tensor].nbytes > entry.data_length:
                zeros = np.frombuffer(writer.region(*place(slots[tensor], entry).unlanded), dtype=np.uint8)
                zeros[:] = 0
                del zeros  # no export of the mapping left behind
            checked = opened = False
            if headers is not None:
                data = writer.slot(tensor)[: entry.data_length]
                try:
                    parsed = open_record(
                        headers[number],
                        data,
                        entry=entry,
                        encrypted_file=self._encrypted,
                        keys=self.keys,
                        hashes="fastest" if self._verify else "none",
                        source=source,
                    )
                except WrongKeyError as exc:
                    if self.keys.doubt(entry.name, source, exc):
                        continue
                    raise
                opened = parsed.encrypted
                checked = self._verify and bool(parsed.hashes)
            published.append(tensor)
            verified.append(checked)
            decrypted.append(opened)
            if crcs is not None:
                given.append(crcs[number])
        if check is not None and published:
            check(all(verified))
        # The CRC-32 of the bytes as they lie in the segment: what `inspect --verify` checks later.
        if crcs is None:
            recorded = list(map(crc32_of, writer.slots(published)))
        else:
            pairs = zip(published, given, strict=True)
            recorded = [crc32_of(writer.slot(tensor)) if crc is None else crc for tensor, crc in pairs]
        writer.mark_ready_many(published, crc32=recorded, verified=verified, decrypted=decrypted)
        return published

    def settle(self) -> None:
        """After the last tensor: a tensor still held was the only encrypted one, so its wrong key stands."""
        self.keys.settle()
