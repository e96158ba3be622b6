"""Every byte checked against the store's own checksum: GCS (fake-gcs-server), Azure (Azurite), S3 (moto).

Sharded directories load byte-exact with every file proven and said so in ``/status`` and the segment; a
bit flipped in transit is read again (once) or, flipped every time, never published: the load fails naming
the file and no tensor of it is READY.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from modelload.loader.errors import HashMismatchError
from modelload.loader.segment import SegmentReader, TensorState, WriterState
from modelload.sidecar.sources import (
    AzureCredentials,
    AzureSettings,
    GcsSettings,
    S3Settings,
    SourceSettings,
)
from tests.sidecar import models
from tests.sidecar.test_engine import FAST, load
from tests.support import hfdir
from tests.support.cloud_emulators import Azurite, FakeGcs
from tests.support.fault_proxy import FaultProxy, FlipBit
from tests.support.fixtures import aws_env, azurite, cloud_env, fake_gcs, moto_s3
from tests.support.moto_s3 import MotoS3Server

__all__ = ["aws_env", "azurite", "cloud_env", "fake_gcs", "moto_s3"]


def _gcs(server: FakeGcs, endpoint: str | None = None) -> SourceSettings:
    return SourceSettings(
        http=FAST.http, retry=FAST.retry, gcs=GcsSettings(endpoint or server.endpoint, anonymous=True)
    )


def _azure(server: Azurite, endpoint: str | None = None) -> SourceSettings:
    credentials = AzureCredentials(connection_string=server.connection_string)
    return SourceSettings(
        http=FAST.http,
        retry=FAST.retry,
        azure=AzureSettings(endpoint_url=endpoint or server.endpoint, credentials=credentials),
    )


def _s3(server: MotoS3Server, endpoint: str | None = None) -> SourceSettings:
    return SourceSettings(
        http=FAST.http,
        retry=FAST.retry,
        s3=S3Settings(endpoint_url=endpoint or server.endpoint, addressing="path"),
    )


class Store:
    """One store under test: upload, the settings to read it (optionally through a proxy), its port."""

    def __init__(self, kind: str, request: pytest.FixtureRequest) -> None:
        self.kind = kind
        request.getfixturevalue("cloud_env")
        if kind == "gcs":
            self.server: Any = request.getfixturevalue("fake_gcs")
        elif kind == "azure":
            self.server = request.getfixturevalue("azurite")
        else:
            request.getfixturevalue("aws_env")
            self.server = request.getfixturevalue("moto_s3")

    @property
    def port(self) -> int:
        return int(self.server.port)

    def put(self, name: str, data: bytes, *, algorithm: str = "CRC32") -> str:
        if self.kind == "gcs":
            return str(self.server.put("checksums", name, data))
        if self.kind == "azure":
            return str(self.server.put("checksums", name, data))
        self.server.create_bucket("checksums")
        self.server.client().put_object(Bucket="checksums", Key=name, Body=data, ChecksumAlgorithm=algorithm)
        return f"s3://checksums/{name}"

    def settings(self, proxy: FaultProxy | None = None) -> SourceSettings:
        endpoint = None
        if proxy is not None:
            endpoint = proxy.endpoint + ("/devstoreaccount1" if self.kind == "azure" else "")
        return {"gcs": _gcs, "azure": _azure, "s3": _s3}[self.kind](self.server, endpoint)


EXPECTED = {"gcs": "crc32c", "azure": "md5", "s3": "crc32"}


@pytest.fixture(params=["gcs", "azure", "s3"])
def store(request: pytest.FixtureRequest) -> Store:
    return Store(request.param, request)


def test_a_sharded_directory_loads_byte_exact_with_every_file_proven(store: Store, shm_dir: Path) -> None:
    tensors = models.state_dict(layers=4, width=128, seed=3)
    content = hfdir.files(tensors, shards=3)
    for name, data in content.items():
        store.put(f"sharded-{store.kind}/{name}", data)
    base = store.put(f"sharded-{store.kind}/config.json", content["config.json"]).rsplit("/", 1)[0] + "/"
    segment = shm_dir / "model.seg"
    _, tracker = load(base, segment, sources=store.settings(), readers=4, chunk_size=16 << 10)
    models.assert_segment_matches(segment, tensors)
    proofs = tracker.snapshot().as_dict()["proofs"]
    shards = [n for n in content if n.startswith("model-")]
    assert sorted(proofs) == sorted(base + n for n in shards)
    assert all(
        p["state"] == "proven" and p["proof"].startswith(EXPECTED[store.kind]) for p in proofs.values()
    )
    with SegmentReader.open(segment) as reader:
        recorded = json.loads(reader.metadata["proofs"])
    assert recorded == {file: entry["proof"] for file, entry in proofs.items()}


@pytest.mark.parametrize("algorithm", ["SHA256", "CRC64NVME", "CRC32C", "SHA1"])
def test_every_checksum_s3_keeps_proves_the_bytes(
    algorithm: str, moto_s3: MotoS3Server, aws_env: Any, shm_dir: Path
) -> None:
    tensors = models.state_dict(layers=2, width=64, seed=4)
    moto_s3.create_bucket("checksums")
    data = models.safetensors_bytes(tensors)
    moto_s3.client().put_object(
        Bucket="checksums", Key=f"m-{algorithm}", Body=data, ChecksumAlgorithm=algorithm
    )
    _, tracker = load(
        f"s3://checksums/m-{algorithm}", shm_dir / "m.seg", sources=_s3(moto_s3), chunk_size=8 << 10
    )
    models.assert_segment_matches(shm_dir / "m.seg", tensors)
    (entry,) = tracker.snapshot().proofs.values()
    assert entry["state"] == "proven" and entry["proof"].startswith(algorithm.lower())


def test_a_bit_flipped_once_in_transit_is_read_again_and_the_load_completes(
    store: Store, shm_dir: Path
) -> None:
    tensors = models.state_dict(layers=3, width=256, seed=5)  # past the index read's first 512 KiB
    uri = store.put(f"flip-once-{store.kind}.safetensors", models.safetensors_bytes(tensors))
    with FaultProxy(store.port) as proxy:
        proxy.push(FlipBit(at=5000, from_offset=600_000), path="flip-once")
        _, tracker = load(
            uri, shm_dir / "m.seg", sources=store.settings(proxy), readers=2, chunk_size=64 << 10
        )
        assert proxy.pending() == 0, "the flip was applied"
    models.assert_segment_matches(shm_dir / "m.seg", tensors)
    status = tracker.snapshot()
    assert status.errors.get("checksum") == 1
    assert next(iter(status.proofs.values()))["state"] == "proven"


def test_a_bit_flipped_every_time_is_never_published(store: Store, shm_dir: Path) -> None:
    tensors = models.state_dict(layers=3, width=256, seed=6)
    uri = store.put(f"flip-always-{store.kind}.safetensors", models.safetensors_bytes(tensors))
    segment = shm_dir / "m.seg"
    with FaultProxy(store.port) as proxy:
        proxy.always(FlipBit(at=100, from_offset=600_000), path="flip-always")
        with pytest.raises(
            HashMismatchError, match=f"flip-always-{store.kind}.safetensors.*{EXPECTED[store.kind]}"
        ):
            load(uri, segment, sources=store.settings(proxy), readers=2, chunk_size=64 << 10)
    with SegmentReader.open(segment) as reader:
        assert reader.writer_state == WriterState.FAILED
        # (an empty tensor has no byte to prove: it is published at once)
        ready = [s.name for i, s in enumerate(reader.slots) if reader.state(i) == TensorState.READY]
        assert ready == ["empty"]


def test_a_tensorizer_file_publishes_as_it_lands_and_is_proven_at_its_end(
    fake_gcs: FakeGcs, cloud_env: None, shm_dir: Path
) -> None:
    tensors = models.state_dict(layers=2, width=64, seed=7)
    uri = fake_gcs.put("checksums", "model.tensors", models.tensorizer_bytes(tensors))
    recorder, tracker = load(uri, shm_dir / "t.seg", sources=_gcs(fake_gcs), chunk_size=8 << 10)
    models.assert_segment_matches(shm_dir / "t.seg", tensors)
    events = [name for name, _ in recorder.events if name in ("tensor_ready", "file_proof")]
    assert events.index("tensor_ready") < len(events) - 1 - events[::-1].index("file_proof")
    assert next(iter(tracker.snapshot().proofs.values()))["state"] == "proven"


def test_a_blob_without_content_md5_falls_back_to_its_pinned_version(
    azurite: Azurite, cloud_env: None, shm_dir: Path
) -> None:
    """A blob uploaded in blocks has no Content-MD5: /status says so, and the ETag still pins every range."""
    tensors = models.state_dict(layers=2, width=256, seed=8)
    data = models.safetensors_bytes(tensors)
    client = azurite.container("checksums")
    client.upload_blob("blocks.safetensors", data, overwrite=True, max_concurrency=1, length=len(data))
    big = os.urandom(1)  # noqa: F841 - keep the upload above in blocks regardless of size (see Azurite.container)
    _, tracker = load(
        f"az://{azurite.account}/checksums/blocks.safetensors", shm_dir / "b.seg", sources=_azure(azurite)
    )
    models.assert_segment_matches(shm_dir / "b.seg", tensors)
    (entry,) = tracker.snapshot().proofs.values()
    if len(data) > 4 << 20:
        assert entry["proof"].startswith("no checksum kept by the store")
        assert entry["state"] == "pinned"


def test_a_refused_sas_token_never_reaches_the_status_the_metrics_or_the_log(
    azurite: Azurite, cloud_env: None, shm_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from prometheus_client import generate_latest

    from modelload.loader.errors import SourceAccessDeniedError
    from modelload.sidecar.load import LoadSettings
    from modelload.sidecar.load.engine import Engine
    from modelload.sidecar.metrics import MetricsObserver
    from modelload.sidecar.progress import LoadTracker, Observers

    uri = azurite.put(
        "checksums", "secret.safetensors", models.safetensors_bytes(models.state_dict(layers=1))
    )
    sas = azurite.sas("checksums", read=False)
    sources = SourceSettings(
        http=FAST.http,
        retry=FAST.retry,
        azure=AzureSettings(endpoint_url=azurite.endpoint, credentials=AzureCredentials(sas_token=sas)),
    )
    tracker, metrics = LoadTracker(), MetricsObserver()
    caplog.set_level("DEBUG")
    engine = Engine(
        LoadSettings(source=uri, segment=shm_dir / "s.seg"),
        sources=sources,
        observer=Observers(tracker, metrics),
    )
    with pytest.raises(SourceAccessDeniedError) as caught:
        engine.run()
    signature = dict(part.split("=", 1) for part in sas.split("&"))["sig"]
    seen = [
        str(caught.value),
        json.dumps(tracker.snapshot().as_dict()),
        generate_latest(metrics.registry).decode(),
        caplog.text,
    ]
    assert tracker.snapshot().phase == "failed"
    assert not any(signature in text or sas in text for text in seen)
