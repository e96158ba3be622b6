"""From a model's index to a load plan: where each tensor goes in the segment, and which ranges to fetch.

A plan is pure arithmetic over the index; nothing is read or allocated here. Its two halves:

- the segment :class:`~modelload.loader.segment.Layout`, in file order, each slot with a *lead*: room in the
  padding before the slot for the tensor's record header (tensorizer), so one range request lands the
  header and the start of the data contiguously, with no copy;
- the :class:`Chunk` list in load order: the range requests. A chunk covers neighbouring tensors of one
  weight file, up to ``chunk_size`` bytes, so a checkpoint of 100,000 small tensors (a mixture of experts)
  costs about as many requests as its bytes in big tensors would; a tensor larger than a chunk is cut into
  pieces of at most ``chunk_size`` (several readers share it). Each chunk lands as *pieces*, one per tensor
  it holds: the bytes are contiguous in the file, while each tensor's slot starts on its own 4096-byte
  boundary in the segment, so the pieces are landed one after the other from the same response.

Per-tensor and per-piece facts are numpy arrays (:class:`Pieces`), not objects: a plan of 100,000 tensors
is a few arrays and a few hundred chunks.
"""

from __future__ import annotations

import array
import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import numpy.typing as npt

from modelload.loader.errors import ConfigError
from modelload.loader.formats import ModelIndex, TensorEntry
from modelload.loader.segment import Layout, TensorSpec, plan_layout

__all__ = ["Chunk", "LoadPlan", "Pieces", "load_order", "plan_load"]

Ints = npt.NDArray[np.int64]


@dataclass(frozen=True, slots=True)
class Chunk:
    """One range request: ``length`` bytes of weight file ``file`` from ``src_offset``, landing as pieces
    ``first`` to ``first + count - 1`` of the plan (:class:`Pieces`), in that order.

    ``dst_offset`` is where the first piece lands in the segment (the whole chunk, when it has one piece);
    ``tensor`` is the first piece's tensor (the chunk's only one, when it has one piece). The first piece of
    a tensorizer tensor starts with its record header, which lands in the slot's lead.
    """

    file: int
    src_offset: int
    length: int
    data_bytes: int
    """Bytes of tensor data in this chunk (``length`` less the record header bytes)."""
    first: int
    count: int
    dst_offset: int
    tensor: int

    @property
    def pieces(self) -> range:
        """The indices of this chunk's pieces in :attr:`LoadPlan.pieces`."""
        return range(self.first, self.first + self.count)


@dataclass(frozen=True)
class Pieces:
    """What each tensor contributes to each chunk, in chunk order: the columns of one table.

    Piece ``i`` is ``length[i]`` bytes of tensor ``tensor[i]``'s record, from ``src[i]`` in its weight file
    to ``dst[i]`` in the segment, ``data[i]`` of them tensor data (the rest a record header).
    """

    tensor: npt.NDArray[np.int32]
    src: Ints
    dst: Ints
    length: Ints
    data: Ints
    chunk: npt.NDArray[np.int32]
    """The chunk each piece belongs to."""

    def __len__(self) -> int:
        return len(self.tensor)


