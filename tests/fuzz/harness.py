"""The pieces of the fuzz harness: seed files, mutations, the three reader targets and the guard.

A *seed* is a small valid file made by the project's own writers at run time (so the corpus follows the
formats as they change, and no binary blob is checked in). A *mutation* is a short list of edits drawn by
hypothesis: byte flips, integers written at offsets, truncations, insertions, and, for the JSON parts (the
safetensors header, the segment manifest), structural edits that swap a value for a hostile one and then
re-seal the lengths and the checksum, so the edit reaches the rules behind them instead of stopping at the
first length or CRC check. Hypothesis shrinks a failing list to the fewest edits.

A *target* reads a file as completely as a consumer would (index, every tensor header, every tensor's
bytes through a bounded window, states and views of a segment). The *guard* holds each run to the
invariant: it may end normally or with a :class:`~modelload.loader.errors.ModelloadError`; anything else,
a peak of traced allocations above :data:`MEMORY_LIMIT`, or a run longer than :data:`TIME_LIMIT` fails.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import struct
import time
import tracemalloc
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from hypothesis import strategies as st

from modelload.loader.dtypes import by_name
from modelload.loader.errors import LoadTimeoutError, ModelloadError
from modelload.loader.formats import safetensors as safetensors_format
from modelload.loader.formats.tensorizer import (
    DecryptionKey,
    EncryptionParams,
    TensorizerReader,
    TensorizerWriter,
)
from modelload.loader.segment import SegmentReader, SegmentWriter, TensorSpec, plan_layout

MEMORY_LIMIT = 32 << 20
"""Bytes of traced allocations one run may peak at. Every seed is under 64 KiB, so a run that allocates
more than this believed a size the file claims instead of one it has."""

TIME_LIMIT = 5.0
"""Seconds one run may take before it counts as a hang (seeds read in milliseconds)."""

WINDOW = 64 << 10
"""The window tensor bytes are read through: a tensor's declared size must never become an allocation."""

KEY = bytes(range(32))
_SEGMENT_MANIFEST_AT = 4096


class InvariantBroken(AssertionError):
    """A run broke the invariant: a non-project error, too much memory, or too much time."""


class _Hang(BaseException):
    """Raised from the alarm handler; a BaseException so no ``except Exception`` in the code swallows it."""


# --- the guard -------------------------------------------------------------------------------------------


@contextlib.contextmanager
def guarded(label: str, *, time_limit: float = TIME_LIMIT) -> Iterator[None]:
    """Run the body under the invariant: only project errors, bounded memory, no hang.

    The alarm restores whatever timer was set before (pytest-timeout's), so both keep working.
    """
    previous_handler = signal.signal(signal.SIGALRM, _alarm)
    previous_timer = signal.setitimer(signal.ITIMER_REAL, time_limit)
    started = time.monotonic()
    owns_tracing = not tracemalloc.is_tracing()
    if owns_tracing:
        tracemalloc.start()
    tracemalloc.reset_peak()
    try:
        yield
    except ModelloadError:
        pass
    except _Hang:
        raise InvariantBroken(f"{label}: still running after {time_limit} s") from None
    except Exception as exc:
        message = str(exc)[:300]
        raise InvariantBroken(f"{label}: {type(exc).__name__} escaped the error tree: {message}") from exc
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous_handler)
        if previous_timer[0]:
            left = max(previous_timer[0] - (time.monotonic() - started), 0.001)
            signal.setitimer(signal.ITIMER_REAL, left, previous_timer[1])
        _, peak = tracemalloc.get_traced_memory()
        if owns_tracing:
            tracemalloc.stop()
    if peak > MEMORY_LIMIT:
        raise InvariantBroken(f"{label}: allocations peaked at {peak / 2**20:.1f} MiB")


def _alarm(signum: int, frame: object) -> None:
    raise _Hang


# --- seeds -----------------------------------------------------------------------------------------------


def _tensors() -> dict[str, Any]:
    rng = np.random.default_rng(7)
    return {
        "embed.weight": rng.standard_normal((8, 4)).astype(np.float16),
        "layers.0.w": rng.standard_normal((4, 4)).astype(np.float32),
        "layers.0.b": np.arange(4, dtype=np.int64),
        "scale": np.array(0.5, dtype=np.float64),
        "empty": np.zeros((0, 3), dtype=np.uint8),
    }


