"""Whole loads through the engine from the Hugging Face Hub (stand-in) and from a real OCI registry.

Byte-exact segments from single files and sharded directories, each weight file proved against the digest
its origin publishes; a corrupted blob fails the load (never COMPLETE); a tag or branch moved mid-load does
not mix versions; the token stays out of logs and statuses.
"""

from __future__ import annotations

import base64
import hashlib
import json
import logging
from pathlib import Path
from typing import Any

import pytest

from modelload.loader.errors import HashMismatchError
from modelload.loader.segment import SegmentReader, WriterState
from modelload.sidecar.load import LoadSettings
from modelload.sidecar.load.engine import Engine
from modelload.sidecar.progress import LoadTracker, Observers
from modelload.sidecar.sources import HubSettings, RegistrySettings, SourceSettings
from modelload.sidecar.sources.oci import push_directory
from tests.sidecar import models
from tests.sidecar.test_engine import FAST, Recorder
from tests.support import hfdir
from tests.support.failures import assert_load_failed
from tests.support.fixtures import REGISTRY_USERS
from tests.support.hub import HubServer
from tests.support.registry import RegistryServer

TOKEN = "hf_engine-token-EXAMPLE-51aa"
USER, PASSWORD = next(iter(REGISTRY_USERS.items()))


def hub_settings(hub: HubServer, token: str | None = None) -> SourceSettings:
    return SourceSettings(http=FAST.http, retry=FAST.retry, hub=HubSettings(endpoint=hub.url, token=token))


def registry_settings(registry: RegistryServer, *, login: bool = False) -> SourceSettings:
    auths = {}
    if login:
        auths = {registry.host: {"auth": base64.b64encode(f"{USER}:{PASSWORD}".encode()).decode()}}
    return SourceSettings(
        http=FAST.http, retry=FAST.retry, registry=RegistrySettings(auths=auths, plain_http=(registry.host,))
    )


class _Hook(Recorder):
    """A recorder that runs ``then`` once, when the segment's manifest is published (the load has listed its
    files and is about to read them)."""

    def __init__(self, then: Any) -> None:
        super().__init__()
        self._then = then

    def manifest_published(self, **kwargs: Any) -> None:
        self.events.append(("manifest_published", kwargs))
        then, self._then = self._then, None
        if then is not None:
            then()


def run(
    source: str, segment: Path, sources: SourceSettings, *, observer: Any = None, **settings: Any
) -> LoadTracker:
    tracker = LoadTracker()
    engine = Engine(
        LoadSettings(source=source, segment=segment, readers=4, chunk_size=64 << 10, **settings),
        sources=sources,
        observer=Observers(observer or Recorder(), tracker),
    )
    engine.run()
    return tracker


def state(segment: Path) -> WriterState:
    with SegmentReader.open(segment) as reader:
        return reader.writer_state


# --- the Hub ------------------------------------------------------------------------------------------------


