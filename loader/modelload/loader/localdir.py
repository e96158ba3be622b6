"""A local model directory's files, for the sidecar (``file://`` sources) and ``modelload stage`` alike.

A model directory's small files are copied into the app's model directory, and its weights into the
segment: a symbolic link in it that points outside it (``config.json -> /etc/shadow``, or to the sidecar's
own key file) would hand the app a file it was never meant to read. So a link is followed only when its
target stays inside the directory, or inside the ``blobs`` folder of the Hugging Face cache the directory
is a snapshot of (``.../models--org--name/snapshots/<commit>/config.json -> ../../blobs/<sha>``, how
``huggingface_hub`` lays out its cache); any other link refuses the load, naming it.
"""

from __future__ import annotations

import os
from pathlib import Path

from modelload.loader.errors import SourceAccessDeniedError

__all__ = ["check_inside", "list_local_directory"]


def list_local_directory(directory: Path) -> dict[str, int]:
    """The regular files at the top of ``directory`` (links followed when :func:`check_inside` allows them),
    by name, with their sizes. Raises OSError as :func:`os.scandir` does."""
    files: dict[str, int] = {}
    with os.scandir(directory) as entries:
        for entry in entries:
            if entry.is_symlink():
                check_inside(directory, entry.name)
            if entry.is_file():
                files[entry.name] = entry.stat().st_size
    return files


def check_inside(directory: Path, name: str) -> None:
    """SourceAccessDeniedError when ``directory/name`` is a link whose target leaves the directory (and is
    not in the Hugging Face cache's ``blobs`` beside the snapshot the directory is)."""
    path = directory / name
    if not path.is_symlink():
        return
    target = path.resolve()
    root = directory.resolve()
    allowed = [root]
    if root.parent.name == "snapshots":
        allowed.append(root.parent.parent / "blobs")
    if any(target.is_relative_to(place) for place in allowed):
        return
    raise SourceAccessDeniedError(
        f"{path} is a symbolic link to {target}, outside the model directory {directory}: a link out of a"
        " model directory is not followed (it could hand the app any file the loader can read); copy the"
        " file into the directory instead",
        uri=str(path),
    )
