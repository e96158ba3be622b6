"""Publishing a model directory as a CNCF ModelPack artifact whose layers any registry serves by range.

Each file of the directory's top level is one layer, uploaded as it is (no tar, no compression), so a loader
reads a weight file by range straight from its blob:

- weight files (``.safetensors``, ``.tensors``, ``.gguf``, ``.bin``, ``.pt``, ``.pth``) as
  ``application/vnd.cncf.model.weight.v1.raw``;
- their configuration (``config.json``, tokenizer files, ``model.safetensors.index.json``, every other file
  a loader copies beside the weights) as ``application/vnd.cncf.model.weight.config.v1.raw``;
- ``README*``, ``LICENSE*`` and other ``.md`` files as ``application/vnd.cncf.model.doc.v1.raw``.

Every layer carries its file name twice: ``org.cncf.model.filepath`` (ModelPack's) and
``org.opencontainers.image.title`` (what ``oras pull`` names files by). The config blob is ModelPack's model
configuration (``modelfs.diffIds`` lists the layers' digests: raw layers are their own uncompressed content),
and the manifest's ``artifactType`` is ModelPack's.

The upload is the distribution spec's: ``HEAD`` a blob (one the registry already holds is not sent again),
``POST .../blobs/uploads/`` then one ``PUT ...?digest=`` with the file as the body; then ``PUT`` the manifest
under the tag. Credentials come from the same Docker config ``auths`` as pulls, with scope ``pull,push``.
"""

from __future__ import annotations

import datetime
import hashlib
import http.client
import json
import logging
import ssl
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO
from urllib.parse import urljoin, urlsplit

from modelload.loader.errors import ConfigError, SourceError

from .._body import read_document
from .._connections import Origin
from .._service import origin_of
from .._settings import SourceSettings
from .._splice import RateFloor
from .._transport_errors import PLAIN_HTTP_REPLIES, translate_transport_error
from ._auth import RegistryAuth
from ._client import MANIFEST_LIMIT, explain
from ._media import (
    ANNOTATION_FILEPATH,
    ANNOTATION_TITLE,
    ARTIFACT_MODELPACK,
    CONFIG_MODELPACK,
    DOC_RAW,
    DOCKER_MANIFEST,
    OCI_MANIFEST,
    WEIGHT_CONFIG_RAW,
    WEIGHT_RAW,
)
from ._reference import OciRef, parse_oci_uri

__all__ = ["PushedLayer", "PushResult", "layer_media_type", "push_directory"]

log = logging.getLogger("modelload.sidecar.push")

WEIGHT_SUFFIXES = (".safetensors", ".tensors", ".gguf", ".bin", ".pt", ".pth")
LOADED_SUFFIXES = (".safetensors", ".tensors")
"""The weight files a sidecar loads: a push without one would publish an artifact no pod can use."""
_BLOCK = 1 << 20
_ANSWER_LIMIT = MANIFEST_LIMIT + (64 << 10)
"""The most a registry's answer to a push's request holds: a manifest (the spec's limit), or an error."""


def layer_media_type(name: str) -> str:
    """The ModelPack media type a file of a model directory is pushed as (see the module docstring)."""
    lower = name.lower()
    if lower.endswith(WEIGHT_SUFFIXES):
        return WEIGHT_RAW
    if lower.startswith(("readme", "license", "licence")) or lower.endswith(".md"):
        return DOC_RAW
    return WEIGHT_CONFIG_RAW


@dataclass(frozen=True)
class PushedLayer:
    name: str
    digest: str
    size: int
    media_type: str
    uploaded: bool
    """False when the registry held the blob already."""


@dataclass(frozen=True)
class PushResult:
    reference: str
    """The artifact by tag (``oci://REGISTRY/REPOSITORY:TAG``)."""
    digest: str
    """The manifest's digest: ``oci://REGISTRY/REPOSITORY@DIGEST`` names this very push."""
    layers: tuple[PushedLayer, ...]


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while block := handle.read(_BLOCK):
            digest.update(block)
    return "sha256:" + digest.hexdigest()


