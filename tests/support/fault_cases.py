"""The fault suite's cases: each transient fault against the index read and against a data range, over HTTP
(nginx) and S3 (moto), behind the fault proxy. The test suite runs each case once
(``tests/sidecar/test_fault_suite.py``); ``benchmarks/fault_suite.py`` runs each many times.

A case loads a small model with the real engine through a :class:`~tests.support.fault_proxy.FaultProxy`
whose *n*-th GET breaks: the first GET is the look-up and the index read at once (a range of the file's first
512 KiB, which holds the header), the second the first data range. The run passes when the load
ends COMPLETE, byte-exact, and the fault was applied and retried.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from modelload.loader.errors import ModelloadError
from modelload.loader.segment import SegmentReader, WriterState
from modelload.sidecar.load import LoadSettings
from modelload.sidecar.load.engine import Engine
from modelload.sidecar.progress import LoadTracker
from modelload.sidecar.sources import HttpSettings, RetryPolicy, S3Settings, SourceSettings
from tests.support.fault_proxy import (
    Fault,
    FaultProxy,
    Reset,
    Respond,
    Stall,
    Truncate,
    server_error,
    slow_down,
)

__all__ = ["FAULTS", "ORIGINS", "TARGETS", "Outcome", "queue_fault", "run_case", "source_settings"]

Target = Literal["index", "data"]
TARGETS: tuple[Target, ...] = ("index", "data")
ORIGINS = ("http", "s3")
PASS = Stall(after=0, seconds=0.0)
"""A fault that changes nothing: lets one request through."""


def _unavailable() -> Respond:
    return Respond(503, b"Service Unavailable\n", (("Content-Type", "text/plain"),))


FAULTS: dict[str, Callable[[Target], Fault]] = {
    "reset": lambda target: Reset(after=_into(target)),
    "truncation": lambda target: Truncate(after=_into(target)),
    "500": lambda target: server_error(),
    "503": lambda target: _unavailable(),
    "slowdown": lambda target: slow_down(retry_after=0.05),
    "stall": lambda target: Stall(after=_into(target), seconds=1.0),
}
"""Each fault, for a target. A fault in the body strikes 1000 bytes into the index read (512 KiB, the look-up
too: it is tried again whole) and at a data range's first byte (the second request may be a small range: a
chunk of small tensors, or a sample)."""


def _into(target: Target) -> int:
    return 1000 if target == "index" else 0


RETRY = RetryPolicy(attempts=4, initial_backoff=0.01, max_backoff=0.05, jitter=0.0, deadline=20.0)
HTTP = HttpSettings(connect_timeout=2.0, stall_timeout=0.3)
"""The defaults scaled down a hundredfold (a 30 s stall timeout becomes 0.3 s), as the fault tests do."""


def source_settings(origin: str, proxy: FaultProxy) -> SourceSettings:
    if origin == "s3":
        return SourceSettings(
            s3=S3Settings(endpoint_url=proxy.endpoint, addressing="path"), http=HTTP, retry=RETRY
        )
    return SourceSettings(http=HTTP, retry=RETRY)


def queue_fault(proxy: FaultProxy, fault: Fault, target: Target) -> None:
    """Break the index read (the first GET, which is the look-up too) or the first data range (the second)."""
    proxy.push(*([] if target == "index" else [PASS]), fault)


@dataclass(frozen=True)
class Outcome:
    """How one run ended."""

    complete: bool
    exact: bool
    retries: int
    applied: bool
    """The proxy applied the fault to a request."""
    seconds: float
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.complete and self.exact and self.applied and self.retries >= 1


def run_case(
    *,
    url: str,
    fault: Fault,
    target: Target,
    proxy: FaultProxy,
    sources: SourceSettings,
    segment: Path,
    expected: dict[str, bytes],
) -> Outcome:
    """Load ``url`` into ``segment`` with ``fault`` on ``target``; compare every tensor with ``expected``."""
    proxy.clear()
    segment.unlink(missing_ok=True)  # else the second run of a case would reuse the first one's segment
    before = len(proxy.requests)
    queue_fault(proxy, fault, target)
    tracker = LoadTracker()
    started = time.monotonic()
    error = None
    try:
        settings = LoadSettings(source=url, segment=segment, readers=3, chunk_size=64 << 10)
        Engine(settings, sources=sources, observer=tracker).run()
    except ModelloadError as exc:
        error = f"{type(exc).__name__}: {exc}"
    seconds = time.monotonic() - started
    status = tracker.snapshot()
    applied = any(r.fault == fault for r in proxy.requests[before:])
    exact = error is None and _exact(segment, expected)
    return Outcome(status.phase == "complete", exact, status.retries, applied, seconds, error)


def _exact(segment: Path, expected: dict[str, bytes]) -> bool:
    with SegmentReader.open(segment) as reader:
        if reader.writer_state != WriterState.COMPLETE or sorted(reader.by_name) != sorted(expected):
            return False
        return all(bytes(reader.view(reader.by_name[name])) == data for name, data in expected.items())
