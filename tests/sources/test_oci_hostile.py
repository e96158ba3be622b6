"""``oci://`` against a registry that lies: an attacker's look at the registry store.

A real distribution registry (tests/support/registry.py) holds the artifacts; where the registry itself is
the attacker, a fault proxy in front of it answers chosen requests with hostile documents (an index chain, a
manifest that lies), and a small HTTPS stand-in plays a registry that names a token service of its choice.
Every case ends in an error that says what is wrong, never a traceback, a wrong file or a credential sent
where it should not go.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import io
import json
import socket
import tarfile
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from modelload.loader.errors import FormatError, ModelloadError, SourceAccessDeniedError, SourceError
from modelload.sidecar.sources import HttpSettings, RegistrySettings, SourceSettings, list_directory
from modelload.sidecar.sources.oci import PushResult, push_directory
from modelload.sidecar.sources.oci._tar import tar_members
from tests.sources.conftest import FAST_SETTINGS, payload
from tests.support.fault_proxy import FaultProxy, Respond
from tests.support.registry import RegistryServer
from tests.support.tls import find_openssl, self_signed_certificate

INDEX = "application/vnd.oci.image.index.v1+json"
MANIFEST = "application/vnd.oci.image.manifest.v1+json"


def _settings(host: str, *, auths: dict[str, dict[str, str]] | None = None, **http: Any) -> SourceSettings:
    return SourceSettings(
        http=HttpSettings(**{"connect_timeout": 2.0, "stall_timeout": 2.0, **http}),
        retry=FAST_SETTINGS.retry,
        registry=RegistrySettings(auths=auths or {}, plain_http=(host,)),
    )


def _digest(body: bytes) -> str:
    return "sha256:" + hashlib.sha256(body).hexdigest()


def _document(value: dict[str, Any]) -> bytes:
    return json.dumps(value).encode()


def _answer(body: bytes, media: str) -> Respond:
    return Respond(200, body, (("Content-Type", media), ("Docker-Content-Digest", _digest(body))))


# --- manifests and indexes --------------------------------------------------------------------------------


@pytest.mark.parametrize("depth", [2, 1200])
def test_an_index_that_names_another_index_is_refused_without_following_the_chain(
    registry: RegistryServer, depth: int
) -> None:
    """Each index of the chain names the next by its true digest, so nothing but depth can stop it: 1200
    levels once ended in a RecursionError, and every level cost a request."""
    with FaultProxy(registry.port) as proxy:
        host = f"127.0.0.1:{proxy.port}"
        last = _document({"schemaVersion": 2, "mediaType": MANIFEST, "layers": []})
        proxy.always(_answer(last, MANIFEST), path=_digest(last))
        named = _digest(last)
        for _ in range(depth):
            index = _document(
                {
                    "schemaVersion": 2,
                    "mediaType": INDEX,
                    "manifests": [{"mediaType": INDEX, "digest": named, "size": 100}],
                }
            )
            proxy.always(_answer(index, INDEX), path=_digest(index))
            named = _digest(index)
        proxy.always(_answer(index, INDEX), path="/manifests/v1")
        with pytest.raises(SourceError, match=r"index.*names another index") as caught:
            list_directory(f"oci://{host}/chain/model:v1", _settings(host))
        asked = [r for r in proxy.requests if "/manifests/" in r.path]
    assert len(asked) <= 2, f"{len(asked)} manifests fetched"
    assert "sha256:" in str(caught.value)


def test_a_manifest_that_lies_about_a_layers_size_fails_the_read_naming_both_sizes(
    registry: RegistryServer, tmp_path: Path
) -> None:
    """Held: the listed size is checked against the blob the registry serves."""
    pushed = _push_one_file(tmp_path, registry.uri("liar/model", "v1"), _settings(registry.host))
    layer = next(layer for layer in pushed.layers if layer.name == "model.safetensors")
    manifest = _document(
        {
            "schemaVersion": 2,
            "mediaType": MANIFEST,
            "layers": [
                {
                    "mediaType": "application/vnd.cncf.model.weight.v1.raw",
                    "digest": layer.digest,
                    "size": layer.size + 4096,
                    "annotations": {"org.cncf.model.filepath": "model.safetensors"},
                }
            ],
        }
    )
    from modelload.loader.errors import SourceChangedError
    from modelload.sidecar.sources import open_source

    with FaultProxy(registry.port) as proxy:
        host = f"127.0.0.1:{proxy.port}"
        proxy.always(_answer(manifest, MANIFEST), path="/manifests/")
        config = _settings(host)
        directory = list_directory(f"oci://{host}/liar/model:v1", config)
        assert directory.files["model.safetensors"].size == layer.size + 4096
        with pytest.raises(SourceChangedError, match=rf"{layer.size} bytes where its listing said"):
            open_source(directory.file_uri("model.safetensors"), config).stat()


# --- tar layers -------------------------------------------------------------------------------------------


def _pax_tar(pax: dict[str, str], *, data: bytes = b"x" * 100, name: str = "model.safetensors") -> bytes:
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT) as tar:
        info = tarfile.TarInfo(name)
        info.size = len(data)
        info.pax_headers = pax
        tar.addfile(info, io.BytesIO(data))
    return out.getvalue()


def _members(data: bytes) -> list[Any]:
    return tar_members(
        lambda offset, length: data[offset : offset + length], len(data), where="a hostile tar"
    )


@pytest.mark.parametrize(
    ("pax", "rule"),
    [
        ({"size": "0x10"}, r"PAX size '0x10' is not a decimal number"),
        ({"size": "1e3"}, r"PAX size '1e3' is not a decimal number"),
        ({"size": "-512"}, r"PAX size '-512' is not a decimal number"),
        ({"size": "99999999999999"}, r"runs past the layer's end"),
        ({"path": "a\x00b.safetensors"}, r"control character"),
        ({"path": "a\nb.json"}, r"control character"),
    ],
)
def test_a_tar_whose_pax_records_lie_is_refused_naming_the_rule(pax: dict[str, str], rule: str) -> None:
    """A PAX ``size`` overrides the header's, so it gets the header's checks: decimal digits (``int()``
    took ``-512`` and raised ValueError on ``0x10``), and inside the blob (a member of 100 TB was listed)."""
    with pytest.raises(FormatError, match=rule):
        _members(_pax_tar(pax))


def test_a_tar_member_with_an_absolute_or_dotted_path_is_refused_or_made_relative() -> None:
    """Held: ``..`` is refused, a leading ``/`` is dropped (the file stays inside the model directory)."""
    with pytest.raises(FormatError, match=r"'\.' or '\.\.'"):
        _members(_pax_tar({"path": "../../etc/passwd"}))
    assert [m.name for m in _members(_pax_tar({"path": "/abs/config.json"}))] == ["abs/config.json"]


def test_a_tar_layer_with_a_member_past_its_blob_is_refused_when_listed(
    registry: RegistryServer, tmp_path: Path
) -> None:
    """End to end: the hostile tar pushed as a layer of a real registry; the listing fails, naming it."""
    import oras.client

    layer = tmp_path / "model.tar"
    layer.write_bytes(_pax_tar({"size": str(10**12)}, data=payload(3000, seed=2)))
    client = oras.client.OrasClient(hostname=registry.host, insecure=True)
    import os

    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        client.push(
            target=f"{registry.host}/hostile/tar:v1",
            files=["model.tar:application/vnd.kitops.modelkit.model.v1.tar"],
        )
    finally:
        os.chdir(cwd)
    with pytest.raises(FormatError, match=r"runs past the layer's end"):
        list_directory(registry.uri("hostile/tar", "v1"), _settings(registry.host))


CONFIG = b'{"model_type": "toy", "hidden_size": 4096}'


def test_a_small_file_inside_a_tar_layer_is_proved_by_its_blobs_digest_before_it_is_written(
    registry: RegistryServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A config file packed as a tar of its own (as ModelPack tools pack each file) was written into the
    model directory as it came: its checksum is the blob's, which it does not cover alone, and no weight
    file shares the blob to have it hashed. A flipped bit on the way (or a storage serving other bytes) went
    into the app's config unseen."""
    import oras.client

    from modelload.loader.errors import HashMismatchError
    from modelload.sidecar.sources import fetch_small_file
    from tests.support.fault_proxy import FlipBit

    layer = tmp_path / "config.tar"
    with tarfile.open(layer, "w", format=tarfile.USTAR_FORMAT) as tar:
        info = tarfile.TarInfo("config.json")
        info.size = len(CONFIG)
        tar.addfile(info, io.BytesIO(CONFIG))
    monkeypatch.chdir(tmp_path)
    oras.client.OrasClient(hostname=registry.host, insecure=True).push(
        target=f"{registry.host}/cfg/toy:v1",
        files=["config.tar:application/vnd.cncf.model.weight.config.v1.tar"],
    )
    with FaultProxy(registry.port) as proxy:
        host = f"127.0.0.1:{proxy.port}"
        config = _settings(host)
        directory = list_directory(f"oci://{host}/cfg/toy:v1", config)
        assert fetch_small_file(directory, "config.json", config) == CONFIG
        proxy.always(FlipBit(at=7, from_offset=tarfile.BLOCKSIZE), path="/blobs/")  # the file's own read
        assert fetch_small_file(directory, "config.json", config) == CONFIG, "the bytes proved are written"
        proxy.clear()
        proxy.always(FlipBit(at=7), path="/blobs/")  # every read of the blob
        with pytest.raises(HashMismatchError, match=r"sha256 digest"):
            fetch_small_file(directory, "config.json", config)


