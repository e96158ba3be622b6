"""``modelload inspect FILE``: what a tensorizer file, safetensors file, model directory or segment holds,
and whether its bytes match their hashes.

A model directory (shards beside config and tokenizer) is shown as the one model the sidecar loads: every
tensor across its weight files (each row says its file), totals, a line per weight file, and which files
are copied to the model directory and which are ignored.

The file's kind comes from its content. Everything but the tensor data is shown without a key: names,
dtypes and shapes of an encrypted tensorizer file are stored in clear. ``--verify`` reads every tensor:
tensorizer tensors are decrypted (with a key) and checked against their CRC32 and SHA-256; a segment's
tensors against the CRC32 and SHA-256 its writer recorded, where it recorded them; safetensors stores no
hashes, so its tensors are only read to the end.

The report is built once as the JSON document that ``--json`` prints (keys in :data:`JSON_KEYS`), and the
human output is rendered from it (:mod:`._inspect_output`), so the two never disagree.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import sys
import time
from pathlib import Path
from typing import Any

from modelload.loader.cli._common import (
    add_decryption_options,
    decryption_key,
    local_model_files,
    local_path,
    named_kind,
    sniff,
    translate_os_error,
)
from modelload.loader.cli._inspect_output import Report, render
from modelload.loader.cli.progress import ProgressBar
from modelload.loader.errors import (
    ConfigError,
    FormatError,
    MissingKeyError,
    NotEncryptedError,
    WrongKeyError,
)
from modelload.loader.formats import ModelIndex, ModelReader, merge_indexes, open_reader
from modelload.loader.formats.tensorizer import DecryptionKey
from modelload.loader.formats.tensorizer.hashes import crc32
from modelload.loader.segment import SegmentReader, TensorFlags, TensorState

__all__ = ["JSON_KEYS", "register", "run"]

JSON_KEYS = """\
JSON output (--json), one document:
  path          the file inspected
  format        "tensorizer", "safetensors" or "segment"
  version       tensorizer data version; 1 for safetensors; the segment layout version
  file_size     bytes of the file
  tensor_count  number of tensors
  total_bytes   bytes of all tensors in memory
  encrypted     true for an encrypted tensorizer file
  encryption    null, or {"key": "raw" | "password", "argon2": {"opslimit", "memlimit"} | null,
                "chunk_size"} read from the first tensor's header
  metadata      the file's string metadata (safetensors __metadata__, segment metadata)
  dtypes        {dtype: {"count", "bytes"}}, largest first
  tensors       every tensor, in file order: {"name", "dtype", "shape", "bytes", "offset"}; tensorizer
                adds "kind" and "data_length" (0 for a meta tensor); segments add "state", "flags",
                "crc32" (or null), "sha256" (or null), "ready_ns"
  files         directories and segments of several files: the weight files, in load order, each
                {"name", "file_size", "tensor_count", "total_bytes"} (segments: {"name"}); tensors then
                add "file"
  small_files   directories only: the files copied into the model directory; "ignored": the rest
  segment       segments only: {"writer_state", "writer_pid", "load_id", "created_ns", "finished_ns",
                "heartbeat_ns", "tensors_ready", "bytes_ready", "error"}
  verify        with --verify: {"ok", "checked", "bytes", "seconds", "failures": [{"name", "error"}],
                "note"}; absent otherwise"""

VERIFY_WINDOW = 8 << 20
"""Bytes --verify reads at a time: its memory, whatever the tensors' sizes (plus one encryption chunk of
an encrypted file when its chunks are larger, which the file's own bytes bound)."""


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "inspect",
        help="show what a model file or segment holds; --verify checks its hashes",
        description=(
            "Show a tensorizer file, a safetensors file, a modelload segment (detected by content)\n"
            "or a model directory of shards (as one model): format, tensors, bytes, encryption,\n"
            "metadata, dtypes. An encrypted file's index is readable without its key. Local paths\n"
            "only: for s3:// or http(s)://, load the model with `modelload sidecar` and inspect its\n"
            "segment."
        ),
        epilog=JSON_KEYS,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("file", metavar="FILE", help="the file or model directory to inspect")
    parser.add_argument("--json", action="store_true", help="print one JSON document with every tensor")
    rows = parser.add_mutually_exclusive_group()
    rows.add_argument("--limit", metavar="N", type=int, default=50, help="tensor rows to show (default 50)")
    rows.add_argument("--all", action="store_true", help="show every tensor")
    parser.add_argument(
        "--verify",
        action="store_true",
        help="read every tensor and check its hashes; exits 1 when one does not match",
    )
    parser.add_argument(
        "--format",
        choices=("auto", "tensorizer", "safetensors"),
        default="auto",
        help="which weights of a directory holding both to show; a file's format is checked against it "
        "(default: detected)",
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar on standard error")
    add_decryption_options(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Inspect ``args.file``; exit status 1 when ``--verify`` found a bad tensor."""
    if args.limit < 0:
        raise ConfigError("--limit must be 0 or more")
    path = local_path(
        args.file,
        command="inspect",
        remote="`modelload sidecar --source URI --segment PATH`, then `modelload inspect PATH`",
    )
    key = decryption_key(args)
    if path.is_dir():
        report = _inspect_directory(
            path, key, verify=args.verify, progress=not args.no_progress, fmt=args.format
        )
        return _emit(report, args)
    kind = named_kind(path, args.format)
    if kind == "torch":
        raise ConfigError(
            f"{path} is a torch checkpoint; inspect reads tensorizer and safetensors files and segments: "
            "convert it first (modelload serialize)"
        )
    if key is not None and kind != "tensorizer":
        raise ConfigError(f"a key or password was given, but {path} is a {kind}, which is never encrypted")
    try:
        if kind == "segment":
            report = _inspect_segment(path, verify=args.verify, progress=not args.no_progress)
        else:
            report, _ = _inspect_file(path, kind, key, verify=args.verify, progress=not args.no_progress)
    except OSError as exc:
        raise translate_os_error(exc, path) from None
    return _emit(report, args)


def _emit(report: Report, args: argparse.Namespace) -> int:
    if args.json:
        sys.stdout.write(json.dumps(report, ensure_ascii=False) + "\n")
    else:
        sys.stdout.write(render(report, limit=None if args.all else args.limit))
    verified = report.get("verify")
    return 1 if verified is not None and not verified["ok"] else 0


# --- model files -------------------------------------------------------------------------------------------


def _inspect_file(
    path: Path,
    kind: str,
    key: DecryptionKey | None,
    *,
    verify: bool,
    progress: bool,
    bar: ProgressBar | None = None,
) -> tuple[Report, ModelIndex]:
    with open_reader(path, "tensorizer" if kind == "tensorizer" else "safetensors", key=key) as reader:
        index = reader.index
        if verify and index.encrypted and key is None:
            raise MissingKeyError(
                f"{path} is encrypted: verifying decrypts it, so give its key (--key-file) or password "
                "(--password-file, --password-env); without --verify its index is shown without one"
            )
        report = _index_report(path, index)
        if index.format == "tensorizer":  # record kinds and stored lengths: only tensorizer has them
            report["encryption"] = _encryption(reader)
            for row, entry in zip(report["tensors"], index.tensors, strict=True):
                row.update(kind=entry.kind, data_length=entry.data_length)
        if verify:
            report["verify"] = _verify_file(reader, index, progress=progress, bar=bar)
    return report, index


def _index_report(path: Path, index: ModelIndex) -> Report:
    tensors = [
        {
            "name": t.name,
            "dtype": t.dtype.name,
            "shape": list(t.shape),
            "bytes": t.nbytes,
            "offset": t.data_offset,
        }
        for t in index.tensors
    ]
    return {
        "path": str(path),
        "format": index.format,
        "version": index.version,
        "file_size": path.stat().st_size,
        "tensor_count": len(index.tensors),
        "total_bytes": index.nbytes,
        "encrypted": index.encrypted,
        "encryption": None,
        "metadata": dict(index.metadata),
        "dtypes": _histogram(tensors),
        "tensors": tensors,
    }


def _encryption(reader: ModelReader) -> dict[str, Any] | None:
    """How an encrypted file's key is made, from the first tensor with data (stored in clear)."""
    if not reader.index.encrypted:
        return None
    entry = next((t for t in reader.index.tensors if t.data_length), None)
    if entry is None:
        return {"key": "unknown", "argon2": None, "chunk_size": None}
    header = reader.read_header(entry)
    crypt = header.crypt if header is not None else None
    kdf = crypt.kdf if crypt is not None else None
    cipher = crypt.cipher if crypt is not None else None
    return {
        "key": "password" if kdf is not None else "raw",
        "argon2": {"opslimit": kdf.opslimit, "memlimit": kdf.memlimit} if kdf is not None else None,
        "chunk_size": cipher.chunk_size if cipher is not None else None,
    }


def _verify_file(
    reader: ModelReader, index: ModelIndex, *, progress: bool, bar: ProgressBar | None = None
) -> Report:
    """Check every tensor of one file; ``bar``, a directory's, counts them towards the whole model."""
    # One window for every tensor, whatever they declare: a file may claim terabytes (a meta tensor costs
    # nothing on disk), so memory must follow the window, never a tensor's size.
    scratch = memoryview(bytearray(VERIFY_WINDOW))
    if index.format == "tensorizer":
        note = "CRC32 and SHA-256 of every tensor checked" + (" after decryption" if index.encrypted else "")
    else:
        note = "safetensors stores no hashes: every tensor was read to its end, nothing could be compared"
    failures: list[dict[str, str]] = []
    wrong_key: WrongKeyError | None = None
    started = time.monotonic()
    counting = (
        ProgressBar(index.nbytes, "verify", enabled=progress) if bar is None else contextlib.nullcontext(bar)
    )
    with counting as shown:
        for entry in index.tensors:
            try:
                reader.check(entry, scratch=scratch)
            except WrongKeyError as exc:  # also what a corrupt first chunk looks like: decided below
                wrong_key = wrong_key or exc
                failures.append({"name": entry.name, "error": str(exc), "wrong_key": "yes"})
            except (FormatError, NotEncryptedError) as exc:
                failures.append({"name": entry.name, "error": str(exc)})
            shown.update(entry.nbytes)
    if wrong_key is not None and len(failures) == len(index.tensors):
        raise wrong_key  # no tensor opened: the key is wrong, not every tensor corrupt
    for failure in failures:  # other tensors opened with this key: those that did not are corrupt
        if failure.pop("wrong_key", None):
            failure["error"] = (
                "its encrypted bytes fail authentication although the same key opened other tensors of "
                "this file: the file is corrupt (the key is right); re-upload or re-create it"
            )
    return _verify_report(len(index.tensors), index.nbytes, time.monotonic() - started, failures, note)


def _verify_report(
    checked: int, nbytes: int, seconds: float, failures: list[dict[str, str]], note: str
) -> Report:
    return {
        "ok": not failures,
        "checked": checked,
        "bytes": nbytes,
        "seconds": round(seconds, 3),
        "failures": failures,
        "note": note,
    }


# --- model directories -------------------------------------------------------------------------------------


def _inspect_directory(
    path: Path, key: DecryptionKey | None, *, verify: bool, progress: bool, fmt: str
) -> Report:
    """One report over a directory's weight files, as the one model they make."""
    where = f"{path}/"
    chosen = local_model_files(path, format=fmt)
    kinds = {name: sniff(path / name) for name in chosen.weights}
    for name, kind in kinds.items():
        if kind not in ("tensorizer", "safetensors"):
            raise ConfigError(f"{path / name} is a {kind}, not a tensorizer or safetensors weight file")
    reports = []
    indexes = []
    for name in chosen.weights:
        try:
            one, index = _inspect_file(path / name, kinds[name], key, verify=False, progress=False)
        except OSError as exc:
            raise translate_os_error(exc, path / name) from None
        reports.append(one)
        indexes.append((name, index))
    merge_indexes(indexes, where=where)  # the sidecar's rules: one format, names unique across shards
    if verify:
        with ProgressBar(sum(r["total_bytes"] for r in reports), "verify", enabled=progress) as bar:
            for i, name in enumerate(chosen.weights):
                reports[i], _ = _inspect_file(
                    path / name, kinds[name], key, verify=True, progress=progress, bar=bar
                )
    tensors = [
        {**row, "file": name} for name, r in zip(chosen.weights, reports, strict=True) for row in r["tensors"]
    ]
    report: Report = {
        "path": str(path),
        "format": reports[0]["format"],
        "version": max(r["version"] for r in reports),
        "file_size": sum(r["file_size"] for r in reports),
        "tensor_count": len(tensors),
        "total_bytes": sum(r["total_bytes"] for r in reports),
        "encrypted": reports[0]["encrypted"],
        "encryption": reports[0]["encryption"],
        "metadata": reports[0]["metadata"],
        "dtypes": _histogram(tensors),
        "tensors": tensors,
        "files": [
            {
                "name": name,
                "file_size": r["file_size"],
                "tensor_count": r["tensor_count"],
                "total_bytes": r["total_bytes"],
            }
            for name, r in zip(chosen.weights, reports, strict=True)
        ],
        "small_files": list(chosen.small),
        "ignored": list(chosen.ignored),
    }
    if verify:
        checks = [r["verify"] for r in reports]
        report["verify"] = _verify_report(
            sum(c["checked"] for c in checks),
            sum(c["bytes"] for c in checks),
            sum(c["seconds"] for c in checks),
            [f for c in checks for f in c["failures"]],
            checks[0]["note"],
        )
    return report


# --- segments ----------------------------------------------------------------------------------------------


def _inspect_segment(path: Path, *, verify: bool, progress: bool) -> Report:
    with SegmentReader.open(path) as reader:
        mask = reader.ready_mask()
        tensors = []
        for slot in reader.slots:
            flags = reader.flags(slot.index)
            tensors.append(
                {
                    "name": slot.name,
                    "dtype": slot.dtype.name,
                    "shape": list(slot.shape),
                    "bytes": slot.nbytes,
                    "offset": slot.offset,
                    "state": reader.state(slot.index).name,
                    "flags": [f.name.lower() for f in TensorFlags if f and f in flags and f.name],
                    "crc32": reader.crc32(slot.index),
                    "sha256": slot.sha256,
                    "ready_ns": reader.ready_ns(slot.index),
                    **({"file": reader.files[slot.file]} if slot.file is not None else {}),
                }
            )
        report: Report = {
            "path": str(path),
            "format": "segment",
            "version": reader.header.layout_version,
            "file_size": reader.header.segment_length,
            "tensor_count": len(reader.slots),
            "total_bytes": sum(s.nbytes for s in reader.slots),
            "encrypted": False,
            "encryption": None,
            "metadata": dict(reader.metadata),
            "dtypes": _histogram(tensors),
            "tensors": tensors,
            **({"files": [{"name": name} for name in reader.files]} if reader.files else {}),
            "segment": {
                "writer_state": reader.writer_state.name,
                "writer_pid": reader.writer_pid,
                "load_id": f"{reader.load_id:016x}",
                "created_ns": reader.header.created_ns,
                "finished_ns": reader.finished_ns,
                "heartbeat_ns": reader.heartbeat_ns,
                "tensors_ready": int(mask.sum()),
                "bytes_ready": sum(s.nbytes for s, ready in zip(reader.slots, mask, strict=True) if ready),
                "error": reader.error,
            },
        }
        if verify:
            report["verify"] = _verify_segment(reader, progress=progress)
    return report


def _verify_segment(reader: SegmentReader, *, progress: bool) -> Report:
    failures: list[dict[str, str]] = []
    checked = unchecked = pending = 0
    started = time.monotonic()
    total = sum(s.nbytes for s in reader.slots)
    with ProgressBar(total, "verify", enabled=progress) as bar:
        for slot in reader.slots:
            bar.update(slot.nbytes)
            if reader.state(slot.index) != TensorState.READY:
                pending += 1
                continue
            crc = reader.crc32(slot.index)
            if crc is None and slot.sha256 is None:
                unchecked += 1
                continue
            view = reader.view(slot.index)
            found = crc32(view) if crc is not None else None
            sha_differs = (
                slot.sha256 is not None and found == crc and hashlib.sha256(view).hexdigest() != slot.sha256
            )
            if reader.state(slot.index) != TensorState.READY:  # released while it was read: not a fault
                pending += 1
                continue
            checked += 1
            if found is not None and found != crc:
                failures.append({"name": slot.name, "error": f"CRC32 is {found:08x}, recorded {crc:08x}"})
            elif sha_differs:
                failures.append({"name": slot.name, "error": "SHA-256 differs from the one in the manifest"})
    parts = [f"{checked} tensors checked against the hashes their writer recorded"]
    if unchecked and not checked:
        parts = [
            f"nothing was checked: the writer recorded no hash for any of the {unchecked} ready tensors "
            "(an older modelload); write the segment again to get one"
        ]
    elif unchecked:
        parts.append(f"{unchecked} have no recorded hash")
    if pending:
        parts.append(f"{pending} are not ready")
    return _verify_report(checked, total, time.monotonic() - started, failures, "; ".join(parts))


# --- the report's shared parts -----------------------------------------------------------------------------


def _histogram(tensors: list[dict[str, Any]]) -> dict[str, dict[str, int]]:
    counts: dict[str, dict[str, int]] = {}
    for row in tensors:
        slot = counts.setdefault(row["dtype"], {"count": 0, "bytes": 0})
        slot["count"] += 1
        slot["bytes"] += row["bytes"]
    return dict(sorted(counts.items(), key=lambda item: (-item[1]["bytes"], item[0])))
