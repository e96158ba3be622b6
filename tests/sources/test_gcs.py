"""gs:// against fake-gcs-server on loopback, with google-auth doing every token exchange.

Reads are byte-exact in parallel ranges, pinned to the generation the first look-up saw; a prefix lists its
top level with generations and checksums; refusals name the identity and the permission; the workload
identity paths (a federated token file exchanged at an STS, the GKE metadata server) run through
google-auth against loopback stand-ins, and the token they yield is what reaches the store, and nothing
else sees it.
"""

from __future__ import annotations

import json
import logging
import threading
from pathlib import Path
from typing import Any

import pytest

from modelload.loader.errors import (
    ConfigError,
    SourceAccessDeniedError,
    SourceChangedError,
    SourceNotFoundError,
    SourceUriError,
)
from modelload.sidecar.sources import (
    GcsSettings,
    SourceSettings,
    list_directory,
    open_source,
    read_range,
)
from tests.sources.conftest import FAST_SETTINGS, payload
from tests.support.fault_proxy import FaultProxy, Respond
from tests.support.fixtures import cloud_env, fake_gcs, point_metadata_server
from tests.support.token_endpoints import SERVICE_ACCOUNT, TokenEndpoints

__all__ = ["cloud_env", "fake_gcs"]

BUCKET = "gcs-sources"


def settings(endpoint: str, **gcs: Any) -> SourceSettings:
    return SourceSettings(
        http=FAST_SETTINGS.http, retry=FAST_SETTINGS.retry, gcs=GcsSettings(endpoint, **gcs)
    )