# --- the token flow -----------------------------------------------------------------------------------------


class _Recorder:
    """A server that records what it is sent (headers, path) and answers with ``answer``."""

    def __init__(self, answer: Any, *, tls: tuple[Path, Path] | None = None) -> None:
        self.requests: list[dict[str, str]] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def do_GET(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length).decode() if length else ""
                seen = {"method": self.command, "path": self.path, "body": body}
                outer.requests.append({**seen, **{k.lower(): v for k, v in self.headers.items()}})
                status, headers, body = answer(self)
                self.send_response(status)
                for name, value in headers:
                    self.send_header(name, value)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            do_POST = do_GET

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        if tls is not None:
            import ssl

            context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            context.load_cert_chain(*tls)
            self._server.socket = context.wrap_socket(self._server.socket, server_side=True)
        self.port = self._server.server_address[1]
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


@pytest.fixture
def tls(tmp_path: Path) -> tuple[Path, Path]:
    """A certificate for localhost and 127.0.0.1 (its own CA: the first path is the bundle to trust)."""
    from tests.conftest import require

    require(find_openssl() is not None, "openssl is not installed")
    return self_signed_certificate(tmp_path)


@pytest.fixture
def realm() -> Iterator[_Recorder]:
    server = _Recorder(lambda request: (200, [("Content-Type", "application/json")], b'{"token": "t0k3n"}'))
    yield server
    server.close()


