"""``modelload serialize SRC DST``: convert a model to tensorizer or safetensors, tensor by tensor.

SRC is a safetensors file, a tensorizer file (plain or encrypted), a torch checkpoint, recognised by its
content, or a model directory, whose weight shards are merged into DST (its config and tokenizer stay where
they are: DST holds the weights). The reverse, ``--shard-size``, writes DST as a directory of safetensors
shards with ``model.safetensors.index.json``, as ``save_pretrained`` lays a model out. DST's format comes from
``--to`` or its extension. The conversion streams: one tensor's bytes are in memory at a time (a torch
checkpoint is mapped, not read whole), and DST appears only when it is complete (written under a temporary
name and renamed), so an interrupted run leaves no half file behind.

Decisions, for the cases where formats disagree:

- **Torch checkpoints** load with ``torch.load(weights_only=True, mmap=True)``: no code in the file runs. A
  dict whose values include tensors is the state dict; otherwise the first of :data:`STATE_DICT_KEYS`
  that holds tensors, or the only top-level key that does (``--state-dict-key`` names one). Nested dicts and
  lists are flattened with dots (``{"layers": [{"w": t}]}`` gives ``layers.0.w``), the names a flat
  ``state_dict()`` has, in either output format. Values that are not tensors (an epoch counter) are skipped
  and listed. Tensors sharing storage (tied weights) are written as separate copies, as neither format can
  express sharing.
- **Tensorizer to tensorizer** keeps structured names, tensor kinds and module indices. A tensorizer meta
  tensor (a shape without data) is written as zeros.
- **Metadata**: safetensors ``__metadata__`` carries over to safetensors; a torch checkpoint becomes a
  safetensors file with ``{"format": "pt"}`` (what Hugging Face loaders expect). Tensorizer files hold no
  metadata, so it is dropped there, with a note.
"""

from __future__ import annotations

import argparse
import bisect
import contextlib
import itertools
import json
import os
import pickle
import re
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Literal, Protocol

import numpy as np

from modelload.loader import dtypes
from modelload.loader.cli._common import (
    add_decryption_options,
    atomic_output,
    decryption_key,
    local_model_files,
    open_model_file,
    rate,
    read_password,
    read_secret,
    sniff,
    translate_os_error,
)
from modelload.loader.cli.progress import ProgressBar
from modelload.loader.dtypes import DType
from modelload.loader.errors import (
    BoundsError,
    ConfigError,
    DuplicateNameError,
    FormatError,
    HeaderError,
    ModelloadError,
    UnsupportedDtypeError,
)
from modelload.loader.formats import SAFETENSORS_INDEX, merge_indexes, read_index
from modelload.loader.formats.safetensors import HEADER_SIZE_CAP, RawTensor, SafetensorsFile, serialize
from modelload.loader.formats.tensorizer import (
    Argon2Limits,
    DecryptionKey,
    EncryptionParams,
    TensorizerReader,
    TensorizerWriter,
)
from modelload.loader.formats.tensorizer.file_header import DEFAULT_METADATA_SIZE, MAX_METADATA_SIZE
from modelload.loader.formats.tensorizer.names import encode_name

__all__ = ["STATE_DICT_KEYS", "register", "run"]

STATE_DICT_KEYS = ("state_dict", "model_state_dict", "model", "module", "weights", "params", "net")
"""Keys under which training checkpoints commonly keep the model's state dict, tried in this order."""

