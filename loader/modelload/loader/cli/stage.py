"""``modelload stage SOURCE SEGMENT``: load a local model file or directory into a new segment.

A directory (a Hugging Face checkpoint: shards, ``model.safetensors.index.json``, config, tokenizer) loads
every weight file into the one segment, and copies its small files into the model directory beside it
(``--model-dir``, default ``model/`` beside the segment), as the sidecar does from S3 or HTTP.

The simple path the sidecar replaces with a streaming one: plan the layout from the file's index, create
and publish the segment, then fill the slots, each published as soon as its bytes are in. A thread pool
takes tensors in file order, so early tensors are ready first and reading overlaps hashing. The threads and
the finishing of a tensor (decrypt, verify, publish) are the sidecar engine's own, from the segment package
(:func:`run_in_order`, :class:`TensorFinisher`); only how bytes land differs:

- Tensorizer tensors are read with one ``preadv`` (header and data) straight into their slot of the mapped
  segment, decrypted and verified there: no intermediate buffer.
- Safetensors tensors need neither, so the kernel copies them from the file into the segment
  (``copy_file_range``), without passing through this process or faulting in the mapping; where the kernel
  cannot, they are read into the slot like tensorizer's.
- On huge pages (a segment on hugetlbfs, or a tmpfs mounted ``huge=always``; ``segment.pages``) every
  tensor is read into its slot of the mapping: hugetlbfs takes nothing else, and a huge-page mapping faults
  512 times fewer pages than 4 KiB ones. The segment is planned for the volume's page size.

Any error (SIGTERM and Ctrl-C included) marks the segment FAILED with the reason, so processes already
attached stop waiting and see why, then removes it and the model directory this run wrote (a failed stage
holds no memory), leaving the reason in ``SEGMENT.failed`` for processes that attach later. The segment's
folder must exist, as for the sidecar; only one writer (this command or a sidecar) may hold a segment.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from modelload.loader.cli._common import (
    add_decryption_options,
    decryption_key,
    local_model_files,
    local_path,
    modelload_version,
    named_kind,
    open_model_file,
    open_weight_files,
    rate,
)
from modelload.loader.cli.progress import ProgressBar
from modelload.loader.errors import (
    ConfigError,
    ModelloadError,
    SourceError,
    TruncatedError,
)
from modelload.loader.formats import (
    ModelIndex,
    ModelReader,
    TensorEntry,
    check_small_files,
)
from modelload.loader.formats.tensorizer import DecryptionKey
from modelload.loader.segment import (
    MODEL_DIR_KEY,
    Layout,
    SegmentWriter,
    TensorFinisher,
    TensorSpec,
    plan_layout,
    run_in_order,
)
from modelload.loader.segment.failure import leave_failed, remove_failure
from modelload.loader.segment.layout import MAGIC
from modelload.loader.segment.lock import WriterLock
from modelload.loader.segment.modeldir import remove_model_dir, write_model_dir
from modelload.loader.segment.pages import Volume, prefers_mapping, volume_of
from modelload.loader.segment.previous import set_aside
from modelload.loader.segment.room import check_folder
from modelload.loader.segment.volume import full_volume

__all__ = ["register", "run"]

_NO_KERNEL_COPY = frozenset({errno.EXDEV, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL, errno.EBADF})


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "stage",
        help="load a local model file or directory into a new segment (what the sidecar does remotely)",
        description=(
            "Load SOURCE (a tensorizer or safetensors file, detected by content, or a model directory of "
            "shards with its config and tokenizer) into a new segment at SEGMENT, publishing each tensor as "
            "it lands. A directory's small files go to the model directory (--model-dir). A segment already "
            "at SEGMENT is replaced (its readers are told it was superseded). On an error the segment is "
            "marked failed for its readers and removed, with the reason left in SEGMENT.failed for apps "
            "that attach later; nothing of the failed load keeps holding memory. Remote models (s3://, "
            "http(s)://) are loaded by `modelload sidecar --source URI`."
        ),
    )
    parser.add_argument("source", metavar="SOURCE", help="the model file or directory")
    parser.add_argument("segment", metavar="SEGMENT", type=Path, help="the segment file to create")
    parser.add_argument(
        "--model-dir",
        metavar="DIR",
        type=Path,
        help=(
            "where a directory's config and tokenizer go (default: model/ beside SEGMENT, which every "
            "segment in that folder shares: give each model its own DIR, or its own folder)"
        ),
    )
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
    source = local_path(
        args.source, command="stage", remote="`modelload sidecar --source URI --segment PATH`"
    )
    if args.threads < 1:
        raise ConfigError("--threads must be 1 or more")
    key = decryption_key(args)
    _check_target(source, args.segment, force=args.force)
    check_folder(args.segment)
    with WriterLock.acquire(args.segment, program="modelload stage") as lock, _terminated_as_interrupt():
        staged = _stage(args, source, key, lock)
    index = staged.index
    kind = index.format
    verified = kind == "tensorizer" and args.verify
    checks = [word for word, on in (("decrypted", index.encrypted), ("verified", verified)) if on]
    how = f"{kind}{', ' if checks else ''}{', '.join(checks)}"
    files = f" from {len(index.files)} files" if index.files else ""
    seconds = time.monotonic() - started
    print(
        f"staged {args.segment} ({how}): {len(index.tensors)} tensors{files}, {rate(index.nbytes, seconds)}"
    )
    if staged.model_dir is not None:
        print(f"model directory {staged.model_dir}: {len(staged.small or ())} files")
    return 0


@dataclass
class _Staged:
    """What a stage loaded: the index, a directory's small files, and the model directory written."""

    index: ModelIndex
    small: list[str] | None
    model_dir: Path | None


