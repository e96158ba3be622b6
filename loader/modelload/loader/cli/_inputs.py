"""What ``modelload serialize`` reads: SRC as a sequence of tensors, whatever it is.

A safetensors or tensorizer file (through the formats' one reader protocol, verified and decrypted), a model
directory's weight files read one after another as one model, or a torch checkpoint mapped by torch. Every
input lists its tensors first (:class:`Item`: name, dtype, shape, known before any bytes are read), then
hands out one tensor's bytes at a time (:meth:`Input.read`), so a conversion holds one tensor in memory.
The decisions on torch checkpoints (which dict is the state dict, flattened names, skipped values) are in
the serialize command's docstring.
"""

from __future__ import annotations

import bisect
import contextlib
import itertools
import pickle
import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Protocol

import numpy as np

from modelload.loader import dtypes
from modelload.loader.cli._common import (
    local_model_files,
    open_model_file,
    open_weight_files,
    sniff,
    translate_os_error,
)
from modelload.loader.dtypes import DType
from modelload.loader.errors import ConfigError, DuplicateNameError, FormatError, UnsupportedDtypeError
from modelload.loader.formats import ModelReader
from modelload.loader.formats.tensorizer import DecryptionKey

__all__ = [
    "STATE_DICT_KEYS",
    "DirectoryInput",
    "FileInput",
    "Input",
    "Item",
    "Subset",
    "TorchInput",
    "open_input",
]

STATE_DICT_KEYS = ("state_dict", "model_state_dict", "model", "module", "weights", "params", "net")
"""Keys under which training checkpoints commonly keep the model's state dict, tried in this order."""


@dataclass(frozen=True)
class Item:
    """One tensor to convert, known before its bytes are read."""

    name: str
    dtype: DType
    shape: tuple[int, ...]
    path: tuple[str | int, ...] | None = None
    """A tensorizer structured name, kept when writing tensorizer."""
    kind: Literal["param", "buffer", "state_dict"] = "state_dict"

    @property
    def nbytes(self) -> int:
        return self.dtype.nbytes(self.shape)


class Input(Protocol):
    items: Sequence[Item]
    metadata: dict[str, str] | None
    notes: list[str]

    @property
    def copies(self) -> bool:
        """Whether :meth:`read` fills the scratch buffer (which must then hold the largest tensor)."""
        ...

    def read(self, index: int, scratch: np.ndarray[Any, Any]) -> tuple[np.ndarray[Any, Any], int]:
        """Tensor ``index``'s bytes as a flat uint8 array (in ``scratch`` or a view of the source), and its
        tensorizer module index (0 when the source has none)."""
        ...


@dataclass
class FileInput:
    """A safetensors or tensorizer file, read tensor by tensor into a scratch buffer (verified, decrypted)."""

    reader: ModelReader
    items: Sequence[Item]
    metadata: dict[str, str] | None
    notes: list[str]
    copies = True

    def read(self, index: int, scratch: np.ndarray[Any, Any]) -> tuple[np.ndarray[Any, Any], int]:
        entry = self.reader.index.tensors[index]
        out = scratch[: entry.nbytes]
        header = self.reader.readinto(entry, out)
        return out, header.module_idx if header is not None else 0


@dataclass
class TorchInput:
    """The tensors of a torch checkpoint, mapped from the file by torch."""

    tensors: list[Any]
    items: Sequence[Item]
    metadata: dict[str, str] | None
    notes: list[str]
    copies = False

    def read(self, index: int, scratch: np.ndarray[Any, Any]) -> tuple[np.ndarray[Any, Any], int]:
        import torch

        tensor = self.tensors[index].detach()
        plain = tensor.resolve_conj().resolve_neg().contiguous()
        flat: np.ndarray[Any, Any] = plain.reshape(-1).view(torch.uint8).numpy()
        return flat, 0


@dataclass
class DirectoryInput:
    """A model directory's weight files, read one after the other as one model."""

    parts: list[FileInput]
    items: Sequence[Item]
    metadata: dict[str, str] | None
    notes: list[str]
    _starts: list[int]

    copies = True

    def read(self, index: int, scratch: np.ndarray[Any, Any]) -> tuple[np.ndarray[Any, Any], int]:
        part = bisect.bisect_right(self._starts, index) - 1
        return self.parts[part].read(index - self._starts[part], scratch)


