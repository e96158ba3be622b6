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

from collections.abc import Callable, Mapping, Sequence

import numpy as np
import numpy.typing as npt

from modelload.loader.errors import WrongKeyError
from modelload.loader.formats._index import TensorEntry, TensorTable
from modelload.loader.formats.tensorizer.hashes import crc32 as crc32_of
from modelload.loader.formats.tensorizer.keys import DecryptionKey
from modelload.loader.formats.tensorizer.record import KeyState, open_record
from modelload.loader.segment.geometry import place
from modelload.loader.segment.layout import MemoryMode
from modelload.loader.segment.writer import SegmentWriter

__all__ = ["Entries", "TensorFinisher"]

Entries = TensorTable | Mapping[int, TensorEntry] | Sequence[TensorEntry]
"""Index entries by tensor number: the index's table, or a mapping of the tensors at hand."""


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
        crcs = None if crc32 is None else np.array([crc32], dtype=np.int64)
        done = self.finish_many(
            [tensor], entries={tensor: entry}, headers=headers, source=source, check=check, crcs=crcs
        )
        return bool(len(done))

    def finish_many(
        self,
        tensors: Sequence[int] | npt.NDArray[np.integer],
        *,
        entries: Entries,
        headers: Sequence[bytes | bytearray | memoryview] | None,
        source: str,
        check: Callable[[bool], None] | None = None,
        crcs: npt.NDArray[np.int64] | None = None,
    ) -> npt.NDArray[np.intp]:
        """:meth:`finish` for tensors landed together (the tensors of one range, of one weight file
        ``source``), published together: steps 1-5 per tensor, then one :meth:`SegmentWriter.mark_ready_many`.

        ``entries`` gives each tensor's index entry by tensor number: the index's :class:`TensorTable` (its
        columns are read, no entry is made unless a record header needs one), or a mapping. ``headers``
        pairs with ``tensors`` (None: a format without record headers); ``crcs`` too, the CRC-32 of each
        slot where the caller took it already, ``-1`` where this takes it. ``check(verified)`` runs once,
        before anything is published, with whether every one of them was verified by its stored hash.
        Returns the tensors published (in order): all of them, less any held for a key verdict.
        """
        picked = np.asarray(tensors, dtype=np.intp)
        slot_nbytes = self.writer.layout.table.nbytes[picked]
        if isinstance(entries, TensorTable):
            data_lengths = np.asarray(entries.data_lengths[picked], dtype=np.int64)
        else:
            data_lengths = np.fromiter(
                (entries[t].data_length for t in picked.tolist()), np.int64, len(picked)
            )
        if crcs is not None and bool(
            np.any((crcs >= 0) & ((headers is not None) | (data_lengths != slot_nbytes)))
        ):
            raise ValueError("CRC-32s given for tensors whose bytes this finish changes")
        # Only a ring reuses pages: elsewhere a slot's bytes past its data are the new file's zeros.
        if self._ring:
            self._zero_tails(picked[slot_nbytes > data_lengths], entries)
        if headers is None:  # nothing to open: each is published as landed, none verified or decrypted
            published, verified, decrypted, given = picked, None, None, crcs
        else:
            published, verified, decrypted = self._open_records(picked, entries, headers, source)
            given = None
        if check is not None and len(published):
            check(verified is not None and all(verified))
        self.writer.mark_ready_many(published, crc32=self._crcs(published, given), verified=verified,
                                    decrypted=decrypted)  # fmt: skip
        return published

    def _zero_tails(self, tensors: npt.NDArray[np.intp], entries: Entries) -> None:
        """Zeros in the slots of ``tensors`` past their data (a ring slot may hold older tensors' bytes)."""
        writer = self.writer
        for tensor in tensors.tolist():
            unlanded = place(writer.layout.slots[tensor], entries[tensor]).unlanded
            zeros = np.frombuffer(writer.region(*unlanded), dtype=np.uint8)
            zeros[:] = 0
            del zeros  # no export of the mapping left behind

    def _open_records(
        self,
        tensors: npt.NDArray[np.intp],
        entries: Entries,
        headers: Sequence[bytes | bytearray | memoryview],
        source: str,
    ) -> tuple[npt.NDArray[np.intp], list[bool], list[bool]]:
        """Steps 2-4 for tensorizer records: each header parsed and checked against its entry, the data
        decrypted in place and its hash checked. Returns the tensors to publish (less those held for a key
        verdict) with whether each was verified and decrypted."""
        published: list[int] = []
        verified: list[bool] = []
        decrypted: list[bool] = []
        for number, tensor in enumerate(tensors.tolist()):
            entry = entries[tensor]
            data = self.writer.slot(tensor)[: entry.data_length]
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
            published.append(tensor)
            verified.append(self._verify and bool(parsed.hashes))
            decrypted.append(parsed.encrypted)
        return np.asarray(published, dtype=np.intp), verified, decrypted

    def _crcs(
        self, tensors: npt.NDArray[np.intp], given: npt.NDArray[np.int64] | None
    ) -> npt.NDArray[np.int64]:
        """The CRC-32 of each slot of ``tensors`` as it lies in the segment (what ``inspect --verify`` checks
        later): ``given`` where it is not -1, else taken here."""
        recorded = np.full(len(tensors), -1, dtype=np.int64) if given is None else given.copy()
        missing = np.flatnonzero(recorded < 0)
        if len(missing):
            views = self.writer.slots(tensors[missing].tolist())
            recorded[missing] = np.fromiter(map(crc32_of, views), dtype=np.int64, count=len(missing))
        return recorded

    def settle(self) -> None:
        """After the last tensor: a tensor still held was the only encrypted one, so its wrong key stands."""
        self.keys.settle()
