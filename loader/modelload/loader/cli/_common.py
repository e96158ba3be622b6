"""What the loader's file commands (serialize, inspect, stage) share: keys, file kinds, safe output, figures.

Keys and passwords are read here, at the edge, from files or a named environment variable, never from the
command line (argv shows in ``ps`` and in shell history). Errors about the files a user named are
:class:`ConfigError` or :class:`SourceError` messages that name the file and say what to do; they never
carry a key or a password.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import os
from collections.abc import Callable, Iterator, Sequence
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import IO, Literal

from modelload.loader.errors import (
    BadMagicError,
    ConfigError,
    MissingKeyError,
    ModelloadError,
    SourceAccessDeniedError,
    SourceError,
    SourceNotFoundError,
)
from modelload.loader.formats import (
    SAFETENSORS_INDEX,
    FormatName,
    ModelFiles,
    ModelIndex,
    ModelReader,
    detect_format,
    merge_indexes,
    open_reader,
    select_model_files,
)
from modelload.loader.formats._atomic import atomic_file
from modelload.loader.formats.tensorizer import DecryptionKey
from modelload.loader.localdir import list_local_directory
from modelload.loader.segment._regular import NotRegularFileError, open_regular
from modelload.loader.segment.layout import MAGIC as SEGMENT_MAGIC
from modelload.loader.segment.volume import FULL
from modelload.loader.sizes import format_bytes

__all__ = [
    "PASSWORD_ENV",
    "FileKind",
    "add_decryption_options",
    "atomic_output",
    "decryption_key",
    "local_model_files",
    "local_path",
    "modelload_version",
    "named_kind",
    "open_model_file",
    "open_weight_files",
    "rate",
    "read_password",
    "read_secret",
    "sniff",
    "translate_os_error",
]

PASSWORD_ENV = "MODELLOAD_PASSWORD"  # noqa: S105 - the name of a variable, not a password
"""The variable the help suggests for ``--password-env`` (always named: an optional value would swallow
the positional argument after it)."""

FileKind = Literal["tensorizer", "safetensors", "torch", "segment"]

_SNIFF_LENGTH = 64
# A torch checkpoint: the zip container of torch.save since 1.6, or a bare pickle (protocol 2 to 5) of the
# legacy format.
_TORCH_PREFIXES = (b"PK\x03\x04", b"\x80\x02", b"\x80\x03", b"\x80\x04", b"\x80\x05")


# --- decryption keys ---------------------------------------------------------------------------------------


def add_decryption_options(parser: argparse.ArgumentParser) -> None:
    """--key-file / --password-file / --password-env, for reading an encrypted tensorizer file."""
    group = parser.add_argument_group(
        "decryption (encrypted tensorizer files)",
        "Give the key or password as a file or an environment variable, never on the command line:\n"
        "arguments show in `ps` and in shell history.",
    )
    choice = group.add_mutually_exclusive_group()
    choice.add_argument(
        "--key-file", metavar="FILE", type=Path, help="raw 32-byte key (as EncryptionParams.random().key)"
    )
    choice.add_argument(
        "--password-file",
        metavar="FILE",
        type=Path,
        help="password for a file written with an Argon2id-derived key (one trailing newline is ignored)",
    )
    choice.add_argument(
        "--password-env",
        metavar="VAR",
        help=f"read the password from the environment variable VAR (for example {PASSWORD_ENV})",
    )


def decryption_key(args: argparse.Namespace) -> DecryptionKey | None:
    """The key the decryption options name, or None when none was given."""
    if args.key_file is not None:
        data = read_secret(args.key_file, what="key file")
        if len(data) != 32:
            hint = " (a trailing newline?)" if len(data) == 33 and data.endswith(b"\n") else ""
            raise ConfigError(
                f"the key file {args.key_file} holds {len(data)} bytes{hint}; a raw key is exactly 32 bytes "
                "(for a passphrase use --password-file)"
            )
        return DecryptionKey.from_bytes(data)
    password = read_password(args.password_file, args.password_env)
    return None if password is None else DecryptionKey.from_password(password)


def read_secret(path: Path, *, what: str) -> bytes:
    """The bytes of a key or password file; errors name the file, never its content."""
    try:
        return path.read_bytes()
    except FileNotFoundError:
        raise ConfigError(f"the {what} {path} does not exist") from None
    except IsADirectoryError:
        raise ConfigError(f"the {what} {path} is a directory, not a file") from None
    except OSError as exc:
        raise ConfigError(f"cannot read the {what} {path}: {exc.strerror}") from None


def read_password(path: Path | None, env: str | None) -> bytes | None:
    """A password from a file (one trailing newline dropped) or an environment variable; None for neither."""
    if path is not None:
        data = read_secret(path, what="password file")
        if data.endswith(b"\n"):
            data = data[:-1].removesuffix(b"\r")
        where = f"the password file {path}"
    elif env is not None:
        value = os.environ.get(env)
        if value is None:
            raise ConfigError(f"the environment variable {env} is not set; export the password in it")
        data = value.encode("utf-8")
        where = f"the environment variable {env}"
    else:
        return None
    if not data:
        raise ConfigError(f"{where} holds an empty password")
    return data


# --- what a file is ----------------------------------------------------------------------------------------


def local_model_files(
    directory: Path,
    *,
    format: str = "auto",  # noqa: A002 - the CLI's word
    flag: str = "--format",
) -> ModelFiles:
    """A local model directory's files by role (weights, small files, ignored), by the sidecar's rules;
    ``flag`` is the command's option that picks a format where the directory holds both."""
    try:
        names = list(list_local_directory(directory))
        index_json = (directory / SAFETENSORS_INDEX).read_bytes() if SAFETENSORS_INDEX in names else None
    except OSError as exc:
        raise translate_os_error(exc, directory) from None
    return select_model_files(
        names,
        where=f"{directory}/",
        index_json=index_json,
        format=format,  # type: ignore[arg-type]
        choose_with=flag,
    )


