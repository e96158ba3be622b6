"""The one place the operator reads a model: the sidecar's sources layer plus the loader's index readers.

The operator needs a model's size before any pod asks for it (the webhook sizes the memory volume and the
sidecar's memory from it), so it reads the index once: a ``stat`` and the first bytes of the file (the
tensorizer metadata block or the safetensors header; usually one request). A model directory is read as the
sidecar reads it (its listing, every shard's header, the sizes of its small files), with the same rules.
Everything that ties the operator to those two layers' APIs is in this module, so aligning with a change there
is a change here only.

What the operator reads is bounded: never a local file (a ``file://`` model lives in the pods' filesystem, not
the operator's), only public addresses and the networks the installation allows (``AddressPolicy``, checked
at every connection and redirect), and nothing it read is echoed back (an unreadable file is described, not
shown). The statuses it writes carry counts, sizes and reasons, never bytes of the file.

Credentials (S3 keys, a GCS service-account key, an Azure connection string, SAS token or account key, or
an HTTP server's token or header lines) come from the ModelLoad's Secrets, read
through the Kubernetes API, and are handed to the source as explicit settings: the operator's own
environment is never changed (it serves many namespaces at once, each with its own Secret). The call is
blocking; the handlers run it in a thread.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from modelload.loader.errors import ConfigError, SourceAccessDeniedError, SourceUriError
from modelload.loader.formats import ModelIndex
from modelload.loader.segment import ALIGNMENT, TensorSpec, plan_layout
from modelload.loader.segment.layout import align
from modelload.loader.sizes import format_bytes
from modelload.operator import hubs
from modelload.operator.cloud_sources import GcsKey, endpoint_of, own_identity_reaches
from modelload.operator.hubs import HubAccess
from modelload.operator.quantity import format_mib, parse_bytes
from modelload.operator.schema import ModelLoadSpec
from modelload.sidecar.sources import AzureCredentials, Network, RequestHeaders, S3Credentials, parse_headers

__all__ = [
    "ModelSummary",
    "Network",
    "RequestHeaders",
    "S3Credentials",
    "check_priority",
    "is_local",
    "parse_headers",
    "read_summary",
    "segment_bound",
]


@dataclass(frozen=True)
class ModelSummary:
    """What the status reports about a model file."""

    format: str
    format_version: int
    tensors: int
    bytes: int
    """Bytes of all tensors in memory (what the segment must hold, before alignment)."""
    file_bytes: int
    """Bytes of the weight files at the source."""
    encrypted: bool
    segment_bytes: int
    """An upper bound of what the sidecar writes in the volume for this model: the segment
    (:func:`segment_bound`) and a directory's small files."""
    files: int = 1
    """Weight files: 1, or a directory's shards."""


def read_summary(
    spec: ModelLoadSpec,
    *,
    credentials: S3Credentials | None,
    headers: RequestHeaders | None = None,
    cloud: GcsKey | AzureCredentials | None = None,
    access: HubAccess | None = None,
    networks: Sequence[Network] = (),
) -> ModelSummary:
    """Read the model's index at ``spec.source`` and summarise it, with the S3 ``credentials`` or the HTTP
    ``headers`` (a private server's token) from the ModelLoad's Secret, or the Hub's token and the registry's
    credentials (``access``, see :mod:`.hubs`), from public addresses and the ``networks`` the installation
    allows only.

    Raises the loader's error tree: ConfigError (a bad URI or setting; a local file, which the operator
    never reads; an address it may not read), the SourceError branches (not found, access denied,
    transient), FormatError (not a model file, or a corrupt one).
    """
    from modelload.sidecar.sources import open_model

    if is_local(spec.source):
        raise SourceUriError(
            f"{spec.source}: the operator reads no local file on a ModelLoad's behalf", setting="spec.source"
        )
    anonymous = cloud is None and credentials is None and not own_identity_reaches(spec)
    settings = _source_settings(spec, credentials, headers, cloud, access, networks, anonymous=anonymous)
    try:
        model = open_model(spec.source, settings, format=_format_name(spec.format), files=spec.files)
        try:
            index = model.index
        finally:
            model.close()
    except SourceAccessDeniedError as exc:
        if not anonymous:
            raise
        raise SourceAccessDeniedError(
            f"{exc}. The operator read {endpoint_of(spec)} anonymously: it sends its own identity only to "
            "the cloud's own endpoints, never to a ModelLoad's; give this read credentials in a Secret "
            "(credentialsSecretRef)",
            uri=exc.uri,
        ) from exc
    check_priority(index, spec.priority)
    check_ring(index, spec)
    return ModelSummary(
        format=index.format,
        format_version=index.version,
        tensors=len(index.tensors),
        bytes=index.nbytes,
        file_bytes=model.size,
        encrypted=index.encrypted,
        segment_bytes=segment_bound(index, source=model.uri) + _small_files_bound(model.small),
        files=max(len(index.files), 1),
    )


def _small_files_bound(small: dict[str, int]) -> int:
    """The volume's pages the model directory takes: each file rounded up to a page, and the directory."""
    return sum(align(size) for size in small.values()) + ALIGNMENT * (1 + bool(small))


