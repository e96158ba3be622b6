"""``oci://`` sources and ``modelload push`` against a real distribution registry (tests/support/registry.py).

Artifacts are pushed by ``modelload push`` and by ``oras`` (the ORAS project's Python client) for interop, to
a registry that lets anyone in and to one behind the Bearer token flow; the sidecar's store lists and reads
them by range, proves each blob by its digest, and says clearly what a refused, missing or compressed layer
needs.
"""

from __future__ import annotations

import base64
import io
import json
import os
import tarfile
from pathlib import Path
from typing import Any

import pytest

from modelload.loader.errors import (
    ConfigError,
    SourceAccessDeniedError,
    SourceNotFoundError,
    SourceUriError,
)
from modelload.sidecar.sources import (
    RegistrySettings,
    SourceSettings,
    checksum_of,
    fetch_small_file,
    list_directory,
    open_source,
    read_range,
)
from modelload.sidecar.sources.oci import auths_from_docker_config, parse_oci_uri, push_directory
from tests.sources.conftest import FAST_SETTINGS, payload
from tests.support.fixtures import REGISTRY_USERS
from tests.support.registry import RegistryServer

WEIGHTS = payload(400_000, seed=11)
FILES = {
    "model.safetensors": WEIGHTS,
    "config.json": b'{"model_type": "toy"}',
    "tokenizer.json": b'{"version": "1.0"}',
    "README.md": b"# toy\n",
}
USER, PASSWORD = next(iter(REGISTRY_USERS.items()))


def settings(
    registry: RegistryServer, *, user: str | None = None, password: str | None = None
) -> SourceSettings:
    auths = {}
    if user is not None:
        auths = {registry.host: {"auth": base64.b64encode(f"{user}:{password}".encode()).decode()}}
    return SourceSettings(
        http=FAST_SETTINGS.http,
        retry=FAST_SETTINGS.retry,
        registry=RegistrySettings(auths=auths, plain_http=(registry.host,)),
    )


def model_dir(tmp_path: Path, files: dict[str, bytes] = FILES) -> Path:
    folder = tmp_path / "model"
    folder.mkdir(parents=True, exist_ok=True)
    for name, data in files.items():
        (folder / name).write_bytes(data)
    return folder


def read_all(uri: str, config: SourceSettings) -> bytes:
    with open_source(uri, config) as source:
        buf = bytearray(source.stat().size)
        read_range(source, 0, memoryview(buf), policy=config.retry)
        return bytes(buf)


def oras_client(registry: RegistryServer, tmp_path: Path, *, login: bool = False) -> Any:
    import oras.client

    client = oras.client.OrasClient(hostname=registry.host, insecure=True)
    if login:
        client.login(username=USER, password=PASSWORD, hostname=registry.host, insecure=True)
    return client


# --- modelload push, read back by the store and by oras ----------------------------------------------------


def test_a_pushed_directory_lists_every_file_with_its_blob_digest_and_reads_byte_exact(
    registry: RegistryServer, tmp_path: Path
) -> None:
    config = settings(registry)
    result = push_directory(model_dir(tmp_path), registry.uri("push/toy", "v1"), config)
    directory = list_directory(registry.uri("push/toy", "v1"), config)
    assert sorted(directory.files) == sorted(FILES)
    assert directory.display == f"oci://{registry.host}/push/toy:v1/"
    assert (
        directory.file_uri("model.safetensors")
        == f"oci://{registry.host}/push/toy@{result.digest}/model.safetensors"
    )
    for name, data in FILES.items():
        assert read_all(directory.file_uri(name), config) == data, name
    with open_source(directory.file_uri("model.safetensors"), config) as source:
        part = bytearray(4096)
        read_range(source, 100_000, memoryview(part), policy=config.retry)
        assert part == WEIGHTS[100_000:104_096]
        checksum = checksum_of(source)
        assert checksum is not None and f"sha256:{checksum.expected}" == result.layers[2].digest