def tensorizer_seed(directory: Path, *, encrypted: bool) -> bytes:
    path = directory / ("enc.tensors" if encrypted else "plain.tensors")
    params = EncryptionParams.from_key(KEY, chunk_size=1024) if encrypted else None
    with TensorizerWriter(path, encryption=params, metadata_size=0) as writer:
        writer.write_state_dict(
            {
                "layers": [{"w": np.arange(300, dtype=np.float32)}],
                "bias": np.ones(3),
                "head": np.arange(12, dtype=np.int16).reshape(3, 4),
            }
        )
    data = path.read_bytes()
    path.unlink()
    return data


def safetensors_seed() -> bytes:
    return safetensors_format.serialize(_tensors(), metadata={"format": "np", "note": "fuzz seed"})


def segment_seed(directory: Path, *, packed: bool = False) -> bytes:
    """A complete segment of the seed tensors: slots on pages, or ``packed`` (layout version 5)."""
    tensors = _tensors()
    layout = plan_layout(
        [TensorSpec(name, by_name(str(a.dtype)), a.shape) for name, a in tensors.items()],
        metadata={"format": "safetensors"},
        packed=packed,
    )
    path = directory / "seed.seg"
    with SegmentWriter.create(path, layout, heartbeat=False) as writer:
        for slot, array in zip(layout.slots, tensors.values(), strict=True):
            writer.slot(slot.index)[:] = array.tobytes()
            writer.mark_ready(slot.index, crc32=zlib.crc32(array.tobytes()) if slot.index % 2 else None)
        writer.mark_complete()
    data = path.read_bytes()
    path.unlink()
    return data


# --- mutations -------------------------------------------------------------------------------------------

_INTERESTING = (0, 1, 7, 63, 64, 65, 255, 4096, 2**16 - 1, 2**31, 2**32 - 1, 2**32, 2**62, 2**63, 2**64 - 1)
_WIDTHS = {"<B": 1, "<H": 2, "<I": 4, "<Q": 8}
_HOSTILE_JSON = (
    "9" * 4400,  # past Python's integer parsing limit
    "[" * 5000 + "]" * 5000,  # past the recursion limit
    '"\\ud800"',  # a lone surrogate
    '"\\udfff\\ud800"',
    "[" + ",".join(["1"] * 65) + "]",  # a shape of 65 dimensions
    "[" + ",".join([str(2**63)] * 8) + "]",
    "-1",
    "1e400",
    "NaN",
    "null",
    "true",
    "{}",
    '""',
    str(2**64),
    str(2**63 - 1),
)


@dataclass(frozen=True)
class Edit:
    """One edit of a file's bytes; ``at`` is a fraction of the length, so it fits any seed."""

    kind: str
    at: float
    value: int = 0
    fmt: str = "<B"
    data: bytes = b""

    def apply(self, blob: bytearray) -> bytearray:
        if not blob:
            return blob + self.data if self.kind == "insert" else blob
        pos = min(int(self.at * len(blob)), len(blob) - 1)
        if self.kind == "flip":
            blob[pos] ^= 1 << (self.value % 8)
        elif self.kind == "int":
            width = _WIDTHS[self.fmt]
            if pos + width <= len(blob):
                struct.pack_into(self.fmt, blob, pos, self.value % (1 << (8 * width)))
        elif self.kind == "truncate":
            del blob[pos:]
        elif self.kind == "insert":
            blob[pos:pos] = self.data
        elif self.kind == "delete":
            del blob[pos : pos + 1 + self.value % 64]
        return blob


def edits() -> st.SearchStrategy[Edit]:
    at = st.floats(min_value=0.0, max_value=1.0, allow_nan=False)
    return st.one_of(
        st.builds(Edit, kind=st.just("flip"), at=at, value=st.integers(0, 7)),
        st.builds(
            Edit,
            kind=st.just("int"),
            at=at,
            value=st.one_of(st.sampled_from(_INTERESTING), st.integers(0, 2**64 - 1)),
            fmt=st.sampled_from(sorted(_WIDTHS)),
        ),
        st.builds(Edit, kind=st.just("truncate"), at=at),
        st.builds(Edit, kind=st.just("insert"), at=at, data=st.binary(min_size=1, max_size=16)),
        st.builds(Edit, kind=st.just("delete"), at=at, value=st.integers(0, 63)),
    )


