"""A scripted stand-in for the engine: it writes a real segment and drives the observers like a real load.

It has the engine's interface (``run`` blocks, ``stop`` from any thread, failures reported to the observer
and the segment before raising), so the sidecar's process, API, metrics and notifications can be tested
with loads that fail, retry or pause exactly where a test wants, which a real source cannot promise.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import numpy as np

from modelload.loader.dtypes import by_name
from modelload.loader.errors import HashMismatchError, ModelloadError
from modelload.loader.segment import SegmentWriter, TensorSpec, plan_layout
from modelload.sidecar.progress import LoadObserver
from modelload.sidecar.settings import SidecarSettings

ELEMENTS = 1024  # float32 elements per tensor: 4 KiB each


class ScriptStopped(ModelloadError):
    """What the scripted engine raises after stop(), as the real one raises LoadStopped."""


def tensor_values(index: int) -> np.ndarray:
    return np.full(ELEMENTS, float(index), dtype=np.float32)


class ScriptedEngine:
    """Loads ``tensors`` tensors of 4 KiB into the segment of ``settings``.

    ``retries``: retry events reported before the first tensor, as ``(kind, message)``.
    ``fail_at``: the index of the tensor whose hash "mismatches"; the load fails there.
    ``pause_at``: the index before which the load waits until ``gate`` is set or stop() is called.
    """

    def __init__(
        self,
        settings: SidecarSettings,
        observer: LoadObserver,
        *,
        tensors: int = 4,
        retries: tuple[tuple[str, str], ...] = (),
        fail_at: int | None = None,
        pause_at: int | None = None,
        gate: threading.Event | None = None,
        source: str | None = None,
    ) -> None:
        self.settings = settings
        self.observer = observer
        self.tensors = tensors
        self.retries = retries
        self.fail_at = fail_at
        self.pause_at = pause_at
        self.gate = gate or threading.Event()
        self.source = source if source is not None else settings.engine.source
        self._stop = threading.Event()

    def stop(self) -> None:
        self._stop.set()
        self.gate.set()

    def run(self) -> None:
        started = time.monotonic()
        segment = Path(self.settings.engine.segment)
        endpoint = self.settings.notify.endpoint
        self.observer.load_started(source=self.source, segment=str(segment))
        specs = [TensorSpec(f"layer{i}.weight", by_name("float32"), (ELEMENTS,)) for i in range(self.tensors)]
        metadata = {"notify": endpoint} if endpoint else {}
        writer = SegmentWriter.create(segment, plan_layout(specs, metadata=metadata))
        nbytes = sum(spec.nbytes for spec in specs)
        try:
            self.observer.manifest_published(
                model_format="safetensors", tensors=self.tensors, nbytes=nbytes, notify=endpoint
            )
            for kind, message in self.retries:
                self.observer.retried(kind=kind, message=message)
            for i in range(self.tensors):
                if i == self.pause_at:
                    self.gate.wait(30)
                if self._stop.is_set():
                    self._fail(writer, "stopped", "the sidecar was stopped before the load finished")
                    raise ScriptStopped("stopped")
                writer.slot(i)[:] = tensor_values(i).tobytes()
                self.observer.bytes_loaded(specs[i].nbytes)
                if i == self.fail_at:
                    reason = f"layer{i}.weight: hash mismatch (the transfer or the file is corrupt)"
                    self._fail(writer, "hash_mismatch", reason)
                    raise HashMismatchError(reason)
                writer.mark_ready(i)
                self.observer.tensor_ready(index=i, name=specs[i].name, nbytes=specs[i].nbytes)
            writer.mark_complete()
            self.observer.load_finished(seconds=time.monotonic() - started, nbytes=nbytes)
        finally:
            writer.close()

    def _fail(self, writer: SegmentWriter, kind: str, reason: str) -> None:
        writer.mark_failed(reason)
        self.observer.load_failed(kind=kind, reason=reason)


def scripted(**options: object):  # type: ignore[no-untyped-def]
    """An engine factory for :class:`~modelload.sidecar.process.Sidecar`: ``scripted(fail_at=2)``."""

    def factory(settings: SidecarSettings, observer: LoadObserver) -> ScriptedEngine:
        return ScriptedEngine(settings, observer, **options)  # type: ignore[arg-type]

    return factory