def _over_tls(tls: tuple[Path, Path], auths: dict[str, dict[str, str]]) -> SourceSettings:
    """Settings for the HTTPS stand-ins: their certificate trusted, ``auths`` as the Docker config's."""
    return SourceSettings(
        http=HttpSettings(connect_timeout=2.0, stall_timeout=2.0, ca_bundle=str(tls[0])),
        retry=FAST_SETTINGS.retry,
        registry=RegistrySettings(auths=auths),
    )


def _challenging_registry(realm_url: str, tls: tuple[Path, Path]) -> _Recorder:
    challenge = f'Bearer realm="{realm_url}",service="registry",scope="repository:m:pull"'
    body = _document({"errors": [{"code": "UNAUTHORIZED", "message": "authentication required"}]})
    return _Recorder(lambda request: (401, [("WWW-Authenticate", challenge)], body), tls=tls)


def test_an_https_registry_naming_a_plain_http_token_service_gets_no_password_sent_there(
    tls: tuple[Path, Path], realm: _Recorder
) -> None:
    """Held: the realm is the registry's choice, but over plain HTTP the password would cross the network in
    clear: refused while the registry itself is reached over HTTPS."""
    registry = _challenging_registry(f"http://127.0.0.1:{realm.port}/token", tls)
    try:
        host = f"localhost:{registry.port}"
        auths = {host: {"auth": base64.b64encode(b"alice:s3cret-password").decode()}}
        config = _over_tls(tls, auths)
        with pytest.raises(SourceAccessDeniedError, match=r"token service over plain HTTP") as caught:
            list_directory(f"oci://{host}/m:v1", config)
    finally:
        registry.close()
    assert realm.requests == []
    assert "s3cret-password" not in str(caught.value)


