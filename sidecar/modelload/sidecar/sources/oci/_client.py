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
import json
from email.message import Message
from typing import Any

from modelload.loader.errors import (
    HashMismatchError,
    ModelloadError,
    SourceAccessDeniedError,
    SourceError,
    SourceNotFoundError,
)

from .._checksum import Checksum
from .._responses import error_for_status
from .._service import Explain, ServiceFile, fetch_document
from .._settings import SourceSettings
from ._auth import RegistryAuth
from ._media import INDEX_TYPES, MANIFEST_TYPES
from ._reference import DIGEST, OciRef

__all__ = ["RegistryClient", "explain"]

MANIFEST_LIMIT = 4 << 20
"""The distribution spec lets registries refuse manifests over 4 MiB; no client needs more."""


def _codes(body: bytes) -> list[str]:
    try:
        errors = json.loads(body).get("errors") or []
        return [str(e.get("code", "")) for e in errors if isinstance(e, dict)]
    except (ValueError, AttributeError):
        return []


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
            if auth.has_credentials:
                advice = (
                    f"the credentials for {ref.registry} in the dockerconfigjson Secret (or Docker config) "
                    "do not grant pull on this repository: check the user, its token's scopes and the "
                    "repository's permissions"
                )
            else:
                advice = (
                    f"no credentials were given for {ref.registry}: give a dockerconfigjson Secret (the "
                    "ModelLoad's registry credentialsSecretRef, the same Secret as a pod's imagePullSecrets) "
                    "or, on the command line, log in (docker login / oras login writes ~/.docker/config.json)"
                )
            return SourceAccessDeniedError(
                f"{uri}: the registry refused the pull ({what}): {advice}", uri=uri
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

    def manifest(self, reference: str | None = None) -> tuple[str, dict[str, Any]]:
        """The image manifest ``reference`` (default: the ref's) names, and its digest."""
        reference = reference or self.ref.reference
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
            document = json.loads(body)
        except ValueError:
            raise SourceError(f"{shown}: the manifest is not JSON", uri=shown) from None
        if not isinstance(document, dict):
            raise SourceError(f"{shown}: the manifest is not a JSON object", uri=shown)
        media = document.get("mediaType") or headers.get_content_type()
        if media in INDEX_TYPES or "manifests" in document:
            return self.manifest(self._only_manifest(document, shown))
        if not isinstance(document.get("layers"), list):
            raise SourceError(f"{shown}: the manifest has no layers ({media})", uri=shown)
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
        )
        blob._checksum = Checksum(
            "sha256", digest.removeprefix("sha256:"), digest, size, where=display, object_source=blob
        )
        return blob
