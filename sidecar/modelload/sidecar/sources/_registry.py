"""Open a source from its URI: a registry of factories keyed by URI scheme.

Built in: ``file://`` and plain paths, ``http://``, ``https://``, ``s3://``, and ``memory://`` (objects
published with :func:`put_memory_object`, for tests). A new backend registers one factory::

    register_source("gs", lambda uri, settings: GcsSource(uri, settings))
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable

from modelload.loader.errors import ConfigError

from ._base import Source
from ._file import open_file
from ._http import open_http
from ._memory import open_memory
from ._s3 import open_s3
from ._settings import SourceSettings

__all__ = ["SourceFactory", "open_source", "register_source", "registered_schemes"]

SourceFactory = Callable[[str, SourceSettings], Source]

_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")
_lock = threading.Lock()


_factories: dict[str, SourceFactory] = {
    "file": open_file,
    "http": open_http,
    "https": open_http,
    "s3": open_s3,
    "memory": open_memory,
}


def register_source(scheme: str, factory: SourceFactory) -> None:
    """Make :func:`open_source` hand URIs of ``scheme`` (lower case, without ``://``) to ``factory``.

    A later registration of the same scheme replaces the earlier one.
    """
    if not re.fullmatch(r"[a-z][a-z0-9+.-]*", scheme):
        raise ConfigError(f"not a URI scheme: {scheme!r}")
    with _lock:
        _factories[scheme] = factory


def registered_schemes() -> tuple[str, ...]:
    """The schemes :func:`open_source` accepts, sorted."""
    with _lock:
        return tuple(sorted(_factories))


def open_source(uri: str, settings: SourceSettings | None = None) -> Source:
    """Open the object at ``uri``. No network I/O happens here; the first :meth:`Source.stat` or read does it.

    ``uri`` is ``s3://bucket/key``, ``http(s)://...``, ``file:///path``, a plain path, or any scheme added
    with :func:`register_source`. Raises ConfigError for an unknown scheme or a malformed URI, and
    SourceNotFoundError / SourceAccessDeniedError for a local file that cannot be opened.
    """
    settings = settings or SourceSettings()
    match = _SCHEME.match(uri)
    if match is None:  # a plain path, or file:/path
        return open_file(uri, settings)
    scheme = match.group(1).lower()
    with _lock:
        factory = _factories.get(scheme)
    if factory is None:
        raise ConfigError(
            f"no source for {scheme}:// URIs (known: {', '.join(registered_schemes())}); check the source URI"
        )
    return factory(uri, settings)
