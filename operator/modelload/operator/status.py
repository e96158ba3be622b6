"""The ModelLoad's status, declared once: what the operator found out about the model and its pods.

The dataclasses give the CRD's ``status`` schema (:func:`status_schema`, rendered by
:mod:`modelload.operator.crd`), so the fields the operator writes are declared and documented once. The spec,
which people write, is :mod:`modelload.operator.schema`; the status is written by the operator only.
"""

# ruff: noqa: RUF009 - prop() returns a dataclasses.field carrying the schema rules
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from modelload.operator._dataschema import openapi, prop

__all__ = ["MESSAGE_MAX_LENGTH", "Condition", "FleetStatus", "ModelLoadStatus", "PodsStatus", "status_schema"]

MESSAGE_MAX_LENGTH = 32768
"""The longest condition message the CRD admits: the API server refuses a status with a longer one whole."""


@dataclass(frozen=True)
class Condition:
    """One observation about the resource, in the Kubernetes convention (metav1.Condition)."""

    type: str = prop(
        doc="Ready (the model's index was read), PodsReady (every injected pod loaded it) or PodsScheduled "
        "(False while injected pods wait for a node that can take them)."
    )
    status: str = prop(doc="True, False or Unknown.", enum=("True", "False", "Unknown"))
    reason: str = prop(doc="A CamelCase reason: Resolved, BadSource, SecretNotFound, SourceUnreadable...")
    last_transition_time: str = prop(doc="When the status last changed.", format="date-time")
    message: str = prop(
        doc="What happened and what to do, for people.", default="", max_length=MESSAGE_MAX_LENGTH
    )
    observed_generation: int | None = prop(doc="The generation this condition describes.", default=None)


@dataclass(frozen=True)
class PodsStatus:
    """The pods that asked for this model, as their sidecars report through the pods' own status."""

    injected: int = prop(doc="Pods carrying the sidecar and not terminating.", default=0, minimum=0)
    serving: int = prop(
        doc="With spec.peers: pods whose sidecar runs and serves what it holds to the other pods (loading "
        "ones included).",
        default=0,
        minimum=0,
    )
    loading: int = prop(
        doc="Pods whose sidecar runs and has not loaded every tensor yet.", default=0, minimum=0
    )
    ready: int = prop(doc="Pods whose sidecar reports every tensor in.", default=0, minimum=0)
    failed: int = prop(
        doc="Pods whose sidecar crashed, cannot start, or whose pod failed.", default=0, minimum=0
    )
    unschedulable: int = prop(
        doc="Pending pods no node can take (for example none with enough free huge pages); the "
        "PodsScheduled condition says why.",
        default=0,
        minimum=0,
    )
    outdated: int = prop(
        doc="Pods injected for an earlier generation of the spec: their sidecar loads what the spec named "
        "then (its source, its options), not what it names now. Restart them (kubectl rollout restart) to "
        "get the current model.",
        default=0,
        minimum=0,
    )
    last_load_seconds: float | None = prop(
        doc="Seconds from sidecar start to pod Ready for the most recent pod that got ready.", default=None
    )
    median_load_seconds: float | None = prop(doc="Median of that time over the ready pods.", default=None)
    last_throughput_bytes_per_second: int | None = prop(
        doc="Model bytes divided by lastLoadSeconds.", default=None
    )


@dataclass(frozen=True)
class FleetStatus:
    """With spec.peers: what the serving pods' sidecars moved, summed over the pods serving now."""

    pods: int = prop(doc="Serving pods with an IP that the operator asked for their peer stats.", minimum=0)
    reporting: int = prop(
        doc="Of those, the pods that answered (the others: unreachable, too slow, or refusing the token).",
        minimum=0,
    )
    origin_bytes: int = prop(doc="Tensor bytes the reporting pods read from the origin.", minimum=0)
    peer_bytes: int = prop(doc="Tensor bytes the reporting pods took from peers.", minimum=0)
    served_bytes: int = prop(doc="Bytes the reporting pods served to peers.", minimum=0)
    mismatches: int = prop(
        doc="Tensors from peers that failed verification and were read again from the origin.", minimum=0
    )
    updated: str = prop(
        doc="When these figures last changed (the operator asks every fleet interval and writes on change). "
        "They are the live fleet's: a pod that left stops counting, a restarted sidecar starts at zero.",
        format="date-time",
    )


@dataclass(frozen=True)
class ModelLoadStatus:
    """What the operator found out about the model and the pods that use it."""

    phase: str | None = prop(
        doc="Pending (not read yet), Ready (index read: pods are admitted), Retrying (a transient error, "
        "retried with backoff) or Failed (fix the spec, the Secret or the file).",
        default=None,
        enum=("Pending", "Ready", "Retrying", "Failed"),
    )
    observed_generation: int | None = prop(doc="The spec generation the status describes.", default=None)
    conditions: list[Condition] | None = prop(doc="Ready, PodsReady and PodsScheduled.", default=None)
    format: str | None = prop(doc="The detected format.", default=None, enum=("tensorizer", "safetensors"))
    format_version: int | None = prop(doc="The format's data version.", default=None)
    tensors: int | None = prop(doc="Number of tensors.", default=None, minimum=0)
    bytes: int | None = prop(doc="Bytes of all tensors in memory.", default=None, minimum=0)
    size: str | None = prop(doc="bytes, for people (e.g. 15.0 GiB).", default=None)
    file_bytes: int | None = prop(
        doc="Size of the model's weight files at the source.", default=None, minimum=0
    )
    files: int | None = prop(
        doc="Number of weight files (1 for a single file, the shards of a directory).",
        default=None,
        minimum=0,
    )
    encrypted: bool | None = prop(doc="Whether the file's tensors are encrypted.", default=None)
    segment_bytes: int | None = prop(
        doc="An upper bound of what the sidecar writes in the pod's volume: the segment (data, alignment, "
        "manifest) and, for a directory, its small files.",
        default=None,
        minimum=0,
    )
    volume_size_limit: str | None = prop(
        doc="The sizeLimit the webhook gives the pods' volume.", default=None
    )
    resolved_at: str | None = prop(doc="When the index was last read.", default=None, format="date-time")
    pods: PodsStatus | None = prop(doc="The pods that asked for this model.", default=None)
    fleet: FleetStatus | None = prop(
        doc="With spec.peers: the serving pods' origin bytes against peer bytes.", default=None
    )


def status_schema() -> dict[str, Any]:
    return openapi(ModelLoadStatus)
