"""The peer protocol's proofs and the manifest's schema, without a network: what a MAC covers, what a replay
guard remembers, what a JSON bound refuses, and every way a manifest can be malformed."""

from __future__ import annotations

import base64
import json
from typing import Any

import pytest

from modelload.loader.peerwire import (
    Answer,
    PeerKey,
    ReplayGuard,
    Request,
    json_depth,
    load_json,
    parse_digest,
)
from modelload.sidecar.peers.manifest import bitmap, manifest_limit, parse_manifest, unbitmap
from modelload.sidecar.sources import ObjectInfo

TOKEN = "a-peer-token-of-the-model"


def test_a_signature_proves_the_token_for_exactly_the_request_it_signs() -> None:
    key, guard = PeerKey(TOKEN), ReplayGuard()
    asked = Request("GET", "/peer/v1/files/0", "10.0.0.7:8480", "bytes=0-99", '"v1"')
    signed = key.sign(asked)
    assert TOKEN not in signed.authorization
    assert key.check(signed.authorization, asked, guard) == signed.nonce
    for changed in (
        Request("GET", "/peer/v1/files/1", "10.0.0.7:8480", "bytes=0-99", '"v1"'),
        Request("GET", "/peer/v1/files/0", "10.0.0.7:8480", "bytes=0-100", '"v1"'),
        Request("GET", "/peer/v1/files/0", "10.0.0.7:8480", "bytes=0-99", '"v2"'),
        Request("HEAD", "/peer/v1/files/0", "10.0.0.7:8480", "bytes=0-99", '"v1"'),
        Request("GET", "/peer/v1/files/0", "10.0.0.8:8480", "bytes=0-99", '"v1"'),  # another peer
        Request("GET", "/peer/v1/files/0", "10.0.0.7:8481", "bytes=0-99", '"v1"'),
    ):
        with pytest.raises(PermissionError, match="does not match"):
            PeerKey(TOKEN).check(key.sign(asked).authorization, changed, guard)
    with pytest.raises(PermissionError, match="does not match"):
        key.check(PeerKey("another-token").sign(asked).authorization, asked, guard)
    for header in (None, "", f"Bearer {TOKEN}", signed.authorization.replace("mac=", "mac=0")):
        with pytest.raises(PermissionError):
            key.check(header, asked, guard)


def test_a_request_is_good_once_and_only_within_the_clock_skew() -> None:
    key, guard = PeerKey(TOKEN), ReplayGuard(skew=30)
    asked = Request("GET", "/peer/v1/manifest", "10.0.0.7:8480")
    signed = key.sign(asked)
    key.check(signed.authorization, asked, guard)
    with pytest.raises(PermissionError, match="already used"):
        key.check(signed.authorization, asked, guard)
    import time

    for offset in (-31, 31):
        late = key.sign(asked, now=time.time() + offset)
        with pytest.raises(PermissionError, match="off this peer's clock"):
            key.check(late.authorization, asked, guard)


def test_a_full_replay_guard_forgets_the_oldest_and_refuses_anything_as_old() -> None:
    guard = ReplayGuard(skew=30, capacity=3)
    now = 1000.0
    for i, ts in enumerate((990.0, 991.0, 992.0, 993.0)):
        guard.admit(f"n{i}", ts, now=now)
    assert len(guard) == 3
    with pytest.raises(PermissionError, match="too old"):
        guard.admit("n0", 990.0, now=now)  # forgotten, so refused by age, not accepted again
    with pytest.raises(PermissionError, match="too old"):
        guard.admit("never-seen", 989.5, now=now)  # older than a forgotten one: it could be a replay
    guard.admit("newer-than-forgotten", 990.5, now=now)
    guard.admit("later", 1040.0, now=1040.0)  # the window moved: everything before 1010 forgotten
    assert len(guard) == 1


def test_an_answer_proof_binds_the_nonce_the_range_and_the_digest() -> None:
    key = PeerKey(TOKEN)
    answer = Answer(206, "/peer/v1/files/0", "bytes 0-99/1000", '"v1"')
    proof = key.prove("n1", answer, "ab" * 32)
    assert key.proven(proof, "n1", answer, "ab" * 32)
    assert not key.proven(proof, "n2", answer, "ab" * 32)
    assert not key.proven(proof, "n1", answer, "cd" * 32)
    assert not key.proven(proof, "n1", Answer(206, "/peer/v1/files/0", "bytes 0-98/1000", '"v1"'), "ab" * 32)
    assert not key.proven(proof, "n1", Answer(200, "/peer/v1/files/0", "bytes 0-99/1000", '"v1"'), "ab" * 32)
    assert not PeerKey("another").proven(proof, "n1", answer, "ab" * 32)
    assert not key.proven(None, "n1", answer, "ab" * 32)
    # A request's MAC never passes as an answer's: the keys differ.
    signed = key.sign(Request("GET", "/peer/v1/files/0", "10.0.0.7:8480"), nonce="n1")
    assert signed.authorization.rsplit("mac=", 1)[1] != proof
    assert parse_digest("sha256=" + "ab" * 32) == "ab" * 32
    assert parse_digest("sha256=AB") is None and parse_digest(None) is None
    assert "hidden" in repr(key) and TOKEN not in repr(key)


