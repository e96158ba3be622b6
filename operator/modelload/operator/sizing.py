"""How much memory a pod needs for a model: the volume's sizeLimit and the sidecar's requests and limits.

The segment lives on an ``emptyDir`` with ``medium: Memory`` (tmpfs). Two facts set the numbers:

* tmpfs pages are charged to the cgroup of the container that writes them (the sidecar) and cannot be
  reclaimed without swap, so the sidecar's memory limit must cover the whole segment plus the process's own
  working set, or it is OOM-killed near the end of the load;
* the segment is larger than the sum of tensor bytes: each tensor starts on a 4096-byte boundary (pinned DMA
  and GPU copies want it), and the header, manifest and state table sit in front.

Memory modes (``spec.memory``) change the first fact's amount: in ``full`` and ``release`` the volume must
hold the whole segment (release gives pages back as the app copies them, but a slow app lets the segment
fill up first), so both are sized from the model; in ``ring`` the sidecar never holds more than the ring of
tensor data, so the volume and the sidecar's memory are the ring plus the segment's header and tables, the
model directory's small files and headroom: the model's size no longer matters.

The memory request equals the limit: the pages are pinned for the pod's life, so scheduling the pod on a node
without them free would only move the failure to the kernel's OOM killer. CPU gets a request and no limit:
hashing and decryption run at the speed of the network when they can.

Huge pages (``spec.memory.hugePages``: ``2Mi`` or ``1Gi``) move the segment to a second volume, an
``emptyDir`` with ``medium: HugePages-<size>``: hugetlbfs over the node's pre-allocated pool, charged to the
container that takes the pages (the sidecar, which allocates every page of the segment) against its
``hugepages-<size>`` limit, which Kubernetes wants equal to the request. The segment there is whole pages
with its data on a page boundary (``loader/modelload/loader/segment/pages.py``), so it takes at most the
4 KiB-page segment rounded up to a page, one page more for its tables, and one for the consumer table in
memory modes release and ring. The memory volume stays for the model directory's small files and the
notification socket (hugetlbfs holds neither), and the sidecar's memory limit shrinks to them.
"""

from __future__ import annotations

from dataclasses import dataclass

from modelload.loader.errors import ConfigError
from modelload.operator.quantity import MIB, format_mib, parse_bytes
from modelload.operator.schema import ModelLoadSpec

__all__ = ["HUGE_PAGE_SIZES", "HugePages", "Sizing", "SizingDefaults", "plan_sizing", "segment_bytes"]

ALIGNMENT = 4096
"""Tensor data offsets in the segment are multiples of this (segment/SPEC.md)."""
MANIFEST_BYTES_PER_TENSOR = 1024
"""A generous bound on a tensor's manifest entry and state slot (name, dtype, shape, offsets, hash)."""
FIXED_HEADROOM = 64 * MIB
"""Segment header, the notification socket, and slack for the filesystem's own accounting."""
CONSUMER_TABLE_ENTRIES = 64
"""Entries of the consumer table beside a segment in memory modes release and ring (segment/SPEC.md)."""
HUGE_PAGE_SIZES = {"2Mi": 2 * MIB, "1Gi": 1024 * MIB}
"""``spec.memory.hugePages`` values and their page sizes."""


@dataclass(frozen=True)
class SizingDefaults:
    """The operator-wide defaults the per-model overrides start from."""

    working_set_bytes: int = 512 * MIB
    """The sidecar process without the segment: Python, boto3, the status API and readers' buffers."""
    cpu_request: str = "500m"


@dataclass(frozen=True)
class HugePages:
    """The huge pages a pod's segment takes: ``size`` (``2Mi``, ``1Gi``) and ``bytes`` (whole pages)."""

    size: str
    bytes: int

    @property
    def resource(self) -> str:
        """The container resource, ``hugepages-2Mi``."""
        return f"hugepages-{self.size}"

    @property
    def medium(self) -> str:
        """The ``emptyDir`` medium, ``HugePages-2Mi``."""
        return f"HugePages-{self.size}"

    @property
    def quantity(self) -> str:
        return format_mib(self.bytes)


@dataclass(frozen=True)
class Sizing:
    """What the webhook writes into a pod for one model."""

    volume_bytes: int
    volume_size_limit: str
    resources: dict[str, dict[str, str]]
    """The sidecar's ``resources``: ``{"requests": {...}, "limits": {...}}``."""
    huge_pages: HugePages | None = None
    """The segment's huge pages (``spec.memory.hugePages``); None: the segment is on the memory volume."""


def segment_bytes(*, model_bytes: int, tensors: int) -> int:
    """An estimate of the volume a model needs (with headroom), from its byte and tensor counts alone."""
    if model_bytes < 0 or tensors < 0:
        raise ConfigError("model bytes and tensor count cannot be negative")
    return model_bytes + tensors * (ALIGNMENT + MANIFEST_BYTES_PER_TENSOR) + FIXED_HEADROOM


