"""A hostile corpus of safetensors files, each made from a valid file by breaking one rule.

Every case names the error class it must raise and words from the message that tell the reader what is
wrong. Where the reference implementation also refuses the file, the test checks that it does: our rules
are then no stricter than needed. Where it accepts a file we refuse, the case says why we differ.
"""

from __future__ import annotations

import json
import struct
import tracemalloc
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import safetensors
import safetensors.numpy

from modelload.loader import errors
from modelload.loader.formats import safetensors as st

SOURCE = "s3://bucket/model.safetensors"


def valid() -> bytes:
    """The file every case starts from: three tensors of three widths, metadata, a scalar, an empty one."""
    return safetensors.numpy.save(
        {
            "a": np.arange(4, dtype=np.float64),
            "b": np.arange(6, dtype=np.int16).reshape(2, 3),
            "c": np.array(2.5, np.float32),
            "d": np.zeros((0, 7), np.uint8),
        },
        metadata={"format": "np"},
    )


def split(blob: bytes) -> tuple[str, bytes]:
    size = int.from_bytes(blob[:8], "little")
    return blob[8 : 8 + size].decode(), blob[8 + size :]


def pack(header: str | bytes, data: bytes) -> bytes:
    raw = header.encode() if isinstance(header, str) else header
    return struct.pack("<Q", len(raw)) + raw + data


def edit(change: Callable[[dict[str, Any]], None], *, extra: bytes = b"") -> bytes:
    """The valid file with its header parsed, changed in place, re-encoded, and its data kept."""
    text, data = split(valid())
    header = json.loads(text)
    change(header)
    return pack(json.dumps(header), data + extra)


def replace(old: str, new: str) -> bytes:
    """The valid file with one piece of header text replaced (for what json.dumps cannot write)."""
    text, data = split(valid())
    assert old in text
    return pack(text.replace(old, new, 1), data)


@dataclass(frozen=True)
class Case:
    blob: bytes
    error: type[errors.FormatError]
    match: str
    reference_refuses: bool = True
    why_we_differ: str = ""


def set_offsets(name: str, begin: int, end: int) -> Callable[[dict[str, Any]], None]:
    def change(header: dict[str, Any]) -> None:
        header[name]["data_offsets"] = [begin, end]

    return change


def set_field(name: str, key: str, value: Any) -> Callable[[dict[str, Any]], None]:
    def change(header: dict[str, Any]) -> None:
        header[name][key] = value

    return change


def swap_to_hole(header: dict[str, Any]) -> None:
    # a is [0, 32), c [32, 36), b [36, 48), d [48, 48); moving b and d 4 bytes on leaves [36, 40) to no one.
    header["b"]["data_offsets"] = [40, 52]
    header["d"]["data_offsets"] = [52, 52]


def shift_all_by_8(header: dict[str, Any]) -> None:
    for name, entry in header.items():
        if name != "__metadata__":
            begin, end = entry["data_offsets"]
            entry["data_offsets"] = [begin + 8, end + 8]