def local_path(text: str, *, command: str, remote: str) -> Path:
    """A local path from a command's argument; a remote URI is refused naming the command that reads it
    (``remote``: the advice, commands in backticks).

    ``Path("s3://bucket/key")`` would quietly become ``s3:/bucket/key`` and fail as a missing file.
    """
    scheme, sep, _ = text.partition("://")
    if sep and scheme.isascii() and scheme.replace("+", "").replace("-", "").replace(".", "").isalnum():
        if scheme.lower() == "file":
            from urllib.parse import unquote, urlsplit

            return Path(unquote(urlsplit(text).path))
        raise ConfigError(
            f"{command} reads local files and directories, and {text.partition('?')[0]} is a remote "
            f"({scheme}://) URI: load it with {remote}"
        )
    return Path(text)


def sniff(path: Path) -> FileKind:
    """The kind of a local file from its first bytes, whatever its name says.

    Only a regular file is read: a FIFO would block the command for ever (its open waits for a writer), and
    what a device or a pipe gives is not a model file read twice the same way.
    """
    try:
        fd = open_regular(path, os.O_RDONLY, what="file")
    except NotRegularFileError as exc:
        if exc.file_kind == "a directory":
            raise ConfigError(f"{path} is a directory; name a model file") from None
        raise ConfigError(
            f"{path} is {exc.file_kind}, not a regular file; name a model file or a segment"
        ) from None
    except OSError as exc:
        raise translate_os_error(exc, path) from None
    try:
        with os.fdopen(fd, "rb") as file:
            head = file.read(_SNIFF_LENGTH)
    except OSError as exc:
        raise translate_os_error(exc, path) from None
    if head.startswith(SEGMENT_MAGIC):
        return "segment"
    if head.startswith(_TORCH_PREFIXES):
        return "torch"
    try:
        return detect_format(head)
    except BadMagicError as exc:
        raise BadMagicError(
            f"{exc}; modelload reads tensorizer and safetensors files, torch checkpoints and segments",
            source=str(path),
        ) from None


def named_kind(path: Path, named: str, *, flag: str = "--format") -> str:
    """The kind of a local file, held against the format ``flag`` named (``auto``: whatever it is). A model
    file of the other format is refused, saying which it is; a torch checkpoint or a segment is returned for
    the caller to explain, and a file of neither format is left to the named format's reader to describe."""
    try:
        kind = sniff(path)
    except BadMagicError:
        if named == "auto":
            raise
        return named
    if named != "auto" and kind in ("tensorizer", "safetensors") and kind != named:
        raise ConfigError(
            f"{path} is a {kind} file, not {named}: give {flag} {kind}, or leave {flag} out (the format is "
            "told from the content)"
        )
    return kind


@contextlib.contextmanager
def open_model_file(
    path: Path, kind: str, key: DecryptionKey | None, *, verify: bool
) -> Iterator[ModelReader]:
    """A local tensorizer or safetensors file, open for reading; an encrypted one without a key is refused.
    Any other ``kind`` is read as safetensors, whose reader says what the file is not."""
    fmt: FormatName = "tensorizer" if kind == "tensorizer" else "safetensors"
    try:
        reader = open_reader(path, fmt, key=key, verify=verify, hashes="fastest")
    except OSError as exc:
        raise translate_os_error(exc, path) from None
    with reader:
        if reader.index.encrypted and key is None:
            raise MissingKeyError(
                f"{path} is encrypted: give its key with --key-file, or its password with --password-file or "
                "--password-env"
            )
        yield reader


