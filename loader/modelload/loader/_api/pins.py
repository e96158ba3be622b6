"""What the GPU copy pins, and when: each tensor's bytes, or a hugetlbfs segment's whole mapping once.

The copy to a GPU registers the host bytes it reads (``cudaHostRegister``, read-only), which pins their
pages. On 4 KiB pages that is one registration per tensor, over up to 262,144 pages per GiB. A segment on
hugetlbfs (``segment.pages``) is different in two ways that make one registration of its whole data
mapping both possible and cheaper:

- its pages are allocated before the first tensor lands (``posix_fallocate``) and mapped shared, so no
  page under the mapping is missing, replaced or copied on write while the segment lives; pinning pages
  whose tensors are still landing is harmless: the writer's bytes land in those very pages;
- the mapping is whole huge pages, 2 MiB-aligned at both ends: one span of 512 pages per GiB.

A copy must read from inside a single registration (the driver refuses a copy whose source crosses from
one registered span into another, seen on an H100), so the spans are not cut per page: the whole mapping is
one span, registered at the first copy and given back when the copier finishes. Where the driver refuses it,
tensors are pinned one by one as on 4 KiB pages. The price: in memory mode release, the pages of tensors
released during the copy go back to the pool when the copier finishes (``state_dict`` returns), not one by
one; the volume is sized for the whole model there anyway. Pure bookkeeping over two callables, so it is
tested without a GPU.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["Mapping", "Pinner"]

Unpin = Callable[[], None]


@dataclass(frozen=True)
class Mapping:
    """A segment's data mapping that may be pinned whole: addresses ``[start, end)``, pages of ``page``."""

    start: int
    end: int
    page: int

    def holds(self, pointer: int, nbytes: int) -> bool:
        return self.start <= pointer and pointer + nbytes <= self.end


def _nothing() -> None:
    """Unpins nothing: the bytes belong to the whole mapping's registration."""


class Pinner:
    """Pins what each copy reads: the whole ``mapping`` once when there is one, else each range.

    ``register(address, length)`` returns whether the driver pinned it; ``unregister(address)`` undoes it.
    """

    def __init__(
        self,
        *,
        register: Callable[[int, int], bool],
        unregister: Callable[[int], None],
        mapping: Mapping | None = None,
    ) -> None:
        self._register = register
        self._unregister = unregister
        self._mapping = mapping
        self._whole: bool | None = None
        """Whether the whole mapping is registered; None until the first copy tried."""

    @property
    def whole(self) -> bool:
        return bool(self._whole)

    def pin(self, pointer: int, nbytes: int) -> Unpin | None:
        """Pin ``[pointer, pointer + nbytes)``; what unpins it, or None when the driver refused."""
        mapping = self._mapping
        if mapping is not None and mapping.holds(pointer, nbytes):
            if self._whole is None:
                self._whole = self._register(mapping.start, mapping.end - mapping.start)
            if self._whole:
                return _nothing
        if not self._register(pointer, nbytes):
            return None
        unregister = self._unregister
        return lambda: unregister(pointer)

    def close(self) -> None:
        """Give back the whole mapping's registration (every copy from it has finished)."""
        if self._whole and self._mapping is not None:
            self._unregister(self._mapping.start)
        self._whole = None
