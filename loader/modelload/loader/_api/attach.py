"""``attach()``: the one call inference code makes to reach the model a sidecar is streaming.

This is the loader's edge: the only place it reads its environment (``MODELLOAD_SEGMENT``,
``MODELLOAD_NOTIFY``, ``MODELLOAD_STATUS_URL``, set in the pod by the operator's webhook), once, into a typed
settings object.

Waiting for the segment, it also watches for a load that failed before any segment existed (a missing
object, a refused credential, a missing key, a full volume), so such a failure reaches the app in about a
second instead of after the whole timeout: the writer's failure marker beside the segment
(``modelload.loader.segment.failure``), and, where the pod gives one, the sidecar's ``/status`` (read with
the standard library's urllib, every couple of seconds, with a short timeout; an unreachable sidecar is not
an error: it may still be starting).

Two waits, two defaults: the segment must appear within ``timeout`` (600 s: the sidecar starts, lists and
opens the model; far longer means something is wrong), while tensors are waited for as long as the load
lasts (``tensor_timeout=None``), since a large model on a slow link takes as long as it takes: a failed load
raises at once and a dead sidecar is noticed from its heartbeat, so waiting without a limit cannot hang.
"""

from __future__ import annotations

import json
import logging
import os
import time
import urllib.error
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from modelload.loader._api.model import Model
from modelload.loader._api.notify import connect
from modelload.loader.errors import LoadFailedError, SidecarUnavailableError
from modelload.loader.segment import MemoryMode, SegmentReader
from modelload.loader.segment.consumers import ConsumerTable
from modelload.loader.segment.failure import read_failure
from modelload.loader.wiring import NOTIFY_ENV, SEGMENT_ENV, STATUS_URL_ENV

__all__ = ["DEFAULT_SEGMENT_TIMEOUT", "AttachSettings", "attach"]

log = logging.getLogger(__name__)

DEFAULT_SEGMENT_TIMEOUT = 600.0
"""Seconds ``attach()`` waits for the segment to appear (``timeout``)."""

STATUS_INTERVAL = 2.0
"""Seconds between looks at the sidecar's ``/status`` while the segment has not appeared."""

SAY_WAITING_AFTER = 10.0
"""Seconds without a segment before the wait is logged (a warning, then one a minute): a mistyped segment
name would otherwise wait out the whole timeout in silence."""

STATUS_TIMEOUT = 1.0
"""Seconds one look at ``/status`` may take: the loopback answers in milliseconds or not at all."""


@dataclass(frozen=True)
class AttachSettings:
    """Where the segment is and where its ready notifications come from."""

    segment: Path | None
    """The segment file (``MODELLOAD_SEGMENT``); the pod's default is ``/run/modelload/model.seg``."""
    notify: str | None
    """The pyzmq endpoint of the sidecar's notifications (``MODELLOAD_NOTIFY``); None: the segment's own."""
    status_url: str | None = None
    """The sidecar's status API (``MODELLOAD_STATUS_URL``), consulted while no segment exists."""

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> AttachSettings:
        env = os.environ if environ is None else environ
        segment = env.get(SEGMENT_ENV)
        status_url = (env.get(STATUS_URL_ENV) or "").strip()
        return cls(
            segment=Path(segment) if segment else None,
            notify=env.get(NOTIFY_ENV) or None,
            status_url=status_url if status_url.startswith(("http://", "https://")) else None,
        )


