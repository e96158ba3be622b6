"""``modelload stage SOURCE SEGMENT``: load a local model file into a new segment, for attach() to use.

The simple path the sidecar replaces with a streaming one: plan the layout from the file's index, create
and publish the segment, then fill the slots, each published as soon as its bytes are in. A thread pool
takes tensors in file order, so early tensors are ready first and reading overlaps hashing.

- Tensorizer tensors are read with one ``preadv`` (header and data) straight into their slot of the mapped
  segment, decrypted and verified there: no intermediate buffer.
- Safetensors tensors need neither, so the kernel copies them from the file into the segment
  (``copy_file_range``), without passing through this process or faulting in the mapping; where the kernel
  cannot, they are read into the slot like tensorizer's.

Any error marks the segment FAILED with the reason, so processes already attached stop waiting and see why.
"""

from __future__ import annotations

import argparse
import errno
import os
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, as_completed
from pathlib import Path

from modelload.loader.cli._common import (
    add_decryption_options,
    decryption_key,
    modelload_version,
    open_model_file,
    rate,
    sniff,
)
from modelload.loader.cli.progress import ProgressBar
from modelload.loader.errors import (
    ConfigError,
    ModelloadError,
    SegmentSpaceError,
    SourceError,
    TruncatedError,
)
from modelload.loader.formats import ModelIndex
from modelload.loader.formats.safetensors import SafetensorsFile
from modelload.loader.formats.tensorizer import TensorizerReader
from modelload.loader.segment import Layout, SegmentWriter, TensorSpec, plan_layout
from modelload.loader.segment.layout import MAGIC

__all__ = ["register", "run"]

