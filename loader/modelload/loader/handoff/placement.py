"""Where each tensor goes in the keeper's device memory: blocks of a chosen size, tensors packed in order.

The keeper allocates its memory in blocks (one CUDA allocation and one exported descriptor each) rather than
one allocation per tensor: a model of 100,000 tensors would otherwise send 100,000 descriptors and map as
many ranges in every app process. A block is a multiple of the driver's allocation granularity (2 MiB on
current GPUs); a tensor larger than the block size gets a block of its own. Tensors start on
:data:`ALIGNMENT` bytes, what torch's own allocator gives, so kernels that vectorise their loads see the same
alignment as on memory torch allocated.
"""

from __future__ import annotations

from collections.abc import Iterable

from modelload.loader.dtypes import DType
from modelload.loader.errors import ConfigError
from modelload.loader.handoff.protocol import TensorPlace

__all__ = ["ALIGNMENT", "DEFAULT_BLOCK_SIZE", "place"]

ALIGNMENT = 512
"""Byte alignment of every tensor in a block."""

DEFAULT_BLOCK_SIZE = 1 << 30
"""Bytes per block unless the keeper is told otherwise (``--block-size``)."""


def place(
    tensors: Iterable[tuple[str, DType, tuple[int, ...]]],
    *,
    block_size: int,
    granularity: int,
) -> tuple[list[int], list[TensorPlace]]:
    """Pack ``(name, dtype, shape)`` tensors, in order, into blocks; return the block sizes and the places.

    Every block size is a multiple of ``granularity``; ``block_size`` is rounded up to one.
    """
    if granularity <= 0 or block_size <= 0:
        raise ConfigError(f"block size {block_size} and granularity {granularity} must be positive")
    block_size = _round_up(block_size, granularity)
    blocks: list[int] = []
    places: list[TensorPlace] = []
    used = 0  # bytes of the open block (the last in ``blocks`` when ``open_block``)
    open_block = False
    for name, dtype, shape in tensors:
        nbytes = dtype.nbytes(shape)
        start = _round_up(used, ALIGNMENT)
        if not open_block or start + nbytes > block_size:
            if open_block:
                blocks[-1] = _round_up(max(used, 1), granularity)
            blocks.append(0)
            open_block, start = True, 0
        places.append(TensorPlace(name, dtype, tuple(shape), len(blocks) - 1, start, nbytes))
        used = start + nbytes
        if used >= block_size:  # a tensor of a block's size or more: the block is its alone
            blocks[-1] = _round_up(max(used, 1), granularity)
            open_block, used = False, 0
    if open_block:
        blocks[-1] = _round_up(max(used, 1), granularity)
    return blocks, places


def _round_up(value: int, to: int) -> int:
    return -(-value // to) * to