def check_priority(index: ModelIndex, priority: list[str]) -> None:
    """Every priority entry names a tensor or a prefix of one: the sidecar refuses the load otherwise, so a
    typo is reported on the ModelLoad rather than by every pod's sidecar. A look-up in the sorted names
    per entry: an entry against every name cost the product of the two (33 CPU-seconds for 4,096 entries
    and 100,000 tensors, the GIL shared with the webhook)."""
    names = sorted(index.table.names)  # a name with the prefix, if any, sorts first at or after it
    for i, wanted in enumerate(priority):
        at = bisect.bisect_left(names, wanted)
        if at == len(names) or not names[at].startswith(wanted):
            raise ConfigError(f"spec.priority[{i}]: {wanted!r} matches no tensor name or prefix in the model")


def check_ring(index: ModelIndex, spec: ModelLoadSpec) -> None:
    """A ring that cannot hold the largest tensor's record (its header and bytes) is refused here: every
    pod's sidecar would refuse the load after being scheduled, and say it only there."""
    ring = spec.memory.ring_size if spec.memory is not None else None
    if ring is None or not index.tensors:
        return
    needs = [t.header_length + t.nbytes for t in index.tensors]
    largest = max(range(len(needs)), key=needs.__getitem__)
    if needs[largest] > parse_bytes(ring):
        name = index.tensors[largest].name
        raise ConfigError(
            f"{ring} cannot hold the model's largest tensor, {name!r} ({format_bytes(needs[largest])}): "
            f"set it to at least {format_mib(needs[largest])}, and a few chunks more to keep the readers "
            "busy while the app copies",
            setting="spec.memory.ringSize",
        )


def segment_bound(index: ModelIndex, *, source: str) -> int:
    """The largest segment the sidecar can write for ``index``, whatever order it loads the tensors in.

    The segment layout (the loader's ``plan_layout``) is planned in file order; the sidecar may load in
    another order (a priority list) and may keep scratch room before each slot (a tensorizer record's
    header, which sits in the file between ``record_offset`` and ``data_offset``). Each slot can move by at
    most that room plus one alignment, so adding both per tensor bounds every order.
    """
    several = bool(index.files)
    specs = [TensorSpec(t.name, t.dtype, t.shape, file=t.file if several else None) for t in index.tensors]
    # The manifest's metadata as the sidecar writes it, with room for the values known only then.
    room_for = {
        "source_etag": 80,
        "source_size": 20,
        "source_version": 80,
        "notify": 200,
        "writer": 64,
        "model_dir": 4096,
    }
    metadata = {"format": index.format, "source": source, **{k: "x" * n for k, n in room_for.items()}}
    planned = plan_layout(specs, metadata=metadata, files=index.files).segment_length
    room = sum(align(t.header_length) for t in index.tensors)
    return planned + room + ALIGNMENT * len(index.tensors)


def _format_name(name: str) -> Literal["auto", "tensorizer", "safetensors"]:
    if name not in ("auto", "tensorizer", "safetensors"):  # the schema's enum; checked again for the type
        raise ConfigError(f"spec.format: {name!r} is not auto, tensorizer or safetensors")
    return name  # type: ignore[return-value]


def is_local(source: str) -> bool:
    """Whether ``source`` names a file in the pods' own filesystem (``file://``), which the operator never
    reads: the file is the pod's (an image, a volume), not the operator's."""
    return source.startswith("file:")


def _source_settings(
    spec: ModelLoadSpec,
    credentials: S3Credentials | None,
    headers: RequestHeaders | None,
    cloud: GcsKey | AzureCredentials | None = None,
    access: HubAccess | None = None,
    networks: Sequence[Network] = (),
    *,
    anonymous: bool = False,
) -> Any:
    from modelload.sidecar.sources import (
        AddressPolicy,
        AzureSettings,
        GcsSettings,
        HttpSettings,
        RetryPolicy,
        S3Settings,
        SourceSettings,
    )

    s3 = spec.s3
    s3_settings = S3Settings(
        endpoint_url=s3.endpoint if s3 else None,
        region=s3.region if s3 else None,
        addressing=s3.addressing if s3 else "auto",  # type: ignore[arg-type]
        # s3://: the Secret's keys when there are some, else the operator's own identity, which goes to
        # AWS's endpoints only (unsigned elsewhere: see cloud_sources).
        unsigned=(s3.unsigned if s3 else False) or (anonymous and credentials is None),
        credentials=credentials,
    )
    # A short retry of the first look-up (a throttled store): the handler's own retry, with kopf's backoff,
    # covers longer outages, and a handler must not sit in a thread for a minute of in-source backoff.
    retry = RetryPolicy(attempts=2, initial_backoff=0.2, max_backoff=1.0, deadline=30.0)
    # gs:// and az://: the Secret's key when there is one, else the operator's own workload identity, which
    # goes to the cloud's own endpoints only (``anonymous`` otherwise: see cloud_sources).
    gcs = GcsSettings(
        endpoint_url=spec.gcs.endpoint if spec.gcs else None,
        credentials_json=str(cloud) if isinstance(cloud, GcsKey) else None,
        anonymous=anonymous and not isinstance(cloud, GcsKey),
    )
    azure = AzureSettings(
        endpoint_url=spec.azure.endpoint if spec.azure else None,
        credentials=cloud if isinstance(cloud, AzureCredentials) else None,
        anonymous=anonymous and not isinstance(cloud, AzureCredentials),
    )
    addresses = AddressPolicy(allowed=tuple(networks), setting="sourceNetworks (--source-networks)")
    return SourceSettings(
        http=HttpSettings(headers=headers, addresses=addresses),
        s3=s3_settings,
        retry=retry,
        gcs=gcs,
        azure=azure,
        **hubs.source_settings(spec, access),
    )
