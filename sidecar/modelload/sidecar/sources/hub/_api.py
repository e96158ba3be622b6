"""The Hugging Face Hub's HTTP API, the part a loader needs: a revision's commit, a folder's files, a file.

- ``GET /api/models/{repo}/revision/{revision}`` answers the commit (``sha``) a branch or tag points to now;
  the load then names that commit everywhere, so every file comes from one commit however the branch moves.
- ``GET /api/models/{repo}/tree/{commit}/{path}`` lists a folder: each file's ``size``, git blob id (``oid``)
  and, for a file kept in LFS (every weight file), its ``lfs`` object (``oid`` is the SHA-256 of the bytes,
  ``size`` the real size). Long listings are paged with a ``Link: <...>; rel="next"`` header.
- ``GET /{repo}/resolve/{commit}/{path}`` serves a file, usually by redirecting to the Hub's CDN or storage
  bridge; Range works there.

Errors carry an ``X-Error-Code`` header (``RepoNotFound``, ``RevisionNotFound``, ``EntryNotFound``,
``GatedRepo``) and an ``X-Error-Message``; without a token the Hub answers 401 for a private or missing
repository alike. :func:`explain` turns each into an error that says what to do.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from email.message import Message
from typing import TypeGuard
from urllib.parse import quote, unquote

from modelload.loader.errors import (
    ModelloadError,
    SourceAccessDeniedError,
    SourceError,
    SourceNotFoundError,
    SourceUriError,
)

from .._connections import Origin
from .._published_digest import PublishedDigest
from .._responses import error_for_status, json_body, redact_uri
from .._service import Explain, fetch_document, origin_of
from .._settings import HubSettings, SourceSettings
from .._store import ListedFile, check_listing_size

__all__ = ["HubAccess", "HubClient", "HubRef", "parse_hub_uri"]

_PART = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,95}$")
COMMIT = re.compile(r"^[0-9a-f]{40}$")
_NEXT = re.compile(r'<([^>]+)>\s*;\s*rel="?next"?')
_DOCUMENT_LIMIT = 16 << 20
_PAGES_MAX = 256


@dataclass(frozen=True)
class HubRef:
    """``hf://ORG/NAME[@REVISION][/PATH]``, parsed."""

    repo: str
    revision: str
    path: str = ""
    """A file, or a folder ending in ``/``; empty for the repository's top folder."""

    def with_revision(self, revision: str) -> HubRef:
        return HubRef(self.repo, revision, self.path)

    @property
    def uri(self) -> str:
        revision = quote(self.revision, safe="")
        return f"hf://{self.repo}@{revision}/{quote(self.path, safe='/')}"


def parse_hub_uri(uri: str) -> HubRef:
    """Parse an ``hf://`` URI. A revision holding ``/`` (``refs/pr/1``) is written percent-encoded."""
    rest = uri[len("hf://") :] if uri.lower().startswith("hf://") else uri
    shown = redact_uri(uri)  # what messages show: no password or query
    if "?" in rest or "#" in rest:
        raise SourceUriError(f"an hf:// URI takes no query or fragment: {shown!r}")
    parts = rest.split("/")
    if len(parts) < 2 or not parts[0] or not parts[1]:
        raise SourceUriError(
            "an hf:// source is hf://ORG/NAME[@REVISION][/PATH] (for example hf://openai-community/gpt2), "
            f"got "
            f"{shown!r}"
        )
    if parts[0] in ("datasets", "spaces"):
        raise SourceUriError(f"{shown!r}: only model repositories are loaded, not {parts[0]}")
    name, at, revision = parts[1].partition("@")
    if not _PART.match(parts[0]) or not _PART.match(name) or name.endswith((".git", ".")):
        raise SourceUriError(
            f"{shown!r}: a repository is ORG/NAME, each of letters, digits, '-', '_' and '.' (not starting "
            "with "
            "one of the last three)"
        )
    revision = unquote(revision) if at else "main"
    if not revision or any(c.isspace() or ord(c) < 32 for c in revision):
        raise SourceUriError(f"{shown!r}: the revision after '@' is empty or holds a space")
    path = unquote("/".join(parts[2:]))
    if any(segment in (".", "..") for segment in path.split("/")):
        raise SourceUriError(f"{shown!r}: a path inside the repository cannot hold '.' or '..'")
    return HubRef(f"{parts[0]}/{name}", revision, path)


