"""A corpus of hostile segments, each with the error it must raise (SPEC.md, reader rules 1-3).

Every case starts from a valid, complete segment and breaks one rule. None of them may make the reader
allocate what the broken header claims: the limits are checked before any read of that size.
"""

from __future__ import annotations

import json
import struct
import zlib
from collections.abc import Callable
from pathlib import Path

import pytest

from modelload.loader.errors import SegmentLayoutError, SegmentVersionError
from modelload.loader.segment import SegmentReader
from tests.segment.helpers import sharded_layout, small_layout, write_complete

Mutation = Callable[[bytearray], bytes | bytearray]


def put(fmt: str, offset: int, value: int) -> Mutation:
    def mutate(data: bytearray) -> bytearray:
        struct.pack_into(fmt, data, offset, value)
        return data

    return mutate


def manifest(change: Callable[[dict], object], *, replace: bool = False) -> Mutation:
    """Rewrite the manifest JSON (keeping its length and CRC consistent, so only the changed rule breaks).

    ``change`` edits the document in place, or with ``replace`` returns the document to write instead.
    """

    def mutate(data: bytearray) -> bytearray:
        length = struct.unpack_from("<Q", data, 32)[0]
        document = json.loads(data[4096 : 4096 + length])
        result = change(document)
        document = result if replace else document
        encoded = json.dumps(document, separators=(",", ":")).encode()
        assert len(encoded) <= 4096, "the test manifest must fit before the state table"
        data[4096:8192] = encoded + bytes(4096 - len(encoded))
        struct.pack_into("<QI", data, 32, len(encoded), zlib.crc32(encoded))
        return data

    return mutate


def tensor(index: int, **fields: object) -> Mutation:
    return manifest(lambda doc: doc["tensors"][index].update(fields))


def set_state_of_tensor_1(value: int) -> Mutation:
    return put("<I", 8192 + 32, value)


