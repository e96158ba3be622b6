"""Sidecars and loads in this process, for tests that drive one: started for a test, stopped at its end.

- ``sidecars`` (function fixture): :class:`Sidecars`; ``sidecars.start(source, segment, *flags)`` builds a
  :class:`~modelload.sidecar.process.Sidecar` from the command line's flags (the status API on a free
  loopback port), starts it and returns it; every one started is stopped after the test.
  :func:`wait_for_phase` waits for its load to reach a phase.
- :class:`BackgroundLoad`: the engine alone, loading in a thread of its own as the sidecar runs it, with a
  tracker to wait on and the error it ended with.

Import the fixture into your area's conftest.py::

    from tests.support.sidecars import sidecars  # noqa: F401
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from modelload.sidecar.load import LoadSettings
from modelload.sidecar.load.engine import Engine, PeerHook
from modelload.sidecar.process import EngineFactory, Sidecar, default_engine
from modelload.sidecar.progress import LoadObserver, LoadStatus, LoadTracker, Observers
from modelload.sidecar.settings import parse_settings
from modelload.sidecar.sources import SourceSettings
from tests.support.waiting import wait_for

__all__ = ["BackgroundLoad", "Sidecars", "sidecars", "wait_for_phase"]

FINAL = ("complete", "failed", "stopped")


class Sidecars:
    """The sidecars one test started in this process."""

    def __init__(self) -> None:
        self.started: list[Sidecar] = []

    def start(
        self,
        source: str,
        segment: Path,
        *flags: str,
        engine_factory: EngineFactory = default_engine,
        environ: dict[str, str] | None = None,
    ) -> Sidecar:
        """Build a sidecar as ``modelload sidecar --source SOURCE --segment SEGMENT FLAGS`` would (its API
        on 127.0.0.1, a free port), start it and return it. ``environ`` stands for the process's."""
        argv = ["--source", source, "--segment", str(segment), "--host", "127.0.0.1", "--port", "0", *flags]
        sidecar = Sidecar(parse_settings(argv, environ=environ or {}), engine_factory=engine_factory)
        self.started.append(sidecar)
        sidecar.start()
        return sidecar

    def stop(self) -> None:
        for sidecar in self.started:
            sidecar.stop()


@pytest.fixture
def sidecars() -> Iterator[Sidecars]:
    running = Sidecars()
    try:
        yield running
    finally:
        running.stop()


def wait_for_phase(sidecar: Sidecar, phase: str, *, timeout: float = 30.0) -> LoadStatus:
    """Wait until ``sidecar``'s load is in ``phase``; fail at once if it ends in another (with its error)."""

    def reached() -> LoadStatus | None:
        status = sidecar.tracker.snapshot()
        assert status.phase == phase or status.phase not in FINAL, (
            f"the load ended {status.phase}: {status.error}"
        )
        return status if status.phase == phase else None

    return wait_for(reached, timeout=timeout, what=f"the sidecar's load {phase}")


class BackgroundLoad:
    """The engine loading in a thread of its own, reporting to :attr:`tracker` (and ``observers``)."""

    def __init__(
        self,
        settings: LoadSettings,
        *,
        sources: SourceSettings | None = None,
        observers: tuple[Any, ...] = (),
        peers: PeerHook | None = None,
    ) -> None:
        self.tracker = LoadTracker()
        observer: LoadObserver = Observers(self.tracker, *observers) if observers else self.tracker
        self.engine = Engine(settings, sources=sources or SourceSettings(), observer=observer, peers=peers)
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name="test-load", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            self.engine.run()
        except BaseException as exc:  # the test asserts on it
            self.error = exc

    def finish(self, timeout: float = 30.0) -> None:
        """Wait for the load to end (stopping it when it does not within ``timeout``, then failing)."""
        self.thread.join(timeout)
        if self.thread.is_alive():
            self.engine.stop()
            self.thread.join(10)
            pytest.fail(f"the load did not end within {timeout:g} s: {self.tracker.snapshot()}")
