"""SPEC.md, "Writers and loads": one writer per segment (the lock file), what a segment says of its load
(the identity), and the segment an earlier load left (set aside, then restored or removed).

Golden vectors pin the bytes of the lock file and of the recorded identity; the hostile cases are files a
shared volume may hold (a link, a directory, garbage) and identities a reader must not take for a load.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from modelload.loader.errors import LoadFailedError, SegmentError
from modelload.loader.formats.tensorizer import DecryptionKey
from modelload.loader.segment import SegmentReader, SegmentWriter, WriterState
from modelload.loader.segment.identity import IDENTITY_KEY, FileVersion, LoadIdentity
from modelload.loader.segment.lock import (
    SegmentBusyError,
    WriterInfo,
    WriterLock,
    holder,
    lock_path,
    writer_gone,
)
from modelload.loader.segment.previous import previous_path, set_aside
from tests.segment.helpers import expected_bytes, small_layout, write_complete

# --- golden vectors ----------------------------------------------------------------------------------------

GOLDEN_LOCK = (
    b'{"host":"pod-a","load_id":"0123456789abcdef","pid":12,"program":"modelload sidecar",'
    b'"started":1700000000.5,"status_url":"http://127.0.0.1:8479"}'
)

IDENTITY = LoadIdentity(
    source="s3://models/llama/",
    files=(
        FileVersion("model-00001-of-00002.safetensors", 4096, '"9b2cf535f27731c974343645a3985328"'),
        FileVersion("model-00002-of-00002.safetensors", 1024, '"6f5902ac237024bdd0c176cb93063dc4-2"'),
    ),
    format="auto",
    memory_mode="ring",
    ring_size=1 << 30,
    key="sha256:" + "ab" * 32,
    slots="paged",
)
GOLDEN_IDENTITY = (
    '{"files":[{"name":"model-00001-of-00002.safetensors","size":4096,'
    '"version":"\\"9b2cf535f27731c974343645a3985328\\""},'
    '{"name":"model-00002-of-00002.safetensors","size":1024,'
    '"version":"\\"6f5902ac237024bdd0c176cb93063dc4-2\\""}],'
    '"format":"auto","key":"sha256:' + "ab" * 32 + '","memory_mode":"ring","ring_size":1073741824,'
    '"slots":"paged","source":"s3://models/llama/"}'
)


def test_the_lock_file_holds_the_writer_as_the_golden_bytes() -> None:
    info = WriterInfo(
        pid=12,
        host="pod-a",
        program="modelload sidecar",
        started=1_700_000_000.5,
        status_url="http://127.0.0.1:8479",
        load_id=0x0123456789ABCDEF,
    )
    assert info.encode() == GOLDEN_LOCK
    assert WriterInfo.decode(GOLDEN_LOCK) == info


def test_a_load_identity_is_recorded_as_the_golden_json() -> None:
    assert IDENTITY.encode() == GOLDEN_IDENTITY
    assert IDENTITY.metadata() == {"load": GOLDEN_IDENTITY}
    assert LoadIdentity.from_metadata({"load": GOLDEN_IDENTITY}) == IDENTITY


# --- one writer --------------------------------------------------------------------------------------------


def test_a_second_writer_is_refused_naming_the_first(shm_dir: Path) -> None:
    segment = shm_dir / "model.seg"
    with WriterLock.acquire(segment, program="modelload sidecar", status_url="http://10.0.0.7:8479"):
        with pytest.raises(SegmentBusyError) as refused:
            WriterLock.acquire(segment, program="modelload stage")
        message = str(refused.value)
        assert f"pid {os.getpid()}" in message and "http://10.0.0.7:8479" in message
        assert "modelload sidecar" in message
        assert refused.value.exit_status == 2
        current = holder(segment)
        assert current is not None and current.pid == os.getpid()
    assert holder(segment) is None
    WriterLock.acquire(segment, program="modelload stage").release()  # free again


def test_a_writer_in_another_process_holds_the_lock_until_it_ends(shm_dir: Path) -> None:
    segment = shm_dir / "model.seg"
    script = (
        "import sys, pathlib\n"
        "from modelload.loader.segment.lock import WriterLock\n"
        "lock = WriterLock.acquire(pathlib.Path(sys.argv[1]), program='other')\n"
        "print('held', flush=True)\n"
        "sys.stdin.read()\n"
    )
    child = subprocess.Popen(
        [sys.executable, "-c", script, str(segment)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "held"
        with pytest.raises(SegmentBusyError, match=f"pid {child.pid}"):
            WriterLock.acquire(segment, program="modelload stage")
    finally:
        child.kill()
        child.wait()
    WriterLock.acquire(segment, program="modelload stage").release()  # a killed writer's lock is free


def test_a_reader_knows_at_once_that_the_writer_of_a_loading_segment_is_gone(shm_dir: Path) -> None:
    segment = shm_dir / "model.seg"
    lock = WriterLock.acquire(segment, program="modelload sidecar")
    writer = SegmentWriter.create(segment, small_layout(), heartbeat=False, lock=lock)
    reader = SegmentReader.open(segment)
    try:
        reader.check()  # the writer holds the lock: alive, whatever the heartbeat says
        assert writer_gone(segment, reader.load_id) is None
        lock.release()  # as when the process dies: the kernel drops its flock
        gone = writer_gone(segment, reader.load_id)
        assert gone is not None and gone.pid == os.getpid()
        reader._next_lock_probe = 0.0
        with pytest.raises(LoadFailedError, match="is gone: it was killed or crashed"):
            reader.check()
        assert writer_gone(segment, reader.load_id + 1) is None, "the lock names another load"
    finally:
        reader.close()
        writer.close()


def test_a_segment_written_without_the_lock_is_left_to_the_heartbeat(shm_dir: Path) -> None:
    segment = shm_dir / "model.seg"
    WriterLock.acquire(segment, program="an earlier writer").release()  # a lock file naming no load
    with (
        SegmentWriter.create(segment, small_layout(), heartbeat=False),
        SegmentReader.open(segment) as reader,
    ):
        reader.check()  # LOADING, lock free, but the lock file does not name this load: not "gone"


@pytest.mark.parametrize(
    "planted",
    ["link", "directory", "fifo"],
)
def test_a_lock_file_that_is_not_a_plain_file_is_refused_and_never_followed(
    shm_dir: Path, tmp_path: Path, planted: str
) -> None:
    segment = shm_dir / "model.seg"
    path = lock_path(segment)
    victim = tmp_path / "victim"
    victim.write_bytes(b"keep me")
    if planted == "link":
        path.symlink_to(victim)
    elif planted == "directory":
        path.mkdir()
    else:
        os.mkfifo(path)
    with pytest.raises(SegmentError, match="lock file"):
        WriterLock.acquire(segment, program="modelload sidecar")
    assert victim.read_bytes() == b"keep me"
    assert writer_gone(segment, 1) is None and holder(segment) is None  # readers just learn nothing


@pytest.mark.parametrize(
    "content",
    [b"", b"not json", b"[1,2]", b'{"pid":"x"}', b'{"pid":1,"host":"h","program":"p","started":1,'
     b'"status_url":null,"load_id":"zz"}', b"\xff" * 5000],
    ids=["empty", "text", "list", "bad-pid", "bad-load-id", "binary"],
)  # fmt: skip
def test_a_garbled_lock_file_tells_readers_nothing(shm_dir: Path, content: bytes) -> None:
    segment = shm_dir / "model.seg"
    lock_path(segment).write_bytes(content)
    assert WriterInfo.decode(content) is None
    assert writer_gone(segment, 1) is None
    WriterLock.acquire(segment, program="modelload stage").release()  # and a writer rewrites it


# --- the identity ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "recorded",
    [
        "not json",
        "[]",
        '{"source":"s3://b/k"}',
        GOLDEN_IDENTITY.replace('"size":4096', '"size":-1'),
        GOLDEN_IDENTITY.replace('"size":4096', '"size":true'),
        GOLDEN_IDENTITY.replace('"ring_size":1073741824', '"ring_size":"1"'),
        GOLDEN_IDENTITY.replace('"files":[', '"files":"ab","x":['),
        GOLDEN_IDENTITY.replace('"key":"sha256', '"key":7,"k":"sha256'),
        GOLDEN_IDENTITY.replace('"slots":"paged"', '"slots":5'),
        "x" * ((1 << 24) + 1),
    ],
    ids=[
        "text",
        "list",
        "partial",
        "negative",
        "bool",
        "string-ring",
        "string-files",
        "number-key",
        "number-slots",
        "huge",
    ],
)
def test_an_identity_a_reader_cannot_read_is_no_identity(recorded: str) -> None:
    assert LoadIdentity.from_metadata({IDENTITY_KEY: recorded}) is None


def test_a_load_is_the_same_load_only_with_every_file_version_setting_and_key_the_same() -> None:
    raw = DecryptionKey.from_bytes(bytes(range(32)))
    recorded = LoadIdentity(IDENTITY.source, IDENTITY.files, "auto", "full", 0, raw.fingerprint())
    assert recorded.same_load(recorded, key=raw)
    assert not recorded.same_load(recorded, key=DecryptionKey.from_bytes(bytes(32))), "another key"
    assert not recorded.same_load(recorded, key=None), "no key now"
    other_version = (IDENTITY.files[0], FileVersion(IDENTITY.files[1].name, 1024, '"new"'))
    for changed in (
        LoadIdentity("s3://models/other/", IDENTITY.files, "auto", "full", 0),
        LoadIdentity(IDENTITY.source, other_version, "auto", "full", 0),
        LoadIdentity(IDENTITY.source, IDENTITY.files, "safetensors", "full", 0),
        LoadIdentity(IDENTITY.source, IDENTITY.files, "auto", "release", 0),
        LoadIdentity(IDENTITY.source, IDENTITY.files, "auto", "full", 0, slots="packed"),
    ):
        assert not changed.same_load(recorded, key=raw)
    unversioned = (IDENTITY.files[0], FileVersion(IDENTITY.files[1].name, 1024, None))
    blind = LoadIdentity(IDENTITY.source, unversioned)
    assert not blind.same_load(blind, key=None), "a file without a version is never taken for another"


def test_an_identity_recorded_before_slots_were_a_setting_reads_as_auto() -> None:
    older = GOLDEN_IDENTITY.replace('"slots":"paged",', "")
    assert older != GOLDEN_IDENTITY
    recorded = LoadIdentity.from_metadata({IDENTITY_KEY: older})
    assert recorded is not None and recorded.slots == "auto"
    assert recorded == dataclasses.replace(IDENTITY, slots="auto")


def test_a_password_fingerprint_is_salted_and_checks_only_that_password() -> None:
    password = DecryptionKey.from_password("correct horse")
    first, second = password.fingerprint(), password.fingerprint()
    assert first != second and first.startswith("argon2id:")
    assert "correct horse" not in first and b"correct horse".hex() not in first
    assert password.matches(first) and password.matches(second)
    assert not DecryptionKey.from_password("wrong horse").matches(first)
    raw = DecryptionKey.from_bytes(bytes(range(32)))
    assert not raw.matches(first) and not password.matches(raw.fingerprint())
    assert bytes(range(32)).hex() not in raw.fingerprint()
    for garbage in ("", "argon2id:zz:00", "argon2id:00:00", "sha256:" + "0" * 64):
        assert not password.matches(garbage)


# --- the previous segment ----------------------------------------------------------------------------------


def test_a_new_load_sets_the_previous_segment_aside_until_it_knows(shm_dir: Path) -> None:
    segment = shm_dir / "model.seg"
    write_complete(segment, small_layout())
    previous = set_aside(segment)
    assert previous is not None and previous.complete
    assert not segment.exists() and previous.path == previous_path(segment)
    previous.restore()
    with SegmentReader.open(segment) as reader:
        assert reader.writer_state == WriterState.COMPLETE
    previous = set_aside(segment)
    assert previous is not None
    previous.discard()
    assert not segment.exists() and not previous_path(segment).exists()
    assert set_aside(segment) is None


def test_a_loading_segment_set_aside_and_discarded_tells_its_readers(shm_dir: Path) -> None:
    segment = shm_dir / "model.seg"
    writer = SegmentWriter.create(segment, small_layout(), heartbeat=False)
    with SegmentReader.open(segment) as reader:
        previous = set_aside(segment)
        assert previous is not None and previous.state == WriterState.LOADING
        previous.discard()
        with pytest.raises(LoadFailedError, match="superseded"):
            reader.check()
    writer.close()


def test_an_older_segment_set_aside_by_a_writer_that_died_gives_way_to_the_newer(shm_dir: Path) -> None:
    segment = shm_dir / "model.seg"
    write_complete(segment, small_layout(), seed=1)
    assert set_aside(segment) is not None  # and the writer died before deciding
    write_complete(segment, small_layout(), seed=2)
    previous = set_aside(segment)
    assert previous is not None
    with SegmentReader.open(previous.path) as reader:
        assert bytes(reader.view(1)) == expected_bytes(2, 1, 8)
    assert sorted(p.name for p in shm_dir.iterdir()) == [".model.seg.previous"]


def test_a_link_planted_at_the_segment_name_is_removed_never_followed(shm_dir: Path, tmp_path: Path) -> None:
    segment = shm_dir / "model.seg"
    victim = tmp_path / "victim.seg"
    write_complete(victim, small_layout())
    segment.symlink_to(victim)
    previous_path(segment).symlink_to(victim)
    assert set_aside(segment) is None
    assert not os.path.lexists(segment) and not os.path.lexists(previous_path(segment))
    assert victim.exists()


def test_a_directory_at_the_set_aside_name_is_refused_with_what_to_do(shm_dir: Path) -> None:
    segment = shm_dir / "model.seg"
    write_complete(segment, small_layout())
    previous_path(segment).mkdir()
    with pytest.raises(SegmentError, match="remove it"):
        set_aside(segment)


def test_a_garbage_file_set_aside_can_only_be_discarded(shm_dir: Path) -> None:
    segment = shm_dir / "model.seg"
    segment.write_bytes(b"MODELSEG" + b"\0" * 100)
    previous = set_aside(segment)
    assert previous is not None and previous.identity is None and not previous.complete
    previous.discard()
    assert not previous.path.exists()


def test_an_old_loader_ignores_the_recorded_identity(shm_dir: Path) -> None:
    """Version rule: the identity is a metadata key, which every reader of layouts 1-4 must ignore."""
    from modelload.loader.dtypes import by_name
    from modelload.loader.segment import TensorSpec, plan_layout

    layout = plan_layout(
        [TensorSpec("w", by_name("uint8"), (3,))], metadata={"format": "safetensors", **IDENTITY.metadata()}
    )
    assert layout.layout_version == 1
    write_complete(shm_dir / "model.seg", layout)
    with SegmentReader.open(shm_dir / "model.seg") as reader:
        assert json.loads(reader.metadata[IDENTITY_KEY])["source"] == "s3://models/llama/"
