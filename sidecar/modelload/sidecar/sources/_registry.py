"""Open a source from its URI: a registry of stores keyed by URI scheme.

Built in: ``file://`` and plain paths, ``http://``, ``https://``, ``s3://``, ``gs://``, ``az://`` (and
``gcs://``, ``abfs[s]://``, ``wasb[s]://``, refused with the URI they mean), ``hf://`` (the Hugging Face
Hub, :mod:`.hub`), ``oci://`` (OCI registries, :mod:`.oci`). A new origin registers a
:class:`~._store.Store`, which opens its files and lists its directories::

    register_store(GcsStore())          # serves every scheme in GcsStore.schemes

A plain factory of single-file sources still registers with :func:`register_source` (the tests' in-memory
source registers ``memory://`` that way).
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable

from modelload.loader.errors import ConfigError, SourceUriError

from ._azure import AzureStore, OtherAzureSchemes
from ._base import Source
from ._gcs import GcsSpelling, GcsStore
from ._responses import display_url, redact_uri
from ._settings import SourceSettings
from ._store import Store
from ._stores import FactoryStore, FileStore, HttpStore, S3Store
from .hub import HubStore
from .oci import OciStore

__all__ = [
    "SourceFactory",
    "check_source_uri",
    "open_source",
    "prepare_source",
    "register_source",
    "register_store",
    "registered_schemes",
    "store_for",
]

SourceFactory = Callable[[str, SourceSettings], Source]

_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")
_lock = threading.Lock()
_FILES = FileStore()
_stores: dict[str, Store] = {}


def register_store(store: Store) -> None:
    """Make :func:`open_source` and the directory listing hand URIs of ``store.schemes`` to ``store``.

    A later registration of the same scheme replaces the earlier one.
    """
    for scheme in store.schemes:
        if not re.fullmatch(r"[a-z][a-z0-9+.-]*", scheme):
            raise ConfigError(f"not a URI scheme: {scheme!r}")
    with _lock:
        _stores.update(dict.fromkeys(store.schemes, store))


def register_source(scheme: str, factory: SourceFactory) -> None:
    """Serve ``scheme`` (lower case, without ``://``) with a factory of single files, not listable."""
    register_store(FactoryStore(scheme, factory))


for _store in (
    _FILES,
    HttpStore(),
    S3Store(),
    GcsStore(),
    GcsSpelling(),
    AzureStore(),
    OtherAzureSchemes(),
    HubStore(),
    OciStore(),
):
    register_store(_store)


def registered_schemes() -> tuple[str, ...]:
    """The schemes :func:`open_source` accepts, sorted."""
    with _lock:
        return tuple(sorted(scheme for scheme, store in _stores.items() if store.listed))


def open_source(uri: str, settings: SourceSettings | None = None) -> Source:
    """Open the object at ``uri``. No network I/O happens here; the first :meth:`Source.stat` or read does it.

    ``uri`` is ``s3://bucket/key``, ``http(s)://...``, ``file:///path``, a plain path, or any scheme added
    with :func:`register_store`. Raises ConfigError for an unknown scheme or a malformed URI, and
    SourceNotFoundError / SourceAccessDeniedError for a local file that cannot be opened.
    """
    return store_for(uri).open(uri, settings or SourceSettings())


def check_source_uri(uri: str) -> None:
    """Raise ConfigError now if no store serves ``uri``'s scheme, or its store cannot read ``uri``'s shape
    (``gs://b``, ``hf://org``, a Hub web page): settings call it, so a sidecar given such a source exits with
    a configuration error instead of serving a failed load forever. No I/O."""
    store_for(uri).check(uri)


def prepare_source(uri: str) -> None:
    """Import what reading ``uri`` needs now, as the sidecar starts (:meth:`Store.prepare`). No I/O."""
    store_for(uri).prepare(uri)


def store_for(uri: str) -> Store:
    """The store that serves ``uri``: by its scheme, or the local files for a plain path."""
    if any(ord(c) < 32 or ord(c) == 127 for c in uri):
        shown = display_url(uri).encode("unicode_escape").decode("ascii")
        raise SourceUriError(
            f"the source URI '{shown}' holds a control character (a NUL byte, a newline): no object is named"
            " that way; check how the URI was written or templated"
        )
    match = _SCHEME.match(uri)
    if match is None:
        _refuse_a_scheme_short_of_its_slashes(uri)
        return _FILES
    scheme = match.group(1).lower()
    with _lock:
        store = _stores.get(scheme)
    if store is not None and match.group(1) != scheme:
        # Stores parse their own URIs by their lower-case prefix: "S3://b/k" would read as another URI.
        shown = redact_uri(uri)
        meant = f"{scheme}://{shown[match.end() :]}"
        raise SourceUriError(f"{shown!r}: write the URI's scheme in lower case: did you mean {meant}?")
    if store is None:
        known = ", ".join(f"{known}://" for known in registered_schemes())
        raise SourceUriError(
            f"no source for {scheme}:// URIs (supported: {known}, or a local path); check the source URI"
        )
    return store


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
            known = scheme in _stores and scheme != "file"
        if known:
            shown = redact_uri(uri)
            rest = shown[pattern.match(shown).end() :]  # type: ignore[union-attr]
            raise SourceUriError(
                f"{shown!r} is not a {scheme}:// URI ({missing.format(scheme=scheme)}): did you mean"
                f" {scheme}://{rest}?"
            )
