"""The app's side of the hand-off: connect to the keeper, map its GPU memory, get tensors without a copy.

``connect()`` is to the keeper what ``attach()`` is to the segment: it waits for the keeper to appear and
to finish its load (saying why it waits), then maps every block the keeper lends and returns a
:class:`DeviceModel` whose tensors are already on the GPU. Mapping is a few driver calls per block, so an
app process that restarts is serving again as soon as it has imported torch and built its model.
"""

from __future__ import annotations

import contextlib
import errno
import os
import socket
import time
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from modelload.loader._api import modules
from modelload.loader.errors import (
    HandoffError,
    HandoffProtocolError,
    KeeperUnavailableError,
    LoadFailedError,
    LoadTimeoutError,
    ModuleLoadError,
)
from modelload.loader.handoff import protocol
from modelload.loader.handoff.device import CudaMapper, Mapper, close_all, view
from modelload.loader.wiring import KEEPER_ENV, KEEPER_SOCKET

if TYPE_CHECKING:
    import torch

__all__ = ["DEFAULT_TIMEOUT", "SILENCE_TIMEOUT", "DeviceModel", "connect", "status"]

DEFAULT_TIMEOUT = 600.0
"""Seconds ``connect()`` waits for the keeper to appear and finish its load (as ``attach()`` waits)."""

SILENCE_TIMEOUT = 30.0
"""Seconds without a message after which a connected keeper is taken for hung (it reports every second)."""

_RETRYABLE = {errno.ENOENT, errno.ECONNREFUSED, errno.EAGAIN}


def connect(
    path: str | os.PathLike[str] | None = None,
    *,
    timeout: float | None = DEFAULT_TIMEOUT,
    writable: bool = False,
    mapper: Mapper | None = None,
) -> DeviceModel:
    """Map the weights a keeper holds on the GPU; return them as a :class:`DeviceModel`.

    ``path`` is the keeper's socket (default ``MODELLOAD_KEEPER``, else ``/run/modelload/keeper.sock``).
    ``timeout`` bounds the wait for the keeper to appear and load (None: no limit; a keeper that stops
    answering for :data:`SILENCE_TIMEOUT` seconds is an error either way). The weights are mapped
    read-only unless ``writable``: they are the keeper's, and every app after this one maps the same bytes.

    Raises :class:`~modelload.loader.errors.KeeperUnavailableError` when no keeper answers in time,
    :class:`~modelload.loader.errors.LoadFailedError` with the keeper's reason when its load failed,
    :class:`~modelload.loader.errors.DeviceError` when the driver refuses (another GPU, no VMM support).

    >>> from modelload.loader.handoff import connect
    >>> weights = connect()                                   # doctest: +SKIP
    >>> weights.load_into_module(net)                         # doctest: +SKIP
    """
    target = Path(path) if path is not None else Path(os.environ.get(KEEPER_ENV) or KEEPER_SOCKET)
    deadline = None if timeout is None else time.monotonic() + timeout
    sock = _connect(target, deadline, timeout)
    try:
        sock.settimeout(SILENCE_TIMEOUT)
        protocol.send(sock, {"op": "open", "versions": list(protocol.VERSIONS)})
        manifest = _manifest(sock, target, deadline, timeout)
        fds = _descriptors(sock, target, len(manifest.blocks))
        try:
            mapped = (mapper or CudaMapper()).map(manifest.device, fds, manifest.blocks, writable=writable)
        except BaseException as exc:
            with contextlib.suppress(OSError, HandoffError):
                protocol.send(sock, protocol.error("map", str(exc)))
            raise
        finally:
            close_all(fds)
        protocol.send(sock, {"op": "mapped"})
    except TimeoutError:
        sock.close()
        raise KeeperUnavailableError(
            f"the keeper at {target} stopped answering for {SILENCE_TIMEOUT:g} s (it reports every second)"
        ) from None
    except OSError as exc:
        sock.close()
        raise KeeperUnavailableError(f"the connection to the keeper at {target} broke: {exc}") from None
    except BaseException:
        sock.close()
        raise
    return DeviceModel(sock, manifest, mapped.device, [b.bytes() for b in mapped.blocks], mapped.writable)