def _files(directory: Path) -> list[Path]:
    if not directory.is_dir():
        raise ConfigError(f"{directory} is not a directory: push takes a model directory")
    files = sorted(p for p in directory.iterdir() if p.is_file() and not p.name.startswith("."))
    skipped = sorted(p.name for p in directory.iterdir() if p.is_dir() and not p.name.startswith("."))
    if skipped:
        log.warning("not pushed (folders are not part of a loaded model): %s", ", ".join(skipped))
    if not any(p.name.lower().endswith(LOADED_SUFFIXES) for p in files):
        others = [p.name for p in files if p.name.lower().endswith(WEIGHT_SUFFIXES)]
        held = (
            f"; it holds {', '.join(others[:4])}, which the sidecar does not read (pickled torch weights, "
            "GGUF): save the model as safetensors (save_pretrained(..., safe_serialization=True)) and push "
            "that"
            if others
            else ": nothing to push"
        )
        raise ConfigError(
            f"{directory} holds no weights the sidecar loads (*.safetensors, or *.tensors for tensorizer)"
            + held
        )
    return files


class _Registry:
    """Requests to one repository for a push: the token flow with ``pull,push``, bodies from files."""

    def __init__(self, ref: OciRef, settings: SourceSettings, *, credentials_from: str | None = None) -> None:
        self.ref = ref
        self.base = ref.base_url(settings.registry)
        self.settings = settings
        self.origin = origin_of(self.base)
        self.auth = RegistryAuth(
            ref,
            base_url=self.base,
            auths=settings.registry.auths,
            http=settings.http,
            retry=settings.retry,
            actions="pull,push",
            credentials_from=credentials_from,
        )
        self._explain = explain(self.auth, ref, uri=ref.display)

    def _connection(self, origin: Origin) -> http.client.HTTPConnection:
        timeout = self.settings.http.stall_timeout
        if origin.is_tls:
            context = ssl.create_default_context(cafile=self.settings.http.ca_bundle)
            if not self.settings.http.verify_tls:
                context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
            return http.client.HTTPSConnection(
                origin.host, origin.port, timeout=timeout, context=context, blocksize=_BLOCK
            )
        return http.client.HTTPConnection(origin.host, origin.port, timeout=timeout, blocksize=_BLOCK)

    def call(
        self,
        method: str,
        url: str,
        *,
        accept: frozenset[int],
        headers: Mapping[str, str] | None = None,
        body: bytes | BinaryIO | None = None,
    ) -> tuple[int, http.client.HTTPMessage, bytes]:
        """One request (renewing the token once on a ``401``); raises the registry's error otherwise."""
        url = urljoin(self.base + "/", url)
        origin = origin_of(url)
        start = body.tell() if body is not None and not isinstance(body, bytes) else 0
        for attempt in range(2):
            sent = dict(headers or {})
            if origin == self.origin:
                sent.update(self.auth.headers())
            if body is not None and not isinstance(body, bytes):
                body.seek(start)
            conn = self._connection(origin)
            try:
                parts = urlsplit(url)
                conn.request(method, parts.path + (f"?{parts.query}" if parts.query else ""), body, sent)
                response = conn.getresponse()
                floor = RateFloor(self.settings.http.min_rate, self.settings.http.slow_window)
                data = read_document(response, _ANSWER_LIMIT + 1, floor)
            except ssl.SSLError as exc:
                if exc.reason not in PLAIN_HTTP_REPLIES:
                    raise SourceError(
                        f"{self.ref.display}: {method} to the registry failed: {type(exc).__name__}: {exc}",
                        uri=self.ref.display,
                    ) from None
                raise ConfigError(
                    f"{self.ref.display}: {origin.netloc} answered in plain HTTP, not TLS: if the registry "
                    "serves plain HTTP, push with --plain-http"
                ) from None
            except (OSError, EOFError, http.client.HTTPException) as exc:
                # by kind, never the text: a malformed status line is quoted in it (a port that speaks
                # another protocol: SSH answers first), and that is the server's to fill
                failed = translate_transport_error(
                    exc,
                    uri=self.ref.display,
                    settings=self.settings.http,
                    plain_http_advice=lambda _: "if the registry serves plain HTTP, push with --plain-http",
                )
                reason = str(failed).removeprefix(f"{self.ref.display}: ")
                raise SourceError(
                    f"{self.ref.display}: {method} to the registry failed ({reason}): is {origin.netloc} the"
                    " registry, and up?",
                    uri=self.ref.display,
                ) from None
            finally:
                conn.close()
            if len(data) > _ANSWER_LIMIT:
                raise SourceError(
                    f"{self.ref.display}: the registry answered {method} with over {_ANSWER_LIMIT} bytes",
                    uri=self.ref.display,
                )
            if response.status in accept:
                return response.status, response.headers, data
            if (
                response.status == 401
                and attempt == 0
                and self.auth.renew(response.getheader("WWW-Authenticate"))
            ):
                continue
            raise self._explain(
                response.status, response.reason, response.headers, data, origin == self.origin
            )
        raise AssertionError("unreachable")  # pragma: no cover

    def tagged(self, tag: str) -> tuple[str, dict[str, object]] | None:
        """The digest and document of the image manifest ``tag`` names now, or None for a new tag."""
        status, _, body = self.call(
            "GET",
            f"v2/{self.ref.repository}/manifests/{tag}",
            accept=frozenset({200, 404}),
            headers={"Accept": f"{OCI_MANIFEST}, {DOCKER_MANIFEST}"},
        )
        if status == 404:
            return None
        try:
            document = json.loads(body)
        except ValueError:
            document = {}
        digest = "sha256:" + hashlib.sha256(body).hexdigest()
        return digest, document if isinstance(document, dict) else {}

    def blob_exists(self, digest: str) -> bool:
        status, _, _ = self.call(
            "HEAD", f"v2/{self.ref.repository}/blobs/{digest}", accept=frozenset({200, 404})
        )
        return status == 200

    def upload(self, digest: str, size: int, body: bytes | BinaryIO) -> None:
        _, headers, _ = self.call("POST", f"v2/{self.ref.repository}/blobs/uploads/", accept=frozenset({202}))
        location = headers.get("Location")
        if not location:
            raise SourceError(
                f"{self.ref.display}: the registry started an upload without a Location", uri=self.ref.display
            )
        separator = "&" if urlsplit(location).query else "?"
        self.call(
            "PUT",
            f"{location}{separator}digest={digest}",
            accept=frozenset({201}),
            headers={"Content-Type": "application/octet-stream", "Content-Length": str(size)},
            body=body,
        )