@contextlib.contextmanager
def _open_directory(
    src: Path, key: DecryptionKey | None, *, verify: bool, source_format: str
) -> Iterator[DirectoryInput]:
    chosen = local_model_files(src, format=source_format, flag="--from")
    with open_weight_files(src, chosen.weights, key, verify=verify) as (readers, _):  # names unique
        parts = []
        for name, reader in zip(chosen.weights, readers, strict=True):
            items = [Item(t.name, t.dtype, t.shape, t.path, t.kind) for t in reader.index.tensors]
            parts.append((name, FileInput(reader, items, dict(reader.index.metadata) or None, [])))
        starts = list(itertools.accumulate((len(part.items) for _, part in parts), initial=0))[:-1]
        notes = [f"merging {len(parts)} weight files of {src}; its config and tokenizer are not copied"]
        yield DirectoryInput(
            [part for _, part in parts],
            [item for _, part in parts for item in part.items],
            parts[0][1].metadata,
            notes,
            starts,
        )


@contextlib.contextmanager
def open_input(
    src: Path,
    *,
    source_format: str,
    key: DecryptionKey | None,
    verify: bool,
    state_dict_key: str | None,
) -> Iterator[FileInput | TorchInput | DirectoryInput]:
    """SRC opened as its format's reader (torch checkpoints mapped by torch), closed after the block."""
    if src.is_dir() and source_format in ("auto", "safetensors", "tensorizer"):
        with _open_directory(src, key, verify=verify, source_format=source_format) as directory:
            yield directory
        return
    kind = sniff(src) if source_format == "auto" else source_format
    if kind == "segment":
        raise ConfigError(
            f"{src} is a modelload segment, not a model file; `modelload inspect` shows what it holds"
        )
    if key is not None and kind != "tensorizer":
        raise ConfigError(
            f"a key or password was given, but {src} is a {kind} file, which is never encrypted; drop it"
        )
    if state_dict_key is not None and kind != "torch":
        raise ConfigError(f"--state-dict-key applies to torch checkpoints; {src} is a {kind} file")
    if kind == "torch":
        yield _open_torch(src, state_dict_key)
        return
    with open_model_file(src, kind, key, verify=verify) as reader:
        index = reader.index
        items = [Item(t.name, t.dtype, t.shape, t.path, t.kind) for t in index.tensors]
        yield FileInput(reader, items, dict(index.metadata) or None, [])


def _open_torch(path: Path, key: str | None) -> TorchInput:
    try:
        import torch
    except ImportError:
        raise ConfigError(
            f"{path} is a torch checkpoint, and reading one needs torch: install it (pip install "
            "'modelload[torch]'), or convert the checkpoint where torch is installed"
        ) from None
    loaded = _torch_load(torch, path)
    found, notes = _state_dict(loaded, key, torch)
    tensors: list[Any] = []
    items: list[Item] = []
    storages: dict[int, list[str]] = {}
    for name, tensor in found.items():
        if tensor.layout != torch.strided or tensor.is_meta:
            what = "on the meta device" if tensor.is_meta else f"{tensor.layout}"
            raise UnsupportedDtypeError(
                f"tensor {name!r} is {what}, which has no plain bytes to store; materialize it (.to_dense())"
            )
        try:
            dtype = dtypes.from_torch(tensor.dtype)
        except UnsupportedDtypeError as exc:
            raise UnsupportedDtypeError(f"tensor {name!r}: {exc}", source=str(path)) from None
        tensors.append(tensor)
        items.append(Item(name, dtype, tuple(int(d) for d in tensor.shape)))
        if tensor.numel():
            storages.setdefault(tensor.untyped_storage().data_ptr(), []).append(name)
    for names in storages.values():
        if len(names) > 1:
            shown = ", ".join(repr(n) for n in names[:4]) + (", ..." if len(names) > 4 else "")
            notes.append(f"tensors {shown} share storage (tied weights): each is written as its own copy")
    return TorchInput(tensors, items, None, notes)


