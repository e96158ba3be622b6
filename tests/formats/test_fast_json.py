"""orjson's fast path for safetensors headers and the shards' index JSON (``formats/_fast_json.py``).

It must change nothing but the time: every header, valid or hostile, reads to the same index or fails with
the same error, word for word, with orjson as with the json module alone. The cases below are the ones
where the two parsers differ (an integer past 2**64 - 1 becomes a float in orjson, ``NaN``, lone
surrogates, deep nesting, a byte-order mark, repeated keys), and then hypothesis's mutations of a real
header, each compared across both paths.
"""

from __future__ import annotations

import json
import struct
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from modelload.loader.formats import _directory, _fast_json
from modelload.loader.formats.safetensors import _header, _json
from modelload.loader.formats.safetensors._header import parse_header
from tests.fuzz import harness

pytestmark = pytest.mark.skipif(_fast_json.fast_loads is None, reason="orjson is not installed")

GOOD = {
    "a": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]},
    "b": {"dtype": "I64", "shape": [1], "data_offsets": [16, 24]},
    "__metadata__": {"format": "pt"},
}


def _text(document: Any) -> bytes:
    return json.dumps(document, separators=(",", ":")).encode()


def _read(header: bytes, *, fast: bool, monkeypatch: pytest.MonkeyPatch) -> Any:
    """What parse_header makes of ``header``: its index as plain values, or its error's type and words."""
    with monkeypatch.context() as patch:
        if not fast:
            patch.setattr(_header, "FAST_JSON", False)
            patch.setattr(_json, "fast_loads", None)
        try:
            index = parse_header(header, size=8 + len(header) + 24, source="model.safetensors")
        except Exception as exc:  # which error, in which words
            return type(exc).__name__, str(exc)
    table = index.tensors
    return (
        list(table.names),
        [d.name for d in table.dtypes],
        list(table.shapes),
        [int(o) for o in table.data_offsets],
        [int(n) for n in table.data_lengths],
        dict(index.metadata),
    )


