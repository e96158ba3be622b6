"""A stand-in for the Hugging Face Hub on loopback: the part of its HTTP API that model loaders use.

There is no Hub server to run locally, so this one speaks the documented subset, checked by the real
``huggingface_hub`` client in ``tests/sources/test_hub_standin.py`` (``hf_hub_download`` and
``snapshot_download`` pointed at it with ``HF_ENDPOINT`` must fetch the same bytes), so it cannot drift from
the real protocol:

- ``GET /api/models/{repo}/revision/{revision}``: ``id``, ``sha`` (the commit), ``private``, ``gated``,
  ``siblings``;
- ``GET /api/models/{repo}/tree/{revision}[/{path}]`` (``recursive``): files with ``size``, ``oid`` (git blob
  id) and, for LFS files, ``lfs`` (``oid`` = SHA-256, ``size``, ``pointerSize``), paged by :attr:`page_size`
  with a ``Link: <...>; rel="next"`` header;
- ``HEAD`` / ``GET /{repo}/resolve/{revision}/{path}``: ``X-Repo-Commit``, ``ETag``; an LFS file answers
  ``302`` to the CDN (another origin: :class:`Cdn`, a second server with Range) with ``X-Linked-Etag`` (its
  SHA-256) and ``X-Linked-Size``; a plain file is served here, with Range;
- errors as the Hub gives them: ``X-Error-Code`` (``RepoNotFound``, ``RevisionNotFound``, ``EntryNotFound``,
  ``GatedRepo``) and ``X-Error-Message``; 401 for a private or missing repository without a token, 401/403
  ``GatedRepo`` for a gated one without a token or without access.

Every request the Hub and the CDN saw is kept (``requests``), with its ``Authorization`` header, so tests
check where the token went. Branches move with :meth:`HubServer.commit`.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, quote, unquote, urlsplit

__all__ = ["Cdn", "HubRepo", "HubServer", "git_blob_id"]

LFS_SUFFIXES = (".safetensors", ".bin", ".gguf", ".model", ".tensors", ".pt")


def git_blob_id(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data, usedforsecurity=False).hexdigest()


def _is_lfs(path: str, data: bytes) -> bool:
    return path.endswith(LFS_SUFFIXES) or len(data) > (10 << 20)


@dataclass
class HubRepo:
    """A model repository: commits (each a full set of files), branches and tags pointing to them."""

    name: str
    private: bool = False
    gated: bool = False
    readers: set[str] = field(default_factory=set)
    """Tokens that may read a private or gated repository."""
    commits: dict[str, dict[str, bytes]] = field(default_factory=dict)
    refs: dict[str, str] = field(default_factory=dict)


class _Server:
    """A threading HTTP server in this process, keeping every request's path and Authorization header."""

    def __init__(self, answer: object) -> None:
        self.requests: list[dict[str, str]] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, fmt: str, *args: object) -> None:
                pass

            def do_GET(self) -> None:
                outer._record(self)
                answer(self, head=False)  # type: ignore[operator]

            def do_HEAD(self) -> None:
                outer._record(self)
                answer(self, head=True)  # type: ignore[operator]

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.port = self._server.server_address[1]
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    def _record(self, request: BaseHTTPRequestHandler) -> None:
        self.requests.append(
            {
                "method": request.command,
                "path": request.path,
                "authorization": request.headers.get("Authorization", ""),
            }
        )

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def _send(
    request: BaseHTTPRequestHandler,
    status: int,
    body: bytes = b"",
    headers: Mapping[str, str] | None = None,
    *,
    head: bool = False,
) -> None:
    request.send_response(status)
    for name, value in (headers or {}).items():
        request.send_header(name, value)
    request.send_header("Content-Length", str(len(body)))
    request.end_headers()
    if not head:
        request.wfile.write(body)


def _serve_bytes(
    request: BaseHTTPRequestHandler, data: bytes, headers: Mapping[str, str], *, head: bool
) -> None:
    """``data`` with one byte range when asked (``206``, or ``416`` past the end), else whole."""
    wanted = request.headers.get("Range")
    match = re.fullmatch(r"bytes=(\d+)-(\d*)", wanted or "")
    headers = {**headers, "Accept-Ranges": "bytes"}
    if match is None:
        _send(request, 200, data, headers, head=head)
        return
    first = int(match.group(1))
    last = min(int(match.group(2)) if match.group(2) else len(data) - 1, len(data) - 1)
    if first >= len(data):
        _send(request, 416, b"", {**headers, "Content-Range": f"bytes */{len(data)}"}, head=head)
        return
    part = data[first : last + 1]
    _send(request, 206, part, {**headers, "Content-Range": f"bytes {first}-{last}/{len(data)}"}, head=head)


