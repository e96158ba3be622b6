"""Peers on loopback: in-process sidecars, the real peer server and nginx as the origin, no namespaces.

These run everywhere (no root): the tensorizer path through a peer (record headers land in the slot's lead
and are served from there), the server's answers to bad askers, and the settings' checks.
"""

from __future__ import annotations

import zlib
from pathlib import Path

import pytest
import torch

from modelload.loader.errors import ConfigError
from modelload.loader.segment import SegmentReader
from modelload.sidecar.peers.ranges import owner
from modelload.sidecar.process import Sidecar
from modelload.sidecar.settings import parse_settings
from tests.sidecar.models import assert_segment_matches, safetensors_bytes, tensorizer_bytes
from tests.support.fixtures import nginx  # noqa: F401 - the fixture
from tests.support.nginx import NginxServer
from tests.support.peer_client import PeerAnswer, peer_get
from tests.support.ports import free_port
from tests.support.sidecars import Sidecars, wait_for_phase

TOKEN = "peer-token-for-tests-0123456789"


def _tensors(seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {f"block.{i}.weight": torch.randn(256, 256 + i, generator=generator) for i in range(12)}


@pytest.fixture
def token_file(tmp_path: Path) -> Path:
    path = tmp_path / "token"
    path.write_text(TOKEN + "\n")
    return path


class _Running:
    """Sidecars of one model on loopback, each serving peers on a port of its own."""

    def __init__(self, sidecars: Sidecars, token_file: Path) -> None:
        self.sidecars, self.token_file = sidecars, token_file

    def start(self, source: str, segment: Path, *, peer_port: int, peers: list[int]) -> Sidecar:
        urls = ",".join(f"http://127.0.0.1:{p}" for p in peers) or f"http://127.0.0.1:{peer_port}"
        return self.sidecars.start(
            source, segment, "--notify", "none", "--chunk-size", "1MiB", "--peers", urls,
            "--peer-port", str(peer_port), "--peer-token-file", str(self.token_file),
            "--peer-stall-timeout", "2",
        )  # fmt: skip

    def pair(self, url: str, folder: Path) -> tuple[Sidecar, Sidecar]:
        """A first sidecar that loads from the origin, then a second that has the first as its peer."""
        first_port, second_port = free_port(), free_port()
        first = self.start(url, folder / "a.seg", peer_port=first_port, peers=[])
        wait_for_phase(first, "complete")
        second = self.start(url, folder / "b.seg", peer_port=second_port, peers=[first_port])
        wait_for_phase(second, "complete")
        return first, second


@pytest.fixture
def running(sidecars: Sidecars, token_file: Path) -> _Running:
    return _Running(sidecars, token_file)


def test_a_tensorizer_model_comes_whole_from_a_peer_with_its_hashes_checked(
    nginx: NginxServer,  # noqa: F811 - the fixture
    running: _Running,
    tmp_path: Path,
) -> None:
    tensors = _tensors(1)
    (nginx.root / "peers-model.tensors").write_bytes(tensorizer_bytes(tensors))
    first, second = running.pair(nginx.url("peers-model.tensors"), tmp_path)
    assert_segment_matches(tmp_path / "b.seg", tensors)
    stats = second.peers.stats()
    data = sum(t.numel() * 4 for t in tensors.values())
    assert stats["origin_bytes"] == 0
    assert stats["peer_bytes"] > data  # the data and every record header
    assert first.peers.stats()["uploaded_bytes"] == stats["peer_bytes"]
    from prometheus_client import generate_latest

    samples = dict(
        line.rsplit(" ", 1)
        for line in generate_latest(second.metrics.registry).decode().splitlines()
        if line.startswith("modelload_peer_")
    )
    assert float(samples["modelload_peer_received_bytes_total"]) == stats["peer_bytes"]
    assert float(samples["modelload_peer_origin_bytes_total"]) == 0


def test_a_safetensors_tensor_from_a_peer_records_the_checksum_its_check_computed(
    nginx: NginxServer,  # noqa: F811 - the fixture
    running: _Running,
    tmp_path: Path,
) -> None:
    (nginx.root / "peers-crc.safetensors").write_bytes(safetensors_bytes(_tensors(2)))
    _, second = running.pair(nginx.url("peers-crc.safetensors"), tmp_path)
    assert second.peers is not None and second.peers.stats()["origin_bytes"] == 0
    listed = second.peers.manifest()["crc32"]
    with SegmentReader.open(tmp_path / "b.seg") as segment:
        for i in range(len(segment.slots)):
            # The peers' check computed the slot's CRC-32 (the record is the slot): the one recorded.
            assert segment.crc32(i) == zlib.crc32(segment.view(i)) == listed[i]


def _get(port: int, path: str, token: str | None = TOKEN, **headers: str) -> PeerAnswer:
    return peer_get(f"http://127.0.0.1:{port}", path, token, headers=headers)


def test_the_peer_server_answers_only_token_holders_and_only_with_ready_tensor_ranges(
    nginx: NginxServer,  # noqa: F811 - the fixture
    running: _Running,
    tmp_path: Path,
) -> None:
    tensors = _tensors(2)
    (nginx.root / "peers-model.safetensors").write_bytes(safetensors_bytes(tensors))
    port = free_port()
    sidecar = running.start(
        nginx.url("peers-model.safetensors"), tmp_path / "a.seg", peer_port=port, peers=[]
    )
    wait_for_phase(sidecar, "complete")
    assert _get(port, "/peer/v1/manifest", None).status == 401
    assert _get(port, "/peer/v1/manifest", None, Authorization=f"Bearer {TOKEN}").status == 401
    assert _get(port, "/peer/v1/manifest", "another-token").status == 401
    answer = _get(port, "/peer/v1/manifest")
    assert answer.status == 200 and answer.proven
    assert TOKEN.encode() not in answer.body
    assert not peer_get(f"http://127.0.0.1:{port}", "/peer/v1/manifest", "another-token").proven
    first = sidecar.peers._ranges.plan.index.tensors[0]
    start, end = first.data_offset, first.data_offset + first.data_length - 1
    answer = _get(port, "/peer/v1/files/0", Range=f"bytes={start}-{end}")
    assert answer.status == 206 and answer.proven
    assert answer.body == (nginx.root / "peers-model.safetensors").read_bytes()[start : end + 1]
    assert _get(port, "/peer/v1/files/0", Range="bytes=0-99").status == 404  # the header
    assert _get(port, "/peer/v1/files/0", Range=f"bytes={start}-{end + 5}").status == 404
    assert _get(port, "/peer/v1/files/1", Range="bytes=0-9").status == 404
    other = _get(port, "/peer/v1/files/0", Range=f"bytes={start}-{end}", **{"If-Match": '"another-version"'})
    assert other.status == 412
    server = sidecar.peers.server
    server._uploads = sidecar.settings.peers.max_uploads  # every upload slot taken
    try:
        assert _get(port, "/peer/v1/files/0", Range=f"bytes={start}-{end}").status == 429
    finally:
        server._uploads = 0


def test_peers_need_a_token_and_never_show_it(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no token"):
        parse_settings(["--source", "file:///m", "--peers", "http://10.0.0.2:8480"], {})
    empty = tmp_path / "empty"
    empty.write_text("\n")
    with pytest.raises(ConfigError, match="must hold one token"):
        parse_settings(["--source", "file:///m", "--peer-dns", "x", "--peer-token-file", str(empty)], {})
    with pytest.raises(ConfigError, match="http:// or https://"):
        parse_settings(["--source", "file:///m", "--peers", "10.0.0.2:8480"], {})
    secret = tmp_path / "token"
    secret.write_text("s3cr3t-peer-token\n")
    settings = parse_settings(
        [],
        {
            "MODELLOAD_SOURCE": "file:///m",
            "MODELLOAD_PEER_DNS": "m.ns.svc",
            "MODELLOAD_PEER_TOKEN_FILE": str(secret),
        },
    )
    assert settings.peers.enabled and settings.peers.token == "s3cr3t-peer-token"
    assert "s3cr3t" not in repr(settings)


def test_rendezvous_moves_only_the_tensors_of_a_member_that_leaves() -> None:
    members = [f"m{i}" for i in range(8)]
    before = {t: owner(t, members, salt="v1") for t in range(2000)}
    after = {t: owner(t, members[:-1], salt="v1") for t in range(2000)}
    moved = [t for t in before if before[t] != after[t]]
    assert all(before[t] == "m7" for t in moved)
    share = sum(1 for t in before if before[t] == "m0") / 2000
    assert 0.08 < share < 0.17  # about one eighth each
