"""From a model's index to a load plan: where each tensor goes in the segment, and which ranges to fetch.

A plan is pure arithmetic over the index; nothing is read or allocated here. Its two halves:

- the segment :class:`~modelload.loader.segment.Layout`, in file order, each slot with a *lead*: room in the
  padding before the slot for the tensor's record header (tensorizer), so one range request lands the
  header and the start of the data contiguously, with no copy (:meth:`LoadPlan.record` says where each
  record lies: :mod:`modelload.loader.segment.geometry`);
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

import bisect
import functools
import itertools
import operator
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import numpy.typing as npt

from modelload.loader.errors import ConfigError
from modelload.loader.formats import ModelIndex
from modelload.loader.segment import ALIGNMENT, Layout, TensorSpecs, plan_layout
from modelload.loader.segment.geometry import Record, footprints, place

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
    def header_bytes(self) -> int:
        """Bytes of record header among this chunk's bytes (tensorizer: one header before each tensor's data
        it starts), else 0."""
        return self.length - self.data_bytes

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
        touches. The pieces grouped by tensor with a stable sort (each tensor's in their order), not a list
        appended to per piece: a plan cut per tensor for peers has 100,000 of them."""
        pieces = self.pieces
        by_tensor = np.argsort(pieces.tensor, kind="stable")
        chunks = list(map(self.chunks.__getitem__, pieces.chunk[by_tensor].tolist()))
        bounds = np.searchsorted(pieces.tensor[by_tensor], np.arange(len(self.index.tensors) + 1)).tolist()
        return tuple(tuple(chunks[start:end]) for start, end in itertools.pairwise(bounds))

    def record(self, tensor: int) -> Record:
        """Where tensor ``tensor``'s record lies in the segment: its header in the lead, then the slot."""
        return place(self.layout.slots[tensor], self.index.tensors[tensor])

    @property
    def headers(self) -> Ints:
        """Every tensor's :attr:`Record.header` (by tensor index), as a column: what code that asks it of
        every tensor reads, rather than a :meth:`record` each."""
        return np.asarray(self.index.table.leads, dtype=np.int64)

    def footprints(self) -> tuple[Ints, Ints]:
        """Every tensor's :attr:`Record.footprint` (by tensor index), as columns: starts and lengths."""
        return footprints(self.layout.table.offsets, self.layout.table.nbytes, self.headers)

    def tensors_of(self, chunk: Chunk) -> npt.NDArray[np.int32]:
        """The tensors ``chunk`` lands bytes of, in source order."""
        return self.pieces.tensor[chunk.first : chunk.first + chunk.count]

    def reordered(self, chunks: Sequence[Chunk]) -> LoadPlan:
        """This plan with its chunks (the same ones) loaded in the order of ``chunks``.

        Chunks hold the plan's pieces in runs (``first``, ``count``) that follow each other: ordered by their
        first piece, the given chunks must be the plan's own, object for object, and each piece's new chunk
        is its run's place in the new order."""
        given, own = _by_first(chunks), _by_first(self.chunks)
        same = map(operator.is_, map(chunks.__getitem__, given), map(self.chunks.__getitem__, own))
        if len(given) != len(own) or not all(same):
            raise ValueError("a reordered plan must load the same chunks")
        counts = np.fromiter(map(_COUNT, chunks), np.int64, len(chunks))
        owner = np.repeat(np.asarray(given, dtype=np.int32), counts[given])
        return replace(self, chunks=tuple(chunks), pieces=replace(self.pieces, chunk=owner))

    def per_tensor(self) -> LoadPlan:
        """This plan with every chunk cut at its tensors' edges: one tensor (or one piece of a big one) per
        range, each landing contiguously. What peers exchange: a peer serves a range that lies inside one
        tensor's record (:mod:`modelload.sidecar.peers.ranges`)."""
        if all(chunk.count == 1 for chunk in self.chunks):
            return self
        pieces = self.pieces
        files = np.fromiter((chunk.file for chunk in self.chunks), np.int64, len(self.chunks))[pieces.chunk]
        # Chunk's fields in order (file, src_offset, length, data_bytes, first, count, dst_offset, tensor),
        # a column each: a chunk per piece, with no numpy scalar read per field.
        chunks = tuple(map(Chunk, files.tolist(), pieces.src.tolist(), pieces.length.tolist(),
                           pieces.data.tolist(), range(len(pieces)), itertools.repeat(1, len(pieces)),
                           pieces.dst.tolist(), pieces.tensor.tolist()))  # fmt: skip
        cut = replace(pieces, chunk=np.arange(len(pieces), dtype=np.int32))
        counts = np.bincount(cut.tensor, minlength=len(self.index.tensors)).astype(np.int32)
        return replace(self, chunks=chunks, pieces=cut, chunk_counts=counts)