def push_directory(
    directory: Path,
    uri: str,
    settings: SourceSettings,
    *,
    annotations: Mapping[str, str] | None = None,
    progress: Callable[[str], None] | None = None,
    force: bool = False,
    credentials_from: str | None = None,
) -> PushResult:
    """Push ``directory`` to ``uri`` (``oci://REGISTRY/REPOSITORY:TAG``) as a ModelPack artifact.

    A tag that already names an artifact of other files (or other annotations) is not moved unless ``force``:
    pods load a tag, so moving it changes the model the next pod gets. The same files pushed again leave the
    tag as it is and return its digest. ``credentials_from`` names where ``settings``' credentials came from,
    for messages.
    """
    ref = parse_oci_uri(uri)
    if ref.digest is not None or ref.path:
        raise ConfigError(
            f"{uri}: push to a tag (oci://REGISTRY/REPOSITORY:TAG): the digest is the push's result"
        )
    tag = ref.tag or "latest"  # a reference without a digest has a tag (parse_oci_uri defaults it)
    say = progress or log.info
    files = _files(directory)
    planned = [(path, _sha256(path), layer_media_type(path.name)) for path in files]
    registry = _Registry(ref, settings, credentials_from=credentials_from)
    current = registry.tagged(tag)
    if current is not None:
        same = _same_files(current[1], [(p.name, digest) for p, digest, _ in planned], annotations or {})
        if same:
            say(f"unchanged: {ref.display} already names these files ({current[0][:19]})")
            kept = tuple(PushedLayer(p.name, d, p.stat().st_size, m, False) for p, d, m in planned)
            return PushResult(ref.display, current[0], kept)
        if not force:
            raise ConfigError(
                f"{ref.display} already names another model ({current[0][:19]}...): pods that load this tag "
                "would get these files instead. Push under a new tag, or pass --force to move the tag"
            )
    layers = [_upload(registry, path, digest, media, say) for path, digest, media in planned]
    config = _model_config(directory, layers)
    config_digest = "sha256:" + hashlib.sha256(config).hexdigest()
    if not registry.blob_exists(config_digest):
        registry.upload(config_digest, len(config), config)
    document = _manifest(config, config_digest, layers, annotations)
    digest = "sha256:" + hashlib.sha256(document).hexdigest()
    registry.call(
        "PUT",
        f"v2/{ref.repository}/manifests/{tag}",
        accept=frozenset({201}),
        headers={"Content-Type": OCI_MANIFEST},
        body=document,
    )
    say(f"pushed {ref.display} ({len(layers)} layers): {ref.pinned(digest).uri}")
    return PushResult(ref.display, digest, tuple(layers))