def _stage(args: argparse.Namespace, source: Path, key: DecryptionKey | None, lock: WriterLock) -> _Staged:
    """Load ``source`` into ``args.segment`` holding its ``lock``; a failure leaves no segment holding
    memory, no model directory, and the reason beside the segment for apps (SPEC.md writer rule 7)."""
    previous = set_aside(args.segment)  # replaced: its readers are told, and it goes
    if previous is not None:
        print(f"modelload stage: replacing the segment at {args.segment}", file=sys.stderr)
        previous.discard()
    remove_failure(args.segment)
    model_dir: Path | None = None
    writer: SegmentWriter | None = None
    try:
        with _open_model(source, args.format, key, verify=args.verify) as model:
            index = model.index
            if model.small is not None:
                target = args.model_dir or args.segment.parent / "model"
                model_dir = write_model_dir(target, model.small, lambda name: (source / name).read_bytes())
            volume = _volume(args.segment)
            layout = _layout(source, model, model_dir, volume.page_size)
            writer = SegmentWriter.create(args.segment, layout, lock=lock)
            with ProgressBar(index.nbytes, "stage", enabled=not args.no_progress) as bar:
                finisher = TensorFinisher(writer, key=key, encrypted=index.encrypted, verify=args.verify)
                kernel_copy = not prefers_mapping(volume)
                _fill(model.readers, writer, finisher, threads=args.threads, bar=bar, kernel_copy=kernel_copy)
            writer.mark_complete()
            return _Staged(index, model.small, model_dir)
    except BaseException as exc:
        problem = leave_failed(args.segment, _reason(exc), writer=writer)
        if model_dir is not None:
            remove_model_dir(model_dir)
        if problem is not None:
            print(f"modelload stage: {problem}", file=sys.stderr)
        raise
    finally:
        if writer is not None:
            writer.close()


class _Terminated(KeyboardInterrupt):
    """SIGTERM, raised in the main thread so the failed stage is cleaned up as after Ctrl-C."""


@contextlib.contextmanager
def _terminated_as_interrupt() -> Iterator[None]:
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def terminate(signum: int, frame: object) -> None:
        raise _Terminated

    previous = signal.signal(signal.SIGTERM, terminate)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@dataclass
class _Model:
    """A local model's open readers (one per weight file), its merged index, and its small files."""

    readers: list[ModelReader]
    index: ModelIndex
    small: list[str] | None
    """A directory's small files; None for a single file."""


@contextlib.contextmanager
def _open_model(source: Path, fmt: str, key: DecryptionKey | None, *, verify: bool) -> Iterator[_Model]:
    if not source.is_dir():
        kind = _kind(source, fmt, key)
        with open_model_file(source, kind, key, verify=verify) as reader:
            yield _Model([reader], reader.index, None)
        return
    chosen = local_model_files(source, format=fmt)
    check_small_files({n: (source / n).stat().st_size for n in chosen.small}, where=f"{source}/")
    kind_of = lambda path: _kind(path, fmt, key)  # noqa: E731 - a refusal per file, as for one file
    with open_weight_files(source, chosen.weights, key, verify=verify, kind_of=kind_of) as (readers, index):
        yield _Model(readers, index, list(chosen.small))


def _kind(path: Path, fmt: str, key: DecryptionKey | None) -> str:
    kind = named_kind(path, fmt)
    if kind not in ("tensorizer", "safetensors"):
        what, hint = {
            "torch": ("a torch checkpoint", "convert it first with modelload serialize"),
            "segment": ("a modelload segment already", "attach to it, or stage the model file it came from"),
        }[kind]
        raise ConfigError(f"{path} is {what}, not a tensorizer or safetensors file: {hint}")
    if key is not None and kind != "tensorizer":
        raise ConfigError(f"a key or password was given, but {path} is a {kind} file, never encrypted")
    return kind


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


