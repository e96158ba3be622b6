"""The engine through a proxy that breaks requests on purpose (tests/support/fault_proxy.py).

Transient faults (resets mid-body, 503 SlowDown, 500, short bodies, stalls) end in a byte-exact load with the
retries counted; permanent ones (denied, gone, replaced object, a server that never recovers) fail the load
fast with a clear error, leave the segment FAILED with the reason for attached readers, and never show a
credential.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Any

import pytest

from modelload.loader import LoadFailedError, attach
from modelload.loader.errors import (
    SourceAccessDeniedError,
    SourceChangedError,
    SourceNotFoundError,
    TransientSourceError,
)
from modelload.sidecar.load import LoadSettings
from modelload.sidecar.load.engine import Engine
from modelload.sidecar.progress import LoadTracker
from modelload.sidecar.sources import HttpSettings, RetryPolicy, S3Settings, SourceSettings
from tests.sidecar import models
from tests.support.failures import assert_load_failed
from tests.support.fault_proxy import (
    ReplaceObject,
    Reset,
    Stall,
    Truncate,
    s3_error,
    server_error,
    slow_down,
)
from tests.support.moto_s3 import TEST_CREDENTIALS

PASS = Stall(after=0, seconds=0.0)
"""A fault that changes nothing: queue it to let a request through (the stat, then the index read)."""

RETRY = RetryPolicy(attempts=4, initial_backoff=0.01, max_backoff=0.05, jitter=0.0, deadline=20.0)
HTTP = HttpSettings(connect_timeout=2.0, stall_timeout=0.3)
SETTINGS = SourceSettings(http=HTTP, retry=RETRY)


def run(source: str, segment: Path, sources: SourceSettings = SETTINGS, **kwargs: Any) -> LoadTracker:
    tracker = LoadTracker()
    kwargs = {"readers": 3, "chunk_size": 64 << 10, **kwargs}
    engine = Engine(
        LoadSettings(source=source, segment=segment, **kwargs),
        sources=sources,
        observer=tracker,
    )
    engine.run()
    return tracker


def s3_settings(endpoint: str) -> SourceSettings:
    return SourceSettings(s3=S3Settings(endpoint_url=endpoint, addressing="path"), http=HTTP, retry=RETRY)


@pytest.mark.parametrize(
    "fault",
    [
        Reset(after=10_000),
        Truncate(after=20_000),
        Stall(after=5_000, seconds=1.0),
        slow_down(retry_after=0.05),
        server_error(),
    ],
    ids=["reset", "truncate", "stall", "slowdown", "500"],
)
@pytest.mark.parametrize("fmt", ["tensorizer", "safetensors"])
def test_transient_faults_end_in_a_byte_exact_load(
    fault: Any, fmt: str, nginx: Any, nginx_proxy: Any, shm_dir: Path
) -> None:
    tensors = models.state_dict(seed=20)
    data = models.tensorizer_bytes(tensors) if fmt == "tensorizer" else models.safetensors_bytes(tensors)
    nginx.put(f"faults-{fmt}.bin", data)
    url = nginx_proxy.url(f"faults-{fmt}.bin")
    nginx_proxy.push(PASS, PASS, *([fault] * 4))  # the stat and index go through; four data requests break
    tracker = run(url, shm_dir / "model.seg")
    status = tracker.snapshot()
    assert status.phase == "complete"
    # A fault breaks a request only when its body is longer than where the fault strikes (a reset after
    # 10 kB leaves a 4 kB tensor alone), so not all four need a retry; most do.
    assert status.retries >= 2
    assert nginx_proxy.pending() == 0
    models.assert_segment_matches(shm_dir / "model.seg", tensors)


def test_a_broken_stream_resumes_at_the_byte_where_it_broke(
    nginx: Any, nginx_proxy: Any, shm_dir: Path
) -> None:
    tensors = models.state_dict(seed=21, width=512, layers=1)  # tensorizer keeps dict order: the big
    nginx.put("faults-resume.bin", models.tensorizer_bytes(tensors))  # embedding is the first data request
    url = nginx_proxy.url("faults-resume.bin")
    nginx_proxy.push(PASS, PASS, Reset(after=30_000))  # the stat, the index, then the first data request
    run(url, shm_dir / "model.seg", readers=1)
    ranges = nginx_proxy.ranges()
    broken, resumed = ranges[2], ranges[3]
    assert resumed[0] == broken[0] + 30_000 and resumed[1] == broken[1], (
        "only the missing tail is asked again"
    )
    models.assert_segment_matches(shm_dir / "model.seg", tensors)


def test_random_faults_on_a_third_of_the_requests_still_load_exactly(
    nginx: Any, nginx_proxy: Any, shm_dir: Path
) -> None:
    tensors = models.state_dict(seed=22)
    nginx.put("faults-random.bin", models.tensorizer_bytes(tensors))
    nginx_proxy.randomly(
        [Reset(after=7_000), Truncate(after=3_000), slow_down(0.01), server_error()], probability=0.33, seed=7
    )
    # Which request draws which fault depends on thread timing, so a range can meet several faults in a row:
    # ten tries make a run out of retries (0.33**10 per range) practically impossible, not just unlikely.
    patient = SourceSettings(
        http=HTTP,
        retry=RetryPolicy(attempts=10, initial_backoff=0.01, max_backoff=0.05, jitter=0.0, deadline=60.0),
    )
    tracker = run(nginx_proxy.url("faults-random.bin"), shm_dir / "model.seg", sources=patient)
    assert tracker.snapshot().retries > 3
    models.assert_segment_matches(shm_dir / "model.seg", tensors)


def test_an_object_replaced_mid_load_fails_rather_than_mixing_versions(
    nginx: Any, nginx_proxy: Any, shm_dir: Path
) -> None:
    tensors = models.state_dict(seed=23)
    nginx.put("faults-replaced.bin", models.tensorizer_bytes(tensors))
    url = nginx_proxy.url("faults-replaced.bin")
    # The stat, the index and three data requests see the first version; every later request a new one.
    nginx_proxy.push(PASS, PASS, PASS, PASS, PASS)
    nginx_proxy.always(ReplaceObject())
    with pytest.raises(SourceChangedError):
        run(url, shm_dir / "model.seg", readers=1)
    assert len(nginx_proxy.ranges()) == 6, "the load stops at the first sign of a new version"
    assert_load_failed(shm_dir / "model.seg", match="changed")


def test_a_server_that_never_recovers_fails_the_load_and_wakes_attached_readers(
    nginx: Any, nginx_proxy: Any, shm_dir: Path
) -> None:
    tensors = models.state_dict(seed=24)
    nginx.put("faults-dead.bin", models.safetensors_bytes(tensors))
    url = nginx_proxy.url("faults-dead.bin")
    errors: list[BaseException] = []

    def attached_reader() -> None:
        try:
            with attach(shm_dir / "model.seg", notify=False, timeout=30) as model:
                model.wait()
        except BaseException as exc:
            errors.append(exc)

    reader = threading.Thread(target=attached_reader)
    reader.start()
    nginx_proxy.push(PASS, PASS)  # the stat and the index read succeed; every data request then fails
    nginx_proxy.always(server_error())
    with pytest.raises(TransientSourceError, match="gave up"):
        run(url, shm_dir / "model.seg")
    reader.join(timeout=30)
    assert len(errors) == 1 and isinstance(errors[0], LoadFailedError)
    assert "gave up" in str(errors[0])


def test_a_missing_object_fails_fast_naming_the_bucket_and_key(
    moto_s3: Any, aws_env: Any, shm_dir: Path
) -> None:
    moto_s3.create_bucket("faults-missing")
    with pytest.raises(SourceNotFoundError, match="faults-missing") as caught:
        run(
            "s3://faults-missing/no/such/model.tensors",
            shm_dir / "model.seg",
            sources=s3_settings(moto_s3.endpoint),
        )
    assert "no/such/model.tensors" in str(caught.value)
    assert not (shm_dir / "model.seg").exists()


def test_credentials_refused_mid_load_fail_it_without_showing_them(
    moto_s3: Any, moto_proxy: Any, aws_env: Any, shm_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    tensors = models.state_dict(seed=25)
    moto_s3.put("faults-denied", "model.tensors", models.tensorizer_bytes(tensors))
    moto_proxy.push(PASS, PASS)  # the stat and the index read go through; the token then expires
    moto_proxy.always(s3_error(403, "ExpiredToken", message="The provided token has expired."))
    caplog.set_level(logging.DEBUG)
    with pytest.raises(SourceAccessDeniedError) as caught:
        run(
            "s3://faults-denied/model.tensors",
            shm_dir / "model.seg",
            sources=s3_settings(moto_proxy.endpoint),
        )
    message = str(caught.value)
    assert "faults-denied" in message and "model.tensors" in message
    recorded = assert_load_failed(shm_dir / "model.seg")
    everything = " ".join([message, recorded, caplog.text])
    for secret in TEST_CREDENTIALS.secrets():
        assert secret not in everything
    assert "Signature=" not in everything and "X-Amz-Signature" not in everything


def test_an_unsigned_request_for_a_public_object_loads(moto_s3: Any, aws_env: Any, shm_dir: Path) -> None:
    tensors = models.state_dict(seed=26, layers=2)
    uri = moto_s3.put("faults-public", "model.safetensors", models.safetensors_bytes(tensors), public=True)
    sources = SourceSettings(
        s3=S3Settings(endpoint_url=moto_s3.endpoint, addressing="path", unsigned=True), http=HTTP, retry=RETRY
    )
    run(uri, shm_dir / "model.seg", sources=sources)
    models.assert_segment_matches(shm_dir / "model.seg", tensors)
