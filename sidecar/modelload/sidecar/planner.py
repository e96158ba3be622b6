"""From a model's index to a load plan: where each tensor goes in the segment, and which ranges to fetch.

A plan is pure arithmetic over the index; nothing is read or allocated here. Its two halves:

- the segment :class:`~modelload.loader.segment.Layout`, in file order, each slot with a *lead*: room in the
  padding before the slot for the tensor's record header (tensorizer), so one range request lands the
  header and the start of the data contiguously, with no copy (:meth:`LoadPlan.record` says where each
  record lies: :mod:`modelload.loader.segment.geometry`);
- the :class:`Chunk` list in load order: tensors in priority order, each tensor's bytes cut into pieces of at
  most ``chunk_size`` so that several readers share a large tensor, and a small tensor costs one request.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from modelload.loader.errors import ConfigError
from modelload.loader.formats import ModelIndex, TensorEntry
from modelload.loader.segment import ALIGNMENT, Layout, TensorSpec, plan_layout
from modelload.loader.segment.geometry import Record, place

__all__ = ["Chunk", "LoadPlan", "load_order", "plan_load"]


@dataclass(frozen=True)
class Chunk:
    """One range request: ``length`` bytes from ``src_offset`` in the source to ``dst_offset`` in the segment.

    The first chunk of a tensorizer tensor starts with its record header, which lands in the slot's lead.
    """

    tensor: int
    src_offset: int
    dst_offset: int
    length: int
    data_bytes: int
    """Bytes of tensor data in this chunk (``length`` less the record header bytes)."""
    file: int = 0
    """Which of the model's weight files ``src_offset`` is in (:attr:`ModelIndex.files`)."""

    @property
    def header_bytes(self) -> int:
        """Bytes of record header this chunk starts with (the first chunk of a tensorizer tensor), else 0."""
        return self.length - self.data_bytes


@dataclass(frozen=True)
class LoadPlan:
    index: ModelIndex
    layout: Layout
    chunks: tuple[Chunk, ...]
    """Every range to fetch, in load order."""
    chunk_counts: tuple[int, ...]
    """How many chunks each tensor (by index) is split into; 0 for a tensor with nothing to fetch."""
    order: tuple[int, ...]
    """Tensor indices in load order."""

    @functools.cached_property
    def chunks_by_tensor(self) -> tuple[tuple[Chunk, ...], ...]:
        """Each tensor's chunks (by tensor index), in load order: what re-reading or checking one tensor
        touches."""
        grouped: list[list[Chunk]] = [[] for _ in self.index.tensors]
        for chunk in self.chunks:
            grouped[chunk.tensor].append(chunk)
        return tuple(tuple(group) for group in grouped)

    def record(self, tensor: int) -> Record:
        """Where tensor ``tensor``'s record lies in the segment: its header in the lead, then the slot."""
        return place(self.layout.slots[tensor], self.index.tensors[tensor])


def load_order(index: ModelIndex, priority: Sequence[str] = ()) -> tuple[int, ...]:
    """Tensor indices with the ``priority`` names (an exact name or a prefix) first, in the order given.

    ``("model.embed_tokens.", "model.layers.0.")`` loads the embeddings, then layer 0, then the rest in file
    order. A priority entry that matches nothing is an error: it is almost always a typo.
    """
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
    page_size: int = ALIGNMENT,
) -> LoadPlan:
    """Plan the segment and the range requests for loading ``index``'s model, for a volume of
    ``page_size``-byte pages (``modelload.loader.segment.pages``)."""
    if chunk_size < 4096:
        raise ConfigError(f"chunk size must be at least 4096 bytes, got {chunk_size}")
    layout = plan_layout(
        [_spec(entry, several=bool(index.files)) for entry in index.tensors],
        metadata={"format": index.format, **(metadata or {})},
        files=index.files,
        page_size=page_size,
    )
    order = load_order(index, priority)
    chunks: list[Chunk] = []
    counts = [0] * len(index.tensors)
    for i in order:
        pieces = _cut(i, index.tensors[i], place(layout.slots[i], index.tensors[i]), chunk_size)
        counts[i] = len(pieces)
        chunks.extend(pieces)
    return LoadPlan(index=index, layout=layout, chunks=tuple(chunks), chunk_counts=tuple(counts), order=order)


def _spec(entry: TensorEntry, *, several: bool) -> TensorSpec:
    file = entry.file if several else None
    return TensorSpec(entry.name, entry.dtype, entry.shape, lead=entry.header_length, file=file)


def _cut(tensor: int, entry: TensorEntry, record: Record, chunk_size: int) -> list[Chunk]:
    header, data = record.header, record.data
    if header + data == 0:
        return []
    pieces = []
    # The first piece carries the header and up to a chunk of data; the rest are plain data.
    first = min(data, chunk_size)
    file = entry.file
    pieces.append(Chunk(tensor, entry.record_offset, record.start, header + first, first, file))
    for start in range(first, data, chunk_size):
        length = min(chunk_size, data - start)
        pieces.append(Chunk(tensor, entry.data_offset + start, record.slot + start, length, length, file))
    return pieces