@dataclass(frozen=True)
class LoadPlan:
    index: ModelIndex
    layout: Layout
    chunks: tuple[Chunk, ...]
    """Every range to fetch, in load order."""
    pieces: Pieces
    chunk_counts: npt.NDArray[np.int32]
    """How many chunks each tensor (by index) is in; 0 for a tensor with nothing to fetch."""
    order: npt.NDArray[np.int32]
    """Tensor indices in load order."""

    @functools.cached_property
    def chunks_by_tensor(self) -> tuple[tuple[Chunk, ...], ...]:
        """Each tensor's chunks (by tensor index), in load order: what re-reading or checking one tensor
        touches."""
        grouped: list[list[Chunk]] = [[] for _ in self.index.tensors]
        for tensor, chunk in zip(self.pieces.tensor.tolist(), self.pieces.chunk.tolist(), strict=True):
            grouped[tensor].append(self.chunks[chunk])
        return tuple(tuple(group) for group in grouped)

    def header_span(self, tensor: int) -> tuple[int, int]:
        """``(segment offset, length)`` of the tensor's record header once fetched; length 0: none."""
        entry = self.index.tensors[tensor]
        length = entry.data_offset - entry.record_offset
        return self.layout.slots[tensor].offset - length, length

    def tensors_of(self, chunk: Chunk) -> npt.NDArray[np.int32]:
        """The tensors ``chunk`` lands bytes of, in source order."""
        return self.pieces.tensor[chunk.first : chunk.first + chunk.count]

    def reordered(self, chunks: Sequence[Chunk]) -> LoadPlan:
        """This plan with its chunks (the same ones) loaded in the order of ``chunks``."""
        if sorted(map(id, chunks)) != sorted(map(id, self.chunks)):
            raise ValueError("a reordered plan must load the same chunks")
        owner = np.empty(len(self.pieces), dtype=np.int32)
        for seq, chunk in enumerate(chunks):
            owner[chunk.first : chunk.first + chunk.count] = seq
        return replace(self, chunks=tuple(chunks), pieces=replace(self.pieces, chunk=owner))

    def per_tensor(self) -> LoadPlan:
        """This plan with every chunk cut at its tensors' edges: one tensor (or one piece of a big one) per
        range, each landing contiguously. What peers exchange: a peer serves a range that lies inside one
        tensor's record (:mod:`modelload.sidecar.peers.ranges`)."""
        if all(chunk.count == 1 for chunk in self.chunks):
            return self
        pieces = self.pieces
        chunks = tuple(
            Chunk(
                file=self.chunks[int(pieces.chunk[i])].file,
                src_offset=int(pieces.src[i]),
                length=int(pieces.length[i]),
                data_bytes=int(pieces.data[i]),
                first=i,
                count=1,
                dst_offset=int(pieces.dst[i]),
                tensor=int(pieces.tensor[i]),
            )
            for i in range(len(pieces))
        )
        cut = replace(pieces, chunk=np.arange(len(pieces), dtype=np.int32))
        counts = np.bincount(cut.tensor, minlength=len(self.index.tensors)).astype(np.int32)
        return replace(self, chunks=chunks, pieces=cut, chunk_counts=counts)


def load_order(index: ModelIndex, priority: Sequence[str] = ()) -> tuple[int, ...]:
    """Tensor indices with the ``priority`` names (an exact name or a prefix) first, in the order given.

    ``("model.embed_tokens.", "model.layers.0.")`` loads the embeddings, then layer 0, then the rest in file
    order. A priority entry that matches nothing is an error: it is almost always a typo.
    """
    if not priority:
        return tuple(range(len(index.tensors)))
    names = [t.name for t in index.tensors]
    first: list[int] = []
    seen: set[int] = set()
    for wanted in priority:
        matched = [i for i, name in enumerate(names) if name == wanted or name.startswith(wanted)]
        if not matched:
            raise ConfigError(f"priority entry {wanted!r} matches no tensor name or prefix in the model")
        for i in matched:
            if i not in seen:
                seen.add(i)
                first.append(i)
    return (*first, *(i for i in range(len(names)) if i not in seen))


def plan_load(
    index: ModelIndex,
    *,
    chunk_size: int,
    priority: Sequence[str] = (),
    metadata: Mapping[str, str] | None = None,
    span_limit: int | None = None,
) -> LoadPlan:
    """Plan the segment and the range requests for loading ``index``'s model.

    A chunk holds whole tensors that are neighbours in their file and in load order, as long as it stays
    within ``chunk_size`` bytes of the file and ``span_limit`` bytes of the segment (default ``chunk_size``;
    ring mode passes its ring size, so a chunk always fits in the ring).
    """
    if chunk_size < 4096:
        raise ConfigError(f"chunk size must be at least 4096 bytes, got {chunk_size}")
    layout = plan_layout(
        [_spec(entry, several=bool(index.files)) for entry in index.tensors],
        metadata={"format": index.format, **(metadata or {})},
        files=index.files,
    )
    order = np.asarray(load_order(index, priority), dtype=np.int32)
    span = chunk_size if span_limit is None else min(chunk_size, span_limit)
    return _Cutter(index, layout, chunk_size, span).plan(order)


def _spec(entry: TensorEntry, *, several: bool) -> TensorSpec:
    lead = entry.data_offset - entry.record_offset
    return TensorSpec(entry.name, entry.dtype, entry.shape, lead=lead, file=entry.file if several else None)