@contextlib.contextmanager
def open_weight_files(
    directory: Path,
    names: Sequence[str],
    key: DecryptionKey | None,
    *,
    verify: bool,
    kind_of: Callable[[Path], str] = sniff,
) -> Iterator[tuple[list[ModelReader], ModelIndex]]:
    """A local model directory's weight files ``names``, each open as its format's reader (``kind_of`` says
    which), and their merged index by the sidecar's rules (one format, names unique across shards); closed
    after the block."""
    with contextlib.ExitStack() as stack:
        paths = [directory / name for name in names]
        readers = [
            stack.enter_context(open_model_file(path, kind_of(path), key, verify=verify)) for path in paths
        ]
        indexes = [(name, reader.index) for name, reader in zip(names, readers, strict=True)]
        yield readers, merge_indexes(indexes, where=f"{directory}/")


def translate_os_error(exc: OSError, path: Path) -> SourceError | ConfigError:
    """An OSError on an input file as the error the caller acts on."""
    if isinstance(exc, FileNotFoundError):
        return SourceNotFoundError(f"{path} does not exist; check the path", uri=str(path))
    if isinstance(exc, PermissionError):
        return SourceAccessDeniedError(f"{path} cannot be read: permission denied", uri=str(path))
    if isinstance(exc, IsADirectoryError):
        return ConfigError(f"{path} is a directory; name a model file")
    return SourceError(f"reading {path} failed: {exc.strerror or exc}", uri=str(path))


# --- output ------------------------------------------------------------------------------------------------


@contextlib.contextmanager
def atomic_output(target: Path, *, force: bool) -> Iterator[IO[bytes]]:
    """A new file beside ``target`` that becomes ``target`` only when the block ends without an error.

    The formats' one atomic writer (:func:`~modelload.loader.formats._atomic.atomic_file`: a hidden
    temporary file in the same directory, mode 0666 less the umask, fsync'ed with its directory), with the
    command's errors: ``target`` is never half written. Without ``force`` an existing ``target`` is refused,
    also one that appears while the file is being written.
    """
    _check_target(target, force=force)
    created = written = False
    try:
        with atomic_file(target, replace=force) as file:
            created = True
            yield file
            written = True
    except OSError as exc:
        if isinstance(exc, ModelloadError):
            raise
        if not created:
            raise ConfigError(f"cannot create a file in {target.parent}: {exc.strerror}") from None
        if written and isinstance(exc, FileExistsError) and not force:
            raise ConfigError(
                f"{target} appeared while it was being written; nothing was replaced (pass --force to)"
            ) from None
        if exc.errno in _OUTPUT_ERRNOS:
            raise output_error(exc, target) from None
        raise


_NO_ROOM = FULL | {errno.EFBIG}
"""A full volume, or a file larger than the file system takes."""
_OUTPUT_ERRNOS = _NO_ROOM | {errno.EROFS}
"""What a write can fail with that is the destination's fault (an input's errors are translated apart)."""


def output_error(exc: OSError, target: Path) -> ConfigError:
    """An OSError while writing ``target`` as a clear error: a full disk or a read-only volume is an ordinary
    mistake, not a traceback. The partial file is already gone when this is raised."""
    if exc.errno in _NO_ROOM:
        return ConfigError(
            f"no room for {target} in {target.parent} ({exc.strerror}); nothing was written: free space"
            " there or write somewhere else"
        )
    return ConfigError(f"cannot write {target}: {exc.strerror}; choose a folder this user can write")


def _check_target(target: Path, *, force: bool) -> None:
    if target.is_dir():
        raise ConfigError(f"{target} is a directory; name the file to write")
    if not target.parent.is_dir():
        raise ConfigError(f"the directory {target.parent} does not exist; create it first")
    if target.exists() and not force:
        raise ConfigError(f"{target} exists; pass --force to replace it")


# --- figures -----------------------------------------------------------------------------------------------


def rate(nbytes: int, seconds: float) -> str:
    """``"1.0 GiB in 0.52 s (1.9 GiB/s)"``."""
    per_second = nbytes / seconds if seconds > 0 else 0.0
    return f"{format_bytes(nbytes)} in {seconds:.2f} s ({format_bytes(per_second)}/s)"


def modelload_version() -> str:
    try:
        return version("modelload")
    except PackageNotFoundError:  # pragma: no cover - running from a tree that was never installed
        return "unknown"