def _volume(segment: Path) -> Volume:
    """The memory under the segment's folder (4 KiB pages when it does not exist: create() says so)."""
    try:
        return volume_of(segment.parent)
    except OSError:
        return Volume("small")


def _layout(source: Path, model: _Model, model_dir: Path | None, page_size: int) -> Layout:
    index = model.index
    several = bool(index.files)
    specs = [TensorSpec(t.name, t.dtype, t.shape, file=t.file if several else None) for t in index.tensors]
    size = sum(Path(r.path).stat().st_size for r in model.readers)
    metadata = {
        "format": index.format,
        "source": str(source.resolve()),
        "source_size": str(size),
        "writer": f"modelload-stage {modelload_version()}",
    }
    if model_dir is not None:
        metadata[MODEL_DIR_KEY] = str(model_dir)
    return plan_layout(specs, metadata=metadata, files=index.files, page_size=page_size)


def _fill(
    readers: list[ModelReader],
    writer: SegmentWriter,
    finisher: TensorFinisher,
    *,
    threads: int,
    bar: ProgressBar,
    kernel_copy: bool = True,
) -> None:
    """Land and finish every slot with ``threads`` threads, tensors handed out in file order.

    The segment's slots follow the files in order, each file's tensors in its own order. Landing is this
    command's own (a kernel copy, or one ``preadv`` of a record); the threads (:func:`run_in_order`) and the
    finishing (:class:`TensorFinisher`: decrypt, verify, publish) are the sidecar's.
    """
    jobs: list[tuple[ModelReader, TensorEntry, _KernelCopy | None]] = []
    copiers: list[_KernelCopy] = []
    for reader in readers:
        copier = None
        if kernel_copy and reader.index.format == "safetensors":  # stored as it loads: no header to open
            copier = _KernelCopy(reader, writer)
            copiers.append(copier)
        jobs.extend((reader, entry, copier) for entry in reader.index.tensors)

    progress = threading.Lock()

    def load(i: int) -> None:
        """Land and finish slot ``i``, or mark it FAILED."""
        reader, entry, copier = jobs[i]
        try:
            header = None
            if copier is None or not copier(entry, i):
                header = reader.read_record(entry, writer.slot(i))
            finisher.finish(i, entry=entry, header=header, source=reader.path)
        except BaseException as exc:
            writer.mark_tensor_failed(i)
            if isinstance(exc, OSError):
                raise _translate(exc, entry.name, reader) from None
            raise
        with progress:
            bar.update(entry.nbytes)

    try:
        run_in_order(len(jobs), load, threads=threads, name="stage")
    finally:
        for copier in copiers:
            copier.close()
    finisher.settle()


class _KernelCopy:
    """Copies a tensor's stored bytes into its slot inside the kernel (``copy_file_range``), where it can."""

    def __init__(self, reader: ModelReader, writer: SegmentWriter) -> None:
        self._path = reader.path
        self._writer = writer
        self._src = os.open(reader.path, os.O_RDONLY | os.O_CLOEXEC)
        self._kernel_copy = hasattr(os, "copy_file_range")
        self._lock = threading.Lock()

    def __call__(self, entry: TensorEntry, slot: int) -> bool:
        """Copy ``entry``'s data into ``slot``; False when this kernel or filesystem cannot (read it)."""
        if not (self._kernel_copy and entry.data_length):
            return False
        try:
            self._copy(entry.data_offset, self._writer.layout.slots[slot].offset, entry.data_length)
            return True
        except OSError as exc:
            if exc.errno not in _NO_KERNEL_COPY:
                raise
            with self._lock:
                self._kernel_copy = False
            return False

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
                    source=self._path,
                )
            done += count

    def close(self) -> None:
        os.close(self._src)


def _translate(exc: OSError, tensor: str, reader: ModelReader) -> ModelloadError:
    full = full_volume(exc, f"no room in the segment's volume while loading tensor {tensor!r}")
    if full is not None:
        return full
    source = reader.path
    return SourceError(f"loading tensor {tensor!r} from {source} failed: {exc.strerror or exc}", uri=source)


def _reason(exc: BaseException) -> str:
    """What a reader of the failed segment is told."""
    if isinstance(exc, _Terminated):
        return "modelload stage was stopped (SIGTERM)"
    if isinstance(exc, KeyboardInterrupt):
        return "modelload stage was interrupted"
    if isinstance(exc, ModelloadError):
        return str(exc)
    return f"{type(exc).__name__}: {exc}"
