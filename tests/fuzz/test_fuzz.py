"""Fuzzing the three readers of untrusted bytes: tensorizer, safetensors, and the segment.

Each test mutates a valid seed file (made by the project's own writers) with a few edits that hypothesis
draws, reads the result as a consumer would, and holds the run to the invariant of ``harness.guarded``:
only project errors, bounded memory, no hang. CI runs a bounded, derandomized number of cases (a few
seconds in all); ``MODELLOAD_FUZZ_EXAMPLES`` runs as many random ones as you like (README.md here).
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.fuzz import harness

LONG_RUN = bool(os.environ.get("MODELLOAD_FUZZ_EXAMPLES", "").strip())
FUZZ = settings(
    max_examples=harness.examples_from_env(500),
    deadline=None,  # the guard's own alarm catches hangs; a wall-clock deadline is flaky on a busy machine
    derandomize=not LONG_RUN,  # CI sees the same cases every run; long runs explore
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    print_blob=True,
)

with tempfile.TemporaryDirectory(prefix="modelload-fuzz-seeds-") as _made:
    SEEDS = {
        "tensorizer": harness.tensorizer_seed(Path(_made), encrypted=False),
        "tensorizer-encrypted": harness.tensorizer_seed(Path(_made), encrypted=True),
        "safetensors": harness.safetensors_seed(),
        "segment": harness.segment_seed(Path(_made)),
        "segment-packed": harness.segment_seed(Path(_made), packed=True),
    }
byte_edits = st.lists(harness.edits(), min_size=1, max_size=6)


@pytest.fixture(scope="module")
def scratch_dir() -> Iterator[Path]:
    """One folder for the files the targets write (tmpfs when there is one: a run writes one file)."""
    base = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None
    with tempfile.TemporaryDirectory(prefix="modelload-fuzz-", dir=base) as path:
        yield Path(path)


# --- the seeds are valid, so mutations start from files the readers accept whole ---------------------------


def test_every_seed_is_read_whole_by_its_target(scratch_dir: Path) -> None:
    harness.read_tensorizer(SEEDS["tensorizer"])
    harness.read_tensorizer(SEEDS["tensorizer-encrypted"], key=harness.KEY)
    harness.read_safetensors(SEEDS["safetensors"], scratch_dir)
    harness.read_segment(SEEDS["segment"], scratch_dir)
    harness.read_segment(SEEDS["segment-packed"], scratch_dir)


# --- the guard can fail ------------------------------------------------------------------------------------


def test_the_guard_fails_a_foreign_error_a_memory_blowup_and_a_hang() -> None:
    with pytest.raises(harness.InvariantBroken, match="ValueError escaped"), harness.guarded("foreign"):
        np.empty([1] * 65)
    with pytest.raises(harness.InvariantBroken, match="peaked at"), harness.guarded("memory"):
        blob = bytearray(harness.MEMORY_LIMIT + (1 << 20))
        del blob
    with (
        pytest.raises(harness.InvariantBroken, match="still running"),
        harness.guarded("hang", time_limit=0.3),
    ):
        while True:
            pass


# --- the readers -------------------------------------------------------------------------------------------


@FUZZ
@given(edits=byte_edits, encrypted=st.booleans())
def test_tensorizer_reader_holds_the_invariant(edits: list[harness.Edit], encrypted: bool) -> None:
    seed = SEEDS["tensorizer-encrypted" if encrypted else "tensorizer"]
    blob = harness.mutate(seed, edits)
    with harness.guarded(f"tensorizer {edits}"):
        harness.read_tensorizer(blob, key=harness.KEY if encrypted else None)


@FUZZ
@given(edits=st.lists(harness.edits(), max_size=4), json_edit=st.none() | harness.json_edits())
def test_safetensors_reader_holds_the_invariant(
    scratch_dir: Path, edits: list[harness.Edit], json_edit: harness.JsonEdit | None
) -> None:
    seed = SEEDS["safetensors"]
    if json_edit is not None:
        seed = harness.reseal_safetensors(seed, json_edit)
    blob = harness.mutate(seed, edits)
    with harness.guarded(f"safetensors {json_edit} {edits}"):
        harness.read_safetensors(blob, scratch_dir)


@FUZZ
@given(
    edits=st.lists(harness.edits(), max_size=4),
    json_edit=st.none() | harness.json_edits(),
    kind=st.sampled_from(["segment", "segment-packed"]),
)
def test_segment_reader_holds_the_invariant(
    scratch_dir: Path, edits: list[harness.Edit], json_edit: harness.JsonEdit | None, kind: str
) -> None:
    seed = SEEDS[kind]
    if json_edit is not None:
        seed = harness.reseal_segment(seed, json_edit)
    blob = harness.mutate(seed, edits)
    with harness.guarded(f"segment {json_edit} {edits}"):
        harness.read_segment(blob, scratch_dir)
