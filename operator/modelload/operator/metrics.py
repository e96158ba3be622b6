"""The operator's own Prometheus metrics: what its webhook admits and refuses, and how long resolving takes.

The sidecars export each load's metrics; these describe the operator, so an alert can fire when pods are
refused (a model missing, the API server unreachable) before anyone reads the events. Families::

    modelload_operator_admissions_total{result}    counter    pod reviews answered: injected, topped_up
                                                              (containers another webhook added), unchanged
                                                              (nothing to add), refused
    modelload_operator_refusals_total{reason}      counter    refused pods, by reason: model_not_found,
                                                              model_not_ready, bad_pod, bad_spec,
                                                              api_unavailable, internal
    modelload_operator_admission_seconds           histogram  time to answer one review (a ModelLoad lookup)
    modelload_operator_resolve_seconds{outcome}    histogram  time to resolve a ModelLoad (Secrets, the index
                                                              read from the source, sizing): resolved, failed

Labels are fixed, short vocabularies: never a pod, a model or a message (cardinality, and no secrets).
The registry is this module's own (not prometheus_client's global one, so no process collectors appear by
surprise); :func:`serve` exposes it on ``--metrics-port`` (``/metrics``, plain HTTP), off by default.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server

__all__ = ["ADMISSION_RESULTS", "METRICS", "REFUSAL_REASONS", "OperatorMetrics", "serve"]

logger = logging.getLogger(__name__)

ADMISSION_RESULTS = ("injected", "topped_up", "unchanged", "refused")
REFUSAL_REASONS = ("model_not_found", "model_not_ready", "bad_pod", "bad_spec", "api_unavailable", "internal")
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
_RESOLVE_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class OperatorMetrics:
    """The families above in a registry of their own; every label value is created at zero up front."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.admissions = Counter(
            "modelload_operator_admissions",
            "Pod admission reviews answered, by result.",
            ["result"],
            registry=self.registry,
        )
        self.refusals = Counter(
            "modelload_operator_refusals",
            "Pods the webhook refused, by reason.",
            ["reason"],
            registry=self.registry,
        )
        self.admission_seconds = Histogram(
            "modelload_operator_admission_seconds",
            "Seconds to answer one pod admission review.",
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.resolve_seconds = Histogram(
            "modelload_operator_resolve_seconds",
            "Seconds to resolve a ModelLoad (Secrets, the index read, sizing), by outcome.",
            ["outcome"],
            buckets=_RESOLVE_BUCKETS,
            registry=self.registry,
        )
        for result in ADMISSION_RESULTS:
            self.admissions.labels(result=result)
        for reason in REFUSAL_REASONS:
            self.refusals.labels(reason=reason)
        for outcome in ("resolved", "failed"):
            self.resolve_seconds.labels(outcome=outcome)

    def admitted(self, *, result: str, seconds: float) -> None:
        self.admissions.labels(result=result).inc()
        self.admission_seconds.observe(seconds)

    def refused(self, *, reason: str, seconds: float) -> None:
        self.refusals.labels(reason=reason).inc()
        self.admitted(result="refused", seconds=seconds)

    @contextlib.contextmanager
    def resolving(self) -> Iterator[None]:
        """Time the block as one resolve: ``resolved`` when it returns, ``failed`` when it raises."""
        started = time.monotonic()
        outcome = "failed"
        try:
            yield
            outcome = "resolved"
        finally:
            self.resolve_seconds.labels(outcome=outcome).observe(time.monotonic() - started)


METRICS = OperatorMetrics()
"""The process's metrics: one operator per process, so the webhook and the handlers share these."""


@contextlib.contextmanager
def serve(*, port: int, host: str = "0.0.0.0", metrics: OperatorMetrics = METRICS) -> Iterator[int]:  # noqa: S104
    """Serve ``/metrics`` on ``port`` (0 picks one) in a thread for the duration of the block; yields it."""
    server: Any
    server, thread = start_http_server(port, addr=host, registry=metrics.registry)
    bound = int(server.server_address[1])
    logger.info("metrics on %s:%d/metrics", host, bound)
    try:
        yield bound
    finally:
        server.shutdown()
        server.server_close()
        if isinstance(thread, threading.Thread):
            thread.join(timeout=5)
