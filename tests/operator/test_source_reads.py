"""What the operator reads on a ModelLoad's behalf, and what it shows of it.

A ModelLoad's author chooses its source; the operator reads from there with its own identity and network
reach. So it never reads a local file (a ``file://`` model is the pods', not the operator's), never shows
bytes of what it read, and reads HTTP(S) and S3 sources only at public addresses and the networks its
installation allows (``sourceNetworks``), redirects included. The tests' own servers listen on loopback,
which the tests' operator is allowed to read (``conftest.LOOPBACK``); here an operator with the chart's
defaults shows the refusal.
"""

from __future__ import annotations

import http.server
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from modelload.loader.errors import SourceUriError
from modelload.operator.model_source import read_summary
from modelload.operator.schema import parse_spec
from modelload.sidecar.sources import AddressPolicy, parse_networks
from tests.operator.conftest import (
    MODELLOADS,
    NAMESPACE,
    create_modelload,
    current,
    model_bytes,
    posted_events,
    request_bodies,
    wait_for,
)
from tests.operator.test_resolving import failed, ready_condition
from tests.support.fault_proxy import FaultProxy

SHADOW = b"root:$6$Zq8e$5b1a0c9f7e2d4b6a8c0e2f4a6b8d0f2a:19000:0:99999:7:::\ndaemon:*:19000:0:99999:7:::\n"


def everything_shown(kube: Any, name: str) -> str:
    obj = current(kube, MODELLOADS, NAMESPACE, name) or {}
    return repr(obj) + repr(posted_events(kube)) + request_bodies(kube)


async def test_a_file_source_is_never_read_by_the_operator(kube, operator, api, tmp_path: Path) -> None:
    shadow = tmp_path / "shadow"
    shadow.write_bytes(SHADOW)
    await create_modelload(api, "local-unsized", {"source": f"file://{shadow}"})
    obj = await failed(kube, "local-unsized", "BadSpec")
    assert "spec.volumeSizeLimit" in ready_condition(obj)["message"]
    await create_modelload(api, "local", {"source": f"file://{shadow}", "volumeSizeLimit": "2Gi"})
    obj = await wait_for(
        lambda: (
            (o := current(kube, MODELLOADS, NAMESPACE, "local"))
            and (o.get("status") or {}).get("phase") == "Ready"
            and o
        ),
        what="the local ModelLoad to be Ready",
    )
    condition = ready_condition(obj)
    assert condition["reason"] == "LocalSource" and "reads no local file" in condition["message"]
    assert "tensors" not in obj["status"] and "bytes" not in obj["status"], "nothing guessed, nothing read"
    assert obj["status"]["volumeSizeLimit"] == "2Gi"
    shown = everything_shown(kube, "local") + everything_shown(kube, "local-unsized")
    for fragment in (b"root:", SHADOW[:16].hex(), SHADOW[:16].hex(" ").encode()):
        text = fragment.decode() if isinstance(fragment, bytes) else fragment
        assert text not in shown


async def test_a_file_that_is_not_a_model_is_refused_without_showing_a_byte_of_it(
    kube, operator, api, nginx
) -> None:
    url = nginx.put("operator/shadow", SHADOW)
    await create_modelload(api, "shadow", {"source": url})
    obj = await failed(kube, "shadow", "BadModel")
    assert "expected a tensorizer file" in ready_condition(obj)["message"]
    shown = everything_shown(kube, "shadow")
    assert "root" not in shown and SHADOW[:16].hex(" ") not in shown and SHADOW[:8].hex() not in shown


async def test_a_nul_byte_in_the_source_is_a_badsource_condition(kube, operator, api) -> None:
    await create_modelload(api, "nul", {"source": "s3://models/llama\x00.safetensors"})
    obj = await failed(kube, "nul", "BadSource")
    assert "control character" in ready_condition(obj)["message"]
    assert obj["status"]["phase"] == "Failed"


async def test_an_operator_with_the_charts_defaults_refuses_a_loopback_source(
    kube, start_operator, api, nginx
) -> None:
    await start_operator(source_networks=())
    with FaultProxy(nginx.port) as proxy:  # counts what reaches the server
        nginx.put("operator/loopback.safetensors", model_bytes())
        await create_modelload(api, "probe", {"source": proxy.url("operator/loopback.safetensors")})
        obj = await failed(kube, "probe", "BadSource")
        assert proxy.connections == 0, "refused before connecting"
    message = ready_condition(obj)["message"]
    assert "127.0.0.1 (loopback)" in message and "sourceNetworks" in message
    assert obj["status"]["phase"] == "Failed"


@pytest.mark.parametrize(
    ("address", "by_default", "with_10_8"),
    [
        ("169.254.169.254", False, False),  # the cloud's metadata service
        ("fe80::1", False, False),
        ("127.0.0.1", False, False),
        ("::1", False, False),
        ("10.96.0.1", False, True),  # a Service address
        ("::ffff:10.0.0.1", False, True),
        ("100.64.0.10", False, False),  # shared address space some clusters use for pods
        ("192.168.1.5", False, False),
        ("0.0.0.0", False, False),
        ("8.8.8.8", True, True),
        ("2606:4700::1111", True, True),
    ],
)
def test_only_public_addresses_and_allowed_networks_are_permitted(
    address: str, by_default: bool, with_10_8: bool
) -> None:
    assert AddressPolicy().permits(address) is by_default
    assert AddressPolicy(allowed=parse_networks("10.0.0.0/8")).permits(address) is with_10_8


def test_the_metadata_service_is_refused_before_any_connection() -> None:
    spec = parse_spec({"source": "http://169.254.169.254/latest/meta-data/iam/model.safetensors"})
    with pytest.raises(SourceUriError, match=r"169\.254\.169\.254 \(link-local\)"):
        read_summary(spec, credentials=None)


@pytest.fixture
def redirector(nginx: Any) -> Iterator[str]:
    """A server on 127.0.0.2 that redirects every request to nginx on 127.0.0.1."""

    class Redirect(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(302)
            self.send_header("Location", f"http://127.0.0.1:{nginx.port}{self.path}")
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.2", 0), Redirect)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.2:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_a_redirect_to_an_address_not_allowed_is_refused(redirector: str, nginx: Any) -> None:
    nginx.put("operator/redirected.safetensors", model_bytes())
    spec = parse_spec({"source": f"{redirector}/operator/redirected.safetensors"})
    with pytest.raises(SourceUriError, match=r"127\.0\.0\.1 \(loopback\)"):
        read_summary(spec, credentials=None, networks=parse_networks("127.0.0.2/32"))
    summary = read_summary(spec, credentials=None, networks=parse_networks("127.0.0.0/8"))
    assert summary.tensors == 3  # the same redirect, allowed: the check is the address, not the redirect
