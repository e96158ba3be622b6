"""Stopping a child process: ask with a signal, wait, then kill it (test servers and benchmarks)."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

from tests.support.ports import wait_for_port

__all__ = ["start_sidecar", "stop_process", "stop_sidecar"]

REPO = Path(__file__).resolve().parents[2]


def stop_process(
    process: subprocess.Popen[bytes], *, sig: signal.Signals = signal.SIGTERM, timeout: float = 15.0
) -> None:
    """Send ``sig`` unless ``process`` has exited, wait ``timeout`` seconds for it, then SIGKILL it.

    A graceful stop first, so that a server removes its sockets and files; the kill, so a hung child never
    outlives the test or benchmark that started it.
    """
    if process.poll() is None:
        process.send_signal(sig)
    try:
        process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def start_sidecar(args: list[str], *, port: int, script: str | None = None) -> subprocess.Popen[str]:
    """``modelload sidecar ARGS`` (or ``python -c SCRIPT ARGS``) in a process of its own, once it listens on
    ``port``; its standard error is kept for :func:`stop_sidecar`."""
    argv = (
        [sys.executable, "-c", script, *args]
        if script
        else [sys.executable, "-m", "modelload.loader.cli.main", "sidecar", *args]
    )
    process = subprocess.Popen(argv, cwd=REPO, stderr=subprocess.PIPE, text=True)
    if not wait_for_port(port, timeout=20, alive=process):
        process.kill()
        raise AssertionError(f"the sidecar did not listen: {process.communicate()[1]}")
    return process


def stop_sidecar(process: subprocess.Popen[str], *, timeout: float = 20.0) -> tuple[int, str]:
    """SIGTERM, then the exit status and standard error."""
    process.send_signal(signal.SIGTERM)
    _, stderr = process.communicate(timeout=timeout)
    return process.returncode, stderr
