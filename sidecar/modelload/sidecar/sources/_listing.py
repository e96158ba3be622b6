"""A model directory at a source: whether a URI names one, and what files it has.

Each store decides for its own scheme (:mod:`._stores`, :class:`~._store.Store`); this module asks the right
one. Which of the files are weights is decided by :func:`modelload.loader.formats.select_model_files`.
"""

from __future__ import annotations

from collections.abc import Sequence

from ._registry import store_for
from ._settings import SourceSettings
from ._store import Directory

__all__ = ["Directory", "is_directory", "list_directory"]


def is_directory(uri: str) -> bool:
    """Whether ``uri`` names a model directory rather than one file (the store of its scheme decides)."""
    return store_for(uri).is_directory(uri)


def list_directory(uri: str, settings: SourceSettings, *, files: Sequence[str] = ()) -> Directory:
    """List the model directory at ``uri``; ``files`` names its files instead (required for HTTP(S)
    directories that do not follow the Hugging Face names)."""
    return store_for(uri).list(uri, settings, files=files)
