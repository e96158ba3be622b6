"""Odd files at the names the loader opens (the segment, its failure marker, its consumer table): any
container that mounts the volume writable can leave a FIFO, a directory, a device or a link there. Each
ends in a clear loader error naming the path and what is there; none blocks, none shows another file's
bytes.

An open that blocks on a FIFO is released by the test (it opens the FIFO's other end) so a regression
fails the test instead of hanging the run.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from pathlib import Path

import pytest

from modelload.loader import attach
from modelload.loader.cli.main import main
from modelload.loader.errors import LoadFailedError, ModelloadError, SegmentLayoutError
from modelload.loader.segment import MemoryMode, SegmentReader
from modelload.loader.segment.consumers import ConsumerTable, table_path
from modelload.loader.segment.failure import marker_path, read_failure, write_failure
from tests.segment.helpers import uint8_segment

PATIENCE = 20.0
"""How long a call may take before the test takes it for blocked on a FIFO (a deadline, not a timing)."""


def _outcome(call: Callable[[], object], fifo: Path) -> BaseException | object:
    """What ``call`` returns or raises; a call still blocked after :data:`PATIENCE` is released by opening
    ``fifo``'s writing end, and the test fails."""
    result: list[BaseException | object] = []

    def run() -> None:
        try:
            result.append(call())
        except BaseException as exc:  # handed to the test
            result.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(PATIENCE)
    if thread.is_alive():
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        thread.join(PATIENCE)
        pytest.fail(f"blocked opening the FIFO {fifo}")
    return result[0]


# --- the segment -------------------------------------------------------------------------------------------


def test_a_fifo_at_the_segment_is_refused_at_once(shm_dir: Path) -> None:
    segment = shm_dir / "model.seg"
    os.mkfifo(segment)
    error = _outcome(lambda: attach(segment, timeout=2), segment)
    assert isinstance(error, SegmentLayoutError), error
    assert str(segment) in str(error) and "FIFO" in str(error)


@pytest.mark.parametrize(
    ("make", "kind"),
    [
        (lambda p: p.mkdir(), "a directory"),
        (lambda p: p.symlink_to("/dev/zero"), "a character device"),
    ],
    ids=["directory", "link-to-dev-zero"],
)
def test_a_segment_that_is_not_a_regular_file_is_refused(
    make: Callable[[Path], None], kind: str, shm_dir: Path
) -> None:
    segment = shm_dir / "model.seg"
    make(segment)
    with pytest.raises(SegmentLayoutError) as caught:
        SegmentReader.open(segment)
    assert str(caught.value).startswith(f"the segment {segment} is {kind}, not a regular file")


def test_a_segment_that_cannot_be_read_is_a_layout_error(shm_dir: Path) -> None:
    segment = shm_dir / "model.seg"
    segment.symlink_to("/proc/self/mem")  # a regular file whose read at 0 fails (EIO)
    with pytest.raises(SegmentLayoutError, match="cannot be read"):
        SegmentReader.open(segment)


def test_a_segment_through_a_link_still_opens(shm_dir: Path) -> None:
    real = shm_dir / "real.seg"
    uint8_segment(real, [8, 16]).close()
    link = shm_dir / "model.seg"
    link.symlink_to(real)
    with SegmentReader.open(link) as reader:
        assert [s.name for s in reader.slots] == ["t0", "t1"]


def test_inspect_refuses_a_fifo_instead_of_waiting(shm_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    fifo = shm_dir / "model.seg"
    os.mkfifo(fifo)
    status = _outcome(lambda: main(["inspect", "--verify", "--no-progress", str(fifo)]), fifo)
    assert status == 2
    assert f"{fifo} is a FIFO (named pipe), not a regular file" in capsys.readouterr().err


# --- the failure marker ------------------------------------------------------------------------------------


def test_a_fifo_as_the_failure_marker_fails_the_attach_saying_so(shm_dir: Path) -> None:
    segment = shm_dir / "model.seg"
    uint8_segment(segment, [8]).close()
    os.mkfifo(marker_path(segment))
    error = _outcome(lambda: attach(segment, timeout=2), marker_path(segment))
    assert isinstance(error, LoadFailedError), error
    assert f"the failure marker {marker_path(segment)} is a FIFO" in error.reason


@pytest.mark.parametrize("target", ["secret", "/dev/zero"])
def test_a_linked_failure_marker_never_shows_the_linked_file(target: str, shm_dir: Path) -> None:
    segment = shm_dir / "model.seg"
    uint8_segment(segment, [8]).close()
    secret = shm_dir / "secret"
    secret.write_text("root:$6$hash-of-the-password:20228:0:99999:7:::\n")
    marker_path(segment).symlink_to(secret if target == "secret" else target)
    with pytest.raises(LoadFailedError) as caught:
        attach(segment, timeout=2)
    assert "hash-of-the-password" not in str(caught.value) and "\0" not in str(caught.value)
    assert f"the failure marker {marker_path(segment)} is a symbolic link" in caught.value.reason


def test_control_characters_in_a_marker_are_not_shown(shm_dir: Path) -> None:
    segment = shm_dir / "model.seg"
    write_failure(segment, "access denied\x1b[2J\x1b]0;owned\x07\nINFO forged line\u202e\x00 end")
    reason = read_failure(segment)
    assert reason == "access denied [2J ]0;owned INFO forged line end"


def test_an_ordinary_marker_reads_as_written(shm_dir: Path) -> None:
    segment = shm_dir / "model.seg"
    write_failure(segment, "the object s3://bucket/model.safetensors does not exist")
    assert read_failure(segment) == "the object s3://bucket/model.safetensors does not exist"
    assert read_failure(shm_dir / "other.seg") is None


# --- the consumer table ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("make", "kind"),
    [(lambda p: p.mkdir(), "a directory"), (os.mkfifo, "a FIFO (named pipe)")],
    ids=["directory", "fifo"],
)
def test_a_consumer_table_that_is_not_a_regular_file_is_refused(
    make: Callable[[Path], None], kind: str, shm_dir: Path
) -> None:
    segment = shm_dir / "model.seg"
    uint8_segment(segment, [8, 8], mode=MemoryMode.RELEASE).close()
    table_path(segment).unlink()
    make(table_path(segment))
    error = _outcome(lambda: attach(segment, timeout=2), table_path(segment))
    assert isinstance(error, SegmentLayoutError), error
    assert f"the consumer table {table_path(segment)} is {kind}, not a regular file" in str(error)


def test_a_consumer_table_that_cannot_be_read_is_a_layout_error(shm_dir: Path) -> None:
    segment = shm_dir / "model.seg"
    uint8_segment(segment, [8], mode=MemoryMode.RELEASE).close()
    table_path(segment).unlink()
    table_path(segment).symlink_to("/proc/self/mem")
    with pytest.raises(ModelloadError, match="cannot be read"):
        ConsumerTable.open(segment, load_id=0, tensor_count=1, write=False)
