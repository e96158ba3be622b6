"""Stopping a child process: ask with a signal, wait, then kill it (test servers and benchmarks)."""

from __future__ import annotations

import signal
import subprocess

__all__ = ["stop_process"]


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
