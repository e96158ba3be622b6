"""The Prometheus metrics of a load: families, units and values after a scripted load, one registry each."""

from __future__ import annotations

import threading

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from modelload.sidecar.metrics import DURATION_BUCKETS, MetricsObserver
from tests.support.clock import FakeClock


def samples(observer: MetricsObserver) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of the exposition text, keyed by name and sorted labels: what a scraper reads."""
    text = generate_latest(observer.registry).decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def value(observer: MetricsObserver, name: str, **labels: str) -> float:
    return samples(observer)[(name, tuple(sorted(labels.items())))]


def observed() -> tuple[MetricsObserver, FakeClock]:
    clock = FakeClock()
    return MetricsObserver(clock=clock), clock


def scripted_load(observer: MetricsObserver, clock: FakeClock, *, tensors: int = 5, size: int = 4096) -> None:
    observer.load_started(source="s3://b/k", segment="/run/modelload/model.seg")
    observer.manifest_published(
        model_format="safetensors", tensors=tensors, nbytes=tensors * size, notify=None
    )
    observer.retried(kind="timeout", message="stalled for 30 s")
    observer.retried(kind="timeout", message="stalled for 30 s")
    observer.retried(kind="throttled", message="503 SlowDown")
    for i in range(tensors):
        observer.bytes_loaded(size)
        observer.tensor_ready(index=i, name=f"t{i}", nbytes=size)
        clock.advance(0.002)
    observer.load_finished(seconds=1.5, nbytes=tensors * size)


def test_a_completed_load_exports_every_family_with_its_values() -> None:
    observer, clock = observed()
    scripted_load(observer, clock)
    assert value(observer, "modelload_loaded_bytes_total") == 5 * 4096
    assert value(observer, "modelload_model_bytes") == 5 * 4096
    assert value(observer, "modelload_model_tensors") == 5
    assert value(observer, "modelload_tensors_ready") == 5
    assert value(observer, "modelload_retries_total", kind="timeout") == 2
    assert value(observer, "modelload_retries_total", kind="throttled") == 1
    assert value(observer, "modelload_errors_total", kind="timeout") == 2
    assert value(observer, "modelload_load_duration_seconds_count") == 1
    assert value(observer, "modelload_load_duration_seconds_sum") == 1.5
    assert value(observer, "modelload_load_duration_seconds_bucket", le="1.0") == 0
    assert value(observer, "modelload_load_duration_seconds_bucket", le="2.5") == 1
    assert value(observer, "modelload_phase", modelload_phase="complete") == 1
    assert value(observer, "modelload_phase", modelload_phase="loading") == 0
    manifest = value(observer, "modelload_manifest_seconds")
    first = value(observer, "modelload_first_tensor_seconds")
    assert 0 <= manifest <= first < 5
    assert value(observer, "modelload_throughput_bytes_per_second") > 0


def test_the_duration_buckets_span_a_tenth_of_a_second_to_half_an_hour() -> None:
    observer, clock = observed()
    scripted_load(observer, clock)
    bounds = {
        float(dict(labels)["le"])
        for (name, labels) in samples(observer)
        if name == "modelload_load_duration_seconds_bucket"
    }
    assert min(bounds) == 0.1
    assert 1800.0 in bounds and float("inf") in bounds
    assert sorted(bounds) == list(DURATION_BUCKETS)


def test_throughput_is_current_while_loading_and_frozen_once_finished() -> None:
    observer, clock = observed()
    observer.load_started(source="s3://b/k", segment="/s")
    observer.bytes_loaded(1 << 20)
    clock.advance(0.05)
    assert value(observer, "modelload_throughput_bytes_per_second") == pytest.approx((1 << 20) / 0.05)
    clock.advance(0.05)
    current = value(observer, "modelload_throughput_bytes_per_second")
    assert current == pytest.approx((1 << 20) / 0.1), "current, at each scrape"
    observer.load_finished(seconds=0.1, nbytes=1 << 20)
    clock.advance(0.05)
    assert value(observer, "modelload_throughput_bytes_per_second") == current, "frozen at the end"


def test_a_failed_load_counts_its_error_and_shows_the_failed_phase() -> None:
    observer = MetricsObserver()
    observer.load_started(source="s3://b/k", segment="/s")
    observer.load_failed(kind="access_denied", reason="403 Forbidden")
    assert value(observer, "modelload_errors_total", kind="access_denied") == 1
    assert value(observer, "modelload_phase", modelload_phase="failed") == 1
    assert value(observer, "modelload_load_duration_seconds_count") == 0  # only completed loads


def test_a_stopped_load_shows_the_stopped_phase() -> None:
    observer = MetricsObserver()
    observer.load_started(source="s3://b/k", segment="/s")
    observer.load_failed(kind="stopped", reason="SIGTERM")
    assert value(observer, "modelload_phase", modelload_phase="stopped") == 1
    assert value(observer, "modelload_phase", modelload_phase="failed") == 0


def test_each_observer_has_its_own_registry() -> None:
    first, second = MetricsObserver(), MetricsObserver()  # the global registry would refuse the second
    first.bytes_loaded(10)
    assert value(first, "modelload_loaded_bytes_total") == 10
    assert value(second, "modelload_loaded_bytes_total") == 0
    assert b"process_cpu_seconds_total" not in generate_latest(first.registry)


def test_bytes_counted_from_many_reader_threads_add_up_exactly() -> None:
    observer = MetricsObserver()
    observer.load_started(source="s3://b/k", segment="/s")

    def reader() -> None:
        for _ in range(2000):
            observer.bytes_loaded(3)

    threads = [threading.Thread(target=reader) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert value(observer, "modelload_loaded_bytes_total") == 8 * 2000 * 3


def test_metric_names_carry_the_prefix_and_their_units() -> None:
    observer, clock = observed()
    scripted_load(observer, clock)
    families = {f.name for f in text_string_to_metric_families(generate_latest(observer.registry).decode())}
    assert families >= {
        "modelload_loaded_bytes",
        "modelload_model_bytes",
        "modelload_model_tensors",
        "modelload_tensors_ready",
        "modelload_throughput_bytes_per_second",
        "modelload_manifest_seconds",
        "modelload_first_tensor_seconds",
        "modelload_load_duration_seconds",
        "modelload_retries",
        "modelload_errors",
        "modelload_phase",
    }
    assert all(name.startswith("modelload_") for name in families)