def test_an_object_reads_byte_exact_in_parallel_ranges(fake_gcs: Any, cloud_env: None) -> None:
    data = payload(3 << 20, seed=21)
    uri = fake_gcs.put(BUCKET, "models/one.bin", data)
    with open_source(uri, settings(fake_gcs.endpoint, anonymous=True)) as source:
        info = source.stat()
        assert info.size == len(data)
        assert info.etag == f'"{fake_gcs.metadata(BUCKET, "models/one.bin")["generation"]}"'
        assert [c.algorithm for c in info.checksums] == ["crc32c", "md5"]
        out = bytearray(len(data))
        view = memoryview(out)
        step = 256 << 10
        threads = [
            threading.Thread(
                target=read_range,
                args=(source, o, view[o : o + step]),
                kwargs={"policy": FAST_SETTINGS.retry},
            )
            for o in range(0, len(data), step)
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    assert bytes(out) == data


def test_the_emulator_named_by_storage_emulator_host_is_used_without_credentials(
    fake_gcs: Any, cloud_env: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    data = payload(4096, seed=1)
    uri = fake_gcs.put(BUCKET, "emulated.bin", data)
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", fake_gcs.endpoint.removeprefix("http://"))
    with open_source(uri, FAST_SETTINGS) as source:
        assert source.read_bytes(0, 4096) == data


def test_a_prefix_lists_its_top_level_with_generations_and_checksums(fake_gcs: Any, cloud_env: None) -> None:
    for name in ("a.safetensors", "b.safetensors", "config.json", "nested/deeper.bin"):
        fake_gcs.put(BUCKET, f"listed/{name}", payload(100, seed=len(name)))
    directory = list_directory(f"gs://{BUCKET}/listed/", settings(fake_gcs.endpoint, anonymous=True))
    assert directory.names == ("a.safetensors", "b.safetensors", "config.json")
    entry = directory.files["a.safetensors"]
    meta = fake_gcs.metadata(BUCKET, "listed/a.safetensors")
    assert (entry.size, entry.version, entry.checksums["crc32c"]) == (100, meta["generation"], meta["crc32c"])


def test_an_object_replaced_during_the_load_fails_the_next_range_as_changed(
    fake_gcs: Any, cloud_env: None
) -> None:
    uri = fake_gcs.put(BUCKET, "replaced.bin", payload(8192, seed=2))
    with open_source(uri, settings(fake_gcs.endpoint, anonymous=True)) as source:
        assert source.read_bytes(0, 10) == payload(8192, seed=2)[:10]
        fake_gcs.put(BUCKET, "replaced.bin", payload(8192, seed=3))
        with pytest.raises(SourceChangedError, match="generation"):
            source.read_bytes(100, 10)


def test_a_missing_bucket_and_a_missing_object_are_named(fake_gcs: Any, cloud_env: None) -> None:
    fake_gcs.create_bucket(BUCKET)
    with pytest.raises(SourceNotFoundError, match=r"no object 'nothing.bin' in bucket 'gcs-sources'"):
        open_source(f"gs://{BUCKET}/nothing.bin", settings(fake_gcs.endpoint, anonymous=True)).stat()


def test_a_missing_bucket_listed_at_its_top_level_is_named_once_as_missing(
    fake_gcs: Any, cloud_env: None
) -> None:
    # A bare bucket is a directory: its listing's errors named it gs://bucket// before, and an object '/'.
    with pytest.raises(SourceNotFoundError) as caught:
        list_directory("gs://no-such-bucket-here", settings(fake_gcs.endpoint, anonymous=True))
    assert "gs://no-such-bucket-here/: bucket 'no-such-bucket-here' does not exist" in str(caught.value)
    assert "gs://no-such-bucket-here//" not in str(caught.value)
    assert caught.value.uri == "gs://no-such-bucket-here/"


@pytest.mark.parametrize(
    "page",
    [
        [],
        {"items": {"name": "x"}},
        {"items": ["model.safetensors"]},
        {"items": [{"name": "hostile/m.safetensors", "size": "12 bytes"}]},
        {"items": [{"name": "hostile/m.safetensors", "size": -5}]},
        {"items": [{"name": "hostile/m.safetensors", "size": "1"}], "nextPageToken": {"a": 1}},
        [[[[[[[]]]]]]],
    ],
)
def test_a_listing_page_that_is_not_what_gcs_answers_is_an_error_naming_the_listing(
    fake_gcs: Any, cloud_env: None, page: Any
) -> None:
    """A store (or an endpoint posing as one) answering a listing of another shape, or a negative or
    non-numeric size (which would count against the small files' limit), gets a SourceError, not an
    AttributeError or ValueError out of the listing."""
    from modelload.loader.errors import SourceError

    fake_gcs.put(BUCKET, "hostile/m.safetensors", b"x")
    with FaultProxy(fake_gcs.port) as proxy:
        proxy.always(Respond(200, json.dumps(page).encode(), (("Content-Type", "application/json"),)))
        with pytest.raises(SourceError, match=r"gs://gcs-sources/hostile/: the listing"):
            list_directory(f"gs://{BUCKET}/hostile/", settings(proxy.endpoint, anonymous=True))


@pytest.mark.parametrize("meta", [{"size": "-5", "generation": "1"}, {"size": "5"}, ["size"]])
def test_object_metadata_without_a_size_and_generation_is_an_error(
    fake_gcs: Any, cloud_env: None, meta: Any
) -> None:
    from modelload.loader.errors import SourceError

    uri = fake_gcs.put(BUCKET, "hostile/meta.bin", b"x")
    with FaultProxy(fake_gcs.port) as proxy:
        proxy.always(Respond(200, json.dumps(meta).encode(), (("Content-Type", "application/json"),)))
        with pytest.raises(SourceError, match=r"metadata has no size or generation"):
            open_source(uri, settings(proxy.endpoint, anonymous=True)).stat()


def test_throttling_is_retried(fake_gcs: Any, cloud_env: None) -> None:
    data = payload(4096, seed=4)
    uri = fake_gcs.put(BUCKET, "throttled.bin", data)
    with (
        FaultProxy(fake_gcs.port) as proxy,
        open_source(uri, settings(proxy.endpoint, anonymous=True)) as source,
    ):
        proxy.push(Respond(429, b'{"error":{"code":429,"message":"rate"}}'), Respond(503))
        out = bytearray(4096)
        read_range(source, 0, memoryview(out), policy=FAST_SETTINGS.retry)
    assert bytes(out) == data


def test_gcs_and_other_spellings_are_refused_with_the_gs_form() -> None:
    with pytest.raises(SourceUriError, match=r"did you mean gs://bucket/model.bin"):
        open_source("gcs://bucket/model.bin", FAST_SETTINGS)


# --- workload identity -------------------------------------------------------------------------------------


@pytest.fixture
def endpoints() -> Any:
    server = TokenEndpoints(federated_token="k8s-projected-token-" + "x" * 40)
    yield server
    server.close()


def federation_config(tmp_path: Path, endpoints: TokenEndpoints) -> Path:
    """A workload identity federation configuration, as ``gcloud iam workload-identity-pools
    create-cred-config`` writes one for a Kubernetes ServiceAccount token file."""
    token_file = tmp_path / "token"
    token_file.write_text(endpoints.federated_token)
    config = {
        "type": "external_account",
        "audience": "//iam.googleapis.com/projects/123/locations/global/workloadIdentityPools/p/providers/k",
        "subject_token_type": "urn:ietf:params:oauth:token-type:jwt",
        "token_url": f"{endpoints.url}/sts",
        "credential_source": {"file": str(token_file)},
    }
    path = tmp_path / "federation.json"
    path.write_text(json.dumps(config))
    return path


def test_workload_identity_federation_exchanges_the_token_file_and_sends_the_issued_token(
    fake_gcs: Any, cloud_env: None, endpoints: TokenEndpoints, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    data = payload(4096, seed=5)
    uri = fake_gcs.put(BUCKET, "federated.bin", data)
    monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", str(federation_config(tmp_path, endpoints)))
    with FaultProxy(fake_gcs.port) as proxy, open_source(uri, settings(proxy.endpoint)) as source:
        assert source.read_bytes(0, 4096) == data
        sent = {r.headers.get("authorization") for r in proxy.requests}
    kind, fields = endpoints.exchanges[0]
    assert kind == "sts" and fields["subject_token"] == endpoints.federated_token
    assert "devstorage.read_only" in fields["scope"]
    assert sent == {f"Bearer {endpoints.issued[0]}"}


def test_the_gke_metadata_server_gives_the_token(
    fake_gcs: Any, cloud_env: None, endpoints: TokenEndpoints, monkeypatch: pytest.MonkeyPatch
) -> None:
    data = payload(4096, seed=6)
    uri = fake_gcs.put(BUCKET, "metadata.bin", data)
    host = endpoints.url.removeprefix("http://")
    point_metadata_server(monkeypatch, host)
    monkeypatch.delenv("NO_GCE_CHECK")
    with FaultProxy(fake_gcs.port) as proxy, open_source(uri, settings(proxy.endpoint)) as source:
        assert source.read_bytes(0, 4096) == data
        sent = {r.headers.get("authorization") for r in proxy.requests}
    assert sent == {f"Bearer {endpoints.issued[0]}"}
    assert any(path["path"].endswith("/token") for kind, path in endpoints.exchanges if kind == "metadata")


def test_a_refused_credential_names_the_identity_and_the_permission_and_never_the_token(
    fake_gcs: Any,
    cloud_env: None,
    endpoints: TokenEndpoints,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    uri = fake_gcs.put(BUCKET, "denied.bin", payload(100, seed=7))
    refusal = {
        "error": {
            "code": 403,
            "message": f"{SERVICE_ACCOUNT} does not have storage.objects.get access to the Google Cloud"
            " Storage object. Permission 'storage.objects.get' denied on resource (or it may not exist).",
            "errors": [{"reason": "forbidden"}],
        }
    }
    monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", str(federation_config(tmp_path, endpoints)))
    caplog.set_level(logging.DEBUG)
    with FaultProxy(fake_gcs.port) as proxy:
        proxy.always(Respond(403, json.dumps(refusal).encode(), (("Content-Type", "application/json"),)))
        with pytest.raises(SourceAccessDeniedError) as caught:
            open_source(uri, settings(proxy.endpoint)).stat()
    message = str(caught.value)
    assert (
        SERVICE_ACCOUNT in message
        and "storage.objects.get" in message
        and "roles/storage.objectViewer" in message
    )
    for secret in (endpoints.issued[0], endpoints.federated_token):
        assert secret not in message
        assert secret not in caplog.text
        assert secret not in repr(caught.value.__cause__)


def test_a_refused_token_exchange_is_access_denied_naming_the_binding(
    fake_gcs: Any, cloud_env: None, endpoints: TokenEndpoints, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    uri = fake_gcs.put(BUCKET, "unbound.bin", payload(100, seed=8))
    endpoints.refuse = True
    monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", str(federation_config(tmp_path, endpoints)))
    with pytest.raises(SourceAccessDeniedError, match=r"iam\.gke\.io/gcp-service-account") as caught:
        open_source(uri, settings(fake_gcs.endpoint)).stat()
    assert endpoints.federated_token not in str(caught.value)


def test_a_secret_may_hold_a_service_account_key_but_not_a_federation_configuration(
    fake_gcs: Any, cloud_env: None, endpoints: TokenEndpoints, tmp_path: Path
) -> None:
    """A federation configuration names files and URLs to fetch: the operator must not fetch what a
    Secret's author points it at."""
    config = federation_config(tmp_path, endpoints).read_text()
    with pytest.raises(ConfigError, match="service-account key"):
        open_source(f"gs://{BUCKET}/x.bin", settings(fake_gcs.endpoint, credentials_json=config))
    assert endpoints.exchanges == []


def test_the_objects_of_one_model_share_a_connection_per_thread_and_close_it_with_the_last(
    fake_gcs: Any, cloud_env: None
) -> None:
    # Each shard had a pool of its own: a connection (over TLS, a handshake) per shard and reader thread.
    from modelload.sidecar.sources import store_for

    uris = [fake_gcs.put(BUCKET, f"shared/model-{i}.bin", payload(5_000, seed=i)) for i in range(4)]
    open_one = store_for(uris[0]).opener(settings(fake_gcs.endpoint, anonymous=True))
    sources = [open_one(uri) for uri in uris]
    for number, source in enumerate(sources):
        assert source.read_bytes(10, 100) == payload(5_000, seed=number)[10:110]
    assert len({id(source.pool) for source in sources}) == 1
    # Each object's metadata answer (JSON) leaves its connection behind; every range took one connection.
    assert sources[0].pool.connections_opened == len(sources) + 1
    *others, last = sources
    for source in others:
        source.close()
    assert last.read_bytes(0, 5) == payload(5_000, seed=3)[:5], "its siblings' close left it connected"
    last.close()
    later = open_one(uris[0])  # after the last close: connections of its own, which the next one shares
    again = open_one(uris[1])
    try:
        assert later.read_bytes(0, 5) == payload(5_000, seed=0)[:5]
        assert again.read_bytes(0, 5) == payload(5_000, seed=1)[:5]
        assert later.pool is again.pool and later.pool is not sources[0].pool
    finally:
        later.close()
        again.close()
