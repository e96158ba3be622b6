"""Reading a registry: a manifest by tag or digest, and blobs by digest (the distribution spec's pull API).

``GET /v2/<name>/manifests/<reference>`` with the manifest media types in ``Accept`` answers the manifest; its
digest is the SHA-256 of the bytes received (checked against the reference when it is a digest, and against
``Docker-Content-Digest`` when the registry sends it), so a tag is resolved once and the load names the digest
from then on. An index (a multi-platform list) of exactly one manifest is followed; a larger one must be named
by the digest of the manifest wanted. ``GET /v2/<name>/blobs/<digest>`` with ``Range`` reads a blob, often
through a redirect to the registry's object storage.
"""

from __future__ import annotations

import hashlib
from email.message import Message
from typing import Any

from modelload.loader.errors import (
    HashMismatchError,
    ModelloadError,
    SourceAccessDeniedError,
    SourceError,
    SourceNotFoundError,
)

from .._published_digest import PublishedDigest
from .._responses import error_for_status, json_body
from .._service import Explain, ServiceFile, fetch_document
from .._settings import SourceSettings
from ._auth import RegistryAuth, login_advice
from ._media import INDEX_TYPES, MANIFEST_TYPES
from ._reference import DIGEST, OciRef

__all__ = ["RegistryClient", "explain"]

MANIFEST_LIMIT = 4 << 20
"""The distribution spec lets registries refuse manifests over 4 MiB; no client needs more."""


def _is_index(document: dict[str, Any]) -> bool:
    return document.get("mediaType") in INDEX_TYPES or "manifests" in document


def _codes(body: bytes) -> list[str]:
    try:
        errors = json_body(body).get("errors") or []  # type: ignore[attr-defined]
        return [str(e.get("code", "")) for e in errors if isinstance(e, dict)]
    except (ValueError, AttributeError):
        return []


def plain_http_advice(registry: str) -> str:
    """How to reach ``registry`` over plain HTTP, on the command line and in a ModelLoad."""
    return (
        f"if the registry serves plain HTTP, say so: --registry-plain-http {registry} (a ModelLoad: "
        "spec.registry.plainHttp: true; modelload push: --plain-http)"
    )


def explain(auth: RegistryAuth, ref: OciRef, *, uri: str) -> Explain:
    """How a registry's error answers read for ``ref``: the spec's error codes, with what to do."""

    def error(status: int, reason: str, headers: Message, body: bytes, at_service: bool) -> ModelloadError:
        codes = _codes(body)
        what = f"HTTP {status}" + (f", {', '.join(codes)}" if codes else "")
        if not at_service:
            if status in (401, 403):
                return SourceAccessDeniedError(
                    f"{uri}: the storage the registry redirected the download to refused it ({what}) twice, "
                    "with a fresh redirect each time: retry later",
                    uri=uri,
                )
            return error_for_status(status, reason, headers, uri=uri)
        if status in (401, 403) or "DENIED" in codes or "UNAUTHORIZED" in codes:
            action = "push" if auth.pushing else "pull"
            if auth.has_credentials:
                advice = (
                    f"the credentials for {ref.registry} in {auth.credentials_from} do not grant {action} on "
                    "this repository: check the user, its token's scopes and the repository's permissions"
                )
            elif auth.pushing:
                advice = f"no credentials were given for {ref.registry}: {login_advice(ref.registry)}"
            else:
                advice = (
                    f"no credentials were given for {ref.registry}: give a dockerconfigjson Secret (the "
                    "ModelLoad's registry credentialsSecretRef, the same Secret as a pod's imagePullSecrets) "
                    "or, on the command line, log in (docker login / oras login writes ~/.docker/config.json)"
                )
            return SourceAccessDeniedError(
                f"{uri}: the registry refused the {action} ({what}): {advice}", uri=uri
            )
        if "NAME_UNKNOWN" in codes:
            return SourceNotFoundError(
                f"{uri}: the registry has no repository {ref.repository!r} ({what}): check the name", uri=uri
            )
        if "MANIFEST_UNKNOWN" in codes or (status == 404 and "BLOB_UNKNOWN" not in codes and not ref.path):
            return SourceNotFoundError(
                f"{uri}: {ref.repository} has no {ref.reference!r}, or there is no such repository ({what}): "
                "check the repository and the tag or digest (oras repo tags lists the tags)",
                uri=uri,
            )
        if "BLOB_UNKNOWN" in codes or status == 404:
            return SourceNotFoundError(
                f"{uri}: the registry does not hold this blob ({what}): the artifact is incomplete; push it "
                "again",
                uri=uri,
            )
        return error_for_status(status, reason, headers, uri=uri)

    return error


