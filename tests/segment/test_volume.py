"""A full volume is one error of one shape, whoever meets it: its errno kept, its text one sentence."""

from __future__ import annotations

import errno
import os

from modelload.loader.errors import SegmentError, SegmentSpaceError
from modelload.loader.segment.volume import RAISE_THE_LIMITS, full_volume, volume_full


def test_a_full_volume_keeps_its_errno_and_reads_without_an_errno_prefix() -> None:
    error = volume_full("the segment needs 10 bytes and /v has 4 free; raise the volume's sizeLimit")
    assert isinstance(error, SegmentSpaceError) and isinstance(error, SegmentError)
    assert isinstance(error, OSError) and error.errno == errno.ENOSPC
    assert str(error) == "the segment needs 10 bytes and /v has 4 free; raise the volume's sizeLimit"
    assert error.kind == "no_space"


def test_no_space_and_a_spent_quota_are_a_full_volume_and_other_errors_are_left_to_the_caller() -> None:
    for code in (errno.ENOSPC, errno.EDQUOT):
        error = full_volume(OSError(code, os.strerror(code)), "no room for tensor 'w'")
        assert error is not None and error.errno == code
        assert str(error) == f"no room for tensor 'w': {os.strerror(code)}; {RAISE_THE_LIMITS}"
    assert full_volume(OSError(errno.EIO, "I/O error"), "no room for tensor 'w'") is None
    assert full_volume(OSError(errno.ENOMEM, "no memory"), "x") is None, "only where the caller says so"
    error = full_volume(OSError(errno.ENOMEM, "no memory"), "x", codes=frozenset({errno.ENOMEM}), advice="y")
    assert error is not None and str(error) == "x: no memory; y"
