"""The sidecar's load engine in a thread of the test process, as the sidecar runs it, for tests that consume a
segment while it loads (memory modes release and ring) without a sidecar process between them."""

from __future__ import annotations

import threading
from pathlib import Path

from modelload.sidecar.load import LoadSettings
from modelload.sidecar.load.engine import Engine
from modelload.sidecar.memory import MemorySettings
from modelload.sidecar.progress import LoadTracker
from modelload.sidecar.sources import SourceSettings
from tests.support.waiting import wait_for


class EngineThread:
    """Loads ``source`` into ``segment``; returns once the segment exists (a reader may attach)."""

    def __init__(self, source: Path, segment: Path, memory: MemorySettings, *, timeout: float = 30) -> None:
        self.engine = Engine(
            LoadSettings(source=str(source), segment=segment, chunk_size=64 << 10, memory=memory, readers=2),
            sources=SourceSettings(),
            observer=LoadTracker(),
        )
        self.segment = segment
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name="test-engine", daemon=True)
        self.thread.start()
        wait_for(self._segment_appeared, timeout=timeout, what=f"a segment at {segment}", interval=0.002)

    def _segment_appeared(self) -> bool:
        assert self.thread.is_alive() or self.segment.exists(), (
            f"the load ended before its segment appeared: {self.error!r}"
        )
        return self.segment.exists()

    def _run(self) -> None:
        try:
            self.engine.run()
        except BaseException as exc:
            self.error = exc

    def finish(self, timeout: float = 30) -> None:
        """Wait for the load to end; it must."""
        self.thread.join(timeout)
        assert not self.thread.is_alive(), f"the load did not end in {timeout} s"
