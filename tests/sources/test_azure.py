"""az:// against Azurite on loopback: shared key (signed by azure-storage-blob's own policy), SAS, and Entra
Workload ID through azure-identity against a loopback token endpoint, with Azurite checking the token."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest

from modelload.loader.errors import (
    SourceAccessDeniedError,
    SourceChangedError,
    SourceError,
    SourceNotFoundError,
    SourceUriError,
)
from modelload.sidecar.sources import (
    AzureCredentials,
    AzureSettings,
    HttpSettings,
    SourceSettings,
    list_directory,
    open_source,
)
from tests.conftest import require
from tests.sources.conftest import FAST_SETTINGS, payload
from tests.support.cloud_emulators import AZURITE_KEY, Azurite, find_azurite
from tests.support.fixtures import azurite, cloud_env
from tests.support.tls import find_openssl, self_signed_certificate
from tests.support.token_endpoints import TokenEndpoints

__all__ = ["azurite", "cloud_env"]

CONTAINER = "azure-sources"


def settings(**azure: Any) -> SourceSettings:
    return SourceSettings(http=FAST_SETTINGS.http, retry=FAST_SETTINGS.retry, azure=AzureSettings(**azure))


def test_a_blob_reads_byte_exact_with_the_connection_string_of_the_environment(
    azurite: Azurite, cloud_env: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    data = payload(1 << 20, seed=31)
    uri = azurite.put(CONTAINER, "models/one.bin", data)
    monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING", azurite.connection_string)
    with open_source(uri, FAST_SETTINGS) as source:
        info = source.stat()
        assert (info.size, [c.algorithm for c in info.checksums]) == (len(data), ["md5"])
        assert source.read_bytes(0, len(data)) == data
        assert source.read_bytes(12345, 100) == data[12345:12445]


def test_a_sas_token_reads_and_lists(azurite: Azurite, cloud_env: None) -> None:
    for name in ("a.safetensors", "b.safetensors", "config.json", "deeper/c.bin"):
        azurite.put(CONTAINER, f"listed/{name}", payload(64, seed=len(name)))
    sas = azurite.sas(CONTAINER)
    given = settings(endpoint_url=azurite.endpoint, credentials=AzureCredentials(sas_token=sas))
    directory = list_directory(f"az://{azurite.account}/{CONTAINER}/listed/", given)
    assert directory.names == ("a.safetensors", "b.safetensors", "config.json")
    assert directory.files["a.safetensors"].size == 64
    with open_source(directory.file_uri("config.json"), given) as source:
        assert source.read_bytes(0, 64) == payload(64, seed=len("config.json"))


def test_a_blob_replaced_during_the_load_fails_the_next_range_as_changed(
    azurite: Azurite, cloud_env: None
) -> None:
    uri = azurite.put(CONTAINER, "replaced.bin", payload(8192, seed=2))
    given = settings(credentials=AzureCredentials(connection_string=azurite.connection_string))
    with open_source(uri, given) as source:
        source.read_bytes(0, 10)
        azurite.put(CONTAINER, "replaced.bin", payload(8192, seed=3))
        with pytest.raises(SourceChangedError, match="ConditionNotMet"):
            source.read_bytes(100, 10)


def test_a_missing_container_and_blob_are_named(azurite: Azurite, cloud_env: None) -> None:
    azurite.container(CONTAINER)
    given = settings(credentials=AzureCredentials(connection_string=azurite.connection_string))
    with pytest.raises(SourceNotFoundError, match="container 'nowhere' does not exist"):
        open_source(f"az://{azurite.account}/nowhere/x.bin", given).stat()
    with pytest.raises(SourceNotFoundError, match=r"no blob 'nothing\.bin' in container"):
        open_source(f"az://{azurite.account}/{CONTAINER}/nothing.bin", given).stat()


def test_a_wrong_account_key_is_refused_and_never_shown(
    azurite: Azurite, cloud_env: None, caplog: pytest.LogCaptureFixture
) -> None:
    uri = azurite.put(CONTAINER, "keyed.bin", payload(100, seed=4))
    wrong = AZURITE_KEY[:-8] + "AAAAAAA="
    caplog.set_level(logging.DEBUG)
    given = settings(
        endpoint_url=azurite.endpoint,
        credentials=AzureCredentials(connection_string=azurite.connection_string.replace(AZURITE_KEY, wrong)),
    )
    with pytest.raises(SourceAccessDeniedError, match="access denied") as caught:
        open_source(uri, given).stat()
    for secret in (wrong, AZURITE_KEY):
        assert secret not in str(caught.value) and secret not in caplog.text and secret not in repr(given)


def test_a_sas_token_never_appears_in_a_message(azurite: Azurite, cloud_env: None) -> None:
    sas = azurite.sas(CONTAINER, read=False, list_=True)
    given = settings(endpoint_url=azurite.endpoint, credentials=AzureCredentials(sas_token=sas))
    azurite.put(CONTAINER, "sas-denied.bin", payload(10, seed=5))
    with pytest.raises(SourceAccessDeniedError) as caught:
        open_source(f"az://{azurite.account}/{CONTAINER}/sas-denied.bin", given).stat()
    signature = dict(part.split("=", 1) for part in sas.split("&"))["sig"]
    assert signature not in str(caught.value) and sas not in repr(given)


def test_an_error_code_that_echoes_the_sas_never_carries_it_into_a_message(
    azurite: Azurite, cloud_env: None
) -> None:
    """A proxy or gateway in front of the account may echo the request into its error: the code (header or
    XML) is taken only when it is an error code's shape, and nothing else of the answer is shown."""
    from urllib.parse import unquote

    from tests.support.fault_proxy import FaultProxy, Respond

    sas = azurite.sas(CONTAINER)
    signature = unquote(dict(part.split("=", 1) for part in sas.split("&"))["sig"])
    azurite.put(CONTAINER, "echoed.bin", payload(10, seed=6))
    echo = f"AuthenticationFailed: sig={signature}"
    body = f"<?xml version='1.0'?><Error><Code>{echo}</Code><Message>{sas}</Message></Error>".encode()
    with FaultProxy(azurite.port) as proxy:
        for headers in (
            (("x-ms-error-code", echo),),
            (("Content-Type", "application/xml"), ("x-ms-request-id", f"sig={signature}")),
        ):
            proxy.push(Respond(403, body, headers), method=None)
            endpoint = f"{proxy.endpoint}/{azurite.account}"
            given = settings(endpoint_url=endpoint, credentials=AzureCredentials(sas_token=sas))
            with pytest.raises(SourceAccessDeniedError) as caught:
                open_source(f"az://{azurite.account}/{CONTAINER}/echoed.bin", given).stat()
            assert signature not in str(caught.value) and "sig=" not in str(caught.value)