class Cdn(_Server):
    """The download host the Hub redirects LFS files to: content by SHA-256, with Range; a signed query
    string, as a real CDN's, that this one ignores. ``corrupt`` serves those digests with their last byte
    flipped."""

    def __init__(self) -> None:
        self.blobs: dict[str, bytes] = {}
        self.corrupt: set[str] = set()
        super().__init__(self._answer)

    def _answer(self, request: BaseHTTPRequestHandler, *, head: bool) -> None:
        digest = urlsplit(request.path).path.rsplit("/", 1)[-1]
        data = self.blobs.get(digest)
        if data is None:
            _send(request, 404, b"no such object", head=head)
            return
        if digest in self.corrupt:
            data = data[:-1] + bytes(
                [data[-1] ^ 0xFF]
            )  # the last tensor's last byte: the header still parses
        _serve_bytes(
            request, data, {"ETag": f'"{digest[:32]}"', "Content-Type": "binary/octet-stream"}, head=head
        )


class HubServer(_Server):
    """The Hub stand-in (see the module docstring); its CDN is :attr:`cdn`."""

    def __init__(self, *, page_size: int = 1000) -> None:
        self.repos: dict[str, HubRepo] = {}
        self.page_size = page_size
        self.cdn = Cdn()
        self._lock = threading.Lock()
        super().__init__(self._answer)

    def close(self) -> None:
        self.cdn.close()
        super().close()

    @property
    def cdn_requests(self) -> list[dict[str, str]]:
        return self.cdn.requests

    def commit(self, name: str, files: Mapping[str, bytes], *, ref: str = "main", **flags: object) -> str:
        """Make a commit of ``files`` in repository ``name`` (created if new) and point ``ref`` to it."""
        with self._lock:
            repo = self.repos.get(name)
            if repo is None:
                repo = self.repos[name] = HubRepo(name)
            for flag, value in flags.items():
                setattr(repo, flag, value)
            sha = os.urandom(20).hex()
            repo.commits[sha] = dict(files)
            repo.refs[ref] = sha
            for path, data in files.items():
                if _is_lfs(path, data):
                    self.cdn.blobs[hashlib.sha256(data).hexdigest()] = data
            return sha

    # --- requests -----------------------------------------------------------------------------------

    def _answer(self, request: BaseHTTPRequestHandler, *, head: bool) -> None:
        parts = urlsplit(request.path)
        path = parts.path
        api = re.fullmatch(r"/api/models/([^/]+/[^/]+)/(revision|tree)/([^/]+)(/.*)?", path)
        resolve = re.fullmatch(r"/([^/]+/[^/]+)/resolve/([^/]+)/(.+)", path)
        if api is not None:
            name, kind, revision, rest = api.groups()
            self._api(request, name, kind, unquote(revision), unquote((rest or "").strip("/")), parts.query)
        elif resolve is not None:
            name, revision, file = resolve.groups()
            self._resolve(request, name, unquote(revision), unquote(file), head=head)
        else:
            _send(request, 404, b"Not Found", head=head)

    def _error(
        self, request: BaseHTTPRequestHandler, status: int, code: str, message: str, *, head: bool
    ) -> None:
        body = json.dumps({"error": message}).encode()
        headers = {"X-Error-Code": code, "X-Error-Message": message, "Content-Type": "application/json"}
        if not code:
            headers.pop("X-Error-Code")
        _send(request, status, body, headers, head=head)

    def _repo_commit(
        self, request: BaseHTTPRequestHandler, name: str, revision: str, *, head: bool
    ) -> tuple[HubRepo, str] | None:
        """The repository and commit a request may read, or None after answering the Hub's error."""
        authorization = request.headers.get("Authorization", "")
        token = authorization.removeprefix("Bearer ") if authorization.startswith("Bearer ") else None
        repo = self.repos.get(name)
        known_tokens = {t for r in self.repos.values() for t in r.readers} | {"hf_valid_but_no_access"}
        if token is not None and token not in known_tokens:
            self._error(request, 401, "", "Invalid credentials in Authorization header", head=head)
            return None
        if repo is None or (repo.private and token not in repo.readers):
            status = 401 if token is None else 404
            message = "Repository not found"
            self._error(request, status, "RepoNotFound", message, head=head)
            return None
        if repo.gated and token not in repo.readers:
            if token is None:
                message = (
                    f"Access to model {name} is restricted. You must have access to it and be authenticated "
                    "to access it. Please log in."
                )
                self._error(request, 401, "GatedRepo", message, head=head)
            else:
                message = (
                    f"Access to model {name} is restricted and you are not in the authorized list. Visit "
                    f"https://huggingface.co/{name} to ask for access."
                )
                self._error(request, 403, "GatedRepo", message, head=head)
            return None
        sha = repo.refs.get(revision) or (revision if revision in repo.commits else None)
        if sha is None:
            self._error(request, 404, "RevisionNotFound", f"Invalid rev id: {revision}", head=head)
            return None
        return repo, sha

    def _api(
        self, request: BaseHTTPRequestHandler, name: str, kind: str, revision: str, folder: str, query: str
    ) -> None:
        found = self._repo_commit(request, name, revision, head=False)
        if found is None:
            return
        repo, sha = found
        files = repo.commits[sha]
        if kind == "revision":
            body = {
                "_id": sha[:24],
                "id": name,
                "modelId": name,
                "sha": sha,
                "private": repo.private,
                "gated": "manual" if repo.gated else False,
                "disabled": False,
                "siblings": [{"rfilename": path} for path in sorted(files)],
            }
            _send(request, 200, json.dumps(body).encode(), {"Content-Type": "application/json"})
            return
        params = parse_qs(query)
        recursive = params.get("recursive", ["false"])[0].lower() == "true"
        entries = self._tree(files, folder, recursive=recursive)
        start = int(params.get("cursor", ["0"])[0])
        page = entries[start : start + self.page_size]
        headers = {"Content-Type": "application/json"}
        if start + self.page_size < len(entries):
            base = f"{self.url}/api/models/{name}/tree/{quote(revision, safe='')}"
            base += f"/{quote(folder)}" if folder else ""
            following = f"{base}?recursive={str(recursive).lower()}&cursor={start + self.page_size}"
            headers["Link"] = f'<{following}>; rel="next"'
        _send(request, 200, json.dumps(page).encode(), headers)

    @staticmethod
    def _tree(files: Mapping[str, bytes], folder: str, *, recursive: bool) -> list[dict[str, object]]:
        prefix = f"{folder}/" if folder else ""
        entries: list[dict[str, object]] = []
        folders: set[str] = set()
        for path in sorted(files):
            if not path.startswith(prefix):
                continue
            rest = path[len(prefix) :]
            if "/" in rest and not recursive:
                folders.add(prefix + rest.split("/", 1)[0])
                continue
            data = files[path]
            entry: dict[str, object] = {
                "type": "file",
                "oid": git_blob_id(data),
                "size": len(data),
                "path": path,
            }
            if _is_lfs(path, data):
                digest = hashlib.sha256(data).hexdigest()
                pointer = (
                    f"version https://git-lfs.github.com/spec/v1\noid sha256:{digest}\nsize {len(data)}\n"
                )
                entry["oid"] = git_blob_id(pointer.encode())
                entry["size"] = len(data)
                entry["lfs"] = {
                    "oid": hashlib.sha256(data).hexdigest(),
                    "size": len(data),
                    "pointerSize": len(pointer),
                }
            entries.append(entry)
        entries.extend({"type": "directory", "oid": "0" * 40, "size": 0, "path": f} for f in sorted(folders))
        return entries

    def _resolve(
        self, request: BaseHTTPRequestHandler, name: str, revision: str, file: str, *, head: bool
    ) -> None:
        found = self._repo_commit(request, name, revision, head=head)
        if found is None:
            return
        repo, sha = found
        data = repo.commits[sha].get(file)
        if data is None:
            self._error(request, 404, "EntryNotFound", f"{file} does not exist on {revision}", head=head)
            return
        headers = {"X-Repo-Commit": sha}
        if _is_lfs(file, data):
            digest = hashlib.sha256(data).hexdigest()
            headers.update(
                {
                    "ETag": f'"{digest}"',
                    "X-Linked-Etag": f'"{digest}"',
                    "X-Linked-Size": str(len(data)),
                    "Location": f"{self.cdn.url}/repos/{digest}?X-Signature=opaque-{os.urandom(4).hex()}",
                }
            )
            _send(request, 302, b"", headers, head=head)
            return
        headers["ETag"] = f'"{git_blob_id(data)}"'
        _serve_bytes(request, data, headers, head=head)