def attach(
    path: str | os.PathLike[str] | None = None,
    *,
    timeout: float | None = DEFAULT_SEGMENT_TIMEOUT,
    tensor_timeout: float | None = None,
    notify: str | bool = True,
    register: bool = True,
) -> Model:
    """Attach to a model segment and return a :class:`Model` over it, tensors usable as they arrive.

    ``path`` defaults to ``MODELLOAD_SEGMENT``. ``timeout`` is how long to wait for the segment to appear (a
    sidecar that is still starting); default 600 s; None waits without limit. ``tensor_timeout`` is the
    model's default wait for tensors afterwards (each accessor also takes its own ``timeout``); default
    None: as long as the load lasts, since a failed load raises at once and a dead sidecar is noticed from
    its heartbeat. ``notify`` is a pyzmq endpoint, True to use ``MODELLOAD_NOTIFY`` or the one the sidecar
    recorded in the segment, or False to poll.

    A load that fails before the segment exists raises :class:`~modelload.loader.errors.LoadFailedError`
    with the sidecar's reason, within a couple of seconds, from the failure marker beside the segment or
    the sidecar's ``/status`` (``MODELLOAD_STATUS_URL``).

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
    reader = _open_when_present(target, timeout, status_url=settings.status_url)
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
    return Model(reader, subscriber, timeout=tensor_timeout, registration=registration)


def _open_when_present(path: Path, timeout: float | None, *, status_url: str | None) -> SegmentReader:
    """The segment at ``path`` once it is there and its load has not failed; the failure marker is read
    first (SPEC.md reader rule 6), so a failed load is reported whatever else the volume holds."""
    started = time.monotonic()
    deadline = None if timeout is None else started + timeout
    pause = 0.01
    next_status = started
    next_word = started + SAY_WAITING_AFTER
    while True:
        reason = read_failure(path)
        if reason is not None:
            raise LoadFailedError(reason, path=str(path))
        try:
            reader = SegmentReader.open(path)
        except SidecarUnavailableError:
            _refuse_a_missing_folder(path)
            if status_url is not None and time.monotonic() >= next_status:
                next_status = time.monotonic() + STATUS_INTERVAL
                reason = _failure_from_status(status_url)
                if reason is not None:
                    raise LoadFailedError(reason, path=str(path)) from None
            if time.monotonic() >= next_word:
                next_word = time.monotonic() + 60
                _say_waiting(path, time.monotonic() - started, timeout)
            if deadline is not None and time.monotonic() >= deadline:
                raise SidecarUnavailableError(
                    f"no segment appeared at {path} within {timeout:g} s: is the modelload sidecar running, "
                    "and is its volume mounted in this container?"
                ) from None
        else:
            try:
                reader.check()  # a failed, stopped or abandoned load fails the attach itself
            except BaseException:
                reader.close()
                raise
            return reader
        time.sleep(pause)
        pause = min(pause * 2, 0.2)


def _say_waiting(path: Path, waited: float, timeout: float | None) -> None:
    limit = "without a limit" if timeout is None else f"up to {timeout:g} s"
    log.warning(
        "modelload: no segment at %s yet after %.0f s, still waiting (%s): is the modelload sidecar running "
        "with this segment path, and is its volume mounted in this container?",
        path,
        waited,
        limit,
    )


def _refuse_a_missing_folder(path: Path) -> None:
    """A segment in a folder that does not exist never appears (no sidecar creates the folder: it refuses to
    start in a missing one), so say so now rather than after the whole timeout."""
    if not path.parent.is_dir():
        raise SidecarUnavailableError(
            f"the segment's folder {path.parent} does not exist, so no sidecar can write {path.name} there: "
            f"check the path (attach(path), {SEGMENT_ENV}) and that the modelload volume is mounted in this "
            "container at that path"
        ) from None


def _failure_from_status(url: str) -> str | None:
    """The sidecar's reason when its ``/status`` says the load failed; None otherwise or when unreachable."""
    try:
        with urllib.request.urlopen(url.rstrip("/") + "/status", timeout=STATUS_TIMEOUT) as answer:  # noqa: S310
            status = json.loads(answer.read(1 << 20))
    except (OSError, ValueError, urllib.error.URLError):
        return None  # still starting, or not a sidecar: the segment wait decides
    if not isinstance(status, dict) or status.get("phase") != "failed":
        return None
    error = status.get("error")
    return str(error) if error else "the sidecar reports a failed load"