def test_a_push_is_a_modelpack_artifact_that_oras_reads_back_by_file_name(
    registry: RegistryServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    push_directory(model_dir(tmp_path), registry.uri("push/oras-read", "v1"), settings(registry))
    client = oras_client(registry, tmp_path)
    manifest = client.get_manifest(f"{registry.host}/push/oras-read:v1")
    assert manifest["artifactType"] == "application/vnd.cncf.model.manifest.v1+json"
    assert manifest["config"]["mediaType"] == "application/vnd.cncf.model.config.v1+json"
    layers = {layer["annotations"]["org.cncf.model.filepath"]: layer for layer in manifest["layers"]}
    assert layers["model.safetensors"]["mediaType"] == "application/vnd.cncf.model.weight.v1.raw"
    assert layers["config.json"]["mediaType"] == "application/vnd.cncf.model.weight.config.v1.raw"
    assert layers["README.md"]["mediaType"] == "application/vnd.cncf.model.doc.v1.raw"
    model_config = json.loads(
        client.get_blob(f"{registry.host}/push/oras-read:v1", manifest["config"]["digest"]).content
    )
    assert model_config["modelfs"]["diffIds"] == [layer["digest"] for layer in manifest["layers"]]
    out = tmp_path / "pulled"
    monkeypatch.chdir(tmp_path)
    client.pull(target=f"{registry.host}/push/oras-read:v1", outdir=str(out))
    for name, data in FILES.items():
        assert (out / name).read_bytes() == data, name


def test_pushing_again_sends_only_the_blobs_the_registry_lacks(
    registry: RegistryServer, tmp_path: Path
) -> None:
    config = settings(registry)
    push_directory(model_dir(tmp_path), registry.uri("push/again", "v1"), config)
    changed = {**FILES, "config.json": b'{"model_type": "toy2"}'}
    again = push_directory(model_dir(tmp_path, changed), registry.uri("push/again", "v2"), config)
    assert {layer.name for layer in again.layers if layer.uploaded} == {"config.json"}


# --- artifacts pushed by oras ------------------------------------------------------------------------------


def test_files_pushed_by_oras_load_whatever_their_media_type_says(
    registry: RegistryServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model_dir(tmp_path)
    monkeypatch.chdir(tmp_path / "model")
    client = oras_client(registry, tmp_path)
    # oras labels a plain file application/vnd.oci.image.layer.v1.tar unless told: the store looks.
    client.push(
        target=f"{registry.host}/oras/toy:v1",
        files=["model.safetensors:application/vnd.cncf.model.weight.v1.raw", "config.json", "tokenizer.json"],
    )
    config = settings(registry)
    directory = list_directory(registry.uri("oras/toy", "v1"), config)
    assert sorted(directory.files) == ["config.json", "model.safetensors", "tokenizer.json"]
    assert read_all(directory.file_uri("model.safetensors"), config) == WEIGHTS
    assert fetch_small_file(directory, "config.json", config) == FILES["config.json"]


def test_files_inside_an_uncompressed_tar_layer_are_read_at_their_offsets(
    registry: RegistryServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    layer = tmp_path / "model.tar"
    with tarfile.open(layer, "w", format=tarfile.PAX_FORMAT) as tar:
        for name, data in FILES.items():
            info = tarfile.TarInfo(f"./{name}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    monkeypatch.chdir(tmp_path)
    oras_client(registry, tmp_path).push(
        target=f"{registry.host}/kit/toy:v1", files=["model.tar:application/vnd.kitops.modelkit.model.v1.tar"]
    )
    config = settings(registry)
    directory = list_directory(registry.uri("kit/toy", "v1"), config)
    assert sorted(directory.files) == sorted(FILES)
    for name, data in FILES.items():
        assert read_all(directory.file_uri(name), config) == data, name
    with open_source(directory.file_uri("model.safetensors"), config) as source:
        checksum = checksum_of(source)
        assert checksum is not None and checksum.object_size == layer.stat().st_size
        assert checksum.offset > 0  # the file is a window of the layer's blob


def test_a_compressed_weight_layer_is_refused_with_how_to_push_a_rangeable_one(
    registry: RegistryServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "model.tar.gz").write_bytes(b"\x1f\x8b" + os.urandom(100))
    monkeypatch.chdir(tmp_path)
    oras_client(registry, tmp_path).push(
        target=f"{registry.host}/kit/gz:v1",
        files=["model.tar.gz:application/vnd.cncf.model.weight.v1.tar+gzip"],
    )
    with pytest.raises(ConfigError, match=r"compressed.*modelload push"):
        list_directory(registry.uri("kit/gz", "v1"), settings(registry))


# --- pinning ------------------------------------------------------------------------------------------------


def test_a_tag_moved_after_the_listing_does_not_change_what_is_read(
    registry: RegistryServer, tmp_path: Path
) -> None:
    config = settings(registry)
    push_directory(model_dir(tmp_path), registry.uri("pin/toy", "v1"), config)
    directory = list_directory(registry.uri("pin/toy", "v1"), config)
    moved = {**FILES, "model.safetensors": payload(400_000, seed=12)}
    push_directory(model_dir(tmp_path / "b", moved), registry.uri("pin/toy", "v1"), config)
    assert read_all(directory.file_uri("model.safetensors"), config) == WEIGHTS
    again = list_directory(registry.uri("pin/toy", "v1"), config)
    assert read_all(again.file_uri("model.safetensors"), config) == moved["model.safetensors"]


def test_an_artifact_named_by_its_digest_lists_the_same_files(
    registry: RegistryServer, tmp_path: Path
) -> None:
    config = settings(registry)
    result = push_directory(model_dir(tmp_path), registry.uri("pin/digest", "v1"), config)
    directory = list_directory(registry.uri("pin/digest", result.digest), config)
    assert sorted(directory.files) == sorted(FILES)


# --- credentials ------------------------------------------------------------------------------------------


def test_the_token_flow_pulls_with_credentials_and_anonymously_from_public_repositories(
    token_registry: RegistryServer, tmp_path: Path
) -> None:
    owner = settings(token_registry, user=USER, password=PASSWORD)
    push_directory(model_dir(tmp_path), token_registry.uri("private/toy", "v1"), owner)
    push_directory(model_dir(tmp_path), token_registry.uri("public/toy", "v1"), owner)
    directory = list_directory(token_registry.uri("private/toy", "v1"), owner)
    assert read_all(directory.file_uri("model.safetensors"), owner) == WEIGHTS
    anonymous = settings(token_registry)
    public = list_directory(token_registry.uri("public/toy", "v1"), anonymous)
    assert read_all(public.file_uri("model.safetensors"), anonymous) == WEIGHTS
    assert token_registry.tokens is not None
    assert any(r["authorization"].startswith("Basic ") for r in token_registry.tokens.requests)


def test_a_refused_pull_says_which_credentials_to_give(
    token_registry: RegistryServer, tmp_path: Path
) -> None:
    owner = settings(token_registry, user=USER, password=PASSWORD)
    push_directory(model_dir(tmp_path), token_registry.uri("private/refused", "v1"), owner)
    with pytest.raises(SourceAccessDeniedError, match=r"no credentials were given .* dockerconfigjson"):
        list_directory(token_registry.uri("private/refused", "v1"), settings(token_registry))
    wrong = settings(token_registry, user=USER, password="not-the-password")
    with pytest.raises(SourceAccessDeniedError, match="refused the credentials") as caught:
        list_directory(token_registry.uri("private/refused", "v1"), wrong)
    assert PASSWORD not in str(caught.value) and "not-the-password" not in str(caught.value)
    assert PASSWORD not in repr(owner)


def test_missing_repositories_and_tags_say_which(registry: RegistryServer, tmp_path: Path) -> None:
    config = settings(registry)
    push_directory(model_dir(tmp_path), registry.uri("missing/toy", "v1"), config)
    with pytest.raises(SourceNotFoundError, match="no 'v9'"):
        list_directory(registry.uri("missing/toy", "v9"), config)
    with pytest.raises(SourceNotFoundError, match="has no 'v1', or there is no such repository"):
        list_directory(registry.uri("missing/absent", "v1"), config)


def test_a_docker_config_gives_the_credentials_of_its_registry() -> None:
    auth = base64.b64encode(b"bob:pw").decode()
    auths = auths_from_docker_config(
        json.dumps({"auths": {"https://Registry.example:5000/v1/": {"auth": auth}}}), where="a test config"
    )
    assert auths == {"registry.example:5000": {"auth": auth}}
    with pytest.raises(ConfigError, match="a test config is not JSON"):
        auths_from_docker_config("{nope", where="a test config")


@pytest.mark.parametrize(
    ("uri", "expected"),
    [
        ("oci://localhost:5000/models/tiny", ("localhost:5000", "models/tiny", "latest", None)),
        ("oci://ghcr.io/org/model:v1.2", ("ghcr.io", "org/model", "v1.2", None)),
        ("oci://reg.example/m@sha256:" + "a" * 64, ("reg.example", "m", None, "sha256:" + "a" * 64)),
        ("oci://reg.example/m:v1@sha256:" + "b" * 64, ("reg.example", "m", "v1", "sha256:" + "b" * 64)),
    ],
)
def test_oci_uris_parse_into_registry_repository_tag_and_digest(uri: str, expected: tuple[Any, ...]) -> None:
    ref = parse_oci_uri(uri)
    assert (ref.registry, ref.repository, ref.tag, ref.digest) == expected


@pytest.mark.parametrize(
    "uri",
    [
        "oci://model:v1",
        "oci://reg.example/Upper:v1",
        "oci://reg.example/m@sha256:abc",
        "oci://reg.example/m:v1?x=1",
    ],
)
def test_malformed_oci_uris_are_refused_with_the_expected_shape(uri: str) -> None:
    with pytest.raises(SourceUriError):
        parse_oci_uri(uri)


# --- the tar index, on tars the standard library writes -----------------------------------------------------


def _tar_bytes(members: dict[str, bytes], *, format: int) -> bytes:  # noqa: A002 - tarfile's word
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=format) as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return out.getvalue()


@pytest.mark.parametrize("fmt", [tarfile.USTAR_FORMAT, tarfile.GNU_FORMAT, tarfile.PAX_FORMAT])
def test_a_tars_files_are_found_at_their_offsets_in_every_format(fmt: int) -> None:
    from modelload.sidecar.sources.oci._tar import tar_members

    long_name = (
        "weights/" + "n" * 120 + ".safetensors" if fmt != tarfile.USTAR_FORMAT else "weights/m.safetensors"
    )
    members = {"./config.json": b"{}", long_name: payload(3000, seed=3), "empty.txt": b""}
    data = _tar_bytes(members, format=fmt)
    found = tar_members(lambda offset, length: data[offset : offset + length], len(data), where="a test tar")
    assert [m.name for m in found] == ["config.json", long_name, "empty.txt"]
    for member, content in zip(found, members.values(), strict=True):
        assert data[member.offset : member.offset + member.size] == content


def test_a_tar_holding_a_link_or_a_bad_header_is_refused() -> None:
    from modelload.loader.errors import FormatError
    from modelload.sidecar.sources.oci._tar import tar_members

    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w") as tar:
        link = tarfile.TarInfo("model.safetensors")
        link.type, link.linkname = tarfile.SYMTYPE, "/etc/passwd"
        tar.addfile(link)
    data = out.getvalue()
    with pytest.raises(FormatError, match="regular files only"):
        tar_members(lambda o, n: data[o : o + n], len(data), where="a test tar")
    broken = bytearray(_tar_bytes({"a": b"x"}, format=tarfile.PAX_FORMAT))
    broken[10] ^= 0xFF
    with pytest.raises(FormatError, match="wrong checksum"):
        tar_members(lambda o, n: bytes(broken[o : o + n]), len(broken), where="a test tar")


# --- a registry on object storage: blobs redirected to presigned URLs -------------------------------------


def test_blobs_redirected_to_object_storage_are_read_there_without_the_registrys_token(
    s3_registry: RegistryServer, moto_s3: Any, tmp_path: Path
) -> None:
    owner = settings(s3_registry, user=USER, password=PASSWORD)
    push_directory(model_dir(tmp_path), s3_registry.uri("s3/toy", "v1"), owner)
    directory = list_directory(s3_registry.uri("s3/toy", "v1"), owner)
    with open_source(directory.file_uri("model.safetensors"), owner) as source:
        buf = bytearray(source.stat().size)
        read_range(source, 0, memoryview(buf), policy=owner.retry)
        assert bytes(buf) == WEIGHTS
        origin, _ = source._location  # where the reads went: the bucket's presigned URL, not the registry
        assert origin.port == int(moto_s3.endpoint.rsplit(":", 1)[1])
        assert "Authorization" not in source._target("GET", {}).headers  # the registry's token stays home
    assert token_registry_token_seen(s3_registry)


def token_registry_token_seen(registry: RegistryServer) -> bool:
    """The registry's token service issued tokens (so the reads above were authenticated at the registry)."""
    return registry.tokens is not None and bool(registry.tokens.issued)


def test_a_token_the_registry_stops_accepting_mid_load_is_renewed(tmp_path: Path) -> None:
    from tests.conftest import require
    from tests.support.registry import find_registry

    require(find_registry() is not None, "docker-registry is not installed (apt-get install docker-registry)")
    server = RegistryServer(tmp_path / "storage", users=REGISTRY_USERS)  # its own: it is restarted
    try:
        owner = settings(server, user=USER, password=PASSWORD)
        push_directory(model_dir(tmp_path), server.uri("renew/toy", "v1"), owner)
        directory = list_directory(server.uri("renew/toy", "v1"), owner)
        with open_source(directory.file_uri("model.safetensors"), owner) as source:
            first = bytearray(1000)
            read_range(source, 0, memoryview(first), policy=owner.retry)
            assert server.tokens is not None
            issued = len(server.tokens.issued)
            server.rotate_signing_key()  # the token in hand is now refused
            rest = bytearray(len(WEIGHTS) - 1000)
            read_range(source, 1000, memoryview(rest), policy=owner.retry)
        assert bytes(first + rest) == WEIGHTS
        assert len(server.tokens.issued) > issued, "a new token was asked for"
    finally:
        server.close()
