"""The model directory of a directory model, fetched through the sources layer (see
:mod:`modelload.loader.segment.modeldir` for what it is and how it is replaced)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

from modelload.loader.segment.modeldir import write_model_dir as _write
from modelload.sidecar.sources import OpenedModel, RetryEvent, SourceSettings, fetch_small_file

__all__ = ["write_model_dir"]

log = logging.getLogger(__name__)


def write_model_dir(
    model: OpenedModel,
    target: Path,
    settings: SourceSettings,
    *,
    on_retry: Callable[[RetryEvent], None] | None = None,
) -> Path:
    """Fetch ``model``'s small files into ``target``; return its absolute path."""
    directory = model.directory
    assert directory is not None

    def fetch(name: str) -> bytes:
        if name in model.fetched:  # read already while opening the model (the safetensors index)
            return model.fetched[name]
        return fetch_small_file(directory, name, settings, on_retry=on_retry, opener=model.opener)

    written = _write(target, list(model.small), fetch)
    model.fetched.clear()  # in the model directory now: 8 MiB for the index of 100,000 tensors
    log.info("model directory %s: %d files, %d bytes", written, len(model.small), model.small_bytes)
    return written
