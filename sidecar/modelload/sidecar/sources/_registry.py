"""Open a source from its URI: a registry of factories keyed by URI scheme.

Built in: ``file://`` and plain paths, ``http://``, ``https://``, ``s3://``. Nothing else is registered in
production (the tests' in-memory source registers ``memory://`` from the test support). A new backend
registers one factory::

    register_source("gs", lambda uri, settings: GcsSource(uri, settings))
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable

from modelload.loader.errors import ConfigError, SourceUriError

from ._base import Source
from ._file import open_file
from ._http import open_http
from ._responses import display_url
from ._s3 import open_s3
from ._settings import SourceSettings

__all__ = ["SourceFactory", "check_scheme", "open_source", "register_source", "registered_schemes"]

SourceFactory = Callable[[str, SourceSettings], Source]

_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")
_lock = threading.Lock()


_factories: dict[str, SourceFactory] = {
    "file": open_file,
    "http": open_http,
    "https": open_http,
    "s3": open_s3,
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
    factory = _factory(uri)
    if factory is None:  # a plain path, or file:/path
        return open_file(uri, settings)
    return factory(uri, settings)


def check_scheme(uri: str) -> None:
    """Raise ConfigError now if no source serves ``uri``'s scheme: settings call it, so a sidecar given an
    ``ftp://`` source exits with a configuration error instead of serving a failed load forever."""
    _factory(uri)


def _factory(uri: str) -> SourceFactory | None:
    if any(ord(c) < 32 or ord(c) == 127 for c in uri):
        shown = display_url(uri).encode("unicode_escape").decode("ascii")
        raise SourceUriError(
            f"the source URI '{shown}' holds a control character (a NUL byte, a newline): no object is named"
            " that way; check how the URI was written or templated"
        )
    match = _SCHEME.match(uri)
    if match is None:
        _refuse_a_scheme_short_of_its_slashes(uri)
        return None
    scheme = match.group(1).lower()
    with _lock:
        factory = _factories.get(scheme)
    if factory is None:
        known = ", ".join(f"{known}://" for known in registered_schemes())
        raise SourceUriError(
            f"no source for {scheme}:// URIs (supported: {known}, or a local path); check the source URI"
        )
    return factory


_SLIPS = (
    (re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)//"), "no ':' after '{scheme}'"),
    (re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*):/?(?!/)"), "two slashes after '{scheme}:'"),
)
"""A known scheme short of its colon (``s3//bucket/m``) or of a slash (``s3:/bucket/m``, ``https:host/m``),
and what is missing."""


def _refuse_a_scheme_short_of_its_slashes(uri: str) -> None:
    """``s3:/bucket/m``, ``https:host/m`` or ``s3//bucket/m`` would otherwise be read as a local path and
    fail as a missing file; ``file:/path`` stays a path, as documented."""
    for pattern, missing in _SLIPS:
        slip = pattern.match(uri)
        if slip is None:
            continue
        scheme = slip.group(1).lower()
        with _lock:
            known = scheme in _factories and scheme != "file"
        if known:
            rest = uri[slip.end() :]
            raise SourceUriError(
                f"{uri!r} is not a {scheme}:// URI ({missing.format(scheme=scheme)}): did you mean"
                f" {scheme}://{rest}?"
            )