def load_order(index: ModelIndex, priority: Sequence[str] = ()) -> tuple[int, ...]:
    """Tensor indices with the ``priority`` names (an exact name or a prefix) first, in the order given.

    ``("model.embed_tokens.", "model.layers.0.")`` loads the embeddings, then layer 0, then the rest in file
    order. A priority entry that matches nothing is an error: it is almost always a typo.

    The names with a prefix are one run of the sorted names, found by bisection: the cost is the sort plus
    what the entries match, not entries times tensors (4,096 entries against a mixture of experts' 100,000
    tensors would be 400 million comparisons).
    """
    if not priority:
        return tuple(range(len(index.tensors)))
    names = index.table.names
    ranked = sorted(range(len(names)), key=names.__getitem__)
    ordered = [names[i] for i in ranked]
    first: list[int] = []
    seen = bytearray(len(names))
    for wanted in priority:
        start = bisect.bisect_left(ordered, wanted)
        end = start
        while end < len(ordered) and ordered[end].startswith(wanted):
            end += 1
        if end == start:
            raise ConfigError(f"priority entry {wanted!r} matches no tensor name or prefix in the model")
        for i in sorted(ranked[start:end]):  # in file order, as the entry's tensors lie
            if not seen[i]:
                seen[i] = 1
                first.append(i)
    return (*first, *(i for i in range(len(names)) if not seen[i]))


def plan_load(
    index: ModelIndex,
    *,
    chunk_size: int,
    priority: Sequence[str] = (),
    metadata: Mapping[str, str] | None = None,
    span_limit: int | None = None,
    page_size: int = ALIGNMENT,
    readers: int = 1,
    packed: bool | None = None,
) -> LoadPlan:
    """Plan the segment and the range requests for loading ``index``'s model, for a volume of
    ``page_size``-byte pages (``modelload.loader.segment.pages``).

    A chunk holds whole tensors that are neighbours in their file and in load order, as long as it stays
    within ``chunk_size`` bytes of the file and, when given, ``span_limit`` bytes of the segment (its slots
    with their padding: ring mode passes its ring size, so a chunk always fits in the ring). ``packed``: the
    layout's (:func:`~modelload.loader.segment.plan_layout`), None to pack where pages would pad too much.

    With ``readers`` > 1, the load's last ``readers`` chunks' worth of bytes (at most a fifth of the model) is
    cut in half-size chunks: otherwise the last wave of full-size ranges keeps a few readers busy while the
    others, done, wait; against an origin that caps each request's rate, 8 readers lost about a tenth of the
    load's time that way. Half, not finer: each extra range is a request (and a sample re-read on an origin
    without a strong validator), and halves already take most of the loss back (0.94 of the bound at 8
    readers in a model of the load, against 0.95 for quarters).
    """
    if chunk_size < 4096:
        raise ConfigError(f"chunk size must be at least 4096 bytes, got {chunk_size}")
    layout = plan_layout(
        _specs(index),
        metadata={"format": index.format, **(metadata or {})},
        files=index.files,
        page_size=page_size,
        packed=packed,
    )
    order = np.arange(len(index.tensors), dtype=np.int32)  # file order, unless priorities come first
    if priority:
        order = np.asarray(load_order(index, priority), dtype=np.int32)
    span = _UNLIMITED if span_limit is None else span_limit
    tail = readers * chunk_size if readers > 1 else 0
    return _Cutter(index, layout, chunk_size, span, tail).plan(order)


_UNLIMITED = 1 << 62
_COUNT = operator.attrgetter("count")


def _by_first(chunks: Sequence[Chunk]) -> list[int]:
    """The positions of ``chunks`` ordered by their first piece."""
    firsts = np.fromiter(map(operator.attrgetter("first"), chunks), np.int64, len(chunks))
    return firsts.argsort(kind="stable").tolist()


def _specs(index: ModelIndex) -> TensorSpecs:
    """The index's tensors as the layout's columns, each slot with a lead for its record header (the index's
    own columns: a mixture of experts has 100,000 tensors)."""
    table = index.table
    count = len(table)
    return TensorSpecs(
        names=table.names,
        dtypes=table.dtypes,
        shapes=table.shapes,
        leads=table.leads,
        files=table.files if index.files else [None] * count,
        sha256=[None] * count,
    )