@pytest.mark.parametrize(
    ("body", "problem"),
    [
        (b"[" * 100 + b"]" * 100, "nested 100 deep"),
        (b"[" * 200_000, "nested 200000 deep"),  # what would be a RecursionError in json
        (b'{"a": "' + b"x" * 2000 + b'"}', "bytes"),
        (b"NaN", "not a number"),
        (b"1" * 5000, "digits"),
        (b'"' + b'\\"' * 1000, "Unterminated"),
    ],
)
def test_bounded_json_refuses_with_a_value_error(body: bytes, problem: str) -> None:
    with pytest.raises(ValueError, match=problem):
        load_json(body, max_bytes=1 << 20 if problem != "bytes" else 1000, max_depth=8)


def test_strings_do_not_count_towards_the_depth() -> None:
    assert json_depth(b'{"a": "[[[[{{{{", "b": [1, {"c": "]]]"}]}') == 3
    assert load_json(b'{"a": ["[", "\\"]"]}', max_bytes=100, max_depth=2) == {"a": ["[", '"]']}


INFOS = [ObjectInfo(size=1000, etag='"v1"'), ObjectInfo(size=2000, etag='"v2"')]


def _manifest(**changes: Any) -> dict[str, Any]:
    doc: dict[str, Any] = {
        "id": "0123456789abcdef",
        "phase": "loading",
        "bytes_done": 300,
        "files": [{"etag": '"v1"', "size": 1000}, {"etag": '"v2"', "size": 2000}],
        "ready": bitmap([True, False, True, False, False, False, False, False, True, False]),
        "crc32": [1, 0, 2, 0, 0, 0, 0, 0, 3, 0],
    }
    doc.update(changes)
    return {k: v for k, v in doc.items() if v is not ...}


def _parse(doc: Any) -> Any:
    return parse_manifest(json.dumps(doc).encode(), infos=INFOS, tensors=10)


def test_an_honest_manifest_parses_with_and_without_a_plan() -> None:
    parsed = _parse(_manifest())
    assert parsed.planned and parsed.ready[:3] == (True, False, True) and parsed.crc32[8] == 3
    assert parsed.files == (('"v1"', 1000), ('"v2"', 2000))
    early = _parse(_manifest(files=..., ready=..., crc32=..., phase="starting"))
    assert not early.planned and early.phase == "starting"


@pytest.mark.parametrize(
    "doc",
    [
        _manifest(crc32=["deadbeef", None, 2, 0, 0, 0, 0, 0, 3, 0]),
        _manifest(crc32=[1.5, 0, 2, 0, 0, 0, 0, 0, 3, 0]),
        _manifest(crc32=[True, 0, 2, 0, 0, 0, 0, 0, 3, 0]),
        _manifest(crc32=[1 << 32, 0, 2, 0, 0, 0, 0, 0, 3, 0]),
        _manifest(crc32=[-1, 0, 2, 0, 0, 0, 0, 0, 3, 0]),
        _manifest(crc32=[1, 2, 3]),
        _manifest(crc32={"0": 1}),
        _manifest(ready=bitmap([True] * 4)),
        _manifest(ready=bitmap([True] * 16)),
        _manifest(ready=base64.b64encode(b"\xff\xff").decode()),  # bits past the tenth tensor set
        _manifest(ready="not base64!"),
        _manifest(ready=17),
        _manifest(bytes_done=2**200),
        _manifest(bytes_done=-1),
        _manifest(bytes_done="300"),
        _manifest(id="PEER"),
        _manifest(id=12),
        _manifest(phase="done"),
        _manifest(files=[{"etag": '"v1"', "size": 1000}]),
        _manifest(files=[{"etag": '"v1"', "size": 1000}, {"etag": '"v2"'}]),
        _manifest(files=[{"etag": "x" * 2000, "size": 1000}, {"etag": '"v2"', "size": 2000}]),
        _manifest(files=..., crc32=...),
        _manifest(extra=1),
        [1, 2, 3],
        "a manifest",
    ],
)
def test_a_malformed_manifest_is_a_value_error_never_anything_else(doc: Any) -> None:
    with pytest.raises(ValueError, match="manifest"):
        _parse(doc)


def test_a_manifest_over_its_size_is_refused_before_parsing() -> None:
    limit = manifest_limit(files=2, tensors=10)
    body = json.dumps(_manifest(id="0" * 16 + " " * limit)).encode()
    with pytest.raises(ValueError, match="bytes"):
        parse_manifest(body, infos=INFOS, tensors=10)
    with pytest.raises(ValueError, match="deep"):
        parse_manifest(b'{"crc32": ' + b"[" * 50 + b"]" * 50 + b"}", infos=INFOS, tensors=10)


def test_a_bitmap_round_trips_and_refuses_the_wrong_length() -> None:
    flags = [i % 3 == 0 for i in range(21)]
    assert unbitmap(bitmap(flags), 21) == flags
    with pytest.raises(ValueError):
        unbitmap(bitmap(flags), 30)


def test_a_request_of_the_earlier_protocol_is_refused_for_its_version_not_its_token() -> None:
    key, guard = PeerKey(TOKEN), ReplayGuard()
    asked = Request("GET", "/peer/v1/manifest", "10.0.0.7:8480")
    earlier = key.sign(asked).authorization.replace("ModelloadPeer2 ", "ModelloadPeer1 ")
    with pytest.raises(PermissionError, match="earlier version of the peer protocol; this peer speaks Model"):
        key.check(earlier, asked, guard)
