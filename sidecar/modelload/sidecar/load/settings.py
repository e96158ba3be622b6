"""The engine's settings: what to load, where to, and how hard to pull (from the flags, or from code)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, get_args

from modelload.loader import wiring
from modelload.loader.errors import ConfigError
from modelload.loader.rules import Between, OneOf, check_fields, rule
from modelload.loader.sizes import format_size
from modelload.sidecar.load.landing import LANDINGS, Landing
from modelload.sidecar.memory.settings import MemorySettings
from modelload.sidecar.sources import display_url

__all__ = [
    "DEFAULT_SEGMENT",
    "MAX_CHUNK",
    "MAX_READERS",
    "MIN_CHUNK",
    "SLOTS",
    "LoadSettings",
    "ModelFormat",
    "Slots",
]

ModelFormat = Literal["auto", "tensorizer", "safetensors"]
Slots = Literal["auto", "packed", "paged"]
SLOTS: tuple[str, ...] = get_args(Slots)

MiB = 1 << 20
GiB = 1 << 30
DEFAULT_SEGMENT = Path(wiring.SEGMENT_PATH)
MAX_READERS = 256
MIN_CHUNK, MAX_CHUNK = MiB, GiB
MIN_CODE_CHUNK = 4096
"""The smallest chunk settings built in code may ask for (tests and tiny models); flags start at 1 MiB."""


@dataclass(frozen=True)
class LoadSettings:
    """What to load, where to, and how hard to pull: the engine's settings, from the flags or from code.

    Each field's default and rule are declared here once; the sidecar's flags and variables
    (:mod:`modelload.sidecar.settings`) read them from here for their parsing and their ``--help``.
    """

    source: str
    """The model's URI (``s3://bucket/key``, ``http(s)://...``, ``file:///path`` or a plain path). Required.
    A directory loads every weight file in it into the one segment: an S3 prefix (``s3://bucket/models/llama/``),
    an HTTP(S) base URL ending in ``/``, or a local directory. Shown in reprs and logs through
    :func:`~modelload.sidecar.sources.display_url` (no user info, no query string)."""

    segment: Path = DEFAULT_SEGMENT
    """The segment file to create, made absolute. Default ``/run/modelload/model.seg``, inside the
    memory-backed volume the operator mounts at ``/run/modelload``."""

    format: ModelFormat = field(default="auto", metadata=rule(OneOf(get_args(ModelFormat))))
    """``auto`` detects tensorizer or safetensors from the file's first bytes; naming it skips the guess and
    fails clearly on a file of the other format. Default ``auto``."""

    readers: int = field(default=8, metadata=rule(Between(1, MAX_READERS)))
    """Parallel range readers. Default 8: enough to fill a 10 Gbit/s link from S3, whose single streams top
    out near 100 MB/s, without overloading a small HTTP server."""

    chunk_size: int = field(
        default=32 * MiB,
        metadata=rule(Between(MIN_CODE_CHUNK, MAX_CHUNK, what="a chunk size", show=format_size)),
    )
    """Bytes per range request. Default 32 MiB: large enough that request latency is small against transfer
    time, small enough that a retry re-reads little and that the readers share a model of a few GB evenly.
    Code may go down to a page (4 KiB), for models of a few kilobytes; a flag or variable starts at 1 MiB."""

    verify: bool = True
    """Check each tensor against the hash its file stores (tensorizer CRC32, or SHA-256 when it is the only
    one) before publishing it. Default on: a corrupt transfer is then an error, not wrong weights. Encrypted
    tensors are always authenticated by their MACs."""

    key_file: Path | None = None
    """A file holding the raw 32-byte decryption key of an encrypted tensorizer file. Default none. Only the
    path is kept here: the engine reads the bytes when it needs them."""

    password_file: Path | None = None
    """A file holding the password of an Argon2id-derived key, instead of ``key_file`` (not both)."""

    priority: tuple[str, ...] = ()
    """Tensor names or name prefixes loaded first, in this order (for example the embeddings and the first
    layers, so an app can start computing sooner). Default empty: file order."""

    model_dir: Path | None = None
    """Where a directory's small files (config, tokenizer) are copied, for the app to pass to its engine as
    the model path. Default ``model/`` beside the segment (``/run/modelload/model``)."""

    files: tuple[str, ...] = ()
    """A directory's file names, instead of listing it: for an HTTP(S) directory that has neither a
    ``model.safetensors.index.json`` nor a ``model.safetensors`` (a server cannot be listed). Default
    empty."""

    notify: str | None = None
    """The pyzmq endpoint recorded in the segment for loaders to subscribe to (the sidecar's ``--notify``,
    ``NotifySettings.endpoint``). Default none."""

    landing: Landing = field(default="auto", metadata=rule(OneOf(LANDINGS)))
    """How bytes reach the segment (:mod:`modelload.sidecar.load.landing`): ``auto`` picks by the segment's
    volume (``os.splice`` through the file descriptor on 4 KiB pages, where the source supports it; the
    segment's mapping on huge pages), ``splice`` and ``mapping`` force a path, to compare them. Default
    ``auto``."""

    memory: MemorySettings = field(default_factory=MemorySettings)
    """Memory modes full, release and ring (``modelload.sidecar.memory``)."""

    slots: Slots = field(default="auto", metadata=rule(OneOf(SLOTS)))
    """Where the segment's slots start: ``paged`` on a page each (layout versions 1 and 2, which every
    loader reads), ``packed`` right after one another, each on its element size (layout version 5: no page
    of padding per tensor, for a model of thousands of small tensors; memory mode full only), ``auto``
    packed where pages would pad the model's bytes by more than 1% and 8 MiB. Default ``auto``."""

    @property
    def packed(self) -> bool | None:
        """:func:`~modelload.loader.segment.plan_layout`'s ``packed`` for :attr:`slots` (never in memory modes
        release and ring, which the plan's layout takes on after it is made)."""
        if self.memory.mode != "full":
            return False
        return {"packed": True, "paged": False}.get(self.slots)

    def __post_init__(self) -> None:
        if not self.source.strip():
            raise ConfigError(
                "no model source: pass --source URI or set MODELLOAD_SOURCE (s3://, http(s)://, file://)"
            )
        check_fields(self)
        if self.key_file is not None and self.password_file is not None:
            raise ConfigError(
                "both a key file (--key-file/MODELLOAD_KEY_FILE) and a password file"
                " (--password-file/MODELLOAD_PASSWORD_FILE) are set: give one"
            )
        if self.slots == "packed" and self.memory.mode != "full":
            raise ConfigError(
                f"--slots packed needs --memory-mode full: memory mode {self.memory.mode} gives each "
                "tensor's pages back, so each tensor keeps pages of its own"
            )
        if not self.segment.is_absolute():
            object.__setattr__(self, "segment", self.segment.absolute())
        if self.model_dir is None:
            object.__setattr__(self, "model_dir", self.segment.parent / "model")
        elif not self.model_dir.is_absolute():
            object.__setattr__(self, "model_dir", self.model_dir.absolute())

    def __repr__(self) -> str:
        return (
            f"LoadSettings(source={display_url(self.source)!r}, segment={str(self.segment)!r}, "
            f"format={self.format!r}, readers={self.readers}, chunk_size={self.chunk_size}, "
            f"verify={self.verify}, key_file={_opt_path(self.key_file)}, "
            f"password_file={_opt_path(self.password_file)}, priority={self.priority!r}, "
            f"model_dir={_opt_path(self.model_dir)}, files={self.files!r}, notify={self.notify!r})"
        )


def _opt_path(path: Path | None) -> str:
    return repr(str(path)) if path is not None else "None"