class _Cutter:
    """Cuts the tensors' records, in load order, into chunks (see :func:`plan_load`), a run at a time.

    A *run* is tensors that follow each other in load order and in their file, each at most a chunk: a run
    is cut greedily into chunks within both bounds, each cut found by a binary search over the run's running
    ends. A tensor larger than a chunk is a run of its own, cut into pieces. The work is per run and per
    chunk, plus numpy over the tensors: a plan of 100,000 tensors in 160 files is a few hundred steps.
    """

    def __init__(self, index: ModelIndex, layout: Layout, chunk_size: int, span: int, tail: int = 0) -> None:
        self.index, self.layout, self.chunk_size, self.span = index, layout, chunk_size, span
        self.step = min(chunk_size, span)
        self.tail = tail
        """Bytes at the end of the load order cut into chunks of ``fine`` bytes, at most a fifth of all
        (see :func:`plan_load`)."""
        self.fine = min(self.step, max(4096, self.step // 2))
        self.parts: dict[str, list[npt.NDArray[Any]]] = {
            k: [] for k in ("tensor", "src", "dst", "length", "data")
        }
        self.chunks: list[Chunk] = []
        self.chunk_of: list[npt.NDArray[np.int32]] = []
        self.pieces = 0

    def plan(self, order: npt.NDArray[np.int32]) -> LoadPlan:
        table = self.index.table
        count = len(table)
        record = np.asarray(table.record_offsets, dtype=np.int64)
        header = np.asarray(table.data_offsets, dtype=np.int64) - record
        data = np.asarray(table.data_lengths, dtype=np.int64)
        file = table.files.astype(np.int64)
        slot = self.layout.table.offsets
        counts = np.zeros(count, dtype=np.int32)
        live = order[(header + data)[order] > 0]  # an empty tensor has nothing to fetch
        t = live.astype(np.int64)
        src, length, dst, end = record[t], header[t] + data[t], slot[t] - header[t], slot[t] + data[t]
        ends = np.cumsum(length)
        tail = min(self.tail, int(ends[-1]) // 5) if len(t) else 0
        fine = ends > ends[-1] - tail if tail else np.zeros(len(t), dtype=bool)
        steps = np.where(fine, self.fine, self.step)
        big = data[t] > steps
        joins = np.zeros(len(t), dtype=bool)
        joins[1:] = ~big[1:] & ~big[:-1] & (file[t][1:] == file[t][:-1]) & (src[1:] == src[:-1] + length[:-1])
        joins[1:] &= fine[1:] == fine[:-1]  # the finely cut tail is a run of its own
        starts = np.flatnonzero(~joins).tolist()
        for a, b in zip(starts, [*starts[1:], len(t)], strict=True):
            step = int(steps[a])
            if big[a]:
                tensor = int(t[a])
                counts[tensor] = self._cut_big(tensor, int(src[a]), int(header[tensor]), int(data[tensor]),
                                               int(slot[tensor]), int(file[tensor]), step)  # fmt: skip
                continue
            counts[t[a:b]] = 1
            size = self.chunk_size if step == self.step else step
            self._cut_run(t[a:b], src[a:b], length[a:b], dst[a:b], end[a:b], data[t[a:b]], int(file[t[a]]),
                          size)  # fmt: skip
        parts = self.parts
        pieces = Pieces(
            tensor=_joined(parts["tensor"], np.int32),
            src=_joined(parts["src"], np.int64),
            dst=_joined(parts["dst"], np.int64),
            length=_joined(parts["length"], np.int64),
            data=_joined(parts["data"], np.int64),
            chunk=_joined(self.chunk_of, np.int32),
        )
        return LoadPlan(self.index, self.layout, tuple(self.chunks), pieces, counts, order)

    def _cut_run(
        self, tensors: Ints, src: Ints, length: Ints, dst: Ints, end: Ints, data: Ints, file: int, size: int
    ) -> None:
        """Neighbouring small tensors: chunks of whole tensors, each within ``size`` bytes of the file and
        ``span`` of the segment (the ends only grow along a run, so each cut is a binary search)."""
        src_end = src + length
        first = 0
        while first < len(tensors):
            by_file = np.searchsorted(src_end, src[first] + size, side="right")
            by_span = np.searchsorted(end, dst[first] + self.span, side="right")
            last = max(int(min(by_file, by_span)), first + 1)
            self._add(tensors[first:last], src[first:last], dst[first:last], length[first:last],
                      data[first:last], file)  # fmt: skip
            first = last

    def _cut_big(
        self, tensor: int, start: int, header: int, data: int, slot: int, file: int, step: int
    ) -> int:
        """A tensor larger than a chunk: its header and a step of data, then steps of data, one chunk each.
        Returns how many."""
        cuts = np.arange(step, data, step, dtype=np.int64)
        sizes = np.minimum(step, data - cuts)
        src = np.concatenate(([start], start + header + cuts))
        dst = np.concatenate(([slot - header], slot + cuts))
        length = np.concatenate(([header + step], sizes))
        datas = np.concatenate(([step], sizes))
        for i in range(len(src)):
            self._add(
                np.array([tensor]), src[i : i + 1], dst[i : i + 1], length[i : i + 1], datas[i : i + 1], file
            )
        return len(src)

    def _add(self, tensors: Ints, src: Ints, dst: Ints, length: Ints, data: Ints, file: int) -> None:
        """One chunk: these pieces, contiguous in ``file``."""
        for name, column in zip(("tensor", "src", "dst", "length", "data"), (tensors, src, dst, length, data),
                                strict=True):  # fmt: skip
            self.parts[name].append(column)
        count = len(tensors)
        self.chunk_of.append(np.full(count, len(self.chunks), dtype=np.int32))
        self.chunks.append(
            Chunk(
                file=file,
                src_offset=int(src[0]),
                length=int(src[-1] + length[-1] - src[0]),
                data_bytes=int(data.sum()),
                first=self.pieces,
                count=count,
                dst_offset=int(dst[0]),
                tensor=int(tensors[0]),
            )
        )
        self.pieces += count


def _joined(parts: list[npt.NDArray[Any]], dtype: type) -> npt.NDArray[Any]:
    return np.concatenate(parts).astype(dtype, copy=False) if parts else np.zeros(0, dtype=dtype)