CASES: dict[str, tuple[Mutation, type[Exception], str]] = {
    "empty file": (lambda d: b"", SegmentLayoutError, "shorter than its 4096-byte header"),
    "cut inside the header": (lambda d: d[:100], SegmentLayoutError, "shorter than its 4096-byte header"),
    "cut inside the data": (lambda d: d[:16384], SegmentLayoutError, "the file is 16384"),
    "longer than declared": (lambda d: d + bytes(4096), SegmentLayoutError, "the file is 24576"),
    "bad magic": (lambda d: b"GGUF" + d[4:], SegmentLayoutError, "not a modelload segment"),
    "future layout version": (put("<I", 8, 6), SegmentVersionError, "version 6 is not known"),
    "zero layout version": (put("<I", 8, 0), SegmentVersionError, "install the modelload loader"),
    "wrong header length": (put("<I", 12, 8192), SegmentLayoutError, "header length 8192"),
    "wrong alignment": (put("<I", 44, 512), SegmentLayoutError, "alignment 512"),
    "manifest elsewhere": (put("<Q", 24, 8192), SegmentLayoutError, "manifest offset"),
    "manifest of 2^40 bytes": (put("<Q", 32, 1 << 40), SegmentLayoutError, "manifest length"),
    "2^60 tensors": (put("<Q", 56, 1 << 60), SegmentLayoutError, "tensor count"),
    "state table inside the manifest": (put("<Q", 48, 4096), SegmentLayoutError, "inside the manifest"),
    "unaligned state table": (put("<Q", 48, 8200), SegmentLayoutError, "state table offset"),
    "data inside the state table": (put("<Q", 64, 8192), SegmentLayoutError, "inside the state table"),
    "data region past the end": (put("<Q", 72, 1 << 20), SegmentLayoutError, "past the end"),
    "reserved header bytes set": (put("<B", 100, 1), SegmentLayoutError, "reserved header bytes"),
    "reserved tail set": (put("<B", 4000, 1), SegmentLayoutError, "reserved header bytes"),
    "unknown writer state": (put("<I", 128, 9), SegmentLayoutError, "unknown writer state 9"),
    "error longer than its area": (put("<I", 160, 5000), SegmentLayoutError, "error length 5000"),
    "never published": (put("<I", 128, 0), SegmentLayoutError, "never published"),
    "manifest bit flip": (
        lambda d: d[:4100] + bytes([d[4100] ^ 1]) + d[4101:],
        SegmentLayoutError,
        "checksum",
    ),
    "manifest not JSON": (lambda d: _raw_manifest(d, b"{not json"), SegmentLayoutError, "not UTF-8 JSON"),
    "manifest not UTF-8": (lambda d: _raw_manifest(d, b'{"tensors":"\xff"}'), SegmentLayoutError, "UTF-8"),
    "manifest extra member": (manifest(lambda doc: doc.update(extra=1)), SegmentLayoutError, "exactly"),
    "manifest is a list": (manifest(lambda doc: [doc], replace=True), SegmentLayoutError, "exactly"),
    "metadata not strings": (
        manifest(lambda doc: doc["metadata"].update(n=1)),
        SegmentLayoutError,
        "strings",
    ),
    "fewer tensors than the header": (
        manifest(lambda doc: doc["tensors"].pop()),
        SegmentLayoutError,
        "lists 1 tensors, the header says 2",
    ),
    "tensor missing nbytes": (
        manifest(lambda doc: doc["tensors"][0].pop("nbytes")),
        SegmentLayoutError,
        "must have",
    ),
    "tensor unknown member": (tensor(0, device="cuda"), SegmentLayoutError, "must have"),
    "unknown dtype": (tensor(0, dtype="float7"), SegmentLayoutError, "unknown dtype 'float7'"),
    "name not a string": (tensor(0, name=7), SegmentLayoutError, "must be strings"),
    "negative dimension": (tensor(0, shape=[-2, -3], nbytes=12), SegmentLayoutError, "shape"),
    "boolean dimension": (tensor(1, shape=[True, True], nbytes=4), SegmentLayoutError, "shape"),
    "65 dimensions": (tensor(1, shape=[1] * 65, nbytes=4), SegmentLayoutError, "at most 64"),
    "lying nbytes": (tensor(0, nbytes=4096), SegmentLayoutError, "does not match bfloat16"),
    "no element, dimensions past 63 bits": (
        tensor(0, shape=[1 << 40, 1 << 40, 0], nbytes=0),
        SegmentLayoutError,
        "holds no element, but its other dimensions span more than",
    ),
    "unaligned offset": (tensor(0, offset=12289), SegmentLayoutError, "not a multiple of 4096"),
    "offset before the data": (tensor(0, offset=8192), SegmentLayoutError, "outside the data region"),
    "offset past the end": (tensor(1, offset=20480), SegmentLayoutError, "outside the data region"),
    "overlapping slots": (tensor(1, offset=12288), SegmentLayoutError, "overlap"),
    "duplicate names": (tensor(1, name="embed.weight"), SegmentLayoutError, "appears twice"),
    "bad sha256": (tensor(0, sha256="XYZ"), SegmentLayoutError, "sha256"),
    "manifest nested beyond reason": (
        lambda d: _raw_manifest(d, b"[" * 2000 + b"]" * 2000),
        SegmentLayoutError,
        "nests JSON deeper",
    ),
    "a name with a lone surrogate": (tensor(1, name="bi\ud800s"), SegmentLayoutError, "unpaired UTF-16"),
    "metadata with a lone surrogate": (
        manifest(lambda doc: doc["metadata"].update({"k\udc00": "v"})),
        SegmentLayoutError,
        "unpaired UTF-16",
    ),
    "a dimension of 2**64": (tensor(1, shape=[2**64, 0], nbytes=0), SegmentLayoutError, "2\\*\\*63"),
    "an offset of 2**70": (tensor(1, offset=2**70), SegmentLayoutError, "2\\*\\*63"),
}


def _raw_manifest(data: bytearray, raw: bytes) -> bytearray:
    data[4096:8192] = raw + bytes(4096 - len(raw))
    struct.pack_into("<QI", data, 32, len(raw), zlib.crc32(raw))
    return data


def version(number: int) -> Mutation:
    return put("<I", 8, number)


def both(*mutations: Mutation) -> Mutation:
    def mutate(data: bytearray) -> bytes | bytearray:
        for change in mutations:
            data = bytearray(change(data))
        return data

    return mutate


# Layout 2 (several weight files): a valid two-file segment, each case breaking one of its rules.
SHARDED_CASES: dict[str, tuple[Mutation, type[Exception], str]] = {
    "files in a layout-1 segment": (version(1), SegmentLayoutError, "exactly"),
    "file member in a layout-1 segment": (
        both(version(1), manifest(lambda doc: doc.pop("files"))),
        SegmentLayoutError,
        "must have",
    ),
    "file index past the files": (tensor(1, file=2), SegmentLayoutError, "file must index"),
    "file index negative": (tensor(0, file=-1), SegmentLayoutError, "file must index"),
    "file index not an integer": (tensor(0, file="0"), SegmentLayoutError, "file must index"),
    "a tensor without its file": (
        manifest(lambda doc: doc["tensors"][0].pop("file")),
        SegmentLayoutError,
        "file must index",
    ),
    "files not strings": (manifest(lambda doc: doc.update(files=[1, 2])), SegmentLayoutError, "files must"),
    "the same file twice": (
        manifest(lambda doc: doc.update(files=["a", "a"])),
        SegmentLayoutError,
        "distinct",
    ),
    "files not a list": (manifest(lambda doc: doc.update(files="a")), SegmentLayoutError, "files must"),
}