@pytest.mark.parametrize(
    ("uri", "form"),
    [
        (
            "abfss://models@acct.dfs.core.windows.net/llama/model.safetensors",
            "az://acct/models/llama/model.safetensors",
        ),
        ("wasbs://models@acct.blob.core.windows.net/m.bin", "az://acct/models/m.bin"),
    ],
)
def test_other_azure_spellings_are_refused_with_the_az_form(uri: str, form: str) -> None:
    with pytest.raises(SourceUriError, match=form):
        open_source(uri, FAST_SETTINGS)


def test_the_account_of_a_connection_string_must_be_the_uris(cloud_env: None) -> None:
    string = f"DefaultEndpointsProtocol=https;AccountName=other;AccountKey={AZURITE_KEY};"
    with pytest.raises(Exception, match="az://other/CONTAINER/PATH"):
        open_source(
            "az://mine/models/m.bin", settings(credentials=AzureCredentials(connection_string=string))
        )


# --- Entra Workload ID ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def azurite_oauth(tmp_path_factory: pytest.TempPathFactory) -> Any:
    require(find_azurite() is not None, "azurite is not installed (make venv installs it with npm)")
    require(find_openssl() is not None, "openssl is not installed")
    cert, key = self_signed_certificate(tmp_path_factory.mktemp("azurite-tls"))
    server = Azurite(tls=(cert, key), oauth=True)
    yield server, cert, key
    server.stop()


