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
"""

from __future__ import annotations

from dataclasses import dataclass

from modelload.loader.errors import ConfigError
from modelload.operator.quantity import MIB, format_mib, parse_bytes
from modelload.operator.schema import ModelLoadSpec

__all__ = ["Sizing", "SizingDefaults", "plan_sizing", "segment_bytes"]

ALIGNMENT = 4096
"""Tensor data offsets in the segment are multiples of this (segment/SPEC.md)."""
MANIFEST_BYTES_PER_TENSOR = 1024
"""A generous bound on a tensor's manifest entry and state slot (name, dtype, shape, offsets, hash)."""
FIXED_HEADROOM = 64 * MIB
"""Segment header, the notification socket, and slack for the filesystem's own accounting."""
CONSUMER_TABLE_ENTRIES = 64
"""Entries of the consumer table beside a segment in memory modes release and ring (segment/SPEC.md)."""


@dataclass(frozen=True)
class SizingDefaults:
    """The operator-wide defaults the per-model overrides start from."""

    working_set_bytes: int = 512 * MIB
    """The sidecar process without the segment: Python, boto3, the status API and readers' buffers."""
    cpu_request: str = "500m"


@dataclass(frozen=True)
class Sizing:
    """What the webhook writes into a pod for one model."""

    volume_bytes: int
    volume_size_limit: str
    resources: dict[str, dict[str, str]]
    """The sidecar's ``resources``: ``{"requests": {...}, "limits": {...}}``."""


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
    options = spec.memory
    if options is not None and options.mode == "ring" and options.ring_size is not None:
        # What the segment holds besides tensor data (tables, alignment, a directory's small files), plus
        # the ring, the consumer table beside the segment, and the same headroom.
        besides_data = max(needed - model_bytes, FIXED_HEADROOM)
        consumer_table = CONSUMER_TABLE_ENTRIES * (64 + tensors // 8 + 64) + ALIGNMENT
        needed = min(needed, parse_bytes(options.ring_size) + besides_data + consumer_table)
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
    overrides = spec.sidecar.resources if spec.sidecar is not None else None
    if overrides is not None:
        requests.update({k: str(v) for k, v in overrides.requests.items()})
        limits.update({k: str(v) for k, v in overrides.limits.items()})
    _check_memory(requests=requests, limits=limits, volume_bytes=rounded_volume)
    return Sizing(
        volume_bytes=rounded_volume,
        volume_size_limit=volume_limit,
        resources={"requests": requests, "limits": limits},
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