def _connect(path: Path, deadline: float | None, timeout: float | None) -> socket.socket:
    pause = 0.01
    while True:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.connect(str(path))
            return sock
        except OSError as exc:
            sock.close()
            if exc.errno not in _RETRYABLE:
                raise KeeperUnavailableError(f"cannot connect to the keeper at {path}: {exc}") from None
        if deadline is not None and time.monotonic() >= deadline:
            raise KeeperUnavailableError(
                f"no keeper answered at {path} within {timeout:g} s: is the keeper container running "
                f"(modelload keeper), and is {path.parent} a volume this container mounts?"
            )
        time.sleep(pause)
        pause = min(pause * 2, 0.2)


def _manifest(
    sock: socket.socket, path: Path, deadline: float | None, timeout: float | None
) -> protocol.Manifest:
    while True:
        received = protocol.expect(_next(sock, path, max_fds=0), "loading", "manifest", "error")
        message = received.message
        if received.op == "manifest":
            if message.get("version") not in protocol.VERSIONS:
                raise HandoffProtocolError(
                    f"the keeper answered in protocol version {message.get('version')!r}"
                )
            return protocol.Manifest.parse(message)
        if received.op == "error":
            raise _error(message, path)
        if deadline is not None and time.monotonic() >= deadline:
            raise LoadTimeoutError(
                f"the keeper at {path} is still loading after {timeout:g} s: "
                f"{message.get('tensors_ready')}/{message.get('tensors_total')} tensors on the GPU"
            )


def _next(sock: socket.socket, path: Path, *, max_fds: int) -> protocol.Received:
    """The next message; a keeper that hangs up between messages has stopped (or restarted)."""
    received = protocol.receive(sock, max_fds=max_fds)
    if received is None:
        raise KeeperUnavailableError(f"the keeper at {path} closed the connection: it stopped or restarted")
    return received


def _error(message: Mapping[str, Any], path: Path) -> HandoffError | LoadFailedError:
    code, text = message.get("code"), str(message.get("message", ""))
    if code == "failed":
        return LoadFailedError(text, path=str(path))
    if code in ("busy", "stopping"):
        return KeeperUnavailableError(f"the keeper at {path} refused: {text}")
    if code in ("version", "bad-request"):
        return HandoffProtocolError(f"the keeper at {path} refused the request: {text}")
    return HandoffError(f"the keeper at {path} answered {code!r}: {text}")


def _descriptors(sock: socket.socket, path: Path, count: int) -> list[int]:
    """The ``count`` descriptors of the ``fds`` messages that follow a manifest, in order."""
    fds: list[int] = []
    try:
        while len(fds) < count:
            received = protocol.expect(_next(sock, path, max_fds=protocol.MAX_FDS_PER_MESSAGE), "fds")
            fds.extend(received.fds)
            first, announced = received.message.get("first"), received.message.get("count")
            if first != len(fds) - len(received.fds) or announced != len(received.fds) or not received.fds:
                raise HandoffProtocolError(
                    f"an fds message announced {announced!r} descriptors from {first!r} and carried "
                    f"{len(received.fds)} (expected from {len(fds) - len(received.fds)})"
                )
        if len(fds) != count:
            raise HandoffProtocolError(f"{len(fds)} descriptors for {count} blocks")
    except BaseException:
        close_all(fds)
        raise
    return fds