def test_a_sharded_repository_loads_byte_exact_with_every_shard_proved_by_its_sha256(
    hub: HubServer, shm_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    weights = models.state_dict(seed=60, layers=4)
    files = hfdir.files(weights, shards=3)
    hub.commit("org/llama", files, private=True, readers={TOKEN})
    caplog.set_level(logging.DEBUG)
    tracker = run("hf://org/llama", shm_dir / "model.seg", hub_settings(hub, TOKEN))
    assert tracker.snapshot().phase == "complete"
    models.assert_segment_matches(shm_dir / "model.seg", weights)
    for name, data in hfdir.SMALL_FILES.items():
        assert (shm_dir / "model" / name).read_bytes() == data, name
    proved = [r.getMessage() for r in caplog.records if "matches its sha256 digest" in r.getMessage()]
    assert len(proved) == 3, proved
    with SegmentReader.open(shm_dir / "model.seg") as reader:
        assert reader.metadata["source_version"] == hub.repos["org/llama"].refs["main"]  # the commit loaded
    assert TOKEN not in caplog.text
    assert TOKEN not in json.dumps(tracker.snapshot().as_dict())
    assert all(r["authorization"] == "" for r in hub.cdn_requests)


def test_one_file_of_a_repository_loads_as_a_single_file_model(hub: HubServer, shm_dir: Path) -> None:
    weights = models.state_dict(seed=61)
    hub.commit("org/one", {"model.safetensors": models.safetensors_bytes(weights)}, ref="v2")
    run("hf://org/one@v2/model.safetensors", shm_dir / "model.seg", hub_settings(hub))
    models.assert_segment_matches(shm_dir / "model.seg", weights)


def test_a_corrupted_file_from_the_cdn_fails_the_load_and_is_never_complete(
    hub: HubServer, shm_dir: Path
) -> None:
    weights = models.state_dict(seed=62)
    data = models.safetensors_bytes(weights)
    hub.commit("org/bad", {"model.safetensors": data, "config.json": b"{}"})
    hub.cdn.corrupt.add(hashlib.sha256(data).hexdigest())
    recorder = Recorder()
    with pytest.raises(HashMismatchError, match="sha256 digest the origin publishes"):
        run("hf://org/bad", shm_dir / "model.seg", hub_settings(hub), observer=recorder)
    assert_load_failed(shm_dir / "model.seg", match="sha256 digest")
    # Held back until the digest matched: no app or peer ever saw a tensor of the corrupted file.
    assert [
        e["name"] for e in recorder.named("tensor_ready") if e["nbytes"]
    ] == []  # (an empty one holds no byte)


def test_a_branch_moved_during_the_load_does_not_mix_commits(hub: HubServer, shm_dir: Path) -> None:
    first, second = models.state_dict(seed=63, layers=3), models.state_dict(seed=64, layers=3)
    hub.commit("org/moving", hfdir.files(first, shards=2))
    move = lambda: hub.commit("org/moving", hfdir.files(second, shards=2))  # noqa: E731
    run("hf://org/moving", shm_dir / "model.seg", hub_settings(hub), observer=_Hook(move))
    models.assert_segment_matches(shm_dir / "model.seg", first)


# --- an OCI registry ---------------------------------------------------------------------------------------


def test_an_artifact_pushed_by_modelload_loads_byte_exact_from_the_token_registry(
    token_registry: RegistryServer, shm_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    weights = models.state_dict(seed=65, layers=4)
    folder = hfdir.write(tmp_path / "model", hfdir.files(weights, shards=3))
    config = registry_settings(token_registry, login=True)
    pushed = push_directory(folder, token_registry.uri("engine/llama", "v1"), config)
    caplog.set_level(logging.DEBUG)
    tracker = run(token_registry.uri("engine/llama", "v1"), shm_dir / "model.seg", config)
    assert tracker.snapshot().phase == "complete"
    models.assert_segment_matches(shm_dir / "model.seg", weights)
    for name, data in hfdir.SMALL_FILES.items():
        assert (shm_dir / "model" / name).read_bytes() == data, name
    assert len([r for r in caplog.records if "matches its sha256 digest" in r.getMessage()]) == 3
    with SegmentReader.open(shm_dir / "model.seg") as reader:
        assert reader.metadata["source_version"] == pushed.digest  # the manifest loaded, whatever v1 says now
    assert token_registry.tokens is not None
    for secret in (PASSWORD, *token_registry.tokens.issued):
        assert secret not in caplog.text
        assert secret not in json.dumps(tracker.snapshot().as_dict())


def test_a_tag_moved_during_the_load_does_not_mix_versions(
    registry: RegistryServer, shm_dir: Path, tmp_path: Path
) -> None:
    first, second = models.state_dict(seed=66, layers=3), models.state_dict(seed=67, layers=3)
    config = registry_settings(registry)
    push_directory(
        hfdir.write(tmp_path / "a", hfdir.files(first, shards=2)), registry.uri("engine/moving", "v1"), config
    )
    folder_b = hfdir.write(tmp_path / "b", hfdir.files(second, shards=2))
    move = lambda: push_directory(folder_b, registry.uri("engine/moving", "v1"), config, force=True)  # noqa: E731
    run(registry.uri("engine/moving", "v1"), shm_dir / "model.seg", config, observer=_Hook(move))
    models.assert_segment_matches(shm_dir / "model.seg", first)


def test_a_blob_corrupted_in_the_registrys_storage_is_never_published(
    registry: RegistryServer, shm_dir: Path, tmp_path: Path
) -> None:
    weights = models.state_dict(seed=68)
    folder = hfdir.write(tmp_path / "model", {"model.safetensors": models.safetensors_bytes(weights)})
    result = push_directory(folder, registry.uri("engine/corrupt", "v1"), registry_settings(registry))
    digest = next(layer.digest for layer in result.layers if layer.name == "model.safetensors").removeprefix(
        "sha256:"
    )
    stored = registry.root / "docker/registry/v2/blobs/sha256" / digest[:2] / digest / "data"
    data = bytearray(stored.read_bytes())
    data[-100] ^= 0xFF  # the last tensor's bytes, same size: only the digest can tell
    stored.write_bytes(bytes(data))
    recorder = Recorder()
    with pytest.raises(HashMismatchError):
        run(
            registry.uri("engine/corrupt", "v1"),
            shm_dir / "model.seg",
            registry_settings(registry),
            observer=recorder,
        )
    assert_load_failed(shm_dir / "model.seg")
    assert [e["name"] for e in recorder.named("tensor_ready") if e["nbytes"]] == [], (
        "a corrupted tensor went out"
    )


@pytest.mark.parametrize("mode", ["release", "ring"])
def test_memory_modes_give_back_pages_only_after_their_bytes_are_hashed(
    mode: str, hub: HubServer, shm_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    import threading

    from modelload.sidecar.memory import MemorySettings
    from tests.sidecar.test_memory import _consume

    weights = models.state_dict(seed=69)
    hub.commit("org/modes", {"model.safetensors": models.safetensors_bytes(weights)})
    memory = MemorySettings(mode=mode, ring_size=(1 << 20) if mode == "ring" else 0)  # type: ignore[arg-type]
    failure: list[BaseException] = []

    def load() -> None:
        try:
            run("hf://org/modes", shm_dir / "model.seg", hub_settings(hub), memory=memory)
        except BaseException as exc:
            failure.append(exc)

    caplog.set_level(logging.INFO)
    loader = threading.Thread(target=load, daemon=True)
    loader.start()
    copies = _consume(shm_dir / "model.seg")
    loader.join(60)
    assert not loader.is_alive() and not failure, failure
    assert copies == {name: models.as_bytes(tensor) for name, tensor in weights.items()}
    assert any("matches its sha256 digest" in r.getMessage() for r in caplog.records)


def test_an_artifact_of_one_weight_file_loads_byte_exact(
    registry: RegistryServer, shm_dir: Path, tmp_path: Path
) -> None:
    weights = models.state_dict(seed=70)
    folder = hfdir.write(tmp_path / "one", {"model.safetensors": models.safetensors_bytes(weights)})
    push_directory(folder, registry.uri("engine/one", "v1"), registry_settings(registry))
    tracker = run(registry.uri("engine/one", "v1"), shm_dir / "model.seg", registry_settings(registry))
    assert tracker.snapshot().phase == "complete"
    models.assert_segment_matches(shm_dir / "model.seg", weights)