def cases() -> dict[str, Case]:
    blob = valid()
    text, data = split(blob)
    return {
        "header size past the end of the file": Case(
            struct.pack("<Q", len(blob)) + blob[8:],
            errors.TruncatedError,
            r"header alone ends at byte \d+.*cut short",
        ),
        "header size over the cap": Case(
            struct.pack("<Q", 2**62) + blob[8:], errors.BoundsError, "over the 100000000-byte limit"
        ),
        "file shorter than the size field": Case(blob[:5], errors.TruncatedError, "too short for the 8-byte"),
        "invalid UTF-8 in a name": Case(
            pack(text.replace('"a"', '"\xff"').encode("latin-1"), data), errors.HeaderError, "not valid UTF-8"
        ),
        "header that is a list": Case(pack("[1, 2]  ", data), errors.HeaderError, "must start with '{'"),
        "header that starts with a space": Case(
            pack(" " + text, data),
            errors.HeaderError,
            "must start with '{' and starts with 0x20",
            reference_refuses=False,
            why_we_differ="the format says the header MUST begin with '{'; the reference does not check",
        ),
        "header with text after the object": Case(
            pack(text.rstrip() + "x", data), errors.HeaderError, "not valid JSON"
        ),
        "header padded with NUL bytes": Case(pack(text + "\0\0", data), errors.HeaderError, "not valid JSON"),
        "a tensor named twice": Case(
            replace('"d":', '"d":{"dtype":"U8","shape":[0,7],"data_offsets":[48,48]},"d":'),
            errors.DuplicateNameError,
            "names 'd' twice",
            reference_refuses=False,
            why_we_differ="the format disallows duplicate keys; the reference silently keeps the last one",
        ),
        "a field repeated inside an entry": Case(
            replace('"dtype":"F64"', '"dtype":"F64","dtype":"F64"'),
            errors.HeaderError,
            "repeats the key 'dtype'",
        ),
        "an unknown field repeated inside an entry": Case(
            replace('"dtype":"F64"', '"dtype":"F64","note":"x","note":"y"'),
            errors.HeaderError,
            "repeats the key 'note'",
            reference_refuses=False,
            why_we_differ="the format disallows duplicate keys; the reference skips fields it does not know",
        ),
        "a tensor named twice, its name holding an escaped quote": Case(
            replace('"d":', '"q\\"":{"dtype":"U8","shape":[0],"data_offsets":[48,48]},"q\\"":'),
            errors.DuplicateNameError,
            "names 'q\"' twice",
            reference_refuses=False,
            why_we_differ="the format disallows duplicate keys; the reference silently keeps the last one",
        ),
        "a field repeated inside an entry, beside a name ending in a backslash": Case(
            replace('"d":', '"q\\\\":{"dtype":"U8","shape":[0],"shape":[0],"data_offsets":[48,48]},"d":'),
            errors.HeaderError,
            "repeats the key 'shape'",
        ),
        "a metadata key repeated": Case(
            replace('"format":"np"', '"format":"np","format":"pt"'),
            errors.HeaderError,
            "__metadata__ repeats the key 'format'",
            reference_refuses=False,
            why_we_differ="the format disallows duplicate keys; the reference keeps the last value",
        ),
        "unknown dtype": Case(
            edit(set_field("a", "dtype", "F7")), errors.UnsupportedDtypeError, "dtype 'F7'"
        ),
        "dtype that is not a string": Case(
            edit(set_field("a", "dtype", 64)), errors.HeaderError, "dtype must be"
        ),
        "negative dimension": Case(
            edit(set_field("b", "shape", [-2, -3])), errors.HeaderError, "non-negative"
        ),
        "float dimension": Case(
            edit(set_field("b", "shape", [2.0, 3])), errors.HeaderError, "non-negative integers"
        ),
        "boolean dimension": Case(
            edit(set_field("b", "shape", [True, 6])), errors.HeaderError, "non-negative"
        ),
        "NaN dimension": Case(replace('"shape":[2,3]', '"shape":[NaN,3]'), errors.HeaderError, "NaN"),
        "dimension past u64": Case(
            edit(set_field("b", "shape", [2**64, 3])), errors.HeaderError, "non-negative"
        ),
        "shape that disagrees with the byte count": Case(
            edit(set_field("b", "shape", [3, 3])), errors.SizeMismatchError, r"takes 18 bytes.*span 12"
        ),
        "shape of many huge dimensions": Case(
            edit(set_field("b", "shape", [2**63] * 60)),
            errors.SizeMismatchError,
            r"\[9223372036854775808, .*\.\.\..*takes more than 2\*\*64 bytes",
        ),
        "missing data_offsets": Case(
            edit(lambda h: h["a"].pop("data_offsets")), errors.HeaderError, "has no 'data_offsets'"
        ),
        "three data_offsets": Case(
            edit(set_field("a", "data_offsets", [0, 32, 33])), errors.HeaderError, "two"
        ),
        "offsets that end before they begin": Case(
            edit(set_offsets("d", 52, 44)), errors.HeaderError, "end before they begin"
        ),
        "offsets past the end of the file": Case(
            edit(set_offsets("b", 1000, 1012)),
            errors.BoundsError,
            r"tensor 'b' claims file bytes.*past the end",
        ),
        "overlapping ranges": Case(edit(set_offsets("b", 28, 40)), errors.OverlapError, "inside tensor 'a'"),
        "a zero-size tensor inside another": Case(
            edit(set_offsets("d", 8, 8)), errors.OverlapError, "'d' starts at data byte 8, inside tensor 'a'"
        ),
        "a hole between tensors": Case(
            edit(swap_to_hole, extra=b"\0" * 4),
            errors.OverlapError,
            r"\[36, 40\) before tensor 'b' belong to no",
        ),
        "a hole at the start": Case(
            edit(shift_all_by_8, extra=b"\0" * 8),
            errors.OverlapError,
            r"\[0, 8\) before tensor 'a'",
        ),
        "bytes after the last tensor": Case(
            pack(text, data + b"\0" * 8), errors.OverlapError, "8 bytes after"
        ),
        "truncated data": Case(
            blob[:-3], errors.TruncatedError, r"data up to byte \d+; the file was cut short"
        ),
        "a metadata value that is a number": Case(
            edit(lambda h: h["__metadata__"].update(n=1)),
            errors.HeaderError,
            r"__metadata__\['n'\] is an integer",
        ),
        "metadata that is a list": Case(
            edit(lambda h: h.update(__metadata__=["x"])), errors.HeaderError, "must be an object of strings"
        ),
        "an entry that is a string": Case(
            edit(lambda h: h.update(e="x")), errors.HeaderError, "must be an object"
        ),
        "an unpaired surrogate in a name": Case(
            replace('"a":', '"\\ud800":'), errors.HeaderError, "unpaired UTF-16 surrogate"
        ),
        "JSON nested beyond reason": Case(
            pack('{"a": ' + "[" * 100_000 + "]" * 100_000 + "}", b""), errors.HeaderError, "nests JSON deeper"
        ),
        "an integer of 4,400 digits (past Python's int parsing limit)": Case(
            replace('"shape":[2,3]', '"shape":[' + "9" * 4400 + "]"),
            errors.HeaderError,
            "thousands of digits",
        ),
        "65 dimensions": Case(
            edit(set_field("b", "shape", [1] * 63 + [2, 3])),
            errors.HeaderError,
            "65 dimensions.*at most 64",
            reference_refuses=False,
            why_we_differ="numpy, torch and the segment hold at most 64 dimensions: refused with the index, "
            "not when the tensor is read",
        ),
    }


