"""``oci://REGISTRY/REPOSITORY[:TAG][@sha256:DIGEST][/FILE]``: an artifact in an OCI registry, parsed.

The grammar is the distribution spec's: a registry host (with its port), a repository of lower-case path
components, then a tag, a digest or both (the digest wins: a tag can move, a digest cannot). Without either,
the tag is ``latest``, as ``docker pull`` and ``oras pull`` take it. A path after a digest names one file of
the artifact: the URIs a listing gives its files.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from urllib.parse import quote, unquote

from modelload.loader.errors import SourceUriError

from .._responses import redact_uri
from .._settings import RegistrySettings

__all__ = ["DIGEST", "OciRef", "parse_oci_uri"]

_HOST = re.compile(
    r"^(?:[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?(?:\.[A-Za-z0-9-]+)*|\[[0-9A-Fa-f:.]+\])(?::\d{1,5})?$"
)
_COMPONENT = re.compile(r"^[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*$")
_TAG = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._-]{0,127}$")
DIGEST = re.compile(r"^sha256:[0-9a-f]{64}$")


@dataclass(frozen=True)
class OciRef:
    """One artifact (and maybe one file of it) in one repository of one registry."""

    registry: str
    """The host as written, with its port (``localhost:5000``)."""
    repository: str
    tag: str | None = None
    digest: str | None = None
    path: str = ""

    @property
    def reference(self) -> str:
        """What the manifest is fetched by: the digest when known, else the tag."""
        return self.digest or self.tag or "latest"

    def pinned(self, digest: str) -> OciRef:
        """This artifact named by its manifest's digest (the tag kept for messages)."""
        return OciRef(self.registry, self.repository, self.tag, digest, self.path)

    def file(self, path: str) -> OciRef:
        return OciRef(self.registry, self.repository, self.tag, self.digest, path)

    @property
    def uri(self) -> str:
        text = f"oci://{self.registry}/{self.repository}"
        if self.digest:
            text += f"@{self.digest}"
        elif self.tag:
            text += f":{self.tag}"
        return text + (f"/{quote(self.path, safe='/')}" if self.path else "")

    @property
    def display(self) -> str:
        """The artifact as the user named it: by tag when there is one, else by digest."""
        text = f"oci://{self.registry}/{self.repository}"
        text += f":{self.tag}" if self.tag else f"@{self.digest}"
        return text + (f"/{self.path}" if self.path else "")

    def base_url(self, settings: RegistrySettings) -> str:
        scheme = "http" if settings.uses_plain_http(self.registry) else "https"
        return f"{scheme}://{self.registry}"


def parse_oci_uri(uri: str) -> OciRef:
    """Parse an ``oci://`` URI (see the module docstring); a SourceUriError says what is wrong."""
    rest = uri[len("oci://") :] if uri.lower().startswith("oci://") else uri
    shown = redact_uri(uri)  # what messages show: no password or query
    if "?" in rest or "#" in rest:
        raise SourceUriError(f"an oci:// URI takes no query or fragment: {shown!r}")
    registry, slash, rest = rest.partition("/")
    if (
        not slash
        or not _HOST.match(registry)
        or ("." not in registry and ":" not in registry and (registry != "localhost"))
    ):
        raise SourceUriError(
            f"an oci:// source is oci://REGISTRY/REPOSITORY:TAG or @sha256:DIGEST, with the registry's host "
            f"first (oci://ghcr.io/org/model:v1, oci://localhost:5000/model:v1), got {shown!r}"
        )
    path = ""
    digest = None
    if "@" in rest:
        name, _, after = rest.partition("@")
        digest, _, path = after.partition("/")
        if not DIGEST.match(digest):
            raise SourceUriError(f"{shown!r}: a digest is sha256: and 64 lower-case hex digits")
    else:
        name = rest
    tag = None
    last = name.rsplit("/", 1)[-1]
    if ":" in last:
        name, _, tag = name.rpartition(":")
        if not _TAG.match(tag):
            raise SourceUriError(f"{shown!r}: {tag!r} is not a tag (letters, digits, '_', '.' and '-')")
    if not name or not all(_COMPONENT.match(part) for part in name.split("/")):
        raise SourceUriError(
            f"{shown!r}: a repository is lower-case letters and digits, separated by '/', '.', '_' or '-'"
        )
    path = unquote(path)
    if path and any(segment in ("", ".", "..") for segment in path.rstrip("/").split("/")):
        raise SourceUriError(
            f"{shown!r}: a file path inside the artifact cannot hold empty, '.' or '..' parts"
        )
    if digest is None and tag is None:
        tag = "latest"
    return OciRef(registry.lower(), name, tag, digest, path)