class HubAccess:
    """The token, sent to the Hub's own origin only (:class:`~.._service.ServiceAuth`)."""

    def __init__(self, settings: HubSettings) -> None:
        self.endpoint = settings.endpoint.rstrip("/")
        self._origin = origin_of(self.endpoint)
        self._token = settings.token

    @property
    def origin(self) -> Origin:
        return self._origin

    @property
    def has_token(self) -> bool:
        return self._token is not None

    def headers(self) -> Mapping[str, str]:
        return {"Authorization": f"Bearer {self._token}"} if self._token else {}

    def renew(self, challenge: str | None) -> bool:
        return False  # a user token does not renew itself

    def __repr__(self) -> str:
        return f"HubAccess({self.endpoint!r}, token={'set' if self._token else 'none'})"


def explain(access: HubAccess, ref: HubRef, *, uri: str) -> Explain:
    """How the Hub's error answers read for ``ref`` (see the module docstring)."""

    def error(status: int, reason: str, headers: Message, body: bytes, at_service: bool) -> ModelloadError:
        code = headers.get("X-Error-Code", "")
        page = f"{access.endpoint}/{ref.repo}"
        token = access.has_token
        if not at_service:
            if status in (401, 403):
                return SourceAccessDeniedError(
                    f"{uri}: the Hub's download host refused the file (HTTP {status}) twice, with a fresh "
                    "redirect from the Hub each time: retry later",
                    uri=uri,
                )
            return error_for_status(status, reason, headers, uri=uri)
        if code == "GatedRepo":
            who = (
                "the token's account has not been granted access"
                if token
                else "no Hugging Face token was given"
            )
            return SourceAccessDeniedError(
                f"{ref.repo} is a gated repository and {who}: log in to {page} with the account the token "
                "belongs to and accept the repository's terms (some authors review each request), then give "
                "that account's token (HF_TOKEN, or the ModelLoad's hub tokenSecretRef) and retry",
                uri=uri,
            )
        if code == "RevisionNotFound":
            return SourceNotFoundError(
                f"{ref.repo} has no revision {ref.revision!r}: check the branch, tag or commit after '@' (a "
                "revision with '/' is written percent-encoded, as in @refs%2Fpr%2F1)",
                uri=uri,
            )
        if code == "EntryNotFound":
            return SourceNotFoundError(f"{uri} does not exist in {ref.repo}: check the file's path", uri=uri)
        if code == "RepoNotFound" or status == 404:
            if token:
                return SourceNotFoundError(
                    f"{ref.repo} does not exist on {access.endpoint}, or the token cannot see it (a private "
                    "repository of another account or organization): check the name and the token's access",
                    uri=uri,
                )
            return SourceAccessDeniedError(
                f"{ref.repo} does not exist on {access.endpoint}, or it is private and no Hugging Face token "
                "was given: check the name, or give a token with read access (HF_TOKEN, or the ModelLoad's "
                "hub tokenSecretRef)",
                uri=uri,
            )
        if status == 401:
            if token:
                return SourceAccessDeniedError(
                    f"{access.endpoint} refused the Hugging Face token (HTTP 401): it is invalid, expired or "
                    "revoked; create a new read token and update the Secret",
                    uri=uri,
                )
            return SourceAccessDeniedError(
                f"{ref.repo} needs a Hugging Face token (HTTP 401): give one with read access (HF_TOKEN, or "
                "the "
                "ModelLoad's hub tokenSecretRef)",
                uri=uri,
            )
        if status == 403:
            return SourceAccessDeniedError(
                f"{access.endpoint} refused {ref.repo} to the token (HTTP 403): a fine-grained token needs "
                "read access to this repository (or to public gated repositories)",
                uri=uri,
            )
        return error_for_status(status, reason, headers, uri=uri)

    return error