def _upload(
    registry: _Registry, path: Path, digest: str, media: str, say: Callable[[str], None]
) -> PushedLayer:
    size = path.stat().st_size
    uploaded = not registry.blob_exists(digest)
    if uploaded:
        with path.open("rb") as body:
            registry.upload(digest, size, body)
    say(f"{'pushed' if uploaded else 'exists'} {path.name} ({size} bytes, {media}, {digest[:19]})")
    return PushedLayer(path.name, digest, size, media, uploaded)


def _same_files(
    manifest: Mapping[str, object], files: list[tuple[str, str]], annotations: Mapping[str, str]
) -> bool:
    """Whether ``manifest`` (a tag's current one) holds exactly ``files`` (name, digest), as a push of them
    would have written it, with the same annotations."""
    layers = manifest.get("layers")
    if not isinstance(layers, list):
        return False
    held = sorted(
        (str((layer.get("annotations") or {}).get(ANNOTATION_FILEPATH)), str(layer.get("digest")))
        for layer in layers
        if isinstance(layer, dict)
    )
    return held == sorted(files) and (manifest.get("annotations") or {}) == dict(annotations)


def _manifest(
    config: bytes, config_digest: str, layers: list[PushedLayer], annotations: Mapping[str, str] | None
) -> bytes:
    manifest: dict[str, object] = {
        "schemaVersion": 2,
        "mediaType": OCI_MANIFEST,
        "artifactType": ARTIFACT_MODELPACK,
        "config": {"mediaType": CONFIG_MODELPACK, "digest": config_digest, "size": len(config)},
        "layers": [
            {
                "mediaType": layer.media_type,
                "digest": layer.digest,
                "size": layer.size,
                "annotations": {ANNOTATION_FILEPATH: layer.name, ANNOTATION_TITLE: layer.name},
            }
            for layer in layers
        ],
    }
    if annotations:
        manifest["annotations"] = dict(annotations)
    return json.dumps(manifest, indent=2).encode()


def _model_config(directory: Path, layers: list[PushedLayer]) -> bytes:
    names = {layer.name for layer in layers}
    formats = {"safetensors" for n in names if n.endswith(".safetensors")} | (
        {"tensorizer"} if any(n.endswith(".tensors") for n in names) else set()
    )
    config: dict[str, object] = {"format": "/".join(sorted(formats)) or "unknown"}
    source = directory / "config.json"
    if source.is_file():
        try:
            hf = json.loads(source.read_text())
            if isinstance(hf, dict) and isinstance(hf.get("architectures"), list) and hf["architectures"]:
                config["architecture"] = "transformer"
            if isinstance(hf, dict) and isinstance(hf.get("torch_dtype") or hf.get("dtype"), str):
                config["precision"] = hf.get("torch_dtype") or hf.get("dtype")
        except (OSError, ValueError):
            pass
    document = {
        "descriptor": {
            "createdAt": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "name": directory.resolve().name,
        },
        "config": config,
        "modelfs": {"type": "layers", "diffIds": [layer.digest for layer in layers]},
    }
    return json.dumps(document, indent=2).encode()
