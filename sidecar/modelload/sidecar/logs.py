"""What the sidecar writes to its log: the load's milestones and progress, as text or JSON lines.

:class:`LoggingObserver` is the load observer behind ``kubectl logs``; :func:`describe_progress` is the line
the process logs every few seconds while loading. ``--log-format`` (``MODELLOAD_LOG_FORMAT``) picks text
lines or one JSON object per line; it is kept apart from the sidecar's settings table so the choice is one
flag and one call in the CLI, and the formatter is the loader's (:mod:`modelload.loader._logjson`), shared
with the operator.
"""

from __future__ import annotations

import argparse
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

from modelload.loader._logjson import LogFormat, parse_log_format, use_log_format
from modelload.loader.options import Lookup, Option, add_arguments
from modelload.loader.sizes import format_bytes
from modelload.sidecar.sources import display_url

if TYPE_CHECKING:
    from modelload.sidecar.progress import LoadStatus

__all__ = ["ENV", "LoggingObserver", "add_log_format", "apply_log_format", "describe_progress"]

log = logging.getLogger("modelload.sidecar")

ENV = "MODELLOAD_LOG_FORMAT"


_OPTIONS = (
    Option(
        "log_format", "--log-format", ENV,
        "text (default) or json: one JSON object per line, for a log pipeline", "FORMAT",
    ),
)  # fmt: skip


def add_log_format(parser: argparse.ArgumentParser) -> None:
    add_arguments(parser, _OPTIONS)


def log_format(args: argparse.Namespace, environ: Mapping[str, str]) -> LogFormat:
    """The flag, else the variable, else ``text``; :class:`ConfigError` for anything else."""
    return Lookup(_OPTIONS, vars(args), environ).get("log_format", parse_log_format, "text")


def apply_log_format(args: argparse.Namespace, environ: Mapping[str, str]) -> None:
    """Call after the sidecar's logging is configured: switch its handlers to the chosen format."""
    use_log_format(log_format(args, environ))


# --- the load's log -----------------------------------------------------------------------------------


def describe_progress(status: LoadStatus) -> str:
    """One line of progress: ``loading: 45.2% 1.2 GiB/2.7 GiB, 800.0 MiB/s, 120/291 tensors, ETA 2 s``."""
    share = status.bytes_done / status.bytes_total if status.bytes_total else 0.0
    eta = status.eta
    return (
        f"{status.phase}: {share:.1%} {format_bytes(status.bytes_done)}/{format_bytes(status.bytes_total)},"
        f" {format_bytes(status.throughput)}/s, {status.tensors_ready}/{status.tensors_total} tensors,"
        f" {status.retries} retries, ETA {'?' if eta is None else f'{eta:.0f} s'}"
    )


class LoggingObserver:
    """Logs a load's milestones at INFO, its retries and failure at WARNING/ERROR, each tensor at DEBUG.

    Sources are shown without user info or query strings (:func:`display_url`), and the engine's
    messages never hold credentials (the error tree's rule). Retries are logged at most once per
    ``retry_interval`` seconds, with a count of those left out, so a flapping source cannot flood the log.
    ``clock`` (monotonic seconds) times that interval; tests pass their own.
    """

    def __init__(
        self,
        *,
        logger: logging.Logger = log,
        retry_interval: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._log = logger
        self._interval = retry_interval
        self._clock = clock
        self._lock = threading.Lock()
        self._last_retry = float("-inf")
        self._quiet = 0

    def load_started(self, *, source: str, segment: str) -> None:
        self._log.info("loading %s into %s", display_url(source), segment)

    def manifest_published(self, *, model_format: str, tensors: int, nbytes: int, notify: str | None) -> None:
        self._log.info(
            "manifest published: %d tensors, %s, %s; apps can attach now",
            tensors,
            format_bytes(nbytes),
            model_format,
        )

    def tensor_ready(self, *, index: int, name: str, nbytes: int) -> None:
        self._log.debug("tensor %d ready: %s (%d bytes)", index, name, nbytes)

    def tensors_published(
        self, *, indices: Sequence[int], names: Sequence[str], nbytes: Sequence[int]
    ) -> None:
        if self._log.isEnabledFor(logging.DEBUG):  # else nothing per tensor: a range holds thousands
            for index, name, size in zip(indices, names, nbytes, strict=True):
                self.tensor_ready(index=index, name=name, nbytes=size)

    def retried(self, *, kind: str, message: str) -> None:
        now = self._clock()
        with self._lock:
            if now - self._last_retry < self._interval:
                self._quiet += 1
                return
            self._last_retry, quiet, self._quiet = now, self._quiet, 0
        more = f" ({quiet} more retries not logged)" if quiet else ""
        self._log.warning("retrying a range (%s): %s%s", kind, message, more)

    def load_finished(self, *, seconds: float, nbytes: int) -> None:
        rate = nbytes / seconds if seconds > 0 else 0.0
        self._log.info(
            "load complete: %s in %.2f s (%s/s)", format_bytes(nbytes), seconds, format_bytes(rate)
        )

    def load_failed(self, *, kind: str, reason: str) -> None:
        if kind == "stopped":
            self._log.warning("load stopped before it finished: %s", reason)
        else:
            self._log.error(
                "load failed (%s): %s; the sidecar keeps serving /status and /readyz (500)", kind, reason
            )

    def load_retrying(self, *, kind: str, reason: str, attempt: int, delay: float) -> None:
        self._log.warning(
            "load attempt %d failed (%s): %s; the whole load starts again in %.0f s",
            attempt,
            kind if kind == "transient" else f"{kind}; transient",
            reason,
            delay,
        )
