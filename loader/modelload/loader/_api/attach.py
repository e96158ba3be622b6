"""``attach()``: the one call inference code makes to reach the model a sidecar is streaming.

This is the loader's edge: the only place it reads its environment (``MODELLOAD_SEGMENT``,
``MODELLOAD_NOTIFY``, set in the pod by the operator's webhook), once, into a typed settings object.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from modelload.loader._api.model import Model
from modelload.loader._api.notify import connect
from modelload.loader.errors import SidecarUnavailableError
from modelload.loader.segment import MemoryMode, SegmentReader
from modelload.loader.segment.consumers import ConsumerTable

__all__ = ["AttachSettings", "attach"]

SEGMENT_ENV = "MODELLOAD_SEGMENT"
NOTIFY_ENV = "MODELLOAD_NOTIFY"


@dataclass(frozen=True)
class AttachSettings:
    """Where the segment is and where its ready notifications come from."""

    segment: Path | None
    """The segment file (``MODELLOAD_SEGMENT``); the pod's default is ``/run/modelload/model.seg``."""
    notify: str | None
    """The pyzmq endpoint of the sidecar's notifications (``MODELLOAD_NOTIFY``); None: the segment's own."""

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> AttachSettings:
        env = os.environ if environ is None else environ
        segment = env.get(SEGMENT_ENV)
        return cls(segment=Path(segment) if segment else None, notify=env.get(NOTIFY_ENV) or None)


def attach(
    path: str | os.PathLike[str] | None = None,
    *,
    timeout: float | None = 600.0,
    notify: str | bool = True,
    register: bool = True,
) -> Model:
    """Attach to a model segment and return a :class:`Model` over it, tensors usable as they arrive.

    ``path`` defaults to ``MODELLOAD_SEGMENT``. ``timeout`` is how long to wait for the segment to appear
    (a sidecar that is still starting) and the default wait for tensors afterwards; None waits as long as the
    sidecar lives (a dead sidecar is noticed from its heartbeat). ``notify`` is a pyzmq endpoint, True to use
    ``MODELLOAD_NOTIFY`` or the one the sidecar recorded in the segment, or False to poll.

    When the sidecar runs in memory mode release or ring, ``register`` (the default) makes this process a
    consumer: the sidecar gives a tensor's pages back only once every registered consumer has consumed it
    (:meth:`Model.consumed`). Pass False for a process that only looks (a monitor): it holds nothing back.

    >>> from modelload.loader import attach
    >>> model = attach()                                          # doctest: +SKIP
    >>> weights = model.state_dict(device="cuda:0")               # doctest: +SKIP
    """
    settings = AttachSettings.from_env()
    target = Path(path) if path is not None else settings.segment
    if target is None:
        raise SidecarUnavailableError(
            f"no segment path given and {SEGMENT_ENV} is not set: pass attach(path) or run in a pod the "
            "modelload operator injected (label modelload.dev/model)"
        )
    reader = _open_when_present(target, timeout)
    endpoint: str | None = None
    if isinstance(notify, str):
        endpoint = notify
    elif notify:
        endpoint = settings.notify or reader.metadata.get("notify")
    registration = None
    if register and reader.memory_mode != MemoryMode.FULL:
        try:
            table = ConsumerTable.open(
                reader.path, load_id=reader.load_id, tensor_count=len(reader.slots), write=True
            )
            registration = table.register()
        except BaseException:
            reader.close()
            raise
    subscriber = connect(endpoint) if endpoint else None
    return Model(reader, subscriber, timeout=timeout, registration=registration)


def _open_when_present(path: Path, timeout: float | None) -> SegmentReader:
    deadline = None if timeout is None else time.monotonic() + timeout
    pause = 0.01
    while True:
        try:
            return SegmentReader.open(path)
        except SidecarUnavailableError:
            if deadline is not None and time.monotonic() >= deadline:
                raise SidecarUnavailableError(
                    f"no segment appeared at {path} within {timeout:g} s: is the modelload sidecar running, "
                    "and is its volume mounted in this container?"
                ) from None
        time.sleep(pause)
        pause = min(pause * 2, 0.2)
