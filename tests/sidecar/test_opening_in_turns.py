"""Opening a directory of shards: the header reads overlap, the parsing takes turns.

A remote origin answers each read after a round trip, so the shards' headers are read on several threads at
once; parsing them is Python, which on several threads at once only fights for the GIL. These tests pin
both halves with events, not timings: no two headers are parsed at the same moment, and the second read of
a header longer than the first read is made while another shard holds the turn. Local files, which have no
round trip to overlap, are looked up one after the other on the caller's thread; the tests of the threads
take them as remote (``remote_files``).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from modelload.sidecar.sources import FileSource, SourceSettings, _model, open_model
from tests.support import hfdir

_LONG = 6000
"""Tensors in a shard whose header outgrows the first read (PREFIX_LENGTH): about 90 bytes of JSON each."""


def _directory(tmp_path: Path, *, shards: int, per_shard: int) -> tuple[Path, dict[str, torch.Tensor]]:
    weights = {
        f"model.layers.{i // 64}.mlp.experts.{i % 64}.up_proj.weight": torch.full((2,), i, dtype=torch.int16)
        for i in range(shards * per_shard)
    }
    return hfdir.write(tmp_path / "moe", hfdir.files(weights, shards=shards)), weights


def _checked(model_dir: Path, weights: dict[str, torch.Tensor]) -> None:
    model = open_model(str(model_dir) + "/", SourceSettings())
    try:
        index = model.index
        assert len(model.sources) > 1
        assert sorted(index.table.names) == sorted(weights)
        assert all(entry.data_length == 4 for entry in index.tensors)
    finally:
        model.close()


@pytest.fixture
def remote_files(monkeypatch: pytest.MonkeyPatch) -> None:
    """Local files looked up as a remote origin's are, on several threads."""
    monkeypatch.setattr(FileSource, "local", False)


def test_local_shards_are_looked_up_on_the_callers_thread(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model_dir, weights = _directory(tmp_path, shards=6, per_shard=50)
    threads: set[str] = set()
    read_index: Callable[..., Any] = _model.read_index

    def watched(*args: Any, **kwargs: Any) -> Any:
        threads.add(threading.current_thread().name)
        return read_index(*args, **kwargs)

    monkeypatch.setattr(_model, "read_index", watched)
    _checked(model_dir, weights)
    assert threads == {threading.current_thread().name}


@pytest.mark.usefixtures("remote_files")
def test_no_two_shard_headers_are_parsed_at_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model_dir, weights = _directory(tmp_path, shards=12, per_shard=200)
    parsing = 0
    most = 0
    began = 0
    count = threading.Lock()
    second = threading.Event()  # a header began to parse while another was parsing
    read_index: Callable[..., Any] = _model.read_index

    def watched(*args: Any, **kwargs: Any) -> Any:
        nonlocal parsing, most, began
        with count:
            parsing += 1
            began += 1
            most = max(most, parsing)
            first = began == 1
        if parsing > 1:
            second.set()
        if first:  # the first parse lasts until a second begins, or long enough for one to, were it let in
            second.wait(timeout=2)
        try:
            return read_index(*args, **kwargs)
        finally:
            with count:
                parsing -= 1

    monkeypatch.setattr(_model, "read_index", watched)
    _checked(model_dir, weights)
    assert most == 1, f"{most} headers were parsed at once"


@pytest.mark.usefixtures("remote_files")
def test_the_rest_of_a_long_header_is_read_while_another_shard_holds_the_turn(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model_dir, weights = _directory(tmp_path, shards=2, per_shard=_LONG)
    # Each shard's second read waits for the other's: were the turn kept while reading, the first would wait
    # for a read that can only start once it is done, and the barrier would break.
    both = threading.Barrier(2, timeout=30)
    read_bytes: Callable[..., bytes] = _model.read_bytes
    rests: list[int] = []

    def meeting(source: Any, offset: int, length: int, **kwargs: Any) -> bytes:
        rests.append(offset)
        both.wait()
        return read_bytes(source, offset, length, **kwargs)

    monkeypatch.setattr(_model, "read_bytes", meeting)
    _checked(model_dir, weights)
    assert rests == [_model.PREFIX_LENGTH] * 2, "each shard read the rest of its header once"


def test_each_shards_look_up_brings_about_its_header_as_the_index_sizes_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model_dir, weights = _directory(tmp_path, shards=12, per_shard=1500)  # headers of about 130 KiB
    asked: list[int] = []
    rests: list[int] = []
    stat_with_prefix: Callable[..., Any] = _model.stat_with_prefix
    read_bytes: Callable[..., bytes] = _model.read_bytes

    def look_up(source: Any, length: int, **kwargs: Any) -> Any:
        asked.append(length)
        return stat_with_prefix(source, length, **kwargs)

    def rest(source: Any, offset: int, length: int, **kwargs: Any) -> bytes:
        rests.append(offset)
        return read_bytes(source, offset, length, **kwargs)

    monkeypatch.setattr(_model, "stat_with_prefix", look_up)
    monkeypatch.setattr(_model, "read_bytes", rest)
    _checked(model_dir, weights)
    shards = sorted(model_dir.glob("*.safetensors"))
    headers = [8 + int.from_bytes(path.read_bytes()[:8], "little") for path in shards]
    weight_reads = [length for length in asked if length != _model.SMALL_FILE_LIMIT]
    assert len(weight_reads) == len(shards) and len(set(weight_reads)) == 1
    assert max(headers) <= weight_reads[0] < _model.PREFIX_LENGTH, (headers, weight_reads[0])
    assert rests == [], "no header needed a second read"


@pytest.mark.parametrize(
    ("index_length", "shards", "expected"),
    [
        (None, 4, _model.PREFIX_LENGTH),  # no index: a single file, or tensorizer
        (30_000, 4, 64 << 10),  # a dense model's few shards: the safetensors reader's own first read
        (8_700_000, 160, 124 << 10),  # 100,000 tensors in 160 shards
        (40_000_000, 10, _model.PREFIX_LENGTH),  # a shard's share past the most asked for at once
    ],
)
def test_the_first_read_is_twice_a_shards_share_of_the_index_within_bounds(
    index_length: int | None, shards: int, expected: int
) -> None:
    index_json = None if index_length is None else bytes(index_length)
    assert _model.first_read_length(index_json, shards) == expected


def test_a_shard_whose_header_outgrows_its_first_read_costs_one_more_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model_dir, weights = _directory(tmp_path, shards=6, per_shard=1500)  # headers of about 130 KiB
    read_bytes: Callable[..., bytes] = _model.read_bytes
    rests: list[int] = []

    def rest(source: Any, offset: int, length: int, **kwargs: Any) -> bytes:
        rests.append(offset)
        return read_bytes(source, offset, length, **kwargs)

    monkeypatch.setattr(_model, "first_read_length", lambda index_json, shards: 64 << 10)
    monkeypatch.setattr(_model, "read_bytes", rest)
    _checked(model_dir, weights)
    assert rests == [64 << 10] * 6, "each shard read the rest of its header once, from where the first ended"
