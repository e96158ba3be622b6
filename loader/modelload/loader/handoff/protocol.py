"""The keeper's wire protocol: length-prefixed JSON messages over a Unix stream socket, file descriptors
beside them (``SCM_RIGHTS``).

docs/handoff.md gives the whole protocol for people; this module is its one implementation, used by both
ends. A message is a 4-byte big-endian length and that many bytes of UTF-8 JSON, an object with an ``op``.
File descriptors travel with the first byte of a message (one ``sendmsg``), at most
:data:`MAX_FDS_PER_MESSAGE` per message, so any number of blocks fits in a sequence of ``fds`` messages.

Everything a message carries is checked here before the caller uses it: sizes are bounded before anything
is allocated, a manifest's tensors must lie inside their blocks without overlapping, and their byte counts
must match dtype and shape. A keeper of another release, or a broken one, gives a
:class:`~modelload.loader.errors.HandoffProtocolError` naming the rule, never a mapping read out of bounds.
Descriptors received with a message that turns out to be bad are closed, never leaked.

Standard library only (and the loader's dtype table): the CPU tests drive it with ordinary descriptors.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import math
import os
import socket
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from modelload.loader.dtypes import DType, by_name
from modelload.loader.errors import HandoffProtocolError, UnsupportedDtypeError

__all__ = [
    "MAX_FDS_PER_MESSAGE",
    "MAX_MESSAGE",
    "VERSIONS",
    "Manifest",
    "Received",
    "TensorPlace",
    "choose_version",
    "error",
    "expect",
    "fd_batches",
    "receive",
    "send",
]

VERSIONS = (1,)
"""Protocol versions this build speaks, oldest first. A keeper answers in the newest one both ends know."""

MAX_MESSAGE = 256 << 20
"""The largest message either end accepts: a manifest of 100,000 tensors is about 15 MB."""

MAX_FDS_PER_MESSAGE = 64
"""Descriptors per message (the kernel's own limit, SCM_MAX_FD, is 253)."""

_HEADER = struct.Struct(">I")
_NAME_LIMIT = 4096


@dataclass(frozen=True)
class Received:
    """One message and the descriptors that came with it (the receiver owns and must close them)."""

    message: dict[str, Any]
    fds: list[int] = field(default_factory=list)

    @property
    def op(self) -> str:
        return str(self.message["op"])

    def close_fds(self) -> None:
        for fd in self.fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        self.fds.clear()


def send(sock: socket.socket, message: Mapping[str, Any], fds: Sequence[int] = ()) -> None:
    """Send one message, with ``fds`` attached to its first byte."""
    if len(fds) > MAX_FDS_PER_MESSAGE:
        raise HandoffProtocolError(f"{len(fds)} descriptors in one message; at most {MAX_FDS_PER_MESSAGE}")
    body = json.dumps(message, separators=(",", ":")).encode()
    if len(body) > MAX_MESSAGE:
        raise HandoffProtocolError(
            f"a {message.get('op')} message of {len(body)} bytes; at most {MAX_MESSAGE}"
        )
    frame = _HEADER.pack(len(body)) + body
    sent = socket.send_fds(sock, [frame], list(fds)) if fds else 0
    if sent < len(frame):
        sock.sendall(memoryview(frame)[sent:])


def receive(sock: socket.socket, *, max_fds: int = MAX_FDS_PER_MESSAGE) -> Received | None:
    """The next message, or None when the other end closed the connection between messages.

    A connection closed inside a message, an oversized or unparseable message, or more descriptors than
    ``max_fds`` raise :class:`HandoffProtocolError` (descriptors that came with it are closed first).
    """
    data, fds, flags, _ = socket.recv_fds(sock, _HEADER.size, max_fds)
    received = Received({}, list(fds))
    try:
        if not data:
            if received.fds:
                raise HandoffProtocolError("descriptors arrived without a message")
            return None
        if flags & socket.MSG_CTRUNC:
            raise HandoffProtocolError(f"more descriptors than the {max_fds} this message may carry")
        header = data + _read_exact(sock, _HEADER.size - len(data))
        (length,) = _HEADER.unpack(header)
        if length > MAX_MESSAGE:
            raise HandoffProtocolError(f"a message of {length} bytes announced; at most {MAX_MESSAGE}")
        body = _read_exact(sock, length)
        try:
            message = json.loads(body)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise HandoffProtocolError(f"a message that is not JSON: {exc}") from None
        if not isinstance(message, dict) or not isinstance(message.get("op"), str):
            raise HandoffProtocolError("a message that is not an object with a string 'op'")
    except BaseException:
        received.close_fds()
        raise
    return Received(message, received.fds)


def _read_exact(sock: socket.socket, count: int) -> bytes:
    buffer = bytearray(count)
    view = memoryview(buffer)
    done = 0
    while done < count:
        got = sock.recv_into(view[done:])
        if not got:
            raise HandoffProtocolError(f"the connection closed inside a message ({done} of {count} bytes)")
        done += got
    return bytes(buffer)


def choose_version(offered: Any) -> int | None:
    """The newest version in both ``offered`` (a client's list) and :data:`VERSIONS`; None if none."""
    if not isinstance(offered, list):
        return None
    common = {v for v in offered if isinstance(v, int) and not isinstance(v, bool)} & set(VERSIONS)
    return max(common) if common else None


def error(code: str, message: str, **extra: Any) -> dict[str, Any]:
    """An ``error`` message: ``code`` says what the receiver does next (docs/handoff.md lists them)."""
    return {"op": "error", "code": code, "message": message, **extra}


def expect(received: Received | None, *ops: str) -> Received:
    """``received`` if its op is one of ``ops``; otherwise the protocol was broken (descriptors closed)."""
    if received is None:
        raise HandoffProtocolError(f"the connection closed where a {' or '.join(ops)} message was due")
    if received.op not in ops:
        received.close_fds()
        raise HandoffProtocolError(f"a {received.op!r} message where a {' or '.join(ops)} message was due")
    return received


# --- the manifest ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TensorPlace:
    """Where one tensor lies in the keeper's device memory: a block and a byte offset in it."""

    name: str
    dtype: DType
    shape: tuple[int, ...]
    block: int
    offset: int
    nbytes: int


@dataclass(frozen=True)
class Manifest:
    """What a keeper lends: its device, its blocks (one descriptor each), and every tensor's place."""

    device: Mapping[str, Any]
    """``uuid`` (the GPU's, as ``nvidia-smi -L`` prints it) and ``name``: the app maps on the GPU with that
    UUID, whatever its ordinal in the app's container."""
    blocks: tuple[int, ...]
    """Each block's size in bytes, in the order their descriptors follow."""
    tensors: tuple[TensorPlace, ...]
    metadata: Mapping[str, str] = field(default_factory=dict)
    """The segment's metadata as the keeper read it (source, its version, format): the load's identity."""

    def message(self, version: int) -> dict[str, Any]:
        return {
            "op": "manifest",
            "version": version,
            "device": dict(self.device),
            "blocks": list(self.blocks),
            "tensors": [
                [t.name, t.dtype.name, list(t.shape), t.block, t.offset, t.nbytes] for t in self.tensors
            ],
            "metadata": dict(self.metadata),
        }

    @classmethod
    def parse(cls, message: Mapping[str, Any]) -> Manifest:
        """Check every rule of a ``manifest`` message (docs/handoff.md) and return it."""
        device = message.get("device")
        if not isinstance(device, dict) or not isinstance(device.get("uuid"), str):
            raise HandoffProtocolError("the manifest names no device uuid")
        blocks = message.get("blocks")
        if not isinstance(blocks, list) or not all(_count(b) and b > 0 for b in blocks):
            raise HandoffProtocolError("the manifest's blocks are not a list of positive sizes")
        metadata = message.get("metadata", {})
        if not isinstance(metadata, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()
        ):
            raise HandoffProtocolError("the manifest's metadata is not an object of strings")
        entries = message.get("tensors")
        if not isinstance(entries, list):
            raise HandoffProtocolError("the manifest's tensors are not a list")
        tensors = tuple(_tensor(entry, blocks) for entry in entries)
        _check_names_and_overlaps(tensors)
        return cls(device=dict(device), blocks=tuple(blocks), tensors=tensors, metadata=dict(metadata))


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _tensor(entry: Any, blocks: Sequence[int]) -> TensorPlace:
    if not (isinstance(entry, list) and len(entry) == 6):
        raise HandoffProtocolError(
            f"a manifest entry is not [name, dtype, shape, block, offset, nbytes]: {entry!r:.200}"
        )
    name, dtype_name, shape, block, offset, nbytes = entry
    if not isinstance(name, str) or not name or len(name) > _NAME_LIMIT:
        raise HandoffProtocolError(f"a manifest entry has no usable name: {name!r:.200}")
    if not isinstance(dtype_name, str):
        raise HandoffProtocolError(f"{name!r}: the dtype is not a string")
    try:
        dtype = by_name(dtype_name)
    except UnsupportedDtypeError:
        raise HandoffProtocolError(f"{name!r}: dtype {dtype_name!r} is unknown to this loader") from None
    if not isinstance(shape, list) or not all(_count(d) for d in shape):
        raise HandoffProtocolError(f"{name!r}: the shape is not a list of sizes")
    if not (_count(block) and _count(offset) and _count(nbytes)):
        raise HandoffProtocolError(f"{name!r}: block, offset and nbytes must be non-negative integers")
    if nbytes != dtype.nbytes(shape):
        raise HandoffProtocolError(
            f"{name!r}: {nbytes} bytes, but {dtype.name} of shape {tuple(shape)} takes {dtype.nbytes(shape)}"
        )
    if block >= len(blocks):
        raise HandoffProtocolError(f"{name!r}: block {block} of {len(blocks)}")
    if offset + nbytes > blocks[block]:
        raise HandoffProtocolError(
            f"{name!r}: bytes {offset}..{offset + nbytes} lie outside block {block} ({blocks[block]} bytes)"
        )
    return TensorPlace(name, dtype, tuple(shape), block, offset, nbytes)


def _check_names_and_overlaps(tensors: Sequence[TensorPlace]) -> None:
    names = set()
    for tensor in tensors:
        if tensor.name in names:
            raise HandoffProtocolError(f"the manifest names {tensor.name!r} twice")
        names.add(tensor.name)
    spans = sorted((t.block, t.offset, t.offset + t.nbytes, t.name) for t in tensors if t.nbytes)
    for (block, _, end, first), (next_block, start, _, second) in itertools.pairwise(spans):
        if block == next_block and start < end:
            raise HandoffProtocolError(f"{first!r} and {second!r} overlap in block {block}")


def fd_batches(count: int) -> int:
    """How many ``fds`` messages carry ``count`` descriptors."""
    return math.ceil(count / MAX_FDS_PER_MESSAGE)