def test_a_token_service_on_another_host_gets_the_password_only_over_https_and_never_the_blob_storage(
    tls: tuple[Path, Path],
) -> None:
    """Held, by the protocol's design: the registry names its realm (Docker Hub's is auth.docker.io), and the
    Docker config's credentials for the registry go there, over TLS; the bearer token it issues goes back to
    the registry only."""
    token_service = _Recorder(
        lambda request: (200, [("Content-Type", "application/json")], b'{"token": "issued-token"}'), tls=tls
    )
    registry = _challenging_registry(f"https://127.0.0.1:{token_service.port}/token", tls)
    try:
        host = f"localhost:{registry.port}"
        auths = {host: {"auth": base64.b64encode(b"alice:s3cret-password").decode()}}
        config = _over_tls(tls, auths)
        with pytest.raises(SourceAccessDeniedError):
            list_directory(f"oci://{host}/m:v1", config)
    finally:
        registry.close()
        token_service.close()
    sent = [r.get("authorization") for r in token_service.requests]
    assert sent and all(a == "Basic " + base64.b64encode(b"alice:s3cret-password").decode() for a in sent)
    assert [r.get("authorization") for r in registry.requests][1:] == ["Bearer issued-token"]


def test_errors_never_carry_the_password_whatever_the_registry_echoes(
    registry: RegistryServer,
) -> None:
    """Held: the registry's error body is reduced to its codes; a hostile one echoing the credentials does
    not get them into the message."""
    echoed = base64.b64encode(b"alice:s3cret-password").decode()
    body = _document({"errors": [{"code": "DENIED", "message": f"Basic {echoed} s3cret-password"}]})
    with FaultProxy(registry.port) as proxy:
        host = f"127.0.0.1:{proxy.port}"
        proxy.always(Respond(403, body, (("Content-Type", "application/json"),)), path="/manifests/")
        auths = {host: {"auth": echoed}}
        with pytest.raises(ModelloadError) as caught:
            list_directory(f"oci://{host}/echo/model:v1", _settings(host, auths=auths))
    assert "s3cret-password" not in str(caught.value) and echoed not in str(caught.value)


DEEP = b"[" * 30_000 + b"]" * 30_000
"""JSON nested past any parser's depth, and small enough for every document and error body limit."""


@pytest.mark.parametrize("status", [200, 404])
def test_a_manifest_or_an_error_nested_past_the_parsers_depth_is_an_error_not_a_recursion(
    registry: RegistryServer, status: int
) -> None:
    with FaultProxy(registry.port) as proxy:
        host = f"127.0.0.1:{proxy.port}"
        proxy.always(Respond(status, DEEP, (("Content-Type", "application/json"),)), path="/manifests/")
        with pytest.raises(SourceError, match=r"not JSON|no .*'v1'"):
            list_directory(f"oci://{host}/deep/model:v1", _settings(host))