class _Cutter:
    """Walks the tensors in load order and cuts their records into chunks (see :func:`plan_load`).

    One pass of plain integer arithmetic per tensor, with the pieces' columns in compact arrays (8 bytes an
    entry, not a Python int each): the plan of 100,000 tensors takes a few MiB while it is made.
    """

    def __init__(self, index: ModelIndex, layout: Layout, chunk_size: int, span: int) -> None:
        self.index, self.layout, self.chunk_size, self.span = index, layout, chunk_size, span
        self.columns = {name: array.array("q") for name in ("tensor", "src", "dst", "length", "data")}
        self.chunk_of = array.array("i")
        self.chunks: list[Chunk] = []
        self._open = -1  # the first piece of the chunk being filled; -1: none
        self._file = 0
        self._end = 0  # where the open chunk ends in the file
        self._data = 0

    def plan(self, order: npt.NDArray[np.int32]) -> LoadPlan:
        tensors = self.index.tensors
        slots = self.layout.slots
        counts = np.zeros(len(tensors), dtype=np.int32)
        step = min(self.chunk_size, self.span)
        columns = self.columns
        src_col, dst_col = columns["src"], columns["dst"]
        for tensor in order.tolist():
            entry = tensors[tensor]
            header = entry.data_offset - entry.record_offset
            data = entry.data_length
            if header + data == 0:
                continue  # nothing to fetch: published as soon as the segment is
            start, slot = entry.record_offset, slots[tensor].offset
            if data > step:  # a big tensor: its own chunks; the last piece may take neighbours after it
                self._close()
                first = step
                self._piece(tensor, start, slot - header, header + first, first, entry.file)
                for at in range(first, data, step):
                    self._close()
                    n = min(step, data - at)
                    self._piece(tensor, start + header + at, slot + at, n, n, entry.file)
                counts[tensor] = -(-(data - first) // step) + 1
                continue
            length = header + data
            if not (
                self._open >= 0
                and self._file == entry.file
                and self._end == start
                and start + length - src_col[self._open] <= self.chunk_size
                and slot + data - dst_col[self._open] <= self.span
            ):
                self._close()
            self._piece(tensor, start, slot - header, length, data, entry.file)
            counts[tensor] = 1
        self._close()
        pieces = Pieces(
            tensor=np.frombuffer(columns["tensor"], dtype=np.int64).astype(np.int32),
            src=np.frombuffer(src_col, dtype=np.int64),
            dst=np.frombuffer(dst_col, dtype=np.int64),
            length=np.frombuffer(columns["length"], dtype=np.int64),
            data=np.frombuffer(columns["data"], dtype=np.int64),
            chunk=np.frombuffer(self.chunk_of, dtype=np.int32),
        )
        return LoadPlan(self.index, self.layout, tuple(self.chunks), pieces, counts, order)

    def _piece(self, tensor: int, src: int, dst: int, length: int, data: int, file: int) -> None:
        columns = self.columns
        if self._open < 0:
            self._open, self._file, self._data = len(columns["tensor"]), file, 0
        columns["tensor"].append(tensor)
        columns["src"].append(src)
        columns["dst"].append(dst)
        columns["length"].append(length)
        columns["data"].append(data)
        self.chunk_of.append(len(self.chunks))
        self._end = src + length
        self._data += data

    def _close(self) -> None:
        first = self._open
        if first < 0:
            return
        columns = self.columns
        src = columns["src"][first]
        self.chunks.append(
            Chunk(
                file=self._file,
                src_offset=src,
                length=self._end - src,
                data_bytes=self._data,
                first=first,
                count=len(columns["tensor"]) - first,
                dst_offset=columns["dst"][first],
                tensor=columns["tensor"][first],
            )
        )
        self._open = -1


def describe(plan: LoadPlan) -> dict[str, Any]:
    """A plan's shape for logs: tensors, chunks, and the most pieces one chunk lands."""
    return {
        "tensors": len(plan.index.tensors),
        "chunks": len(plan.chunks),
        "pieces": len(plan.pieces),
        "largest_chunk_pieces": max((c.count for c in plan.chunks), default=0),
    }