class RegistryClient:
    """One repository of one registry, for one load: its credentials are shared by every request."""

    def __init__(self, ref: OciRef, settings: SourceSettings) -> None:
        self.ref = ref
        self.settings = settings
        self.base = ref.base_url(settings.registry)
        self.auth = RegistryAuth(
            ref, base_url=self.base, auths=settings.registry.auths, http=settings.http, retry=settings.retry
        )

    def url(self, kind: str, reference: str) -> str:
        return f"{self.base}/v2/{self.ref.repository}/{kind}/{reference}"

    @property
    def plain_http_advice(self) -> str:
        """What a registry that answers TLS in plain HTTP needs: to be named as one."""
        return plain_http_advice(self.ref.registry)

    def manifest(self, reference: str | None = None) -> tuple[str, dict[str, Any]]:
        """The image manifest ``reference`` (default: the ref's) names, and its digest.

        An index of one manifest is followed once; an index that names another index is refused, not
        followed: each level costs a request and a registry could chain them without end.
        """
        shown = self.ref.display
        digest, document = self._document(reference or self.ref.reference)
        if _is_index(document):
            chosen = self._only_manifest(document, shown)
            index, (digest, document) = digest, self._document(chosen)
            if _is_index(document):
                raise SourceError(
                    f"{shown}: the index {index} names another index ({chosen}), which is not followed: name "
                    "the model's own manifest by its digest (oci://REGISTRY/REPOSITORY@sha256:...)",
                    uri=shown,
                )
        if not isinstance(document.get("layers"), list):
            raise SourceError(f"{shown}: the manifest has no layers ({document.get('mediaType')})", uri=shown)
        return digest, document

    def _document(self, reference: str) -> tuple[str, dict[str, Any]]:
        """The manifest or index at ``reference`` and its digest, checked against the one asked for or
        announced; ``mediaType`` filled from Content-Type when the document leaves it out."""
        shown = self.ref.display
        body, headers = fetch_document(
            self.url("manifests", reference),
            display=shown,
            what="manifest",
            http=self.settings.http,
            retry=self.settings.retry,
            auth=self.auth,
            explain=explain(self.auth, self.ref, uri=shown),
            limit=MANIFEST_LIMIT,
            headers={"Accept": ", ".join((*MANIFEST_TYPES, *INDEX_TYPES))},
            plain_http_advice=self.plain_http_advice,
        )
        digest = "sha256:" + hashlib.sha256(body).hexdigest()
        stated = headers.get("Docker-Content-Digest")
        if (DIGEST.match(reference) and digest != reference) or (
            stated and stated.startswith("sha256:") and (stated != digest)
        ):
            raise HashMismatchError(
                f"the manifest received has digest {digest}, not the "
                f"{reference if DIGEST.match(reference) else stated}"
                " asked for or announced: the registry or a proxy on the way serves something else",
                source=shown,
            )
        try:
            document = json_body(body)
        except ValueError:
            raise SourceError(f"{shown}: the manifest is not JSON", uri=shown) from None
        if not isinstance(document, dict):
            raise SourceError(f"{shown}: the manifest is not a JSON object", uri=shown)
        document.setdefault("mediaType", headers.get_content_type())
        return digest, document

    def _only_manifest(self, index: dict[str, Any], shown: str) -> str:
        manifests = [m for m in index.get("manifests") or [] if isinstance(m, dict)]
        if len(manifests) != 1 or not DIGEST.match(str(manifests[0].get("digest", ""))):
            digests = ", ".join(str(m.get("digest")) for m in manifests[:4])
            raise SourceError(
                f"{shown} is an index of {len(manifests)} manifests ({digests}): name the model's manifest "
                "by "
                "its digest (oci://REGISTRY/REPOSITORY@sha256:...)",
                uri=shown,
            )
        return str(manifests[0]["digest"])

    def blob(self, digest: str, size: int, *, display: str) -> ServiceFile:
        """A blob, read by ranges; its checksum is its digest."""
        blob = ServiceFile(
            self.url("blobs", digest),
            display=display,
            settings=self.settings.http,
            auth=self.auth,
            explain=explain(self.auth, self.ref.file(digest), uri=display),
            size=size,
            plain_http_advice=self.plain_http_advice,
        )
        blob._checksum = PublishedDigest(
            "sha256", digest.removeprefix("sha256:"), digest, size, where=display, object_source=blob
        )
        return blob