class HubClient:
    """The Hub's API for one model's load: revisions, folders, files (shares one :class:`HubAccess`)."""

    def __init__(self, settings: SourceSettings) -> None:
        self._settings = settings
        self.access = HubAccess(settings.hub)

    def resolve_url(self, ref: HubRef, commit: str) -> str:
        return f"{self.access.endpoint}/{ref.repo}/resolve/{commit}/{quote(ref.path, safe='/')}"

    def _document(self, url: str, ref: HubRef, *, what: str) -> tuple[object, Message]:
        display = f"hf://{ref.repo}@{ref.revision}" + (f"/{ref.path}" if ref.path else "")
        body, headers = fetch_document(
            url,
            display=display,
            what=what,
            http=self._settings.http,
            retry=self._settings.retry,
            auth=self.access,
            explain=explain(self.access, ref, uri=display),
            limit=_DOCUMENT_LIMIT,
            headers={"Accept": "application/json"},
        )
        try:
            return json_body(body), headers
        except ValueError as exc:
            raise SourceError(f"{display}: the Hub's {what} is not JSON ({exc})", uri=display) from None

    def commit(self, ref: HubRef) -> str:
        """The commit ``ref``'s revision names now (no request when it is a commit already)."""
        if COMMIT.match(ref.revision):
            return ref.revision
        url = f"{self.access.endpoint}/api/models/{ref.repo}/revision/{quote(ref.revision, safe='')}"
        info, _ = self._document(url, ref, what="revision info")
        sha = info.get("sha") if isinstance(info, dict) else None
        if not isinstance(sha, str) or not COMMIT.match(sha):
            raise SourceError(
                f"hf://{ref.repo}@{ref.revision}: the Hub's answer names no commit", uri=ref.uri
            )
        return sha

    def folder(self, ref: HubRef, commit: str) -> dict[str, ListedFile]:
        """The files directly in ``ref``'s folder at ``commit``, by name, with sizes and checksums."""
        folder = ref.path.strip("/")
        url = f"{self.access.endpoint}/api/models/{ref.repo}/tree/{commit}"
        if folder:
            url += "/" + quote(folder, safe="/")
        found: dict[str, ListedFile] = {}
        seen = {url}
        for _ in range(_PAGES_MAX):
            page, headers = self._document(url, ref, what="file listing")
            if not isinstance(page, list):
                raise SourceError(f"hf://{ref.repo}: the Hub's file listing is not a list", uri=ref.uri)
            for entry in page:
                name, listed = self._entry(entry, ref, commit, folder)
                if name is not None and listed is not None:
                    found[name] = listed
            check_listing_size(len(found), ref.uri)
            following = _NEXT.search(headers.get("Link", "") or "")
            if following is None:
                return found
            url = following.group(1)
            if origin_of(url) != self.access.origin:
                raise SourceError(f"hf://{ref.repo}: the listing's next page is on another host", uri=ref.uri)
            if url in seen:
                raise SourceError(
                    f"hf://{ref.repo}: the listing's next page is one already read (a loop in its Link "
                    "headers): the Hub or mirror at the endpoint pages wrongly",
                    uri=ref.uri,
                )
            seen.add(url)
        raise SourceError(f"hf://{ref.repo}: the listing runs over {_PAGES_MAX} pages", uri=ref.uri)

    def _entry(
        self, entry: object, ref: HubRef, commit: str, folder: str
    ) -> tuple[str | None, ListedFile | None]:
        if not isinstance(entry, dict) or entry.get("type") != "file":
            return None, None
        path, size, oid = entry.get("path"), entry.get("size"), entry.get("oid")
        if not isinstance(path, str) or not _is_count(size):
            raise SourceError(
                f"hf://{ref.repo}: a listing entry without a path or a size in bytes: {entry!r:.120}",
                uri=ref.uri,
            )
        if folder and not path.startswith(f"{folder}/"):
            return None, None  # not in this folder: a mirror's listing cannot name files elsewhere
        name = path[len(folder) + 1 :] if folder else path
        if "/" in name or not name:
            return None, None
        uri = HubRef(ref.repo, commit, path).uri
        lfs = entry.get("lfs")
        if isinstance(lfs, dict) and isinstance(lfs.get("oid"), str) and "size" in lfs:
            if not _is_count(lfs["size"]):
                raise SourceError(
                    f"hf://{ref.repo}: the LFS size of {path!r} is not a size in bytes: {lfs['size']!r:.40}",
                    uri=ref.uri,
                )
            size = int(lfs["size"])
            checksum = PublishedDigest("sha256", lfs["oid"].lower(), uri, size, where=uri)
        elif isinstance(oid, str):
            checksum = PublishedDigest("git-sha1", oid.lower(), uri, size, where=uri)
        else:
            checksum = None
        sums = {checksum.algorithm: checksum.expected} if checksum is not None else {}
        return name, ListedFile(size=size, uri=uri, version=commit, checksums=sums)


def _is_count(value: object) -> TypeGuard[int]:
    """Whether a listed size is a count of bytes (a negative one would count against the small files'
    limit, letting others past it; JSON's true is a Python int too)."""
    return type(value) is int and value >= 0