HOSTILE = {
    "an offset past 2**64 - 1": b'{"a":{"dtype":"F32","shape":[2,2],"data_offsets":[0,'
    + str(2**64 + 16).encode()
    + b"]}}",
    "a dimension past 2**64 - 1": b'{"a":{"dtype":"F32","shape":['
    + str(2**64).encode()
    + b'],"data_offsets":[0,16]}}',
    "a metadata value past 2**64 - 1": b'{"__metadata__":{"n":18446744073709551616},'
    + b'"a":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}}',
    "NaN": b'{"a":{"dtype":"F32","shape":[NaN],"data_offsets":[0,16]}}',
    "a lone surrogate": b'{"\\ud800":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}}',
    "nesting past 1024": b'{"__metadata__":' + b"[" * 1100 + b"]" * 1100 + b"}",
    "a byte-order mark": b"\xef\xbb\xbf" + _text(GOOD),
    "a tensor named twice": b'{"a":{"dtype":"F32","shape":[4],"data_offsets":[0,16]},'
    + b'"a":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}}',
    "an unknown field repeated": b'{"a":{"dtype":"F32","shape":[4],"data_offsets":[0,16],"n":1,"n":2}}',
    "a name with an escaped quote, twice": b'{"a\\"":{"dtype":"F32","shape":[4],"data_offsets":[0,16]},'
    + b'"a\\"":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}}',
    "a name with an escaped quote": b'{"a\\"":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}}',
    "null metadata": b'{"__metadata__":null,"a":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}}',
    "a float where an integer is due": b'{"a":{"dtype":"F32","shape":[4.0],"data_offsets":[0,16]}}',
    "an exponent": b'{"a":{"dtype":"F32","shape":[4],"data_offsets":[0,1.6e1]}}',
    "valid": _text(GOOD),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_a_header_reads_the_same_with_orjson_as_with_the_json_module(
    case: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    header = HOSTILE[case]
    assert _read(header, fast=True, monkeypatch=monkeypatch) == _read(
        header, fast=False, monkeypatch=monkeypatch
    )


def test_a_valid_header_is_parsed_by_orjson(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    fast = _json.fast_loads
    assert fast is not None

    def counting(text: str | bytes) -> Any:
        calls.append(len(text))
        return fast(text)

    monkeypatch.setattr(_json, "fast_loads", counting)
    index = parse_header(_text(GOOD), source="model.safetensors")
    assert list(index.tensors.names) == ["a", "b"]
    assert calls == [len(_text(GOOD))], "the header went through orjson, once"


@pytest.mark.parametrize("fast", [True, False], ids=["orjson", "json module"])
@pytest.mark.parametrize(
    "names", [["a", "b"], ['a "quoted" name', "C:\\dir\\"]], ids=["plain names", "escapes in names"]
)
def test_a_valid_header_is_read_without_the_careful_reading(
    fast: bool, names: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The careful reading (a Python call per object) is for headers with something wrong: a valid one,
    escapes in its names or not, is proved free of repeats from its text."""

    def careful(*args: Any) -> Any:
        raise AssertionError("a valid header went through the careful reading")

    document = {name: dict(GOOD["a"], data_offsets=[16 * i, 16 * i + 16]) for i, name in enumerate(names)}
    header = _text({**document, "__metadata__": {"format": "pt"}})
    monkeypatch.setattr(_header, "load_header_json", careful)
    if not fast:
        monkeypatch.setattr(_header, "FAST_JSON", False)
    index = parse_header(header, size=8 + len(header) + 16 * len(names), source="model.safetensors")
    assert list(index.tensors.names) == names
    assert index.metadata == {"format": "pt"}


SEED = harness.safetensors_seed()


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(edits=st.lists(harness.edits(), max_size=3), json_edit=st.none() | harness.json_edits())
def test_mutated_headers_read_the_same_with_orjson_as_with_the_json_module(
    edits: list[harness.Edit], json_edit: harness.JsonEdit | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    blob = harness.reseal_safetensors(SEED, json_edit) if json_edit is not None else SEED
    size = struct.unpack_from("<Q", blob)[0]
    header = harness.mutate(blob[8 : 8 + size], edits)
    assert _read(header, fast=True, monkeypatch=monkeypatch) == _read(
        header, fast=False, monkeypatch=monkeypatch
    )


def _shards(index_json: bytes, *, fast: bool, monkeypatch: pytest.MonkeyPatch) -> Any:
    with monkeypatch.context() as patch:
        if not fast:
            patch.setattr(_directory, "fast_loads", None)
        try:
            return _directory.weight_shards(index_json, where="model.safetensors.index.json")
        except Exception as exc:  # compared across both paths
            return type(exc).__name__, str(exc)


INDEXES = {
    "valid": b'{"metadata":{"total_size":40},"weight_map":{"a":"m-1.safetensors","b":"m-2.safetensors"}}',
    "a shard that is a huge number": b'{"weight_map":{"a":18446744073709551616}}',
    "NaN in the metadata": b'{"metadata":{"total_size":NaN},"weight_map":{"a":"m.safetensors"}}',
    "a tensor mapped twice": b'{"weight_map":{"a":"m-1.safetensors","a":"m-2.safetensors"}}',
    "a shard outside the directory": b'{"weight_map":{"a":"../m.safetensors"}}',
    "UTF-16": '{"weight_map":{"a":"m.safetensors"}}'.encode("utf-16"),
    "not JSON": b'{"weight_map":',
}


@pytest.mark.parametrize("case", sorted(INDEXES))
def test_an_index_reads_the_same_with_orjson_as_with_the_json_module(
    case: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    text = INDEXES[case]
    assert _shards(text, fast=True, monkeypatch=monkeypatch) == _shards(
        text, fast=False, monkeypatch=monkeypatch
    )