@pytest.fixture
def sharded(shm_dir: Path) -> bytes:
    path = shm_dir / "sharded.seg"
    write_complete(path, sharded_layout())
    data = path.read_bytes()
    path.unlink()
    return data


@pytest.mark.parametrize("case", list(SHARDED_CASES))
def test_a_hostile_layout_2_segment_is_refused(case: str, sharded: bytes, shm_dir: Path) -> None:
    mutate, error, message = SHARDED_CASES[case]
    path = shm_dir / "hostile.seg"
    path.write_bytes(bytes(mutate(bytearray(sharded))))
    with pytest.raises(error, match=message):
        SegmentReader.open(path)


def test_the_unmutated_layout_2_segment_opens_with_its_files(sharded: bytes, shm_dir: Path) -> None:
    path = shm_dir / "sharded.seg"
    path.write_bytes(sharded)
    with SegmentReader.open(path) as reader:
        assert reader.header.layout_version == 2
        assert reader.files == ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")
        assert [s.file for s in reader.slots] == [0, 1]


@pytest.fixture
def valid(shm_dir: Path) -> bytes:
    path = shm_dir / "valid.seg"
    write_complete(path, small_layout())
    data = path.read_bytes()
    path.unlink()
    return data


@pytest.mark.parametrize("case", list(CASES))
def test_a_hostile_segment_is_refused_with_a_clear_error(case: str, valid: bytes, shm_dir: Path) -> None:
    mutate, error, message = CASES[case]
    path = shm_dir / "hostile.seg"
    path.write_bytes(bytes(mutate(bytearray(valid))))
    with pytest.raises(error, match=message):
        SegmentReader.open(path)


def test_the_unmutated_segment_opens(valid: bytes, shm_dir: Path) -> None:
    path = shm_dir / "valid.seg"
    path.write_bytes(valid)
    with SegmentReader.open(path) as reader:
        reader.wait(timeout=0)
        assert len(reader.slots) == 2


def test_an_unknown_tensor_state_is_an_error_not_a_ready_tensor(valid: bytes, shm_dir: Path) -> None:
    path = shm_dir / "hostile.seg"
    data = bytearray(valid)
    struct.pack_into("<I", data, 128, 1)  # back to LOADING, so the reader must consult the table
    path.write_bytes(bytes(set_state_of_tensor_1(7)(data)))
    with SegmentReader.open(path) as reader:
        with pytest.raises(SegmentLayoutError, match="unknown state 7"):
            reader.state(1)
        with pytest.raises(SegmentLayoutError, match="unknown state 7"):
            reader.wait(timeout=1)


def test_a_released_tensor_in_a_segment_that_never_releases_is_a_layout_error(
    valid: bytes, shm_dir: Path
) -> None:
    """Memory mode full never gives pages back: RELEASED there is corruption, not advice to switch to full."""
    path = shm_dir / "hostile.seg"
    data = bytearray(valid)
    struct.pack_into("<I", data, 128, 1)  # back to LOADING, so the reader must consult the table
    path.write_bytes(bytes(set_state_of_tensor_1(3)(data)))
    refusal = pytest.raises(SegmentLayoutError, match="RELEASED, a state a segment of memory mode full never")
    with SegmentReader.open(path) as reader, refusal:
        reader.wait(timeout=1)


def test_an_integer_past_pythons_digit_limit_is_a_layout_error(shm_dir: Path) -> None:
    """json.loads raises a bare ValueError for an integer of more than 4,300 digits: it must not escape."""
    from modelload.loader.dtypes import by_name
    from modelload.loader.segment import TensorSpec, plan_layout

    roomy = plan_layout(  # metadata padding gives the manifest room for a 4,400-digit number
        [TensorSpec("w", by_name("float32"), (2,))], metadata={"pad": "x" * 6000}
    )
    path = shm_dir / "digits.seg"
    write_complete(path, roomy)
    data = bytearray(path.read_bytes())
    length = struct.unpack_from("<Q", data, 32)[0]
    text = bytes(data[4096 : 4096 + length]).decode()
    hostile = text.replace('"shape":[2]', '"shape":[' + "9" * 4400 + "]").replace("x" * 4500, "").encode()
    assert len(hostile) <= length
    path.write_bytes(bytes(_raw_manifest_at(data, hostile, room=length)))
    with pytest.raises(SegmentLayoutError, match="thousands of digits"):
        SegmentReader.open(path)


def _raw_manifest_at(data: bytearray, raw: bytes, *, room: int) -> bytearray:
    data[4096 : 4096 + room] = raw + bytes(room - len(raw))
    struct.pack_into("<QI", data, 32, len(raw), zlib.crc32(raw))
    return data
