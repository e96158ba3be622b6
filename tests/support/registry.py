"""A real OCI registry on loopback: Debian's ``docker-registry`` (the CNCF distribution server), and a token
service it trusts, for the ``oci://`` tests and benchmarks.

Two modes:

- anonymous: no auth at all, every pull and push allowed (``RegistryServer(root)``);
- token auth (``RegistryServer(root, users={...})``): the registry answers ``401`` with
  ``WWW-Authenticate: Bearer realm=...,service=...,scope=...``, as Docker Hub, GHCR, ECR and Harbor do. The
  realm is :class:`TokenService`, a small HTTP server in this process: it checks HTTP Basic credentials
  against ``users``, grants pull and push to a known user, pull only to anyone on repositories under
  ``public/``, nothing otherwise, and issues an RS256 JWT whose ``x5c`` header carries a certificate the
  registry is configured to trust (``rootcertbundle``). Every request it saw is kept (:attr:`requests`), so
  tests check which credentials went where.

Missing ``docker-registry``: the fixtures skip (or fail under ``MODELLOAD_REQUIRE_SERVERS=1``).
"""

from __future__ import annotations

import base64
import datetime
import json
import os
import shutil
import subprocess
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

from tests.conftest import find_executable

from .ports import free_port, wait_for_port
from .processes import stop_process

__all__ = ["SERVICE", "RegistryServer", "TokenService", "find_registry", "start_registry"]

SERVICE = "modelload-test-registry"
ISSUER = "modelload-test-token-service"


def find_registry() -> str | None:
    """The distribution server's binary (Debian's ``docker-registry``), or None."""
    return find_executable("docker-registry") or find_executable("registry")


def _b64url(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


class _Signer:
    """An RSA key and a self-signed certificate for it: the registry trusts the certificate."""

    def __init__(self, folder: Path) -> None:
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import rsa
        from cryptography.x509.oid import NameOID

        self._key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, ISSUER)])
        now = datetime.datetime.now(datetime.timezone.utc)
        cert = (
            x509.CertificateBuilder()
            .subject_name(name)
            .issuer_name(name)
            .public_key(self._key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(days=1))
            .not_valid_after(now + datetime.timedelta(days=30))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(self._key, hashes.SHA256())
        )
        self.cert_path = folder / "token-signer.pem"
        self.cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        self._x5c = base64.b64encode(cert.public_bytes(serialization.Encoding.DER)).decode()

    def token(self, subject: str, access: list[dict[str, object]], *, lifetime: float) -> str:
        from cryptography.hazmat.primitives import hashes
        from cryptography.hazmat.primitives.asymmetric import padding

        now = int(time.time())
        header = {"typ": "JWT", "alg": "RS256", "x5c": [self._x5c]}
        claims = {
            "iss": ISSUER,
            "sub": subject,
            "aud": SERVICE,
            "exp": now + int(lifetime),
            "nbf": now - 10,
            "iat": now,
            "jti": uuid.uuid4().hex,
            "access": access,
        }
        signing = f"{_b64url(json.dumps(header).encode())}.{_b64url(json.dumps(claims).encode())}"
        signature = self._key.sign(signing.encode(), padding.PKCS1v15(), hashes.SHA256())
        return f"{signing}.{_b64url(signature)}"


class TokenService:
    """The registry's token realm (see the module docstring)."""

    def __init__(self, folder: Path, users: Mapping[str, str], *, lifetime: float = 300.0) -> None:
        self.users = dict(users)
        self.lifetime = lifetime
        self.signer = _Signer(folder)
        self.requests: list[dict[str, str]] = []
        self.issued: list[str] = []
        service = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, fmt: str, *args: object) -> None:
                pass

            def do_GET(self) -> None:
                service._answer(self)

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    @property
    def realm(self) -> str:
        return f"http://127.0.0.1:{self.port}/token"

    def _answer(self, request: BaseHTTPRequestHandler) -> None:
        query = parse_qs(urlsplit(request.path).query)
        authorization = request.headers.get("Authorization", "")
        self.requests.append({"path": request.path, "authorization": authorization})
        user = None
        if authorization.startswith("Basic "):
            name, _, password = base64.b64decode(authorization[6:]).decode().partition(":")
            if self.users.get(name) != password:
                body = json.dumps({"errors": [{"code": "UNAUTHORIZED", "message": "bad credentials"}]})
                self._send(request, 401, body.encode())
                return
            user = name
        access = []
        for scope in query.get("scope", []):
            kind, _, rest = scope.partition(":")
            name, _, actions = rest.rpartition(":")
            wanted = [a for a in actions.split(",") if a]
            if user is not None:
                granted = wanted
            elif name.startswith("public/"):
                granted = [a for a in wanted if a == "pull"]
            else:
                granted = []
            access.append({"type": kind, "name": name, "actions": granted})
        token = self.signer.token(user or "", access, lifetime=self.lifetime)
        self.issued.append(token)
        self._send(request, 200, json.dumps({"token": token, "expires_in": int(self.lifetime)}).encode())

    @staticmethod
    def _send(request: BaseHTTPRequestHandler, status: int, body: bytes) -> None:
        request.send_response(status)
        request.send_header("Content-Type", "application/json")
        request.send_header("Content-Length", str(len(body)))
        request.end_headers()
        request.wfile.write(body)

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


