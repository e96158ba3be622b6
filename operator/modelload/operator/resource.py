"""Reading ModelLoad objects as the webhook and the pod aggregation need them.

A pod asks for a model by label value; :func:`label_value` says which value a ModelLoad answers to, and
:class:`ResolvedModel` is a ModelLoad whose index has been read (the webhook cannot size a pod without it).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from modelload.loader.errors import ConfigError, ModelloadError
from modelload.operator.schema import MODEL_LABEL, ModelLoadSpec, parse_spec

__all__ = [
    "LabelTakenError",
    "NotResolvedError",
    "ResolvedModel",
    "answering",
    "check_label_free",
    "check_selectable",
    "label_value",
    "precedence",
]

LABEL_VALUE_MAX = 63
"""The longest label value Kubernetes accepts; a ModelLoad's name may run to 253 characters."""


class NotResolvedError(ModelloadError):
    """The ModelLoad exists but its index has not been read for its current spec; the message says why."""

    kind = "model_not_ready"


def label_value(body: Mapping[str, Any]) -> str:
    """The ``modelload.dev/model`` label value that selects pods for this ModelLoad."""
    spec = body.get("spec") or {}
    value = spec.get("podLabelValue") if isinstance(spec, Mapping) else None
    return str(value) if value else str(body["metadata"]["name"])


class LabelTakenError(ModelloadError):
    """An older ModelLoad of the namespace answers to the same pod label; the message names it. Retried: the
    label frees itself when that one goes or changes its ``spec.podLabelValue``."""

    condition = "LabelTaken"


def precedence(body: Mapping[str, Any]) -> tuple[str, str]:
    """Which of several ModelLoads answering to one label value answers: the oldest (its creationTimestamp,
    RFC 3339 in UTC, orders as text), then the first name. A fixed rule, so the webhook, the resolver and
    the pods' status agree, and a ModelLoad added by mistake beside one in use takes nothing from it."""
    meta = body.get("metadata") or {}
    return str(meta.get("creationTimestamp") or ""), str(meta.get("name") or "")


def answering(items: Sequence[Mapping[str, Any]]) -> Mapping[str, Any]:
    """The ModelLoad of ``items`` (all answering to one label value, at least one) that answers."""
    return min(items, key=precedence)


def check_label_free(body: Mapping[str, Any], others: Iterable[tuple[str, str]]) -> None:
    """Raise :class:`LabelTakenError` when an older ModelLoad answers to ``body``'s label value: pods get
    that one's model, and this one says so rather than showing Ready. ``others``: the :func:`precedence`
    of every ModelLoad of the namespace answering to that value (the operator's index: no API call, so
    resolving every ModelLoad at start-up costs no list of the namespace each)."""
    mine = precedence(body)
    first = min([*others, mine])
    if first != mine:
        name, value = first[1], label_value(body)
        raise LabelTakenError(
            f"ModelLoad {name!r}, older, already answers to pods labelled {MODEL_LABEL}={value}: they get "
            f"its model, not this one's. Give this one another spec.podLabelValue, or delete {name!r} (this "
            "one then takes the label)"
        )


def check_selectable(body: Mapping[str, Any]) -> None:
    """Raise :class:`ConfigError` for a ModelLoad no pod can ask for: a name longer than a label value
    can be, without ``spec.podLabelValue``. Its model would be read and shown Ready while every pod that
    tried to name it would be refused by the API server for its label."""
    value = label_value(body)
    if len(value) > LABEL_VALUE_MAX:
        raise ConfigError(
            f"the ModelLoad's name is {len(value)} characters, and a pod's label {MODEL_LABEL} holds at "
            f"most {LABEL_VALUE_MAX}, so no pod could ask for this model: set spec.podLabelValue (the "
            "value pods will carry), or use a shorter name",
            setting="spec.podLabelValue",
        )


@dataclass(frozen=True)
class ResolvedModel:
    """A ModelLoad whose status carries the model's size: everything a pod's injection is computed from."""

    name: str
    namespace: str
    spec: ModelLoadSpec
    bytes: int
    tensors: int
    segment_bytes: int | None = None
    """The operator's bound on the segment file; None in statuses written before it was reported."""
    generation: int | None = None
    """The ModelLoad's ``metadata.generation``: the spec a pod is injected from (its status describes it)."""

    @classmethod
    def from_body(cls, body: Mapping[str, Any]) -> ResolvedModel:
        """Raises :class:`NotResolvedError` while the status does not describe the current spec, and
        :class:`~modelload.loader.errors.ConfigError` when the spec itself is invalid."""
        meta = body.get("metadata") or {}
        name = str(meta.get("name"))
        status = body.get("status") or {}
        spec = parse_spec(body.get("spec"))
        nbytes, tensors = status.get("bytes"), status.get("tensors")
        phase = status.get("phase") or "Pending"
        if spec.source.startswith("file:") and phase == "Ready":
            nbytes = tensors = 0  # a local model is not read: its volume is spec.volumeSizeLimit
        if not isinstance(nbytes, int) or not isinstance(tensors, int):
            reason = _failing_message(status)
            raise NotResolvedError(f"ModelLoad {name!r} is not ready yet (phase {phase}{reason})")
        generation, observed = meta.get("generation"), status.get("observedGeneration")
        if generation is not None and observed is not None and observed != generation:
            raise NotResolvedError(
                f"ModelLoad {name!r} changed (generation {generation}) and its model has not been re-read "
                f"yet (status describes generation {observed})"
            )
        segment = status.get("segmentBytes")
        return cls(
            name=name,
            namespace=str(meta.get("namespace")),
            spec=spec,
            bytes=nbytes,
            tensors=tensors,
            segment_bytes=segment if isinstance(segment, int) else None,
            generation=generation if isinstance(generation, int) else None,
        )


def _failing_message(status: Mapping[str, Any]) -> str:
    for condition in status.get("conditions") or ():
        if condition.get("type") == "Ready" and condition.get("status") != "True":
            return f": {condition.get('reason')}: {condition.get('message')}"
    return ""
