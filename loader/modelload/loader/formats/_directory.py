"""A model directory: which of its files are weights, which are small files an engine reads, and one index.

A Hugging Face checkpoint is a directory: weight shards (``model-00001-of-00004.safetensors`` ...) with
``model.safetensors.index.json`` naming the shard of every tensor, beside ``config.json``,
``generation_config.json``, tokenizer files and a chat template. modelload loads the weights of all shards
into one segment and copies every small file into a *model directory* beside it, which the app hands its
engine as the model path. This module decides, from file names alone (and the index's bytes), which file is
which, and merges the shards' indexes into one; it does no I/O, so the sidecar (over S3 and HTTP), the
operator and ``modelload stage`` (a local directory) share it.

The rules:

- **Weights.** With ``model.safetensors.index.json``, exactly the shards its ``weight_map`` names (a shard
  it names that the directory lacks is an error; other ``*.safetensors`` files, such as a
  ``consolidated.safetensors`` kept beside the shards, are ignored). Without it, every top-level
  ``*.safetensors`` file; for tensorizer, every ``*.tensors`` file. Both kinds in one directory without a
  format to choose is an error.
- **Small files.** Top-level files named ``*.json``, ``*.txt``, ``*.model``, ``*.jinja``, ``*.tiktoken`` and
  ``*.py`` (remote code, which engines run only when asked to trust it), each at most
  :data:`SMALL_FILE_LIMIT` bytes and all together at most :data:`SMALL_FILES_LIMIT`. They are copied, never
  the weights.
- Everything else (``*.bin`` and ``*.pth`` checkpoints, ``*.gguf``, files in subdirectories) is ignored.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from modelload.loader.errors import ConfigError, DuplicateNameError, FormatError, SourceNotFoundError
from modelload.loader.formats._fast_json import fast_loads
from modelload.loader.formats._index import ModelIndex, TensorTable, has_repeats

__all__ = [
    "SAFETENSORS_INDEX",
    "SMALL_FILES_LIMIT",
    "SMALL_FILE_LIMIT",
    "SMALL_FILE_SUFFIXES",
    "WELL_KNOWN_SMALL_FILES",
    "ModelFiles",
    "check_file_name",
    "check_small_files",
    "merge_indexes",
    "select_model_files",
]

SAFETENSORS_INDEX = "model.safetensors.index.json"
SMALL_FILE_LIMIT = 64 << 20
"""The largest small file, in bytes. The largest tokenizer files in use are tens of MiB; a bigger ``.json``
is more likely data than configuration, and would be charged to the pod's memory volume."""
SMALL_FILES_LIMIT = 256 << 20
"""The most bytes of small files a model directory holds."""
SMALL_FILE_SUFFIXES = (".json", ".txt", ".model", ".jinja", ".tiktoken", ".py")
WELL_KNOWN_SMALL_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
    "preprocessor_config.json",
)
"""What an HTTP(S) directory, which has no listing, is probed for (each may be absent)."""

_MAX_FILES = 65536
_SAFE_NAME = re.compile(r"^[^/\\\x00-\x1f]+$")

WeightFormat = Literal["tensorizer", "safetensors"]


@dataclass(frozen=True)
class ModelFiles:
    """A model directory's files by role, each a name relative to the directory."""

    format: WeightFormat
    weights: tuple[str, ...]
    """Weight files, in load order: sorted by name (the shards an index names, else the directory's)."""
    small: tuple[str, ...]
    """Files copied into the model directory."""
    ignored: tuple[str, ...]


def check_file_name(name: str, *, where: str) -> str:
    """Refuse a file name that could leave the model directory or does not print (``../x``, ``a/b``)."""
    if name in ("", ".", "..") or not _SAFE_NAME.match(name):
        raise FormatError(f"{where} names a file {name!r} that is not a plain file name", source=where)
    return name


def weight_shards(index_json: bytes, *, where: str) -> tuple[str, ...]:
    """The shard names ``model.safetensors.index.json`` maps tensors to, sorted (see :func:`_shards_of`).

    The names are made afresh once the parsed document is gone: the parser's own strings lie one among
    every few hundred tensors' names, and keeping them kept the memory of the whole document (20 MiB at
    100,000 tensors) from going back."""
    # None of them holds a NUL (check_file_name refuses one), so one joined string carries them out.
    return tuple(_joined_shards(index_json, where=where).split("\0"))