_CONFIG = """\
version: 0.1
log:
  level: warn
  accesslog:
    disabled: true
storage:
{storage}
  delete:
    enabled: true
  maintenance:
    uploadpurging:
      enabled: false
http:
  addr: 127.0.0.1:{port}
  secret: modelload-test-secret
{auth}"""
_FILESYSTEM = """\
  filesystem:
    rootdirectory: {root}"""
_S3 = """\
  s3:
    accesskey: {key}
    secretkey: {secret}
    region: us-east-1
    regionendpoint: {endpoint}
    bucket: {bucket}
    secure: false
    v4auth: true
  redirect:
    disable: false"""
_TOKEN_AUTH = """\
auth:
  token:
    realm: {realm}
    service: {service}
    issuer: {issuer}
    rootcertbundle: {bundle}
"""


class RegistryServer:
    """A running distribution registry (see the module docstring)."""

    def __init__(
        self,
        root: Path,
        *,
        users: Mapping[str, str] | None = None,
        token_lifetime: float = 300.0,
        s3: Mapping[str, str] | None = None,
    ):
        """``s3``: keep the blobs in an S3 bucket (``endpoint``, ``bucket``, ``key``, ``secret``) instead of
        ``root``: the registry then answers a blob GET with a redirect to a presigned URL of the bucket, as
        registries on object storage do."""
        binary = find_registry()
        if binary is None:
            raise FileNotFoundError("docker-registry is not installed (apt-get install docker-registry)")
        self.root = Path(root)
        self._state = Path(tempfile.mkdtemp(prefix="modelload-registry-"))
        self.tokens: TokenService | None = None
        auth = ""
        if users is not None:
            self.tokens = TokenService(self._state, users, lifetime=token_lifetime)
            auth = _TOKEN_AUTH.format(
                realm=self.tokens.realm, service=SERVICE, issuer=ISSUER, bundle=self.tokens.signer.cert_path
            )
        self._log = self._state / "registry.log"
        self._binary = binary
        self._config = self._state / "config.yml"
        for _ in range(5):
            self.port = free_port()
            storage = _S3.format(**s3) if s3 is not None else _FILESYSTEM.format(root=self.root)
            self._config.write_text(_CONFIG.format(storage=storage, port=self.port, auth=auth))
            if self._start():
                return
        log = self.log_text
        self.close()
        raise RuntimeError(f"docker-registry did not start: {log[-2000:]}")

    def _start(self) -> bool:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("REGISTRY_", "AWS_"))}
        with self._log.open("ab") as log:
            process = subprocess.Popen(
                [self._binary, "serve", str(self._config)], stdout=log, stderr=subprocess.STDOUT, env=env
            )
        if wait_for_port(self.port, alive=process, timeout=20):
            self._process = process
            return True
        stop_process(process)
        return False

    def rotate_signing_key(self) -> None:
        """Sign tokens with a new key and restart the registry trusting only it: every token issued so far
        is refused from now on (401), as an expired one would be mid-load."""
        assert self.tokens is not None, "a registry without token auth has no signing key"
        stop_process(self._process)
        self.tokens.signer = _Signer(self._state)
        if not self._start():
            raise RuntimeError(f"docker-registry did not restart: {self.log_text[-2000:]}")

    @property
    def host(self) -> str:
        """The registry as an ``oci://`` URI names it: ``127.0.0.1:PORT``."""
        return f"127.0.0.1:{self.port}"

    def uri(self, repository: str, reference: str = "latest") -> str:
        separator = "@" if reference.startswith("sha256:") else ":"
        return f"oci://{self.host}/{repository}{separator}{reference}"

    @property
    def log_text(self) -> str:
        return self._log.read_text(errors="replace") if self._log.exists() else ""

    def close(self) -> None:
        process = getattr(self, "_process", None)
        if process is not None:
            stop_process(process)
        if self.tokens is not None:
            self.tokens.close()
        shutil.rmtree(self._state, ignore_errors=True)


@contextmanager
def start_registry(root: Path, *, users: Mapping[str, str] | None = None) -> Iterator[RegistryServer]:
    server = RegistryServer(root, users=users)
    try:
        yield server
    finally:
        server.close()