_NO_KERNEL_COPY = frozenset({errno.EXDEV, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL, errno.EBADF})


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "stage",
        help="load a local model file into a new segment (what the sidecar does from remote sources)",
        description=(
            "Load SOURCE (a tensorizer or safetensors file, detected by content) into a new segment at "
            "SEGMENT, publishing each tensor as it lands. A segment already at SEGMENT is replaced (its "
            "readers are told it was superseded). On an error the segment is marked failed with the reason."
        ),
    )
    parser.add_argument("source", metavar="SOURCE", type=Path, help="the model file")
    parser.add_argument("segment", metavar="SEGMENT", type=Path, help="the segment file to create")
    parser.add_argument(
        "--format",
        choices=("auto", "tensorizer", "safetensors"),
        default="auto",
        help="SOURCE's format (default: detected)",
    )
    parser.add_argument(
        "--verify",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="check a tensorizer file's hashes (default on; safetensors has none)",
    )
    parser.add_argument(
        "--threads",
        metavar="N",
        type=int,
        default=min(4, os.cpu_count() or 1),
        help="tensors loaded at once (default: CPUs, at most 4)",
    )
    parser.add_argument(
        "--force", action="store_true", help="replace a file at SEGMENT even when it is not a segment"
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar on standard error")
    add_decryption_options(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Stage ``args.source`` into ``args.segment``; ModelloadErrors carry what went wrong."""
    started = time.monotonic()
    source: Path = args.source
    if args.threads < 1:
        raise ConfigError("--threads must be 1 or more")
    kind = sniff(source) if args.format == "auto" else args.format
    if kind not in ("tensorizer", "safetensors"):
        what, hint = {
            "torch": ("a torch checkpoint", "convert it first with modelload serialize"),
            "segment": ("a modelload segment already", "attach to it, or stage the model file it came from"),
        }[kind]
        raise ConfigError(f"{source} is {what}, not a tensorizer or safetensors file: {hint}")
    key = decryption_key(args)
    if key is not None and kind != "tensorizer":
        raise ConfigError(f"a key or password was given, but {source} is a {kind} file, never encrypted")
    _check_target(source, args.segment, force=args.force)
    with open_model_file(source, kind, key, verify=args.verify) as reader:
        index = reader.index
        writer = SegmentWriter.create(args.segment, _layout(source, index))
        try:
            with ProgressBar(index.nbytes, "stage", enabled=not args.no_progress) as bar:
                _fill(reader, writer, threads=args.threads, verify=args.verify, bar=bar)
            writer.mark_complete()
        except BaseException as exc:
            writer.mark_failed(_reason(exc))
            raise
        finally:
            writer.close()
    verified = kind == "tensorizer" and args.verify
    checks = [word for word, on in (("decrypted", index.encrypted), ("verified", verified)) if on]
    how = f"{kind}{', ' if checks else ''}{', '.join(checks)}"
    seconds = time.monotonic() - started
    print(f"staged {args.segment} ({how}): {len(index.tensors)} tensors, {rate(index.nbytes, seconds)}")
    return 0


def _check_target(source: Path, segment: Path, *, force: bool) -> None:
    """Refuse to replace the source itself, or a file that is not a segment (unless forced)."""
    if segment.is_dir():
        raise ConfigError(f"{segment} is a directory; name the segment file to create in it")
    if not segment.exists():
        return
    if source.exists() and segment.samefile(source):
        raise ConfigError(f"SEGMENT {segment} is the model file itself; name a new file")
    try:
        with segment.open("rb") as file:
            is_segment = file.read(len(MAGIC)) == MAGIC
    except OSError as exc:
        raise ConfigError(f"{segment} exists and cannot be read ({exc.strerror}); remove it") from None
    if not is_segment and not force:
        raise ConfigError(f"{segment} exists and is not a modelload segment; pass --force to replace it")
    if is_segment:
        print(f"modelload stage: replacing the segment at {segment}", file=sys.stderr)


def _layout(source: Path, index: ModelIndex) -> Layout:
    specs = [TensorSpec(t.name, t.dtype, t.shape) for t in index.tensors]
    metadata = {
        "format": index.format,
        "source": str(source.resolve()),
        "source_size": str(source.stat().st_size),
        "writer": f"modelload-stage {modelload_version()}",
    }
    return plan_layout(specs, metadata=metadata)


def _fill(
    reader: TensorizerReader | SafetensorsFile,
    writer: SegmentWriter,
    *,
    threads: int,
    verify: bool,
    bar: ProgressBar,
) -> None:
    """Fill and publish every slot with a pool of ``threads``, tensors handed out in file order."""
    entries = reader.index.tensors
    copier = _SafetensorsCopy(reader, writer) if isinstance(reader, SafetensorsFile) else None
    fill: Callable[[int], tuple[bool, bool]]
    if isinstance(reader, TensorizerReader):

        def fill(i: int) -> tuple[bool, bool]:
            header = reader.readinto(entries[i], writer.slot(i))
            return verify, header.encrypted

    else:
        assert copier is not None
        fill = copier

    def load(i: int) -> None:
        """Load and publish tensor ``i``, or mark it FAILED."""
        try:
            verified, decrypted = fill(i)
        except BaseException as exc:
            writer.mark_tensor_failed(i)
            if isinstance(exc, OSError):
                raise _translate(exc, entries[i].name, reader) from None
            raise
        writer.mark_ready(i, verified=verified, decrypted=decrypted)

    pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="stage")
    try:
        futures: dict[Future[None], int] = {pool.submit(load, i): i for i in range(len(entries))}
        for future in as_completed(futures):
            future.result()
            bar.update(entries[futures[future]].nbytes)
    except BaseException:
        pool.shutdown(wait=True, cancel_futures=True)
        raise
    finally:
        pool.shutdown(wait=True)
        if copier is not None:
            copier.close()


class _SafetensorsCopy:
    """Copies a safetensors tensor into its slot inside the kernel, or reads it into the slot."""

    def __init__(self, reader: SafetensorsFile, writer: SegmentWriter) -> None:
        self._reader = reader
        self._writer = writer
        self._src = os.open(reader.path, os.O_RDONLY | os.O_CLOEXEC)
        self._kernel_copy = hasattr(os, "copy_file_range")
        self._lock = threading.Lock()

    def __call__(self, i: int) -> tuple[bool, bool]:
        entry = self._reader.index.tensors[i]
        if self._kernel_copy and entry.data_length:
            try:
                self._copy(entry.data_offset, self._writer.layout.slots[i].offset, entry.data_length)
                return False, False
            except OSError as exc:
                if exc.errno not in _NO_KERNEL_COPY:
                    raise
                with self._lock:
                    self._kernel_copy = False  # this kernel or filesystem cannot: read instead
        self._reader.readinto(entry.name, self._writer.slot(i))
        return False, False

    def _copy(self, src_at: int, dst_at: int, length: int) -> None:
        done = 0
        while done < length:
            count = os.copy_file_range(
                self._src, self._writer.fileno(), length - done, src_at + done, dst_at + done
            )
            if count == 0:
                raise TruncatedError(
                    f"the file ended at byte {src_at + done} while copying a tensor: it shrank after it was "
                    "opened (is something rewriting it?)",
                    source=self._reader.path,
                )
            done += count

    def close(self) -> None:
        os.close(self._src)


def _translate(exc: OSError, tensor: str, reader: TensorizerReader | SafetensorsFile) -> ModelloadError:
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return SegmentSpaceError(
            exc.errno, f"no room in the segment's volume while loading tensor {tensor!r}: {exc.strerror}"
        )
    source = reader.source if isinstance(reader, TensorizerReader) else reader.path
    return SourceError(f"loading tensor {tensor!r} from {source} failed: {exc.strerror or exc}", uri=source)


def _reason(exc: BaseException) -> str:
    """What a reader of the failed segment is told."""
    if isinstance(exc, KeyboardInterrupt):
        return "modelload stage was interrupted"
    if isinstance(exc, ModelloadError):
        return str(exc)
    return f"{type(exc).__name__}: {exc}"
