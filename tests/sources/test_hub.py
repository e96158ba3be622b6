"""``hf://`` sources against the Hub stand-in (tests/support/hub.py), and the stand-in against the real
client.

The stand-in is only worth what the real ``huggingface_hub`` client says of it: the first tests point
``hf_hub_download`` and ``snapshot_download`` at it (``HF_ENDPOINT``) and require the same bytes and the same
error classes the Hub gives. The rest load through the sidecar's store: the revision pinned to a commit, the
listing's sizes and checksums, redirects followed to the CDN without the token, and each error's message.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from modelload.loader.errors import (
    ConfigError,
    HashMismatchError,
    SourceAccessDeniedError,
    SourceNotFoundError,
    SourceUriError,
)
from modelload.sidecar.sources import (
    HubSettings,
    SourceSettings,
    checksum_of,
    fetch_small_file,
    list_directory,
    open_source,
    read_range,
)
from modelload.sidecar.sources.hub import parse_hub_uri
from tests.sources.conftest import FAST_SETTINGS, payload
from tests.support.hub import HubServer, git_blob_id

TOKEN = "hf_standin-token-EXAMPLE-92c1"
WEIGHTS = payload(300_000, seed=7)
FILES = {
    "model.safetensors": WEIGHTS,
    "config.json": b'{"model_type": "toy"}',
    "tokenizer.json": b'{"version": "1.0"}',
    "README.md": b"# toy\n",
    "original/consolidated.pth": b"nested: not listed",
}


def settings(hub: HubServer, token: str | None = None) -> SourceSettings:
    return SourceSettings(
        http=FAST_SETTINGS.http, retry=FAST_SETTINGS.retry, hub=HubSettings(endpoint=hub.url, token=token)
    )


def read_all(uri: str, config: SourceSettings) -> bytes:
    with open_source(uri, config) as source:
        buf = bytearray(source.stat().size)
        read_range(source, 0, memoryview(buf), policy=config.retry)
        return bytes(buf)


def real_client(hub: HubServer, tmp_path: Path, script: str, **env: str) -> Any:
    """Run ``script`` with the real ``huggingface_hub`` in a fresh process pointed at the stand-in (its
    settings are read at import); the script prints one JSON value, returned here."""
    environ = {
        **{k: v for k, v in os.environ.items() if not k.startswith("HF_")},
        "HF_ENDPOINT": hub.url,
        "HF_HOME": str(tmp_path / "hf-home"),
        "HF_HUB_DISABLE_TELEMETRY": "1",
        "HF_HUB_DISABLE_XET": "1",
        **env,
    }
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script)],
        env=environ,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


# --- the stand-in, checked by the real client -------------------------------------------------------------


def test_the_real_client_downloads_a_file_and_a_snapshot_through_the_standin(
    hub: HubServer, tmp_path: Path
) -> None:
    commit = hub.commit("org/toy", FILES)
    got = real_client(
        hub,
        tmp_path,
        """
        import json
        from huggingface_hub import hf_hub_download, snapshot_download
        one = hf_hub_download("org/toy", "model.safetensors")
        folder = snapshot_download("org/toy")
        print(json.dumps({"one": one, "folder": folder}))
        """,
    )
    assert Path(got["one"]).read_bytes() == WEIGHTS
    assert commit in got["one"]  # filed under the commit the revision resolved to
    for name, data in FILES.items():
        assert (Path(got["folder"]) / name).read_bytes() == data, name
    assert any(r["path"].startswith("/repos/") for r in hub.cdn_requests), "LFS files came from the CDN"


def test_the_real_client_reads_the_standins_errors_as_the_hubs(hub: HubServer, tmp_path: Path) -> None:
    hub.commit("org/gated", FILES, gated=True, readers={TOKEN})
    hub.commit("org/toy", FILES)
    got = real_client(
        hub,
        tmp_path,
        f"""
        import json
        from huggingface_hub import hf_hub_download

        def attempt(*args, **kwargs):
            try:
                return open(hf_hub_download(*args, **kwargs), "rb").read().decode()
            except Exception as exc:
                return type(exc).__name__

        print(json.dumps([
            attempt("org/gated", "config.json"),
            attempt("org/toy", "config.json", revision="no-such-branch"),
            attempt("org/toy", "missing.json"),
            attempt("org/absent", "config.json"),
            attempt("org/gated", "config.json", token={TOKEN!r}),
        ]))
        """,
    )
    assert got == [
        "GatedRepoError",
        "RevisionNotFoundError",
        "RemoteEntryNotFoundError",
        "RepositoryNotFoundError",
        FILES["config.json"].decode(),
    ]


def test_the_real_client_pages_through_a_long_listing_as_the_sidecar_does(
    hub: HubServer, tmp_path: Path
) -> None:
    hub.page_size = 2
    many = {f"part-{i}.json": f'{{"i": {i}}}'.encode() for i in range(7)}
    hub.commit("org/many", many)
    folder = real_client(
        hub,
        tmp_path,
        "import json\nfrom huggingface_hub import snapshot_download\n"
        "print(json.dumps(snapshot_download('org/many')))",
    )
    assert sorted(p.name for p in Path(folder).iterdir()) == sorted(many)
    assert any("cursor=" in r["path"] for r in hub.requests), "the listing was paged"
    listed = list_directory("hf://org/many", settings(hub))
    assert sorted(listed.files) == sorted(many)


# --- the store ----------------------------------------------------------------------------------------------


def test_a_repository_lists_its_top_folder_with_the_hubs_sizes_and_checksums(hub: HubServer) -> None:
    commit = hub.commit("org/toy", FILES)
    directory = list_directory("hf://org/toy", settings(hub))
    assert sorted(directory.files) == ["README.md", "config.json", "model.safetensors", "tokenizer.json"]
    weights = directory.files["model.safetensors"]
    assert weights.size == len(WEIGHTS)
    assert weights.checksums == {"sha256": hashlib.sha256(WEIGHTS).hexdigest()}
    assert weights.version == commit
    assert directory.files["config.json"].checksums == {"git-sha1": git_blob_id(FILES["config.json"])}
    assert directory.file_uri("model.safetensors") == f"hf://org/toy@{commit}/model.safetensors"
    assert directory.display == "hf://org/toy@main/"


def test_every_file_is_read_at_the_commit_the_revision_named_when_listed(hub: HubServer) -> None:
    first = hub.commit("org/toy", FILES)
    directory = list_directory("hf://org/toy@main", settings(hub))
    hub.commit("org/toy", {**FILES, "model.safetensors": payload(300_000, seed=8)})  # main moves on
    assert read_all(directory.file_uri("model.safetensors"), settings(hub)) == WEIGHTS
    resolves = [r["path"] for r in hub.requests if "/resolve/" in r["path"]]
    assert resolves and all(f"/resolve/{first}/" in path for path in resolves)


def test_a_file_is_read_by_range_from_the_cdn_and_the_token_never_goes_there(hub: HubServer) -> None:
    hub.commit("org/private", FILES, private=True, readers={TOKEN})
    config = settings(hub, TOKEN)
    directory = list_directory("hf://org/private", config)
    with open_source(directory.file_uri("model.safetensors"), config) as source:
        part = bytearray(1000)
        read_range(source, 5000, memoryview(part), policy=config.retry)
        assert part == WEIGHTS[5000:6000]
        checksum = checksum_of(source)
        assert checksum is not None and checksum.expected == hashlib.sha256(WEIGHTS).hexdigest()
    assert hub.cdn_requests, "the weights came from the CDN"
    assert all(r["authorization"] == "" for r in hub.cdn_requests)
    assert all(r["authorization"] == f"Bearer {TOKEN}" for r in hub.requests)


def test_a_small_file_is_checked_against_its_git_blob_id(hub: HubServer) -> None:
    hub.commit("org/toy", FILES)
    config = settings(hub)
    directory = list_directory("hf://org/toy", config)
    assert fetch_small_file(directory, "config.json", config) == FILES["config.json"]
    repo = hub.repos["org/toy"]
    commit = repo.refs["main"]
    repo.commits[commit]["config.json"] = b'{"model_type": "bad"}'  # same commit and size, other bytes
    with pytest.raises(HashMismatchError, match="git-sha1"):
        fetch_small_file(directory, "config.json", config)


def test_one_file_named_by_its_path_is_a_source_of_its_own(hub: HubServer) -> None:
    hub.commit("org/toy", FILES, ref="v1.0")
    assert read_all("hf://org/toy@v1.0/model.safetensors", settings(hub)) == WEIGHTS
    with open_source("hf://org/toy@v1.0/model.safetensors", settings(hub)) as source:
        source.stat()
        checksum = checksum_of(source)  # learnt from X-Linked-Etag without a listing
        assert checksum is not None and checksum.expected == hashlib.sha256(WEIGHTS).hexdigest()


def test_a_gated_repository_says_so_and_how_to_accept_its_terms(hub: HubServer) -> None:
    hub.commit("org/gated", FILES, gated=True, readers={TOKEN})
    with pytest.raises(SourceAccessDeniedError) as anonymous:
        list_directory("hf://org/gated", settings(hub))
    message = str(anonymous.value)
    assert "gated" in message and "accept" in message and f"{hub.url}/org/gated" in message
    assert "no Hugging Face token was given" in message
    with pytest.raises(SourceAccessDeniedError, match="has not been granted access"):
        list_directory("hf://org/gated", settings(hub, "hf_valid_but_no_access"))
    assert "model.safetensors" in list_directory("hf://org/gated", settings(hub, TOKEN)).files


def test_missing_repositories_revisions_and_files_say_which(hub: HubServer) -> None:
    hub.commit("org/toy", FILES)
    with pytest.raises(SourceNotFoundError, match="no revision 'v9'"):
        list_directory("hf://org/toy@v9", settings(hub))
    with pytest.raises(SourceAccessDeniedError, match=r"does not exist .* or it is private"):
        list_directory("hf://org/absent", settings(hub))
    with pytest.raises(SourceAccessDeniedError, match="refused the Hugging Face token"):
        list_directory("hf://org/toy", settings(hub, "hf_revoked-token-EXAMPLE"))
    with pytest.raises(SourceNotFoundError, match="does not exist in org/toy"):
        read_all("hf://org/toy@main/missing.safetensors", settings(hub))


def test_the_token_never_shows_in_an_error(hub: HubServer) -> None:
    hub.commit("org/gated", FILES, gated=True, readers={"hf_someone-else"})
    for uri in ("hf://org/gated", "hf://org/gated@main/model.safetensors", "hf://org/absent"):
        with pytest.raises(SourceAccessDeniedError) as caught:
            if uri.endswith(".safetensors"):
                read_all(uri, settings(hub, TOKEN))
            list_directory(uri.split("@")[0], settings(hub, TOKEN))
        assert TOKEN not in str(caught.value) and TOKEN not in repr(caught.value)
    assert TOKEN not in repr(settings(hub, TOKEN))


@pytest.mark.parametrize(
    ("uri", "expected"),
    [
        ("hf://org/name", ("org/name", "main", "")),
        ("hf://org/name@v1.0", ("org/name", "v1.0", "")),
        ("hf://org/name@refs%2Fpr%2F3/sub/", ("org/name", "refs/pr/3", "sub/")),
        ("hf://org/name@" + "a" * 40 + "/model.safetensors", ("org/name", "a" * 40, "model.safetensors")),
    ],
)
def test_hf_uris_parse_into_repository_revision_and_path(uri: str, expected: tuple[str, str, str]) -> None:
    ref = parse_hub_uri(uri)
    assert (ref.repo, ref.revision, ref.path) == expected


@pytest.mark.parametrize(
    "uri", ["hf://gpt2", "hf://datasets/org/x", "hf://org/na me", "hf://org/x?rev=1", "hf://o/x/../y"]
)
def test_malformed_hf_uris_are_refused_with_the_expected_shape(uri: str) -> None:
    with pytest.raises(SourceUriError):
        parse_hub_uri(uri)


def test_a_mirror_endpoint_must_be_an_http_url() -> None:
    with pytest.raises(ConfigError, match="http:// or https://"):
        HubSettings(endpoint="huggingface.co")
