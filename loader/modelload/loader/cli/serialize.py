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
import contextlib
import json
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Literal

import numpy as np

from modelload.loader.cli._common import (
    add_decryption_options,
    atomic_output,
    decryption_key,
    rate,
    read_password,
    read_secret,
)
from modelload.loader.cli._inputs import (
    STATE_DICT_KEYS,
    DirectoryInput,
    FileInput,
    Input,
    Item,
    Subset,
    TorchInput,
    open_input,
)
from modelload.loader.cli.progress import ProgressBar
from modelload.loader.errors import (
    ConfigError,
    DuplicateNameError,
    ModelloadError,
)
from modelload.loader.formats import SAFETENSORS_INDEX, read_index
from modelload.loader.formats.safetensors import plan_header
from modelload.loader.formats.tensorizer import (
    Argon2Limits,
    DecryptionKey,
    EncryptionParams,
    TensorizerWriter,
)
from modelload.loader.sizes import parse_size

__all__ = ["STATE_DICT_KEYS", "register", "run"]

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
        help="SRC's format (default: detected from its first bytes); for a directory holding both "
        "safetensors and tensorizer weights, which ones to merge",
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
                    _convert(Subset(source, group), file, "safetensors", None, bar)
                weight_map.update((source.items[i].name, name) for i in group)
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        with atomic_output(out / SAFETENSORS_INDEX, force=args.force) as file:
            file.write(json.dumps(index, indent=2).encode() + b"\n")
    seconds = time.monotonic() - started
    what = f"{len(groups)} safetensors shards and {SAFETENSORS_INDEX}"
    print(f"wrote {out}/ ({what}): {len(source.items)} tensors, {rate(total, seconds)}")
    return 0


def _open_input(
    args: argparse.Namespace, key: DecryptionKey | None
) -> contextlib.AbstractContextManager[FileInput | TorchInput | DirectoryInput]:
    return open_input(
        args.src,
        source_format=args.source_format,
        key=key,
        verify=not args.no_verify,
        state_dict_key=args.state_dict_key,
    )


def _parse_shard_size(text: str) -> int:
    limit = parse_size(text, setting="--shard-size")
    if limit <= 0:
        raise ConfigError(
            f"a positive size such as 5GB, 2GiB or 500MiB, got {text!r}", setting="--shard-size"
        )
    return limit


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


# --- outputs -----------------------------------------------------------------------------------------------


def _convert(
    source: Input,
    file: IO[bytes],
    target: OutputFormat,
    encryption: EncryptionParams | None,
    bar: ProgressBar,
) -> None:
    """Read every tensor and write it to ``file``, then read the result's index back as a check."""
    items = source.items
    largest = max((item.nbytes for item in items), default=0)
    scratch = np.empty(largest if source.copies else 0, dtype=np.uint8)
    if target == "tensorizer":
        writer = TensorizerWriter(file, encryption=encryption)
        try:
            writer.reserve((item.path or item.name, item.dtype, item.shape) for item in items)
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
        metadata = {"format": "pt"} if isinstance(source, TorchInput) else source.metadata
        header, offsets = _safetensors_header(items, metadata)
        _write_at(file.fileno(), header, 0)
        os.ftruncate(file.fileno(), len(header) + sum(item.nbytes for item in items))
        for i, item in enumerate(items):
            data, _ = source.read(i, scratch)
            _write_at(file.fileno(), data.data, len(header) + offsets[i])
            bar.update(item.nbytes)
    _check_written(file, items, target)


def _safetensors_header(items: Sequence[Item], metadata: dict[str, str] | None) -> tuple[bytes, list[int]]:
    """The size field and header of a safetensors file of ``items`` (the formats package's writer's, byte for
    byte), and each item's data offset."""
    planned = {item.name: (item.dtype, item.shape) for item in items}
    if len(planned) != len(items):
        raise DuplicateNameError("two tensors share a name; safetensors names must be unique")
    header, offsets = plan_header(planned, metadata=metadata)
    return header, [offsets[item.name] for item in items]


def _write_at(fd: int, data: bytes | memoryview, offset: int) -> None:
    view = memoryview(data).cast("B")
    done = 0
    while done < view.nbytes:
        done += os.pwrite(fd, view[done:], offset + done)


def _check_written(file: IO[bytes], items: Sequence[Item], target: OutputFormat) -> None:
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