def _torch_load(torch: Any, path: Path) -> Any:
    try:
        with path.open("rb") as file:
            # torch.load hands a path ending in .safetensors to the safetensors package, whatever the file
            # holds; this one was told a torch checkpoint by its content, so torch reads it by another name
            # of the same file (a path still: mmap needs one)
            target = f"/proc/self/fd/{file.fileno()}" if path.name.endswith(".safetensors") else path

            def load(mmap: bool) -> Any:
                return torch.load(target, weights_only=True, map_location="cpu", mmap=mmap)

            try:
                return load(mmap=True)
            except RuntimeError as exc:
                if "mmap can only be used" not in str(exc):
                    raise
                return load(mmap=False)  # the legacy (pre-1.6) format cannot be mapped: read it whole
    except OSError as exc:
        raise translate_os_error(exc, path) from None
    except pickle.UnpicklingError as exc:
        found = re.search(r"Unsupported global: GLOBAL ([\w.]+)", str(exc))
        detail = f" (it refers to {found.group(1)})" if found else ""
        raise FormatError(
            "the checkpoint holds Python objects besides tensors, and modelload loads checkpoints with "
            f"weights_only=True so that no code in them runs{detail}; re-save just the weights: "
            "torch.save(model.state_dict(), path)",
            source=str(path),
        ) from None
    except (RuntimeError, EOFError, ValueError) as exc:
        first = str(exc).split(". ")[0].splitlines()[0] if str(exc) else type(exc).__name__
        raise FormatError(
            f"torch cannot load this checkpoint ({first}); it may be truncated or not a checkpoint",
            source=str(path),
        ) from None


def _state_dict(loaded: Any, key: str | None, torch: Any) -> tuple[dict[str, Any], list[str]]:
    """The flat ``{name: tensor}`` of a loaded checkpoint, and notes on what was chosen or skipped."""
    notes: list[str] = []
    chosen: Any = loaded
    if key is not None:
        for part in key.split("."):
            if not isinstance(chosen, Mapping) or part not in chosen:
                keys = ", ".join(repr(k) for k in list(chosen)[:10]) if isinstance(chosen, Mapping) else ""
                raise ConfigError(f"--state-dict-key {key!r}: no key {part!r} in the checkpoint ({keys})")
            chosen = chosen[part]
    elif isinstance(loaded, Mapping) and not any(isinstance(v, torch.Tensor) for v in loaded.values()):
        holders = [k for k, v in loaded.items() if _holds_tensors(v, torch)]
        common = [k for k in STATE_DICT_KEYS if k in holders]
        pick = common[0] if common else (holders[0] if len(holders) == 1 else None)
        if pick is not None:
            chosen = loaded[pick]
            notes.append(f"using the state dict under the checkpoint's key {pick!r}")
    if isinstance(chosen, torch.Tensor):
        raise FormatError("the checkpoint holds a single tensor, not a state dict; save it in a dict")
    found: dict[str, Any] = {}
    skipped: list[str] = []
    for name, value in _flatten(chosen, ()):
        if not isinstance(value, torch.Tensor):
            skipped.append(name)
        elif name in found:
            raise DuplicateNameError(f"two tensors flatten to the name {name!r}; rename one")
        else:
            found[name] = value
    if skipped:
        shown = ", ".join(skipped[:5]) + (", ..." if len(skipped) > 5 else "")
        notes.append(f"skipped {len(skipped)} entries that are not tensors: {shown}")
    if not found:
        raise FormatError("the checkpoint holds no tensors")
    return found, notes


def _holds_tensors(value: Any, torch: Any) -> bool:
    return any(isinstance(leaf, torch.Tensor) for _, leaf in _flatten(value, ()))


def _flatten(value: Any, prefix: tuple[str, ...]) -> Iterator[tuple[str, Any]]:
    """(dotted name, leaf) for every leaf of nested dicts, lists and tuples."""
    if isinstance(value, Mapping):
        children: Iterator[tuple[Any, Any]] = iter(value.items())
    elif isinstance(value, list | tuple):
        children = enumerate(value)
    else:
        yield ".".join(prefix), value
        return
    for key, child in children:
        yield from _flatten(child, (*prefix, str(key)))


class Subset:
    """Some tensors of an input, read through it."""

    def __init__(self, source: FileInput | TorchInput | DirectoryInput, indices: list[int]) -> None:
        self.source = source
        self.indices = indices
        self.items: Sequence[Item] = [source.items[i] for i in indices]
        self.metadata: dict[str, str] | None = {"format": "pt"}
        self.notes: list[str] = []

    @property
    def copies(self) -> bool:
        return self.source.copies

    def read(self, index: int, scratch: np.ndarray[Any, Any]) -> tuple[np.ndarray[Any, Any], int]:
        return self.source.read(self.indices[index], scratch)
