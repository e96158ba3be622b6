"""Prometheus metrics of a load: an observer that updates its own registry, scraped at ``GET /metrics``.

Each sidecar process loads one model, so most series are gauges of that one load; the load duration is a
histogram so that a fleet's loads can be aggregated (``histogram_quantile`` over every pod). The registry is
the observer's own, not prometheus_client's global one: tests and several sidecars in one process stay
apart, and no process-wide collectors (GC, platform) are exported by surprise.

Families (units in the names, as Prometheus asks)::

    modelload_loaded_bytes_total             counter    tensor bytes landed in the segment
    modelload_model_bytes                    gauge      tensor bytes of the model (0 until the manifest)
    modelload_model_tensors                  gauge      tensors in the model
    modelload_tensors_ready                  gauge      tensors published READY
    modelload_throughput_bytes_per_second    gauge      bytes landed / seconds since the load started
    modelload_manifest_seconds               gauge      seconds from start to the manifest (startup probe)
    modelload_first_tensor_seconds           gauge      seconds from start to the first READY tensor
    modelload_load_duration_seconds          histogram  seconds of each completed load
    modelload_retries_total{kind}            counter    range requests retried, by kind of failure
    modelload_errors_total{kind}             counter    every error seen, retried or fatal, by kind
    modelload_phase{modelload_phase}         state set  starting, loading, complete, failed, stopped
    modelload_memory_resident_bytes          gauge      segment bytes in memory (memory modes release, ring)
    modelload_memory_released_bytes          gauge      bytes given back after every consumer copied them
    modelload_memory_waiting                 gauge      1 while ring mode waits for consumers to free room
    modelload_memory_wait_seconds            gauge      seconds ring mode has waited for room, in all
    modelload_memory_consumers               gauge      live consumers registered on the segment

Callbacks come from the readers' threads: each is one or two lock-protected updates in prometheus_client.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence

from prometheus_client import CollectorRegistry, Counter, Enum, Gauge, Histogram

__all__ = ["DURATION_BUCKETS", "PHASES", "MetricsObserver"]

DURATION_BUCKETS = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 30, 60, 120, 300, 600, 1200, 1800, float("inf"))
"""Load durations from a small test model (0.1 s) to a large model on a slow link (30 min)."""

PHASES = ("starting", "loading", "complete", "failed", "stopped")


class MetricsObserver:
    """A :class:`~modelload.sidecar.progress.LoadObserver` that keeps Prometheus metrics of the load.

    ``registry``: where the metrics are registered; a new one by default. Read it with
    ``prometheus_client.generate_latest(observer.registry)``. ``clock`` (monotonic seconds) times the load
    for the durations and the throughput; tests pass their own.
    """

    def __init__(
        self, registry: CollectorRegistry | None = None, *, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.registry = registry if registry is not None else CollectorRegistry(auto_describe=True)
        self._clock = clock
        r = self.registry
        self._lock = threading.Lock()
        self._started: float | None = None
        self._finished: float | None = None
        self._bytes = 0
        self._first_tensor_seen = False

        self.loaded_bytes = Counter(
            "modelload_loaded_bytes", "Tensor bytes landed in the segment.", registry=r
        )
        self.model_bytes = Gauge("modelload_model_bytes", "Tensor bytes of the model.", registry=r)
        self.model_tensors = Gauge("modelload_model_tensors", "Tensors in the model.", registry=r)
        self.tensors_ready = Gauge("modelload_tensors_ready", "Tensors published READY.", registry=r)
        self.throughput = Gauge(
            "modelload_throughput_bytes_per_second",
            "Tensor bytes landed per second since the load started (the final average once it ends).",
            registry=r,
        )
        self.throughput.set_function(self._throughput)
        self.manifest_seconds = Gauge(
            "modelload_manifest_seconds",
            "Seconds from the load's start to the manifest being published (apps can attach).",
            registry=r,
        )
        self.first_tensor_seconds = Gauge(
            "modelload_first_tensor_seconds",
            "Seconds from the load's start to the first tensor published READY.",
            registry=r,
        )
        self.duration = Histogram(
            "modelload_load_duration_seconds",
            "Seconds of each completed load, from start to the last tensor.",
            buckets=DURATION_BUCKETS,
            registry=r,
        )
        self.retries = Counter(
            "modelload_retries", "Range requests retried, by kind of failure.", ["kind"], registry=r
        )
        self.errors = Counter(
            "modelload_errors", "Errors seen, retried or fatal, by kind.", ["kind"], registry=r
        )
        self.phase = Enum("modelload_phase", "Phase of the load.", states=list(PHASES), registry=r)
        self.memory = {
            key: Gauge(f"modelload_memory_{name}", text, registry=r)
            for key, name, text in (
                ("resident_bytes", "resident_bytes", "Segment bytes in memory (memory modes release, ring)."),
                ("released_bytes", "released_bytes", "Bytes given back after every consumer copied them."),
                ("waiting", "waiting", "1 while ring mode waits for consumers to free room."),
                ("wait_seconds_total", "wait_seconds", "Seconds ring mode has waited for room, in all."),
                ("consumers", "consumers", "Live consumers registered on the segment."),
            )
        }

    # --- LoadObserver ---------------------------------------------------------------------------------

    def load_started(self, *, source: str, segment: str) -> None:
        with self._lock:
            self._started = self._clock()
        self.phase.state("starting")

    def manifest_published(self, *, model_format: str, tensors: int, nbytes: int, notify: str | None) -> None:
        self.model_bytes.set(nbytes)
        self.model_tensors.set(tensors)
        self.manifest_seconds.set(self._since_start())
        self.phase.state("loading")

    def bytes_loaded(self, count: int) -> None:
        self.loaded_bytes.inc(count)
        with self._lock:
            self._bytes += count

    def tensor_ready(self, *, index: int, name: str, nbytes: int) -> None:
        self._count_ready(1)

    def tensors_published(
        self, *, indices: Sequence[int], names: Sequence[str], nbytes: Sequence[int]
    ) -> None:
        self._count_ready(len(indices))

    def _count_ready(self, count: int) -> None:
        self.tensors_ready.inc(count)
        with self._lock:
            first, self._first_tensor_seen = not self._first_tensor_seen, True
        if first:
            self.first_tensor_seconds.set(self._since_start())

    def retried(self, *, kind: str, message: str) -> None:
        self.retries.labels(kind=kind).inc()
        self.errors.labels(kind=kind).inc()

    def load_finished(self, *, seconds: float, nbytes: int) -> None:
        with self._lock:
            self._finished = self._clock()
        self.duration.observe(seconds)
        self.phase.state("complete")

    def load_failed(self, *, kind: str, reason: str) -> None:
        with self._lock:
            self._finished = self._clock()
        self.errors.labels(kind=kind).inc()
        self.phase.state("stopped" if kind == "stopped" else "failed")

    def memory_changed(self, status: dict[str, object]) -> None:
        for key, gauge in self.memory.items():
            value = status.get(key)
            gauge.set(len(value) if isinstance(value, list) else float(value or 0))  # type: ignore[arg-type]

    # --- derived values -------------------------------------------------------------------------------

    def _since_start(self) -> float:
        with self._lock:
            started = self._started
        return self._clock() - started if started is not None else 0.0

    def _throughput(self) -> float:
        """Evaluated at scrape time, so the rate is current without a timer thread."""
        with self._lock:
            if self._started is None:
                return 0.0
            end = self._finished if self._finished is not None else self._clock()
            elapsed = end - self._started
            return self._bytes / elapsed if elapsed > 0 else 0.0