CASES = cases()


def reader_of(blob: bytes, log: list[int] | None = None) -> Callable[[int, int], bytes]:
    def read(offset: int, length: int) -> bytes:
        if log is not None:
            log.append(length)
        return blob[offset : offset + length]

    return read


@pytest.mark.parametrize("name", list(CASES))
def test_a_hostile_file_raises_its_rules_error_with_a_helpful_message(name: str) -> None:
    case = CASES[name]
    with pytest.raises(case.error, match=case.match) as caught:
        st.read_index(reader_of(case.blob), source=SOURCE)
    message = str(caught.value)
    assert message.startswith(SOURCE + ": "), "the message names the file"
    assert caught.value.source == SOURCE
    advice = ("re-export", "cut short", "convert", "corrupt", "not safetensors", "strings", "fetch")
    assert any(word in message for word in advice), f"the message says what to do: {message}"


@pytest.mark.parametrize("name", list(CASES))
def test_the_reference_implementation_agrees_where_it_checks_the_same_rule(name: str) -> None:
    case = CASES[name]
    if case.reference_refuses:
        with pytest.raises(safetensors.SafetensorError):
            safetensors.deserialize(case.blob)
    else:
        assert case.why_we_differ
        safetensors.deserialize(case.blob)  # accepted there; refused here for the reason given


