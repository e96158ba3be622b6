"""The segment layout pinned by bytes (SPEC.md, "Golden vector").

The expected bytes below were checked field by field against SPEC.md's header table; a change to them is a
change of the layout, which needs a new layout_version.
"""

from __future__ import annotations

import struct
from pathlib import Path

from modelload.loader.segment import SegmentWriter
from tests.segment.helpers import small_layout

LOAD_ID = 0x0123456789ABCDEF
CREATED_NS = 1_700_000_000_000_000_000

GOLDEN_HEADER = bytes.fromhex(
    "4d4f44454c5345470100000000100000"  # magic MODELSEG, layout 1, header_length 4096
    "00500000000000000010000000000000"  # segment_length 20480, manifest_offset 4096
    "cd00000000000000fceca52b00100000"  # manifest_length 205, manifest_crc32, alignment 4096
    "00200000000000000200000000000000"  # state_offset 8192, tensor_count 2
    "00300000000000000020000000000000"  # data_offset 12288, data_length 8192
    "efcdab89674523010000 2a36fe9c9717".replace(" ", "")  # load_id, created_ns
    + "00" * 32  # reserved
)

GOLDEN_MANIFEST = (
    b'{"tensors":[{"name":"embed.weight","dtype":"bfloat16","shape":[2,3],"offset":12288,"nbytes":12},'
    b'{"name":"bias","dtype":"float32","shape":[2],"offset":16384,"nbytes":8}],'
    b'"metadata":{"format":"safetensors"}}'
)


def test_the_header_manifest_and_state_table_match_the_golden_bytes(shm_dir: Path) -> None:
    path = shm_dir / "golden.seg"
    with SegmentWriter.create(
        path, small_layout(), load_id=LOAD_ID, created_ns=CREATED_NS, heartbeat=False
    ) as w:
        w.slot(0)[:] = bytes.fromhex("803f" * 6)
        w.mark_ready(0, verified=True, crc32=0x01020304)
        data = path.read_bytes()

    assert len(data) == 20480
    assert data[:128] == GOLDEN_HEADER
    writer_state, _pid, tensors_ready, bytes_ready, finished_ns, error_length, reserved = struct.unpack_from(
        "<IIQQQII", data, 128
    )
    assert (writer_state, tensors_ready, bytes_ready, finished_ns, error_length, reserved) == (
        1,
        1,
        12,
        0,
        0,
        0,
    )
    assert data[176:4096] == bytes(4096 - 176), "error area and reserved tail are zero"
    assert data[4096 : 4096 + 205] == GOLDEN_MANIFEST
    assert data[4096 + 205 : 8192] == bytes(8192 - 4096 - 205), "manifest padding is zero"

    state0, flags0, ready_ns0, crc0 = struct.unpack_from("<IIQI", data, 8192)
    assert (state0, flags0, crc0) == (1, 0b101, 0x01020304)
    assert ready_ns0 > CREATED_NS
    assert data[8192 + 20 : 8192 + 32] == bytes(12)
    assert data[8192 + 32 : 8192 + 64] == bytes(32), "tensor 1 is PENDING with an empty entry"
    assert data[12288 : 12288 + 12] == bytes.fromhex("803f" * 6)
    assert data[12288 + 12 : 20480] == bytes(20480 - 12288 - 12)


GOLDEN_MANIFEST_V2 = (
    b'{"tensors":[{"name":"embed.weight","dtype":"bfloat16","shape":[2,3],"offset":12288,"nbytes":12,"file":0},'
    b'{"name":"bias","dtype":"float32","shape":[2],"offset":16384,"nbytes":8,"file":1}],'
    b'"metadata":{"format":"safetensors"},'
    b'"files":["model-00001-of-00002.safetensors","model-00002-of-00002.safetensors"]}'
)


def test_a_segment_of_several_files_is_layout_2_with_each_tensor_s_file(shm_dir: Path) -> None:
    from tests.segment.helpers import sharded_layout

    path = shm_dir / "golden2.seg"
    with SegmentWriter.create(
        path, sharded_layout(), load_id=LOAD_ID, created_ns=CREATED_NS, heartbeat=False
    ):
        data = path.read_bytes()
    assert struct.unpack_from("<I", data, 8)[0] == 2, "layout version 2"
    assert data[16:32] == GOLDEN_HEADER[16:32], "same geometry as the one-file golden segment"
    length = struct.unpack_from("<Q", data, 32)[0]
    assert data[4096 : 4096 + length] == GOLDEN_MANIFEST_V2
