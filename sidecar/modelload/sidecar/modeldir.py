"""The model directory: a directory model's small files (config, tokenizer), beside the segment.

Engines take a model *path*: transformers and vLLM read ``config.json`` and the tokenizer from it. The
sidecar copies every small file of the source directory there (never a weight file: the weights are in the
segment) before it publishes the segment, whose metadata names the directory, so an app that attaches
finds both.

The directory is replaced whole: the files land in a temporary directory beside it, which is renamed into
place, so a reader never sees a mix of two loads' files. Files are world-readable (0644): they are the
model's configuration, and the app's container may run as another user.
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from modelload.loader.errors import ConfigError, SegmentError, SegmentSpaceError
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
    """Fetch ``model``'s small files into ``target`` (replacing what is there); return its absolute path."""
    assert model.directory is not None
    directory = model.directory
    target = target.absolute()
    if target.exists() and not target.is_dir():
        raise ConfigError(
            f"the model directory {target} exists and is not a directory: remove it or choose another"
        )
    staging = target.with_name(f".{target.name}.new-{os.getpid()}")
    retired = target.with_name(f".{target.name}.old-{os.getpid()}")
    try:
        for stale in (staging, retired):
            shutil.rmtree(stale, ignore_errors=True)
        staging.mkdir(mode=0o755, parents=True)
        staging.chmod(0o755)

        def fetch(name: str) -> None:
            data = fetch_small_file(directory, name, settings, on_retry=on_retry)
            path = staging / name
            with path.open("wb") as file:
                file.write(data)
            path.chmod(0o644)

        with ThreadPoolExecutor(
            max_workers=min(8, max(len(model.small), 1)), thread_name_prefix="files"
        ) as pool:
            list(pool.map(fetch, sorted(model.small)))
        if target.exists():
            target.rename(retired)
        staging.rename(target)
    except OSError as exc:
        raise _translate(exc, target) from exc
    finally:
        shutil.rmtree(staging, ignore_errors=True)
        shutil.rmtree(retired, ignore_errors=True)
    log.info("model directory %s: %d files, %d bytes", target, len(model.small), model.small_bytes)
    return target


def _translate(exc: OSError, target: Path) -> SegmentError:
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return SegmentSpaceError(
            exc.errno,
            f"no room for the model's small files in {target.parent}: {exc.strerror} (size the volume for "
            "the weights and the small files)",
        )
    return SegmentError(f"cannot write the model directory {target}: {exc.strerror or exc}")
