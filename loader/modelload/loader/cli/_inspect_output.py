"""The human output of ``modelload inspect``: text rendered from the JSON report, never from the file.

:mod:`~modelload.loader.cli.inspect` builds one report (the document ``--json`` prints); this module only
lays it out for a terminal (a summary, the dtypes, a table of tensors, the verification), so the text and
the JSON cannot disagree.
"""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any

from modelload.loader.sizes import format_bytes

__all__ = ["Report", "render"]

Report = dict[str, Any]
"""An inspect report: the JSON document of ``modelload inspect --json``."""


def render(report: Report, *, limit: int | None) -> str:
    """The human form of a report: a block of fields, the dtype histogram, a table of tensors."""
    lines: list[tuple[str, str]] = [("file", report["path"])]
    kind = report["format"]
    if kind == "safetensors":
        lines.append(("format", kind))  # the format has no version field
    else:
        version = "layout version" if kind == "segment" else "data version"
        lines.append(("format", f"{kind} ({version} {report['version']})"))
    lines.append(("size", f"{format_bytes(report['file_size'])} ({report['file_size']} bytes)"))
    lines.append(("tensors", f"{report['tensor_count']}, {format_bytes(report['total_bytes'])}"))
    if kind == "tensorizer":
        lines.append(("encrypted", _describe_encryption(report)))
    for i, file in enumerate(report.get("files", ())):
        size = (
            f", {file['tensor_count']} tensors, {format_bytes(file['total_bytes'])}"
            if "tensor_count" in file
            else ""
        )
        lines.append(("files" if i == 0 else "", f"{file['name']}{size}"))
    if "small_files" in report:
        lines.append(("model dir", ", ".join(report["small_files"]) or "(none)"))
        if report["ignored"]:
            lines.append(("ignored", ", ".join(report["ignored"])))
    segment = report.get("segment")
    if segment is not None:
        lines.extend(_segment_lines(segment, report))
    metadata = report["metadata"]
    lines.extend(
        ((("metadata" if i == 0 else ""), f"{k} = {v}") for i, (k, v) in enumerate(metadata.items()))
    )
    if not metadata:
        lines.append(("metadata", "(none)"))
    width = max((len(dtype) for dtype in report["dtypes"]), default=0)
    for i, (dtype, row) in enumerate(report["dtypes"].items()):
        lines.append(
            (
                "dtypes" if i == 0 else "",
                f"{dtype:<{width}}  {row['count']:>6} tensors  {format_bytes(row['bytes'])}",
            )
        )
    out = [f"{label:<12}{value}" for label, value in lines]
    out.append("")
    out.extend(_table(report["tensors"], limit, segment is not None))
    verified = report.get("verify")
    if verified is not None:
        out.append("")
        out.extend(_verify_lines(verified))
    return "\n".join(out) + "\n"


def _describe_encryption(report: Report) -> str:
    info = report["encryption"]
    if not report["encrypted"] or info is None:
        return "no"
    if info["key"] == "password":
        argon = info["argon2"]
        return (
            f"yes, key derived from a password (Argon2id, {argon['opslimit']} passes, "
            f"{format_bytes(argon['memlimit'])})"
        )
    return "yes, raw 32-byte key" if info["key"] == "raw" else "yes"


def _segment_lines(segment: dict[str, Any], report: Report) -> list[tuple[str, str]]:
    lines = [
        ("writer", f"{segment['writer_state']} (pid {segment['writer_pid']}), load {segment['load_id']}"),
        (
            "ready",
            f"{segment['tensors_ready']}/{report['tensor_count']} tensors, "
            f"{format_bytes(segment['bytes_ready'])}/{format_bytes(report['total_bytes'])}",
        ),
        ("created", _timestamp(segment["created_ns"])),
    ]
    if segment["finished_ns"]:
        seconds = (segment["finished_ns"] - segment["created_ns"]) / 1e9
        lines.append(("finished", f"{_timestamp(segment['finished_ns'])} ({seconds:.2f} s after created)"))
    if segment["error"]:
        lines.append(("error", segment["error"]))
    flags: dict[str, int] = {}
    for row in report["tensors"]:
        for flag in row["flags"]:
            flags[flag] = flags.get(flag, 0) + 1
    if flags:
        lines.append(("flags", ", ".join(f"{name} {count}" for name, count in flags.items())))
    return lines


def _timestamp(ns: int) -> str:
    return datetime.fromtimestamp(ns / 1e9, tz=timezone.utc).isoformat(timespec="milliseconds")


def _table(tensors: list[dict[str, Any]], limit: int | None, segment: bool) -> list[str]:
    shown = tensors if limit is None else tensors[:limit]
    header = ["name", "dtype", "shape", "bytes"] + (["state"] if segment else [])
    rows = [
        [row["name"], row["dtype"], str(row["shape"]), format_bytes(row["bytes"])]
        + ([row["state"].lower()] if segment else [])
        for row in shown
    ]
    widths = [max(len(r[c]) for r in [header, *rows]) for c in range(len(header))]
    lines = [
        "  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)).rstrip() for r in [header, *rows]
    ]
    hidden = len(tensors) - len(shown)
    if hidden:
        lines.append(f"... {hidden} more tensors (--all shows every one)")
    return lines


def _verify_lines(verified: Report) -> list[str]:
    status = "ok" if verified["ok"] else f"FAILED for {len(verified['failures'])} tensors"
    lines = [f"{'verify':<12}{status}: {verified['note']} ({verified['seconds']:.2f} s)"]
    lines.extend(f"  {failure['name']}: {failure['error']}" for failure in verified["failures"])
    return lines