@pytest.mark.parametrize(
    "answer",
    [
        DEEP,
        _document({"token": "t\u00f6ken-\u20ac"}),
        _document({"token": "tok\x7fen"}),
        _document({"token": "tok\x00en"}),
    ],
    ids=["nested-past-the-parser", "outside-latin-1", "delete", "nul"],
)
def test_a_token_answer_that_holds_no_usable_token_is_refused_and_nothing_is_sent(answer: bytes) -> None:
    """Nested JSON past the parser's depth, or a token HTTP cannot carry in a header: one outside latin-1
    failed the next request with a UnicodeEncodeError holding ``Bearer <token>`` (a traceback, an internal
    error); a control character went to the registry as it was."""
    realm = _Recorder(lambda request: (200, [("Content-Type", "application/json")], answer))
    challenge = f'Bearer realm="http://127.0.0.1:{realm.port}/token",service="registry"'
    registry = _Recorder(lambda request: (401, [("WWW-Authenticate", challenge)], b"{}"))
    try:
        host = f"127.0.0.1:{registry.port}"
        with pytest.raises(SourceError, match=r"answered no usable token"):
            list_directory(f"oci://{host}/odd/model:v1", _settings(host))
    finally:
        registry.close()
        realm.close()
    assert [r.get("authorization") for r in registry.requests] == [None]


def test_a_token_service_whose_status_line_echoes_the_identity_token_is_named_without_it() -> None:
    """The refresh grant's failures were told with the exception's own text, which for a malformed status
    line is the line the service wrote: the identity token it was just sent, into the error and the log."""
    identity = "refresh-me-EXAMPLE-0123456789"
    service = socket.create_server(("127.0.0.1", 0))

    def echo() -> None:
        with contextlib.suppress(OSError):
            while True:
                client, _ = service.accept()
                with client:
                    client.recv(65536)
                    client.sendall(f"HTTP/1.1 2xx {identity}\r\n\r\n".encode())

    threading.Thread(target=echo, daemon=True).start()
    challenge = f'Bearer realm="http://127.0.0.1:{service.getsockname()[1]}/token",service="registry"'
    registry = _Recorder(lambda request: (401, [("WWW-Authenticate", challenge)], b"{}"))
    try:
        host = f"127.0.0.1:{registry.port}"
        with pytest.raises(ModelloadError) as caught:
            list_directory(f"oci://{host}/m:v1", _settings(host, auths={host: {"identitytoken": identity}}))
    finally:
        registry.close()
        service.close()
    assert identity not in str(caught.value)
    assert "status line is malformed" in str(caught.value)


def test_an_identity_token_is_exchanged_over_the_same_connections_as_every_request(
    tls: tuple[Path, Path],
) -> None:
    """A Docker config's ``identitytoken`` is posted to the realm (an OAuth2 refresh grant). That POST went
    through a connection of its own making: the configured CA bundle was not trusted (a private registry's
    token service failed its certificate check), and no proxy or address rule applied to it."""
    token_service = _Recorder(
        lambda request: (200, [("Content-Type", "application/json")], b'{"access_token": "issued"}'), tls=tls
    )
    registry = _challenging_registry(f"https://localhost:{token_service.port}/token", tls)
    try:
        host = f"localhost:{registry.port}"
        config = _over_tls(tls, {host: {"identitytoken": "refresh-me-EXAMPLE"}})
        with pytest.raises(SourceAccessDeniedError, match=r"do not grant pull") as caught:
            list_directory(f"oci://{host}/m:v1", config)
    finally:
        registry.close()
        token_service.close()
    posted = [r for r in token_service.requests if r["method"] == "POST"]
    assert posted and "grant_type=refresh_token" in posted[0]["body"]
    assert "refresh_token=refresh-me-EXAMPLE" in posted[0]["body"]
    assert [r.get("authorization") for r in registry.requests][1:] == ["Bearer issued"]
    assert "refresh-me-EXAMPLE" not in str(caught.value)


