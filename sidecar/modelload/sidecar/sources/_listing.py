"""A model directory at a source: whether a URI names one, and what files it has.

Each store decides for its own scheme (:mod:`._stores`, :class:`~._store.Store`); this module asks the right
one. Which of the files are weights is decided by :func:`modelload.loader.formats.select_model_files`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from modelload.loader.errors import ModelloadError

from ._registry import store_for
from ._responses import display_url
from ._settings import RetryPolicy, SourceSettings
from ._store import Directory

__all__ = ["Directory", "directory_hint", "is_directory", "list_directory"]


def is_directory(uri: str) -> bool:
    """Whether ``uri`` names a model directory rather than one file (the store of its scheme decides)."""
    return store_for(uri).is_directory(uri)


def list_directory(uri: str, settings: SourceSettings, *, files: Sequence[str] = ()) -> Directory:
    """List the model directory at ``uri``; ``files`` names its files instead (required for HTTP(S)
    directories that do not follow the Hugging Face names)."""
    return store_for(uri).list(uri, settings, files=files)


_ONE_TRY = RetryPolicy(attempts=1, initial_backoff=0.0, max_backoff=0.0, deadline=10.0)
"""A hint's look is not retried: a failed load waits for no courtesy."""


def directory_hint(uri: str, settings: SourceSettings) -> str | None:
    """What to say when ``uri``, read as one file, does not exist but names a model directory: the store
    of its scheme lists ``uri/`` (an S3 prefix, an HTTP(S) base whose usual files answer) and finds files.
    None when it does not look like one, or the look fails: the hint is a courtesy, the not-found error
    stands."""
    if uri.endswith("/") or "?" in uri or "://" not in uri or uri.startswith("file:"):
        return None
    base = uri + "/"
    quick = dataclasses.replace(settings, retry=_ONE_TRY)
    try:
        names = sorted(list_directory(base, quick).sizes)
    except ModelloadError:
        return None
    if not names:
        return None
    shown = ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")
    where = display_url(base)
    return f"but {where} is a directory holding {shown}: end the source with '/' to load the model in it"
