"""Which load this is, and whether the segment an earlier load left at the path is it.

The engine asks two things of an earlier segment (set aside by
:func:`~modelload.loader.segment.previous.set_aside` as the load starts, so no app attaches it meanwhile):
is it COMPLETE, and does it record this very load (:class:`~modelload.loader.segment.identity.LoadIdentity`:
the same source, every weight file at the same version and size, the same format setting, memory mode,
ring and slots, and a fingerprint of the same key)? Then it is put back and the load is over without reading
the model again (a restarted sidecar). Anything else is removed before the new load creates its own segment.
"""

from __future__ import annotations

import logging
from typing import Any

from modelload.loader.segment.identity import FileVersion, LoadIdentity
from modelload.loader.segment.previous import Previous
from modelload.sidecar.load.settings import LoadSettings
from modelload.sidecar.progress import LoadObserver
from modelload.sidecar.sources import OpenedModel, file_version

__all__ = ["load_identity", "reuse"]

log = logging.getLogger(__name__)


def load_identity(model: OpenedModel, settings: LoadSettings, key: Any) -> LoadIdentity:
    """The identity of loading ``model`` with ``settings`` and ``key`` (a DecryptionKey or None)."""
    names = model.weights or ("",)
    listed = model.directory.files if model.directory is not None else {}
    files = tuple(
        FileVersion(
            name=name,
            size=info.size,
            # the look-up's own version, else the one the listing saw (a Hub commit, a registry digest)
            version=file_version(info) or (listed[name].version if name in listed else None),
        )
        for name, info in zip(names, model.infos, strict=True)
    )
    memory = settings.memory
    return LoadIdentity(
        source=model.uri,
        files=files,
        format=settings.format,
        memory_mode=memory.mode,
        ring_size=memory.ring_size if memory.mode == "ring" else 0,
        slots=settings.slots if memory.mode == "full" else "paged",  # (other modes never pack)
        key=key.fingerprint() if key is not None else None,
    )


def reuse(previous: Previous | None, identity: LoadIdentity, key: Any, observer: LoadObserver) -> bool:
    """Put ``previous`` back and report it loaded when it is this load, complete; else remove it. True when
    it was reused."""
    if previous is None:
        return False
    recorded = previous.identity
    if not (previous.complete and recorded is not None and identity.same_load(recorded, key=key)):
        why = "it is not complete" if not previous.complete else "it holds another load"
        log.info("not reusing the segment an earlier load left at %s: %s", previous.segment, why)
        previous.discard()
        return False
    from modelload.loader.segment import SegmentReader

    with SegmentReader.open(previous.path) as old:
        slots = old.slots
        metadata = old.metadata
    previous.restore()
    nbytes = sum(slot.nbytes for slot in slots)
    observer.manifest_published(
        model_format=metadata.get("format", "unknown"),
        tensors=len(slots),
        nbytes=nbytes,
        notify=metadata.get("notify"),
    )
    sizes = [slot.nbytes for slot in slots]
    observer.bytes_loaded(sum(sizes))  # one event for the whole segment, not one per tensor
    observer.tensors_published(
        indices=[slot.index for slot in slots], names=[slot.name for slot in slots], nbytes=sizes
    )
    observer.load_finished(seconds=0.0, nbytes=nbytes)
    return True
