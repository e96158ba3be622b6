"""The processes the GPU benchmark starts (sidecars, the keeper), each stopped when its case ends, and all of
them when a case is cut short or the run ends."""

from __future__ import annotations

import argparse
import contextlib
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

__all__ = ["sidecar", "spawn", "stop", "stop_all"]

CHILDREN: list[subprocess.Popen[bytes]] = []


def spawn(argv: list[str], **kwargs: Any) -> subprocess.Popen[bytes]:
    process = subprocess.Popen(argv, **kwargs)
    CHILDREN.append(process)
    return process


def stop(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=30)
    with contextlib.suppress(ValueError):
        CHILDREN.remove(process)


def stop_all() -> None:
    for process in list(CHILDREN):
        stop(process)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def sidecar(
    source: Path, segment: Path, mode: str, args: argparse.Namespace, *, ring: int = 0
) -> Iterator[float]:
    """A ``modelload sidecar`` loading ``source`` into ``segment``; yields when the segment appears (the
    monotonic time of that moment: the load's first byte is right after)."""
    argv = [
        sys.executable, "-m", "modelload.loader.cli.main", "sidecar", "--source", str(source),
        "--segment", str(segment), "--readers", str(args.readers), "--chunk-size", "32MiB",
        "--host", "127.0.0.1", "--port", str(_free_port()), "--memory-mode", mode,
        "--notify", f"ipc://{segment.parent}/notify-{segment.stem}.sock",
    ]  # fmt: skip
    if mode == "ring":
        argv += ["--ring-size", str(ring)]
    log = segment.with_suffix(".log")  # a file, not a pipe: a pipe nobody reads would stall a chatty sidecar
    with log.open("wb") as err:
        process = spawn(argv, stdout=subprocess.DEVNULL, stderr=err)
    try:
        deadline = time.monotonic() + 120
        while not segment.exists():
            if process.poll() is not None:
                raise RuntimeError(f"the {mode} sidecar died: {log.read_text(errors='replace')[-2000:]}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the {mode} sidecar made no segment in 120 s")
            time.sleep(0.001)
        yield time.monotonic()
    finally:
        stop(process)
        for path in segment.parent.glob(f"{segment.name}*"):
            path.unlink(missing_ok=True)