_EXTENSIONS = {".tensors": "tensorizer", ".tensorizer": "tensorizer", ".safetensors": "safetensors"}
_ARGON2 = {
    "min": Argon2Limits.MIN,
    "interactive": Argon2Limits.INTERACTIVE,
    "moderate": Argon2Limits.MODERATE,
    "sensitive": Argon2Limits.SENSITIVE,
}
OutputFormat = Literal["tensorizer", "safetensors"]
_TORCH_HELP = f"""\
torch checkpoints load with torch.load(weights_only=True, mmap=True), so no code in them runs. A dict with
tensors among its values is the state dict; otherwise the first key of {", ".join(STATE_DICT_KEYS)}
that holds tensors, or the only key that does (--state-dict-key names one). Nested dicts and lists are
flattened with dots (layers.0.weight) for either output format; values that are not tensors are skipped
and listed; tensors that share storage (tied weights) are written as separate copies."""


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "serialize",
        help="convert a model file to tensorizer or safetensors",
        description=(
            "Convert SRC (safetensors, tensorizer, or a torch .pt/.pth/.bin checkpoint; detected by content) "
            "to DST, tensor by tensor. DST appears only once complete. Keys and passwords are read from "
            "files or environment variables, never from arguments, which show in `ps`."
        ),
        epilog=_TORCH_HELP,
    )
    parser.add_argument(
        "src",
        metavar="SRC",
        type=Path,
        help="the model file to read, or a model directory whose shards to merge",
    )
    parser.add_argument("dst", metavar="DST", type=Path, help="the file to write")
    parser.add_argument(
        "--from",
        dest="source_format",
        choices=("auto", "safetensors", "torch", "tensorizer"),
        default="auto",
        help="SRC's format (default: detected from its first bytes)",
    )
    parser.add_argument(
        "--to",
        choices=("tensorizer", "safetensors"),
        help="DST's format (default: from DST's extension: .tensors/.tensorizer or .safetensors)",
    )
    parser.add_argument("--force", action="store_true", help="replace DST if it exists")
    parser.add_argument(
        "--shard-size",
        metavar="SIZE",
        help="write DST as a directory of safetensors shards of at most SIZE each (5GB, 500MiB) with "
        "model.safetensors.index.json; a tensor larger than SIZE gets a shard of its own. Weights only: "
        "copy config.json and the tokenizer into DST yourself (from_pretrained and vLLM read them)",
    )
    parser.add_argument(
        "--state-dict-key",
        metavar="KEY",
        help="for a torch checkpoint: the key (dotted for nested ones) that holds the state dict",
    )
    parser.add_argument(
        "--no-verify", action="store_true", help="skip checking a tensorizer SRC's hashes (faster)"
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar on standard error")
    add_decryption_options(parser)
    group = parser.add_argument_group(
        "encryption of DST (tensorizer only)",
        "XSalsa20-Poly1305, as tensorizer writes it. Passwords come from a file or an environment "
        "variable, never from an argument.",
    )
    choice = group.add_mutually_exclusive_group()
    choice.add_argument("--encrypt-key-file", metavar="FILE", type=Path, help="encrypt with this 32-byte key")
    choice.add_argument(
        "--generate-key",
        metavar="FILE",
        type=Path,
        help="encrypt with a fresh random key, saved to FILE (mode 0600; never overwritten)",
    )
    choice.add_argument(
        "--encrypt-password-file",
        metavar="FILE",
        type=Path,
        help="encrypt with a key derived (Argon2id) from the password in FILE",
    )
    choice.add_argument(
        "--encrypt-password-env", metavar="VAR", help="as --encrypt-password-file, password from variable VAR"
    )
    group.add_argument(
        "--argon2",
        choices=tuple(_ARGON2),
        help="Argon2id cost for a password (default moderate: 3 passes, 256 MiB; min is for tests only)",
    )
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Convert ``args.src`` to ``args.dst``; the exit status (errors are raised as ModelloadError)."""
    if args.shard_size is not None:
        return _run_sharded(args)
    target = _output_format(args.dst, args.to)
    key = decryption_key(args)
    encryption, generated = _encryption(args, target)
    started = time.monotonic()
    try:
        with _open_input(args, key) as source:
            for note in source.notes:
                print(f"modelload serialize: {note}", file=sys.stderr)
            if key is not None and encryption is None:
                print(
                    f"modelload serialize: {args.dst} will hold the decrypted tensors; to keep them "
                    "encrypted pass --encrypt-key-file, --generate-key or --encrypt-password-file",
                    file=sys.stderr,
                )
            if target == "tensorizer" and source.metadata:
                print(
                    f"modelload serialize: the metadata of {args.src} ({len(source.metadata)} keys) is not "
                    "carried over: tensorizer files hold no metadata",
                    file=sys.stderr,
                )
            total = sum(item.nbytes for item in source.items)
            with (
                atomic_output(args.dst, force=args.force) as file,
                ProgressBar(total, "serialize", enabled=not args.no_progress) as bar,
            ):
                _convert(source, file, target, encryption, bar)
    except BaseException:
        if generated is not None:
            generated.unlink(missing_ok=True)  # a key to a file that was never written
        raise
    seconds = time.monotonic() - started
    how = f"{target}, encrypted" if encryption is not None else target
    print(f"wrote {args.dst} ({how}): {len(source.items)} tensors, {rate(total, seconds)}")
    return 0


def _run_sharded(args: argparse.Namespace) -> int:
    """SRC into a directory of safetensors shards and their index, each shard written atomically."""
    limit = _parse_shard_size(args.shard_size)
    if args.to not in (None, "safetensors"):
        raise ConfigError("--shard-size writes safetensors shards (the Hugging Face layout); drop --to")
    if any(
        getattr(args, name) is not None
        for name in ("encrypt_key_file", "generate_key", "encrypt_password_file", "encrypt_password_env")
    ):
        raise ConfigError("safetensors shards cannot be encrypted; write one tensorizer file to encrypt")
    out: Path = args.dst
    if out.exists() and not out.is_dir():
        raise ConfigError(f"{out} exists and is not a directory; --shard-size writes a directory")
    out.mkdir(parents=True, exist_ok=True)
    key = decryption_key(args)
    started = time.monotonic()
    with _open_input(args, key) as source:
        groups = _shard_groups([item.nbytes for item in source.items], limit)
        total = sum(item.nbytes for item in source.items)
        weight_map: dict[str, str] = {}
        with ProgressBar(total, "serialize", enabled=not args.no_progress) as bar:
            for number, group in enumerate(groups, 1):
                name = f"model-{number:05d}-of-{len(groups):05d}.safetensors"
                with atomic_output(out / name, force=args.force) as file:
                    _convert(_Subset(source, group), file, "safetensors", None, bar)
                weight_map.update((source.items[i].name, name) for i in group)
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        with atomic_output(out / SAFETENSORS_INDEX, force=args.force) as file:
            file.write(json.dumps(index, indent=2).encode() + b"\n")
    seconds = time.monotonic() - started
    what = f"{len(groups)} safetensors shards and {SAFETENSORS_INDEX}"
    print(f"wrote {out}/ ({what}): {len(source.items)} tensors, {rate(total, seconds)}")
    return 0


def _parse_shard_size(text: str) -> int:
    match = re.fullmatch(r"\s*(\d+)\s*([KMGT]i?B|B)?\s*", text, flags=re.IGNORECASE)
    if match is None or int(match.group(1)) <= 0:
        raise ConfigError(f"--shard-size {text!r}: a positive size such as 5GB, 2GiB or 500MiB")
    unit = (match.group(2) or "B").upper()
    scale = {
        "B": 1,
        "KB": 10**3,
        "MB": 10**6,
        "GB": 10**9,
        "TB": 10**12,
        "KIB": 1 << 10,
        "MIB": 1 << 20,
        "GIB": 1 << 30,
        "TIB": 1 << 40,
    }[unit]
    return int(match.group(1)) * scale


def _shard_groups(sizes: Sequence[int], limit: int) -> list[list[int]]:
    """Consecutive tensors in shards of at most ``limit`` bytes (a larger tensor alone), as
    ``save_pretrained`` cuts them."""
    groups: list[list[int]] = [[]]
    filled = 0
    for i, size in enumerate(sizes):
        if groups[-1] and filled + size > limit:
            groups.append([])
            filled = 0
        groups[-1].append(i)
        filled += size
    return groups


class _Subset:
    """Some tensors of an input, read through it."""

    def __init__(self, source: _FileInput | _TorchInput | _DirectoryInput, indices: list[int]) -> None:
        self.source = source
        self.indices = indices
        self.items: Sequence[_Item] = [source.items[i] for i in indices]
        self.metadata: dict[str, str] | None = {"format": "pt"}
        self.notes: list[str] = []

    def read(self, index: int, scratch: np.ndarray[Any, Any]) -> tuple[np.ndarray[Any, Any], int]:
        return self.source.read(self.indices[index], scratch)


# --- options -----------------------------------------------------------------------------------------------


def _output_format(dst: Path, named: OutputFormat | None) -> OutputFormat:
    if named is not None:
        return named
    found = _EXTENSIONS.get(dst.suffix.lower())
    if found is None:
        raise ConfigError(
            f"cannot tell DST's format from its name {dst.name!r}; pass --to tensorizer or --to safetensors "
            "(or name it .tensors or .safetensors)"
        )
    return found  # type: ignore[return-value]


def _encryption(
    args: argparse.Namespace, target: OutputFormat
) -> tuple[EncryptionParams | None, Path | None]:
    """The encryption DST asks for, and the key file this run creates (to remove if the run fails)."""
    password_source = args.encrypt_password_file is not None or args.encrypt_password_env is not None
    wanted = password_source or args.encrypt_key_file is not None or args.generate_key is not None
    if args.argon2 is not None and not password_source:
        raise ConfigError("--argon2 sets the cost of a password: use it with --encrypt-password-file/-env")
    if not wanted:
        return None, None
    if target != "tensorizer":
        raise ConfigError(
            "safetensors files cannot be encrypted; write a tensorizer file (--to tensorizer) to encrypt"
        )
    if args.encrypt_key_file is not None:
        data = read_secret(args.encrypt_key_file, what="key file")
        if len(data) != 32:
            raise ConfigError(
                f"the key file {args.encrypt_key_file} holds {len(data)} bytes; an encryption key is exactly "
                "32 bytes (use --generate-key for a new one, or --encrypt-password-file for a passphrase)"
            )
        return EncryptionParams.from_key(data), None
    if args.generate_key is not None:
        params = EncryptionParams.random()
        _save_key(args.generate_key, params.key)
        return params, args.generate_key
    password = read_password(args.encrypt_password_file, args.encrypt_password_env)
    assert password is not None
    return EncryptionParams.from_password(password, limits=_ARGON2[args.argon2 or "moderate"]), None


def _save_key(path: Path, key: bytes) -> None:
    """Write a new key file readable by its owner alone; an existing file is never replaced."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    except FileExistsError:
        raise ConfigError(
            f"{path} exists; --generate-key never overwrites a file (it may hold the only copy of a key)"
        ) from None
    except OSError as exc:
        raise ConfigError(f"cannot create the key file {path}: {exc.strerror}") from None
    try:
        os.fchmod(fd, 0o600)
        os.write(fd, key)
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        path.unlink(missing_ok=True)
        raise
    os.close(fd)


# --- inputs ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Item:
    """One tensor to convert, known before its bytes are read."""

    name: str
    dtype: DType
    shape: tuple[int, ...]
    path: tuple[str | int, ...] | None = None
    """A tensorizer structured name, kept when writing tensorizer."""
    kind: Literal["param", "buffer", "state_dict"] = "state_dict"

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize


class _Input(Protocol):
    items: Sequence[_Item]
    metadata: dict[str, str] | None
    notes: list[str]

    def read(self, index: int, scratch: np.ndarray[Any, Any]) -> tuple[np.ndarray[Any, Any], int]:
        """Tensor ``index``'s bytes as a flat uint8 array (in ``scratch`` or a view of the source), and its
        tensorizer module index (0 when the source has none)."""
        ...


@dataclass
class _FileInput:
    """A safetensors or tensorizer file, read tensor by tensor into a scratch buffer (verified, decrypted)."""

    reader: TensorizerReader | SafetensorsFile
    items: Sequence[_Item]
    metadata: dict[str, str] | None
    notes: list[str]

    def read(self, index: int, scratch: np.ndarray[Any, Any]) -> tuple[np.ndarray[Any, Any], int]:
        entry = self.reader.index.tensors[index]
        out = scratch[: entry.nbytes]
        if isinstance(self.reader, TensorizerReader):
            return out, self.reader.readinto(entry, out.data).module_idx
        self.reader.readinto(entry.name, out)
        return out, 0


@dataclass
class _TorchInput:
    """The tensors of a torch checkpoint, mapped from the file by torch."""

    tensors: list[Any]
    items: Sequence[_Item]
    metadata: dict[str, str] | None
    notes: list[str]

    def read(self, index: int, scratch: np.ndarray[Any, Any]) -> tuple[np.ndarray[Any, Any], int]:
        import torch

        tensor = self.tensors[index].detach()
        plain = tensor.resolve_conj().resolve_neg().contiguous()
        flat: np.ndarray[Any, Any] = plain.reshape(-1).view(torch.uint8).numpy()
        return flat, 0


@dataclass
class _DirectoryInput:
    """A model directory's weight files, read one after the other as one model."""

    parts: list[_FileInput]
    items: Sequence[_Item]
    metadata: dict[str, str] | None
    notes: list[str]
    _starts: list[int]

    def read(self, index: int, scratch: np.ndarray[Any, Any]) -> tuple[np.ndarray[Any, Any], int]:
        part = bisect.bisect_right(self._starts, index) - 1
        return self.parts[part].read(index - self._starts[part], scratch)


@contextlib.contextmanager
def _open_directory(args: argparse.Namespace, key: DecryptionKey | None) -> Iterator[_DirectoryInput]:
    src: Path = args.src
    where = f"{src}/"
    chosen = local_model_files(src)
    with contextlib.ExitStack() as stack:
        parts = []
        for name in chosen.weights:
            path = src / name
            reader = stack.enter_context(open_model_file(path, sniff(path), key, verify=not args.no_verify))
            index = reader.index
            items = [_Item(t.name, t.dtype, t.shape, t.path, t.kind) for t in index.tensors]
            parts.append((name, _FileInput(reader, items, dict(index.metadata) or None, [])))
        merge_indexes([(name, part.reader.index) for name, part in parts], where=where)  # names unique
        starts = list(itertools.accumulate((len(part.items) for _, part in parts), initial=0))[:-1]
        notes = [f"merging {len(parts)} weight files of {src}; its config and tokenizer are not copied"]
        yield _DirectoryInput(
            [part for _, part in parts],
            [item for _, part in parts for item in part.items],
            parts[0][1].metadata,
            notes,
            starts,
        )


@contextlib.contextmanager
def _open_input(
    args: argparse.Namespace, key: DecryptionKey | None
) -> Iterator[_FileInput | _TorchInput | _DirectoryInput]:
    """SRC opened as its format's reader (torch checkpoints mapped by torch), closed after the block."""
    src: Path = args.src
    if src.is_dir() and args.source_format == "auto":
        with _open_directory(args, key) as directory:
            yield directory
        return
    kind = sniff(src) if args.source_format == "auto" else args.source_format
    if kind == "segment":
        raise ConfigError(
            f"{src} is a modelload segment, not a model file; `modelload inspect` shows what it holds"
        )
    if key is not None and kind != "tensorizer":
        raise ConfigError(
            f"a key or password was given, but {src} is a {kind} file, which is never encrypted; drop it"
        )
    if args.state_dict_key is not None and kind != "torch":
        raise ConfigError(f"--state-dict-key applies to torch checkpoints; {src} is a {kind} file")
    if kind == "torch":
        yield _open_torch(src, args.state_dict_key)
        return
    with open_model_file(src, kind, key, verify=not args.no_verify) as reader:
        index = reader.index
        items = [_Item(t.name, t.dtype, t.shape, t.path, t.kind) for t in index.tensors]
        yield _FileInput(reader, items, dict(index.metadata) or None, [])


def _open_torch(path: Path, key: str | None) -> _TorchInput:
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
    items: list[_Item] = []
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
        items.append(_Item(name, dtype, tuple(int(d) for d in tensor.shape)))
        if tensor.numel():
            storages.setdefault(tensor.untyped_storage().data_ptr(), []).append(name)
    for names in storages.values():
        if len(names) > 1:
            shown = ", ".join(repr(n) for n in names[:4]) + (", ..." if len(names) > 4 else "")
            notes.append(f"tensors {shown} share storage (tied weights): each is written as its own copy")
    return _TorchInput(tensors, items, None, notes)


def _torch_load(torch: Any, path: Path) -> Any:
    def load(mmap: bool) -> Any:
        return torch.load(path, weights_only=True, map_location="cpu", mmap=mmap)

    try:
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


# --- outputs -----------------------------------------------------------------------------------------------


def _convert(
    source: _Input,
    file: IO[bytes],
    target: OutputFormat,
    encryption: EncryptionParams | None,
    bar: ProgressBar,
) -> None:
    """Read every tensor and write it to ``file``, then read the result's index back as a check."""
    items = source.items
    largest = max((item.nbytes for item in items), default=0)
    copies = isinstance(source, (_FileInput, _DirectoryInput)) or (
        isinstance(source, _Subset) and isinstance(source.source, (_FileInput, _DirectoryInput))
    )
    scratch = np.empty(largest if copies else 0, dtype=np.uint8)
    if target == "tensorizer":
        writer = TensorizerWriter(file, encryption=encryption, metadata_size=_metadata_size(items))
        try:
            for i, item in enumerate(items):
                data, module_idx = source.read(i, scratch)
                array = data.view(item.dtype.numpy).reshape(item.shape)
                name = item.path or item.name
                writer.write_tensor(name, array, kind=item.kind, module_idx=module_idx, dtype=item.dtype.name)
                bar.update(item.nbytes)
        except BaseException:
            writer.abort()
            raise
        writer.close()
    else:
        # Hugging Face loaders expect a safetensors file made from torch tensors to say so.
        metadata = {"format": "pt"} if isinstance(source, _TorchInput) else source.metadata
        header, offsets = _safetensors_header(items, metadata)
        _write_at(file.fileno(), header, 0)
        os.ftruncate(file.fileno(), len(header) + sum(item.nbytes for item in items))
        for i, item in enumerate(items):
            data, _ = source.read(i, scratch)
            _write_at(file.fileno(), data.data, len(header) + offsets[i])
            bar.update(item.nbytes)
    _check_written(file, items, target)


def _metadata_size(items: Sequence[_Item]) -> int:
    """A tensorizer metadata block that surely holds every entry: the writer fixes its size at the first
    tensor, and tensors are written one at a time here."""
    total = 0
    for item in items:
        name = encode_name(item.path or (item.name,))
        dtype = item.dtype.tensorizer.encode("utf-8")
        total += 2 + len(name) + 1 + 1 + len(dtype) + 1 + 8 * len(item.shape) + 24 + 4
    return min(max(DEFAULT_METADATA_SIZE, -(-total // 4096) * 4096), MAX_METADATA_SIZE)


def _safetensors_header(items: Sequence[_Item], metadata: dict[str, str] | None) -> tuple[bytes, list[int]]:
    """The size field and header of a safetensors file of ``items``, and each item's data offset.

    The order of tensors (and every check on names, dtypes and metadata) is the formats package's writer's:
    it is asked with zero-length placeholders, whose header lists the tensors in the order its real files
    use. So a file written here is byte for byte the one ``save_file`` (and the reference writer) writes.
    """
    names = {item.name: i for i, item in enumerate(items)}
    if len(names) != len(items):
        raise DuplicateNameError("two tensors share a name; safetensors names must be unique")
    placeholders = {item.name: RawTensor(item.dtype, (0,), b"") for item in items}
    probe = serialize(placeholders, metadata=metadata)
    document: dict[str, Any] = json.loads(probe[8 : 8 + int.from_bytes(probe[:8], "little")])
    offsets = [0] * len(items)
    offset = 0
    for name, entry in document.items():
        if name == "__metadata__":
            continue
        i = names[name]
        entry["shape"] = list(items[i].shape)
        entry["data_offsets"] = [offset, offset + items[i].nbytes]
        offsets[i] = offset
        offset += items[i].nbytes
    try:
        text = json.dumps(document, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
    except UnicodeEncodeError as exc:
        raise HeaderError(f"a tensor name is not encodable as UTF-8 ({exc.reason})") from None
    text += b" " * (-len(text) % 8)
    if len(text) > HEADER_SIZE_CAP:
        raise BoundsError(
            f"the safetensors header would be {len(text)} bytes, over the {HEADER_SIZE_CAP}-byte limit of "
            "its readers; write a tensorizer file, or split the model into shards"
        )
    return len(text).to_bytes(8, "little") + text, offsets


def _write_at(fd: int, data: bytes | memoryview, offset: int) -> None:
    view = memoryview(data).cast("B")
    done = 0
    while done < view.nbytes:
        done += os.pwrite(fd, view[done:], offset + done)


def _check_written(file: IO[bytes], items: Sequence[_Item], target: OutputFormat) -> None:
    """Read the new file's index back and compare it with what was meant: a cheap guard against writing a
    file that reads as something else."""
    file.flush()
    fd = file.fileno()
    size = os.fstat(fd).st_size
    index = read_index(lambda offset, length: os.pread(fd, length, offset), format=target, size=size)
    got = sorted(((t.name, t.dtype.name, t.shape) for t in index.tensors), key=lambda t: t[0])
    meant = sorted(((i.name, i.dtype.name, i.shape) for i in items), key=lambda t: t[0])
    if got != meant:
        raise ModelloadError(  # pragma: no cover - a bug in a writer, not bad input
            "the written file's index does not list the tensors that were written; please report this"
        )