class DeviceModel:
    """A model whose tensors a keeper holds on the GPU, mapped into this process. Get one from
    :func:`connect`. Tensors are views of the keeper's memory: nothing is copied, and they stay valid for as
    long as they live (even if the keeper stops: the memory is freed once nobody maps it)."""

    def __init__(
        self,
        sock: socket.socket,
        manifest: protocol.Manifest,
        device: Any,
        blocks: list[torch.Tensor],
        writable: bool,
    ) -> None:
        self._sock: socket.socket | None = sock
        self._manifest = manifest
        self._places = {t.name: t for t in manifest.tensors}
        self._blocks = blocks
        self.device = device
        """The torch device holding the weights, in this process's numbering."""
        self.writable = writable
        """Whether the weights are mapped writable (docs/handoff.md: a write is seen by every later app)."""

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(t.name for t in self._manifest.tensors)

    @property
    def metadata(self) -> Mapping[str, str]:
        """The segment's metadata as the keeper read it: ``source``, its version, ``format``."""
        return self._manifest.metadata

    @property
    def gpu(self) -> Mapping[str, str]:
        """The keeper's GPU: ``uuid`` and ``name``."""
        return self._manifest.device

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self._manifest.tensors)

    def __len__(self) -> int:
        return len(self._places)

    def __contains__(self, name: object) -> bool:
        return name in self._places

    def __iter__(self) -> Iterator[str]:
        return iter(self.names)

    def tensor(self, name: str) -> torch.Tensor:
        """Tensor ``name`` on the GPU, a view of the keeper's memory."""
        try:
            place = self._places[name]
        except KeyError:
            raise KeyError(f"no tensor named {name!r} in the keeper's model") from None
        return view(self._blocks, place)

    def state_dict(self, names: Iterable[str] | None = None) -> dict[str, torch.Tensor]:
        """Every tensor (or ``names``) on the GPU, without a copy."""
        return {name: self.tensor(name) for name in (self.names if names is None else names)}

    def load_into_module(
        self,
        module: torch.nn.Module,
        *,
        dtype: torch.dtype | None = None,
        strict: bool = True,
        leftover: modules.Leftover = "raise",
    ) -> Any:
        """Put the keeper's tensors into ``module``'s parameters and buffers by name, as
        :meth:`modelload.loader.Model.load_into_module` does (ties kept, nothing left on ``meta``), without a
        copy. ``dtype`` casts the floating-point tensors, which copies them. Returns torch's
        ``(missing_keys, unexpected_keys)``."""
        import torch

        if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
            raise ModuleLoadError(
                f"dtype={dtype!r}: a cast is to a floating-point torch dtype, such as torch.bfloat16"
            )
        shapes = {t.name: t.shape for t in self._manifest.tensors}
        plan = modules.plan(module, shapes, strict=strict, leftover=leftover)
        modules.check_twins(plan, self.tensor)
        tensors = {name: self.tensor(name) for name in plan.sources}
        if dtype is not None:
            tensors = {n: t.to(dtype) if t.is_floating_point() else t for n, t in tensors.items()}
        return modules.assign(module, plan, tensors, leftover=leftover)

    def close(self) -> None:
        """End the lease with the keeper. Tensors already handed out stay valid while they live."""
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def __enter__(self) -> DeviceModel:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        gpu = self.gpu.get("name")
        return f"<DeviceModel {len(self)} tensors, {self.nbytes} bytes on {self.device} ({gpu})>"


def status(path: str | os.PathLike[str] | None = None, *, timeout: float = 5.0) -> dict[str, Any]:
    """The keeper's state (``state``, progress, ``apps`` holding its weights), for probes and tools."""
    target = Path(path) if path is not None else Path(os.environ.get(KEEPER_ENV) or KEEPER_SOCKET)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout)
    try:
        sock.connect(str(target))
        protocol.send(sock, {"op": "status", "versions": list(protocol.VERSIONS)})
        received = protocol.expect(protocol.receive(sock, max_fds=0), "status", "error")
    except OSError as exc:
        raise KeeperUnavailableError(f"no keeper answers at {target}: {exc}") from None
    finally:
        sock.close()
    if received.op == "error":
        raise _error(received.message, target)
    return received.message
