"""What an artifact's layers hold, by media type: the ModelPack, KitOps and Docker model conventions.

- CNCF ModelPack (``application/vnd.cncf.model.*``, earlier ``application/vnd.cnai.model.*``): the manifest's
  ``artifactType`` is ``...model.manifest.v1+json``, its config ``...model.config.v1+json``; each layer is a
  ``weight``, ``weight.config`` (config.json, tokenizer), ``doc``, ``code`` or ``dataset`` layer, as ``.raw``
  (the file itself), ``.tar``, ``.tar+gzip`` or ``.tar+zstd``. A layer's file path is its
  ``org.cncf.model.filepath`` annotation.
- KitOps ModelKits (``application/vnd.kitops.modelkit.*``): ``model``, ``modelpart``, ``code``, ``dataset``,
  ``docs``, ``prompts`` layers, each a tar (``.tar``, or compressed ``+gzip`` / ``+zstd``).
- Docker model artifacts (``application/vnd.docker.ai.*``): ``safetensors`` and ``gguf.v3`` layers are the
  files themselves, named by ``org.opencontainers.image.title``; ``vllm.config.tar`` and ``dir.tar`` are tars.
- Anything else with a title (what ``oras push FILE`` makes): the file itself; oras labels a plain file
  ``application/vnd.oci.image.layer.v1.tar`` by default, so a "tar" layer whose first block is not a tar
  header is read as the file it is.

Compressed layers cannot be read by range: one that holds weights or their configuration is refused, with
how to push a rangeable one; documentation, code and datasets are not needed for a load and are skipped.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

__all__ = [
    "ANNOTATION_FILEPATH",
    "ANNOTATION_TITLE",
    "ARTIFACT_MODELPACK",
    "CONFIG_MODELPACK",
    "MANIFEST_TYPES",
    "INDEX_TYPES",
    "LayerKind",
    "classify",
]

ARTIFACT_MODELPACK = "application/vnd.cncf.model.manifest.v1+json"
CONFIG_MODELPACK = "application/vnd.cncf.model.config.v1+json"
WEIGHT_RAW = "application/vnd.cncf.model.weight.v1.raw"
WEIGHT_CONFIG_RAW = "application/vnd.cncf.model.weight.config.v1.raw"
DOC_RAW = "application/vnd.cncf.model.doc.v1.raw"
ANNOTATION_FILEPATH = "org.cncf.model.filepath"
ANNOTATION_TITLE = "org.opencontainers.image.title"
ANNOTATION_FILE_METADATA = "org.cncf.model.file.metadata+json"
OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
DOCKER_MANIFEST = "application/vnd.docker.distribution.manifest.v2+json"
MANIFEST_TYPES = (OCI_MANIFEST, DOCKER_MANIFEST)
INDEX_TYPES = (
    "application/vnd.oci.image.index.v1+json",
    "application/vnd.docker.distribution.manifest.list.v2+json",
)

Shape = Literal["raw", "tar", "compressed"]
_SKIPPED_ROLES = ("doc", "docs", "code", "dataset", "prompts", "license")
_RAW_DOCKER = ("safetensors", "gguf.v3", "license", "chat.template.jinja", "model.file", "mmproj", "dduf")


@dataclass(frozen=True)
class LayerKind:
    """How a layer is read: ``raw`` (the file), ``tar`` (files inside, by offset) or ``compressed``; and
    whether a load needs it (weights and their configuration) or may skip it (docs, code, datasets)."""

    shape: Shape
    needed: bool
    sniff: bool = False
    """A generic "tar" type that may be a plain file (oras's default): look at the first block."""


def classify(media_type: str) -> LayerKind:
    """The :class:`LayerKind` of a layer's media type (see the module docstring)."""
    media = media_type.lower()
    compressed = any(mark in media for mark in ("+gzip", "+zstd", ".gzip", ".zstd", "tar.gz"))
    role = _role(media)
    needed = role not in _SKIPPED_ROLES
    if compressed:
        return LayerKind("compressed", needed)
    if media.startswith("application/vnd.docker.ai."):
        rest = media.removeprefix("application/vnd.docker.ai.")
        if rest.endswith(".tar"):
            return LayerKind("tar", needed)
        return LayerKind("raw", needed or rest in _RAW_DOCKER)
    if media.endswith(".raw"):
        return LayerKind("raw", needed)
    if media.endswith((".tar", "+tar")):
        generic = media.startswith("application/vnd.oci.image.layer.") or media.endswith("+tar")
        return LayerKind("tar", needed, sniff=generic)
    return LayerKind("raw", needed)


def _role(media: str) -> str:
    """``weight``, ``weight.config``, ``doc``, ``model``... from a ModelPack, KitOps or Docker media type."""
    for prefix in (
        "application/vnd.cncf.model.",
        "application/vnd.cnai.model.",
        "application/vnd.kitops.modelkit.",
        "application/vnd.docker.ai.",
    ):
        if media.startswith(prefix):
            rest = media.removeprefix(prefix)
            return rest.split(".v1", 1)[0].split(".v3", 1)[0]
    return "file"