def test_the_valid_file_behind_the_corpus_is_accepted_by_both() -> None:
    index = st.read_index(reader_of(valid()))
    assert [t.name for t in index.tensors] == ["a", "c", "b", "d"]  # file order
    assert index.metadata == {"format": "np"}
    assert index.data_end == len(valid())
    assert len(safetensors.deserialize(valid())) == 4


def test_a_huge_header_size_is_refused_before_anything_is_read_or_allocated() -> None:
    blob = CASES["header size over the cap"].blob
    lengths: list[int] = []
    tracemalloc.start()
    try:
        with pytest.raises(errors.BoundsError):
            st.read_index(reader_of(blob, lengths))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert lengths == [st.FIRST_READ_LENGTH]
    assert peak < 1_000_000


def test_a_header_size_past_a_large_file_fails_when_the_second_read_comes_back_short() -> None:
    header = {f"t{i:05}": {"dtype": "U8", "shape": [1], "data_offsets": [i, i + 1]} for i in range(4000)}
    text = json.dumps(header)
    blob = pack(text, bytes(4000))
    assert len(text) > st.FIRST_READ_LENGTH
    cut = blob[: st.FIRST_READ_LENGTH + 100]
    lengths: list[int] = []
    with pytest.raises(errors.TruncatedError, match="inside its"):
        st.read_index(reader_of(cut, lengths))
    assert len(lengths) == 2
    with pytest.raises(errors.TruncatedError, match="header alone ends"):
        st.read_index(reader_of(cut), size=len(cut))


def test_without_the_file_size_a_truncated_large_file_shows_in_data_end() -> None:
    """Past the first read, the file's size is unknown; the caller compares data_end with the size it learns
    from its source (or passes size=, as the next test does)."""
    big = safetensors.numpy.save({"w": np.ones(40_000, np.float32)})
    cut = big[:-100]
    index = st.read_index(reader_of(cut))
    assert index.data_end == len(big) > len(cut)
    with pytest.raises(errors.TruncatedError, match="cut short"):
        st.read_index(reader_of(cut), size=len(cut))


def test_null_metadata_reads_as_none_as_the_reference_reads_it() -> None:
    blob = edit(lambda h: h.update(__metadata__=None))
    assert st.read_index(reader_of(blob)).metadata == {}
    assert len(safetensors.deserialize(blob)) == 4


def test_unknown_fields_in_an_entry_are_ignored_as_the_reference_ignores_them() -> None:
    blob = edit(set_field("a", "comment", "written by hand"))
    assert st.read_index(reader_of(blob)).tensors[0].name == "a"
    assert len(safetensors.deserialize(blob)) == 4


def test_names_with_quotes_and_backslashes_read_as_the_reference_reads_them() -> None:
    # 'b"dtype' shows '"dtype"' in the text ("b\\"dtype"): read carefully, and accepted all the same.
    names = ['say "hi"', "C:\\dir\\", "\\", 'a "dtype" b', 'b"dtype', "plain"]
    blob = safetensors.numpy.save({name: np.full(3, i, np.int32) for i, name in enumerate(names)})
    index = st.read_index(reader_of(blob), size=len(blob))
    assert sorted(t.name for t in index.tensors) == sorted(names)
    assert sorted(index.tensors, key=lambda t: t.data_offset) == list(index.tensors)
    assert {t.name for t in index.tensors} == {name for name, _ in safetensors.deserialize(blob)}


def test_trailing_json_whitespace_is_padding() -> None:
    text, data = split(valid())
    blob = pack(text.rstrip() + " \t\r\n ", data)
    assert len(st.read_index(reader_of(blob)).tensors) == 4