@dataclass(frozen=True)
class JsonEdit:
    """Replace the ``pick``-th JSON value of a document (in a walk of it) with hostile text."""

    pick: int
    text: str

    def __repr__(self) -> str:
        text = self.text if len(self.text) <= 40 else f"{self.text[:20]}...({len(self.text)} chars)"
        return f"JsonEdit(pick={self.pick}, text={text!r})"

    def apply(self, document: Any) -> str:
        marker = "\x00MARK\x00"
        values = list(_walk(document))
        if values:
            container, key = values[self.pick % len(values)]
            container[key] = marker
        return json.dumps(document, separators=(",", ":")).replace(json.dumps(marker), self.text, 1)


def json_edits() -> st.SearchStrategy[JsonEdit]:
    return st.builds(JsonEdit, pick=st.integers(0, 10_000), text=st.sampled_from(_HOSTILE_JSON))


def _walk(node: Any) -> Iterator[tuple[Any, Any]]:
    items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
    for key, value in list(items):
        yield node, key
        yield from _walk(value)


def mutate(seed: bytes, byte_edits: list[Edit]) -> bytes:
    blob = bytearray(seed)
    for edit in byte_edits:
        blob = edit.apply(blob)
    return bytes(blob)


def reseal_safetensors(seed: bytes, edit: JsonEdit) -> bytes:
    """The seed with one header value replaced, its 8-byte length made to match the new header."""
    size = int.from_bytes(seed[:8], "little")
    header = edit.apply(json.loads(seed[8 : 8 + size])).encode("utf-8")
    return struct.pack("<Q", len(header)) + header + seed[8 + size :]


def reseal_segment(seed: bytes, edit: JsonEdit) -> bytes:
    """The seed with one manifest value replaced, length and CRC resealed when the result still fits."""
    length = struct.unpack_from("<Q", seed, 32)[0]
    room = struct.unpack_from("<Q", seed, 48)[0] - _SEGMENT_MANIFEST_AT
    document = json.loads(seed[_SEGMENT_MANIFEST_AT : _SEGMENT_MANIFEST_AT + length])
    manifest = edit.apply(document).encode("utf-8")[:room]
    blob = bytearray(seed)
    blob[_SEGMENT_MANIFEST_AT : _SEGMENT_MANIFEST_AT + room] = manifest + bytes(room - len(manifest))
    struct.pack_into("<QI", blob, 32, len(manifest), zlib.crc32(manifest))
    return bytes(blob)


# --- targets ---------------------------------------------------------------------------------------------


def read_tensorizer(blob: bytes, *, key: bytes | None = None) -> None:
    """Everything ``stage`` and ``inspect --verify`` do with a tensorizer file, through a bounded window."""
    scratch = bytearray(WINDOW)
    secret = DecryptionKey.from_bytes(key) if key is not None else None
    with TensorizerReader(io.BytesIO(blob), key=secret) as reader:
        for entry in reader.index.tensors:
            reader.read_header(entry)
            reader.check(entry, scratch=scratch)
            if entry.nbytes <= WINDOW:
                reader.read_numpy(entry)


def read_safetensors(blob: bytes, directory: Path) -> None:
    """Open the file as ``stage`` does (with its size), read every tensor through a window, and small ones
    whole as numpy arrays."""
    path = directory / "fuzz.safetensors"
    path.write_bytes(blob)
    scratch = bytearray(WINDOW)
    with safetensors_format.SafetensorsFile(path) as file:
        for name in file.names():
            for _ in file.chunks(name, scratch):
                pass
            if file.entry(name).nbytes <= WINDOW:
                file.numpy(name)


def read_segment(blob: bytes, directory: Path) -> None:
    """Attach as a loader does: open, read every state, flag and CRC, wait without blocking, hash views."""
    path = directory / "fuzz.seg"
    path.write_bytes(blob)
    with SegmentReader.open(path) as reader:
        _ = (reader.writer_state, reader.error, reader.tensors_ready, reader.bytes_ready, reader.metadata)
        for slot in reader.slots:
            reader.state(slot.index)
            reader.flags(slot.index)
            reader.crc32(slot.index)
            zlib.crc32(reader.view(slot.index))
        reader.ready_mask()
        with contextlib.suppress(LoadTimeoutError):
            reader.wait(timeout=0)


def examples_from_env(default: int) -> int:
    """``MODELLOAD_FUZZ_EXAMPLES`` for long runs by hand; ``default`` (CI's bounded run) otherwise."""
    raw = os.environ.get("MODELLOAD_FUZZ_EXAMPLES", "")
    return int(raw) if raw.strip() else default


Target = Callable[[bytes], None]