# --- redirects ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "location",
    [
        "http://127.0.0.1:{other}/blob",
        "//127.0.0.1:{other}/blob",
        "http://127.0.0.1:{registry}@127.0.0.1:{other}/blob",
        "http://alice:password@127.0.0.1:{other}/blob",
        "http://localhost:{registry}/blob",
    ],
)
def test_a_blob_redirected_to_another_origin_gets_no_token_whatever_the_location_looks_like(
    token_registry: RegistryServer, tmp_path: Path, location: str
) -> None:
    """Held: the token goes to the registry's origin (scheme, host, port) only. The other port of the same
    host, a scheme-relative location, user info that spells the registry, and the registry's own port under
    another name are all another origin."""
    from tests.support.fixtures import REGISTRY_USERS

    user, password = next(iter(REGISTRY_USERS.items()))
    auth = base64.b64encode(f"{user}:{password}".encode()).decode()
    owner = _settings(token_registry.host, auths={token_registry.host: {"auth": auth}})
    _push_one_file(tmp_path, token_registry.uri("redirected/model", "v1"), owner)
    elsewhere = _Recorder(lambda request: (404, [], b"no"))
    try:
        with FaultProxy(token_registry.port) as proxy:
            host = f"127.0.0.1:{proxy.port}"
            target = location.format(other=elsewhere.port, registry=proxy.port)
            proxy.always(Respond(307, b"", (("Location", target),)), path="/blobs/")
            config = _settings(host, auths={host: {"auth": auth}})
            directory = list_directory(f"oci://{host}/redirected/model:v1", config)
            with pytest.raises(ModelloadError):
                read_one(directory.file_uri("model.safetensors"), config)
            assert any(r.headers.get("authorization", "").startswith("Bearer ") for r in proxy.requests)
            at_target = [r.headers for r in proxy.requests if r.path == "/blob"] + elsewhere.requests
    finally:
        elsewhere.close()
    assert at_target, "the redirect was followed"
    assert all("authorization" not in headers for headers in at_target)


def test_a_blob_redirected_to_itself_ends_after_the_allowed_hops(
    registry: RegistryServer, tmp_path: Path
) -> None:
    _push_one_file(tmp_path, registry.uri("loop/model", "v1"), _settings(registry.host))
    with FaultProxy(registry.port) as proxy:
        host = f"127.0.0.1:{proxy.port}"
        config = _settings(host)
        directory = list_directory(f"oci://{host}/loop/model:v1", config)
        blob = directory.file_uri("model.safetensors").rsplit("@", 1)[1].split("/", 1)[0]
        here = f"{proxy.endpoint}/v2/loop/model/blobs/{blob}"
        proxy.always(Respond(307, b"", (("Location", here),)), path="/blobs/")
        with pytest.raises(SourceError, match=r"too many redirects"):
            read_one(directory.file_uri("model.safetensors"), config)
        hops = [r for r in proxy.requests if "/blobs/" in r.path]
    assert len(hops) <= (config.http.max_redirects + 1) * (config.retry.attempts + 1)


def _push_one_file(tmp_path: Path, uri: str, config: SourceSettings) -> PushResult:
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "model.safetensors").write_bytes(payload(5000, seed=3))
    return push_directory(folder, uri, config)


def read_one(uri: str, config: SourceSettings) -> bytes:
    from modelload.sidecar.sources import open_source, read_range

    with open_source(uri, config) as source:
        buf = bytearray(source.stat().size)
        read_range(source, 0, memoryview(buf), policy=config.retry)
        return bytes(buf)


def test_a_docker_config_entry_for_another_registry_is_never_sent_to_the_source_registry(
    token_registry: RegistryServer,
) -> None:
    """Held: credentials are chosen by the registry's exact host and port; an entry for the same host on
    another port (or any other registry) stays unsent, and the pull is anonymous (and refused)."""
    from tests.support.fixtures import REGISTRY_USERS

    user, password = next(iter(REGISTRY_USERS.items()))
    auth = base64.b64encode(f"{user}:{password}".encode()).decode()
    other = f"127.0.0.1:{token_registry.port + 1}"
    config = _settings(token_registry.host, auths={other: {"auth": auth}, "localhost": {"auth": auth}})
    assert token_registry.tokens is not None
    seen = len(token_registry.tokens.requests)
    with pytest.raises(SourceAccessDeniedError, match=r"no credentials were given") as caught:
        list_directory(token_registry.uri("private/never", "v1"), config)
    sent = [r["authorization"] for r in token_registry.tokens.requests[seen:]]
    assert sent and sent == [""] * len(sent)
    assert password not in str(caught.value)