def plan_sizing(
    *,
    model_bytes: int,
    tensors: int,
    spec: ModelLoadSpec,
    defaults: SizingDefaults,
    segment: int | None = None,
) -> Sizing:
    """The volume size and sidecar resources for a model, with the spec's overrides applied and checked.

    ``segment`` is the bound the operator computed from the model's index (``status.segmentBytes``); the
    volume holds it plus :data:`FIXED_HEADROOM`. Without it (a status written before the field existed),
    :func:`segment_bytes` estimates one from the byte and tensor counts.

    Raises :class:`ConfigError` when an override cannot hold the model: a ``volumeSizeLimit`` below the
    segment's size, or a sidecar memory limit below the volume (the writer is charged for the pages).
    """
    if segment is not None:
        needed = segment + FIXED_HEADROOM
    else:
        needed = segment_bytes(model_bytes=model_bytes, tensors=tensors)
    segment_bound = needed - FIXED_HEADROOM
    options = spec.memory
    # What the segment holds besides tensor data (tables, alignment, a directory's small files), and headroom.
    besides_data = max(needed - model_bytes, FIXED_HEADROOM)
    ring = parse_bytes(options.ring_size) if options is not None and options.ring_size is not None else None
    if ring is not None:
        # The ring, the rest besides it, and the consumer table beside the segment.
        consumer_table = CONSUMER_TABLE_ENTRIES * (64 + tensors // 8 + 64) + ALIGNMENT
        needed = min(needed, ring + besides_data + consumer_table)
    huge = None
    if options is not None and options.huge_pages is not None:
        huge = _huge_pages(
            options.huge_pages, segment=segment_bound, model_bytes=model_bytes, ring=ring, spec=spec
        )
        needed = besides_data  # the memory volume keeps the small files and the socket
    if spec.volume_size_limit is not None:
        volume_bytes = parse_bytes(spec.volume_size_limit)
        if volume_bytes < needed:
            raise ConfigError(
                f"spec.volumeSizeLimit {spec.volume_size_limit} is below the {format_mib(needed)} the model "
                "needs (tensor bytes plus alignment and headroom); raise it or remove it"
            )
        volume_limit = str(spec.volume_size_limit)
    else:
        volume_bytes = needed
        volume_limit = format_mib(needed)
    rounded_volume = max(volume_bytes, parse_bytes(volume_limit))
    memory = format_mib(rounded_volume + defaults.working_set_bytes)
    requests: dict[str, str] = {"cpu": defaults.cpu_request, "memory": memory}
    limits: dict[str, str] = {"memory": memory}
    if huge is not None:
        requests[huge.resource] = limits[huge.resource] = huge.quantity
    overrides = spec.sidecar.resources if spec.sidecar is not None else None
    if overrides is not None:
        requests.update({k: str(v) for k, v in overrides.requests.items()})
        limits.update({k: str(v) for k, v in overrides.limits.items()})
    _check_memory(requests=requests, limits=limits, volume_bytes=rounded_volume)
    _check_page_sizes(requests, limits, huge)
    if huge is not None:
        _check_huge_pages(requests=requests, limits=limits, huge=huge)
    return Sizing(
        volume_bytes=rounded_volume,
        volume_size_limit=volume_limit,
        resources={"requests": requests, "limits": limits},
        huge_pages=huge,
    )


def _huge_pages(
    size: str, *, segment: int, model_bytes: int, ring: int | None, spec: ModelLoadSpec
) -> HugePages:
    """The huge pages of a segment whose 4 KiB-page bound is ``segment``: its tables and data each rounded up
    to whole pages (at most one page more than the whole rounded up), or the tables and the ring; and a page
    for the consumer table in memory modes release and ring. An upper bound: ``segment`` also counts a
    directory's small files, which go to the memory volume."""
    page = HUGE_PAGE_SIZES[size]
    mode = spec.memory.mode if spec.memory is not None else "full"
    table = page if mode in ("release", "ring") else 0
    if ring is not None:
        tables = max(segment - model_bytes, 0)
        pages = _round_up(tables, page) + _round_up(ring, page) + table
    else:
        pages = _round_up(segment, page) + page + table
    return HugePages(size=size, bytes=pages)


def _round_up(value: int, page: int) -> int:
    return -(-value // page) * page


def _check_page_sizes(requests: dict[str, str], limits: dict[str, str], huge: HugePages | None) -> None:
    """Huge pages of a size the segment is not on would be taken from the node's pool for nothing (and keep
    the pod off nodes without them): only the sidecar's segment uses huge pages, through its volume."""
    for resource in sorted({*requests, *limits}):
        if resource.startswith("hugepages-") and (huge is None or resource != huge.resource):
            where = f"on {huge.size} pages" if huge is not None else "on ordinary memory"
            raise ConfigError(
                f"spec.sidecar.resources: {resource} asks for pages the segment does not use (it is {where}, "
                "spec.memory.hugePages): remove it, or set spec.memory.hugePages to that size"
            )


def _check_huge_pages(*, requests: dict[str, str], limits: dict[str, str], huge: HugePages) -> None:
    """Kubernetes wants a huge page request equal to its limit; an override must still hold the segment."""
    request, limit = requests.get(huge.resource), limits.get(huge.resource)
    if request != limit:
        raise ConfigError(
            f"spec.sidecar.resources: {huge.resource} request {request} and limit {limit} differ; Kubernetes "
            "requires huge page requests to equal their limits (set both, or neither)"
        )
    if limit is not None and parse_bytes(limit) < huge.bytes:
        raise ConfigError(
            f"spec.sidecar.resources.limits.{huge.resource} {limit} is below the {huge.quantity} of huge "
            "pages the segment takes (spec.memory.hugePages); raise it or remove it"
        )


def _check_memory(*, requests: dict[str, str], limits: dict[str, str], volume_bytes: int) -> None:
    limit = limits.get("memory")
    if limit is not None and parse_bytes(limit) < volume_bytes:
        raise ConfigError(
            f"spec.sidecar.resources.limits.memory {limit} is below the model's volume "
            f"({format_mib(volume_bytes)}): the sidecar is charged for every page it writes; raise it"
        )
    request = requests.get("memory")
    if request is not None and limit is not None and parse_bytes(request) > parse_bytes(limit):
        raise ConfigError(f"spec.sidecar.resources: memory request {request} is above the limit {limit}")