@pytest.fixture
def entra(azurite_oauth: Any, cloud_env: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    """What the AKS webhook injects (the federated token file, client and tenant ids), an Entra stand-in
    over TLS as the authority, and the settings that read Azurite over TLS:
    ``(server, endpoints, settings)``."""
    server, cert, key = azurite_oauth
    monkeypatch.setenv("REQUESTS_CA_BUNDLE", str(cert))
    endpoints = TokenEndpoints(federated_token="aks-projected-token-" + "y" * 40, tls=(cert, key))
    token_file = tmp_path / "azure-identity-token"
    token_file.write_text(endpoints.federated_token)
    monkeypatch.setenv("AZURE_FEDERATED_TOKEN_FILE", str(token_file))
    monkeypatch.setenv("AZURE_CLIENT_ID", "11111111-2222-3333-4444-555555555555")
    monkeypatch.setenv("AZURE_TENANT_ID", endpoints.tenant)
    monkeypatch.setenv("AZURE_AUTHORITY_HOST", endpoints.url)
    given = SourceSettings(
        http=HttpSettings(ca_bundle=str(cert)),
        retry=FAST_SETTINGS.retry,
        azure=AzureSettings(endpoint_url=server.endpoint),
    )
    yield server, endpoints, given
    endpoints.close()


def test_entra_workload_id_exchanges_the_federated_token_and_azurite_accepts_the_bearer(entra: Any) -> None:
    """azure-identity's DefaultAzureCredential does the exchange with a loopback Entra, and Azurite checks
    the token's issuer, audience and expiry."""
    server, endpoints, given = entra
    data = payload(4096, seed=6)
    uri = server.put(CONTAINER, "federated.bin", data)
    with open_source(uri, given) as source:
        assert source.read_bytes(0, 4096) == data
    fields = dict(endpoints.exchanges)["entra"]
    assert fields["client_id"] == "11111111-2222-3333-4444-555555555555"
    assert fields["scope"] == "https://storage.azure.com/.default"
    assert fields["client_assertion"] == endpoints.federated_token
    assert fields["client_assertion_type"] == "urn:ietf:params:oauth:client-assertion-type:jwt-bearer"


def test_a_refused_federation_names_the_workload_identity_settings(entra: Any) -> None:
    server, endpoints, given = entra
    uri = server.put(CONTAINER, "unbound.bin", payload(10, seed=7))
    endpoints.refuse = True
    with pytest.raises(SourceAccessDeniedError, match=r"azure\.workload\.identity/client-id") as caught:
        open_source(uri, given).stat()
    assert "client id 11111111-2222-3333-4444-555555555555" in str(caught.value)
    assert endpoints.federated_token not in str(caught.value)


LOOPING_PAGE = (
    b'<?xml version="1.0" encoding="utf-8"?><EnumerationResults><Blobs><Blob><Name>loop/a.json</Name>'
    b"<Properties><Content-Length>2</Content-Length></Properties></Blob></Blobs>"
    b"<NextMarker>m1</NextMarker></EnumerationResults>"
)


def test_a_listing_whose_next_marker_loops_stops_at_the_loop_saying_so(
    azurite: Azurite, cloud_env: None
) -> None:
    """An endpoint answering the same NextMarker again was followed to the page limit (64 requests of up to
    16 MiB), and the error asked whether the prefix was a model."""
    from tests.support.fault_proxy import FaultProxy, Respond

    azurite.put(CONTAINER, "loop/a.json", b"{}")
    sas = azurite.sas(CONTAINER)
    with FaultProxy(azurite.port) as proxy:
        endpoint = azurite.endpoint.replace(f":{azurite.port}/", f":{proxy.port}/")
        given = settings(endpoint_url=endpoint, credentials=AzureCredentials(sas_token=sas))
        proxy.always(Respond(200, LOOPING_PAGE, (("Content-Type", "application/xml"),)), path="comp=list")
        with pytest.raises(SourceError, match=r"next marker is one already followed \(a loop\)"):
            list_directory(f"az://{azurite.account}/{CONTAINER}/loop/", given)
        assert len([r for r in proxy.requests if "comp=list" in r.path]) == 2


def test_the_blobs_of_one_model_share_a_connection_per_thread(azurite: Azurite, cloud_env: None) -> None:
    # Each shard had a pool of its own: a connection (over TLS, a handshake) per shard and reader thread.
    from modelload.sidecar.sources import store_for

    uris = [azurite.put(CONTAINER, f"shared/model-{i}.bin", payload(5_000, seed=i)) for i in range(4)]
    given = settings(
        endpoint_url=azurite.endpoint, credentials=AzureCredentials(sas_token=azurite.sas(CONTAINER))
    )
    open_one = store_for(uris[0]).opener(given)
    sources = [open_one(uri) for uri in uris]
    try:
        for number, source in enumerate(sources):
            assert source.read_bytes(10, 100) == payload(5_000, seed=number)[10:110]
        assert len({id(source.pool) for source in sources}) == 1
        assert sources[0].pool.connections_opened == 1, "one connection carried every blob's requests"
    finally:
        for source in sources:
            source.close()