def test_a_manifest_over_the_specs_limit_is_refused_without_reading_it_all(registry: RegistryServer) -> None:
    """Held: a manifest is read up to 4 MiB (registries may refuse larger ones), one byte more is an error."""
    huge = b'{"layers": [' + b'{"a": 1},' * (600 << 10) + b"{}]}"
    with FaultProxy(registry.port) as proxy:
        host = f"127.0.0.1:{proxy.port}"
        proxy.always(Respond(200, huge, (("Content-Type", MANIFEST),)), path="/manifests/")
        with pytest.raises(SourceError, match=r"more than 4194304 bytes"):
            list_directory(f"oci://{host}/huge/model:v1", _settings(host))


def test_a_manifest_that_is_not_the_digest_it_was_asked_by_is_refused(registry: RegistryServer) -> None:
    """Held: a manifest asked for by digest is checked against it, and one whose Docker-Content-Digest
    disagrees with its bytes too (a registry or proxy serving something else)."""
    from modelload.loader.errors import HashMismatchError

    body = _document({"schemaVersion": 2, "mediaType": MANIFEST, "layers": []})
    asked = "sha256:" + "ab" * 32
    with FaultProxy(registry.port) as proxy:
        host = f"127.0.0.1:{proxy.port}"
        proxy.always(Respond(200, body, (("Content-Type", MANIFEST),)), path=f"/manifests/{asked}")
        stated = (("Content-Type", MANIFEST), ("Docker-Content-Digest", asked))
        proxy.always(Respond(200, body, stated), path="/manifests/v1")
        with pytest.raises(HashMismatchError, match=r"asked for or announced"):
            list_directory(f"oci://{host}/m@{asked}", _settings(host))
        with pytest.raises(HashMismatchError, match=r"asked for or announced"):
            list_directory(f"oci://{host}/m:v1", _settings(host))


@pytest.mark.parametrize(
    "challenge",
    [
        'Bearer realm="https://good.example/token",service="x\\",realm=\\"http://evil.example/"',
        'Bearer service="x realm=\\"http://evil.example/\\"",realm="https://good.example/token"',
        'Bearer realm="https://good.example/token", scope="repository:m:pull,push", REALM="junk',
    ],
)
def test_hostile_quoting_in_a_challenge_does_not_move_the_realm(challenge: str) -> None:
    """Held: parameters are ``key="value"`` pairs; an escaped quote inside a value cannot start another
    parameter, and an unterminated one is dropped (only the registry writes the header anyway)."""
    from modelload.sidecar.sources.oci._auth import parse_challenge

    scheme, params = parse_challenge(challenge)
    assert scheme == "bearer" and params["realm"] == "https://good.example/token"


@pytest.mark.parametrize(
    ("answer", "said"),
    [
        (
            b"SSH-2.0-OpenSSH_9.2p1 Debian-2\r\n",
            r"status line is malformed\): is 127\.0\.0\.1:\d+ the registry",
        ),
        (
            b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 8388608\r\n\r\n"
            + b" " * (8 << 20),
            r"answered \w+ with over \d+ bytes",
        ),
    ],
    ids=["another-protocol", "an-endless-answer"],
)
def test_a_push_to_something_that_is_no_registry_is_a_clear_error_not_a_traceback(
    tmp_path: Path, answer: bytes, said: str
) -> None:
    """A push to a port that speaks another protocol (SSH speaks first) ended in http.client's BadStatusLine,
    a traceback quoting the server's line; an answer of any size was read whole into memory."""
    listener = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        with contextlib.suppress(OSError):
            while True:
                client, _ = listener.accept()
                with client:
                    client.recv(65536)
                    client.sendall(answer)

    threading.Thread(target=serve, daemon=True).start()
    host = f"127.0.0.1:{listener.getsockname()[1]}"
    try:
        with pytest.raises(SourceError, match=said):
            _push_one_file(tmp_path, f"oci://{host}/not/registry:v1", _settings(host))
    finally:
        listener.close()
