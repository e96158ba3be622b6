"""``hf://`` against a Hub (or a mirror) that lies: an attacker's look at the Hub store.

The Hub stand-in (tests/support/hub.py, checked against the real ``huggingface_hub`` client) serves the
repositories; where the Hub itself is the attacker, a fault proxy in front of it answers the listing with a
hostile page. Every case ends in a clear error or in the files the repository really names, never in a
request loop, a traceback or the token sent elsewhere.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import numpy as np
import pytest
from safetensors.numpy import save

from modelload.loader.errors import SourceError
from modelload.sidecar.sources import HubSettings, SourceSettings, list_directory, open_model
from tests.sources.conftest import FAST_SETTINGS, payload
from tests.support.fault_proxy import FaultProxy, Respond
from tests.support.hub import HubServer

TOKEN = "hf_hostile-test-token-EXAMPLE-0b7d"
JSON = (("Content-Type", "application/json"),)


def _settings(endpoint: str, token: str | None = TOKEN) -> SourceSettings:
    return SourceSettings(
        http=FAST_SETTINGS.http, retry=FAST_SETTINGS.retry, hub=HubSettings(endpoint=endpoint, token=token)
    )


def _entry(path: str, data: bytes = b"{}") -> dict[str, Any]:
    return {"type": "file", "oid": "0" * 40, "size": len(data), "path": path}


def _commit(hub: HubServer, files: dict[str, bytes] | None = None) -> str:
    files = files or {"model.safetensors": payload(1000), "config.json": b"{}"}
    return hub.commit("org/model", files, readers={TOKEN})


def test_a_listing_whose_next_page_is_itself_stops_at_the_loop(hub: HubServer) -> None:
    """A ``Link: rel="next"`` back to a page already read was followed 256 times before giving up."""
    sha = _commit(hub)
    with FaultProxy(hub.port) as proxy:
        page = f"{proxy.endpoint}/api/models/org/model/tree/{sha}"
        looping = (*JSON, ("Link", f'<{page}>; rel="next"'))
        proxy.always(Respond(200, json.dumps([_entry("config.json")]).encode(), looping), path="/tree/")
        with pytest.raises(SourceError, match=r"next page .* already read"):
            list_directory("hf://org/model", _settings(proxy.endpoint))
        pages = [r for r in proxy.requests if "/tree/" in r.path]
    assert len(pages) == 1


def test_a_listing_whose_next_page_is_on_another_host_is_refused_and_gets_no_token(hub: HubServer) -> None:
    """Held: the token goes to the Hub's own origin; a page elsewhere is refused before it is asked for."""
    _commit(hub)
    with FaultProxy(hub.port) as proxy, FaultProxy(hub.port) as elsewhere:
        away = (*JSON, ("Link", f'<{elsewhere.endpoint}/api/models/org/model/tree/x>; rel="next"'))
        proxy.always(Respond(200, b"[]", away), path="/tree/")
        with pytest.raises(SourceError, match=r"next page is on another host"):
            list_directory("hf://org/model", _settings(proxy.endpoint))
        assert elsewhere.requests == []


def test_a_listing_nested_past_the_parsers_depth_is_an_error_not_a_recursion(hub: HubServer) -> None:
    _commit(hub)
    with FaultProxy(hub.port) as proxy:
        proxy.always(Respond(200, b"[" * 30_000 + b"]" * 30_000, JSON), path="/tree/")
        with pytest.raises(SourceError, match=r"not JSON"):
            list_directory("hf://org/model", _settings(proxy.endpoint))


def test_listed_paths_outside_the_folder_or_the_model_directory_are_never_loaded(hub: HubServer) -> None:
    """A mirror's listing of ``sub/`` that names files of other folders, ``..``, or names a model directory
    cannot hold: only ``sub``'s own plain files are taken (a path outside the folder was once listed under
    its last part, and read from the other folder)."""
    weights = save({"w": np.arange(500, dtype=np.float32)})  # real: opening a model reads its header
    sha = hub.commit(
        "org/model",
        {"sub/model.safetensors": weights, "sub/config.json": b"{}", "other/tokenizer.json": b'{"x": 1}'},
        readers={TOKEN},
    )
    hostile = [
        _entry("sub/model.safetensors", weights),
        _entry("sub/config.json"),
        _entry("other/tokenizer.json", b'{"x": 1}'),
        _entry("subtokenizer.json"),
        _entry("sub/.."),
        _entry("sub/..json"),
        _entry("sub/a\\..\\b.json"),
        _entry("sub/c\x00.json"),
    ]
    hostile[0]["lfs"] = {"oid": hashlib.sha256(weights).hexdigest(), "size": len(weights)}
    with FaultProxy(hub.port) as proxy:
        proxy.always(Respond(200, json.dumps(hostile).encode(), JSON), path=f"/tree/{sha}/sub")
        directory = list_directory(f"hf://org/model@{sha}/sub/", _settings(proxy.endpoint))
        assert "tokenizer.json" not in directory.files
        model = open_model(f"hf://org/model@{sha}/sub/", _settings(proxy.endpoint))
        try:
            assert model.weights == ("model.safetensors",)
            assert sorted(model.small) == ["..json", "config.json"]
        finally:
            model.close()


@pytest.mark.parametrize("lfs", [False, True])
def test_a_listed_size_that_is_no_count_of_bytes_is_refused_not_summed(hub: HubServer, lfs: bool) -> None:
    """A negative size counted against the small files' 256 MiB limit: a mirror listing one file at -10 GiB
    had hundreds of others of up to 64 MiB each written into the model directory (a memory volume in a pod)
    before the lying one was read."""
    _commit(hub)
    lying = _entry("zzz.json")
    if lfs:
        lying["lfs"] = {"oid": "0" * 64, "size": -(10 << 30)}
    else:
        lying["size"] = -(10 << 30)
    page = [_entry("config.json"), lying]
    with FaultProxy(hub.port) as proxy:
        proxy.always(Respond(200, json.dumps(page).encode(), JSON), path="/tree/")
        with pytest.raises(SourceError, match=r"size in bytes") as caught:
            list_directory("hf://org/model", _settings(proxy.endpoint))
    assert "zzz.json" in str(caught.value)