def _joined_shards(index_json: bytes, *, where: str) -> str:
    if fast_loads is not None:
        try:
            return _shards_of(fast_loads(index_json), where=where)
        except (ValueError, FormatError):  # said from the json module's reading (see _fast_json)
            pass
    try:
        document = json.loads(index_json)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise FormatError(f"{where} is not valid JSON ({type(exc).__name__})", source=where) from None
    return _shards_of(document, where=where)


def _shards_of(document: Any, *, where: str) -> str:
    weight_map = document.get("weight_map") if isinstance(document, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise FormatError(f"{where} has no weight_map naming the shard of each tensor", source=where)
    if set(map(type, weight_map.values())) != {str}:
        tensor, shard = next((t, s) for t, s in weight_map.items() if not isinstance(s, str))
        raise FormatError(f"{where} maps tensor {tensor!r} to {shard!r}, not a file name", source=where)
    # By name, each checked once: a writer numbers its shards in the order it wrote the modules
    # (model-00001-of-00004 holds the embeddings and the first layers), while the weight_map lists tensors
    # by name ("lm_head.weight" first, then "model.layers.10" before "model.layers.2"), so the order of
    # first appearance loaded the last shard first.
    shards = tuple(sorted(set(weight_map.values())))
    for shard in shards:
        check_file_name(shard, where=where)
    return "\0".join(shards)


def select_model_files(
    names: Iterable[str],
    *,
    where: str,
    index_json: bytes | None = None,
    format: Literal["auto", "tensorizer", "safetensors"] = "auto",  # noqa: A002 - the CLI\'s word for it
    choose_with: str = "--format (a ModelLoad's spec.format)",
    shards: Sequence[str] | None = None,
) -> ModelFiles:
    """Sort a directory's top-level file ``names`` into weights, small files and ignored ones.

    ``index_json`` is the content of ``model.safetensors.index.json`` when the directory has one, and
    ``shards`` what :func:`weight_shards` read from it where the caller has already (a directory without a
    listing is known by them): an index of 100,000 tensors is parsed once. ``where`` names the directory in
    errors, ``choose_with`` the setting that picks one format where both are there.

    >>> select_model_files(["config.json", "model.safetensors", "README.md"], where="d").weights
    ('model.safetensors',)
    """
    listed = sorted(set(names))
    if len(listed) > _MAX_FILES:
        raise ConfigError(f"{where} holds {len(listed)} files, more than {_MAX_FILES}: is it a model?")
    safetensors = [n for n in listed if n.endswith(".safetensors")]
    tensorizer = [n for n in listed if n.endswith(".tensors")]
    named = format
    if format == "auto":
        if safetensors and tensorizer:
            raise ConfigError(
                f"{where} holds both safetensors and tensorizer weights: choose one with {choose_with}"
            )
        format = "tensorizer" if tensorizer else "safetensors"  # noqa: A001
    if format == "safetensors" and index_json is not None:
        if shards is None:
            shards = weight_shards(index_json, where=f"{where}{SAFETENSORS_INDEX}")
        weights = tuple(shards)
        missing = [w for w in weights if w not in listed]
        if missing:
            raise SourceNotFoundError(
                f"{SAFETENSORS_INDEX} in {where} names {len(missing)} shard(s) the directory does not have "
                f"({', '.join(missing[:3])}): upload every shard, or fix the index",
                uri=f"{where}{missing[0]}",
            )
    else:
        weights = tuple(safetensors if format == "safetensors" else tensorizer)
    if not weights and named != "auto" and (safetensors or tensorizer):
        other = "tensorizer" if tensorizer else "safetensors"
        raise ConfigError(
            f"{where} holds no {named} weight files, only {other} ones: set {choose_with} to {other} or auto"
        )
    if not weights:
        _refuse_other_weights(listed, where=where)
        raise ConfigError(
            f"{where} holds no weight files (*.safetensors, or *.tensors for tensorizer): point the source "
            "at the model's directory (for S3 a prefix ending in /), or at one weight file"
        )
    for name in weights:
        check_file_name(name, where=where)
    chosen = set(weights)
    small = tuple(
        n
        for n in listed
        if n not in chosen
        and n.endswith(SMALL_FILE_SUFFIXES)
        and _SAFE_NAME.match(n)
        and n not in (".", "..")
    )
    ignored = tuple(n for n in listed if n not in chosen and n not in small)
    return ModelFiles(format=format, weights=weights, small=small, ignored=ignored)


PICKLED_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt")
"""Torch checkpoints (pickles) by their usual names: ``modelload serialize`` converts them."""
UNREAD_SUFFIXES = (".gguf", ".h5", ".msgpack", ".onnx", ".ggml")
"""Weights in formats modelload does not read at all."""


def _refuse_other_weights(listed: Sequence[str], *, where: str) -> None:
    """A folder without safetensors or tensorizer weights that holds weights of another kind: name them and
    say how to convert them, rather than to point at the model's folder, which the user did."""
    pickled = [n for n in listed if n.lower().endswith(PICKLED_SUFFIXES)]
    unread = [n for n in listed if n.lower().endswith(UNREAD_SUFFIXES)]
    if not pickled and not unread:
        return
    held = ", ".join((pickled + unread)[:4]) + (", ..." if len(pickled) + len(unread) > 4 else "")
    if len(pickled) == 1 and "://" not in where:
        stem = "model" if pickled[0].startswith("pytorch_model") else pickled[0].rsplit(".", 1)[0]
        how = f"convert it: modelload serialize {where}{pickled[0]} {where}{stem}.safetensors"
    elif pickled:
        how = (
            "convert them where they are (modelload serialize FILE.bin FILE.safetensors, or transformers' "
            "save_pretrained(..., safe_serialization=True)) and load the safetensors"
        )
    else:
        how = "modelload reads safetensors and tensorizer weights only: export the model to safetensors"
    raise ConfigError(f"{where} holds no safetensors or tensorizer weights, only {held}: {how}")


def check_small_files(sizes: Mapping[str, int], *, where: str) -> None:
    """Refuse a small file over :data:`SMALL_FILE_LIMIT`, or small files over :data:`SMALL_FILES_LIMIT`."""
    for name, size in sizes.items():
        if size > SMALL_FILE_LIMIT:
            raise ConfigError(
                f"{where}{name} is {size} bytes, over the {SMALL_FILE_LIMIT >> 20} MiB limit for a model's "
                "small files (config, tokenizer): remove it from the model directory, or rename it so that "
                f"it does not end in {', '.join(SMALL_FILE_SUFFIXES)}"
            )
    total = sum(sizes.values())
    if total > SMALL_FILES_LIMIT:
        raise ConfigError(
            f"the small files of {where} add up to {total} bytes, over the {SMALL_FILES_LIMIT >> 20} MiB "
            "limit: keep only what the engine reads (config, tokenizer) beside the weights"
        )


def _refuse_repeated_name(indexes: Sequence[tuple[str, ModelIndex]], where: str) -> None:
    seen: dict[str, str] = {}
    for name, index in indexes:
        for tensor in index.table.names:
            other = seen.setdefault(tensor, name)
            if other != name:
                raise DuplicateNameError(
                    f"tensor {tensor!r} is in both {other} and {name} in {where}: shards must not "
                    "overlap (is an old shard left beside new ones?)",
                    source=f"{where}{name}",
                )
    raise DuplicateNameError(f"{where} names a tensor twice in one weight file", source=where)


def merge_indexes(indexes: Sequence[tuple[str, ModelIndex]], *, where: str) -> ModelIndex:
    """One index over several weight files: each tensor remembers its file (``TensorEntry.file``), the
    files' columns joined (no object per tensor).

    Tensor names must be unique across files (a name in two shards is an error naming both); every file
    must be of one format, and encrypted or not alike.
    """
    if not indexes:
        raise ConfigError(f"{where} holds no weight files")
    if len(indexes) == 1 and not indexes[0][0]:
        return indexes[0][1]
    first = indexes[0][1]
    for name, index in indexes:
        if index.format != first.format:
            raise FormatError(
                f"{where}{name} is {index.format} and {where}{indexes[0][0]} is {first.format}: "
                "a model's weight files must share one format",
                source=f"{where}{name}",
            )
        if index.encrypted != first.encrypted:
            raise FormatError(
                f"{where}{name} and {where}{indexes[0][0]} differ in encryption: encrypt every shard or none",
                source=f"{where}{name}",
            )
    tensors = TensorTable.concat([index.table for _, index in indexes], files=range(len(indexes)))
    if has_repeats(tensors.names):
        _refuse_repeated_name(indexes, where)
    return ModelIndex(
        format=first.format,
        version=max(i.version for _, i in indexes),
        tensors=tensors,
        index_length=first.index_length,
        data_end=first.data_end,
        encrypted=first.encrypted,
        metadata=dict(first.metadata),
        files=tuple(name for name, _ in indexes),
    )
