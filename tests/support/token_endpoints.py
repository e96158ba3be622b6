"""Stand-ins for the clouds' token endpoints on loopback, checking what Google's and Azure's libraries send.

The project never speaks these protocols itself: google-auth and azure-identity do. These servers play the
other side, so the workload identity paths run end to end on a machine without a cloud:

- ``/sts`` plays Google's Security Token Service for workload identity federation: it accepts a
  ``urn:ietf:params:oauth:grant-type:token-exchange`` whose ``subject_token`` is the federated token the test
  wrote into a file, and issues an access token;
- ``/computeMetadata/v1/...`` plays the GKE metadata server (``Metadata-Flavor: Google`` required);
- ``/{tenant}/oauth2/v2.0/token`` (and the OpenID discovery document MSAL asks for first) plays Entra ID for
  Entra Workload ID: a ``client_credentials`` grant whose ``client_assertion`` is the federated token.

Each exchange is recorded in ``exchanges`` (form fields; the tests check them), and each issued token in
``issued``. Tokens for Azurite are unsigned JWTs with the issuer, audience and expiry Azurite checks.
"""

from __future__ import annotations

import base64
import json
import ssl
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

__all__ = ["TokenEndpoints"]

SERVICE_ACCOUNT = "loader@modelload-test.iam.gserviceaccount.com"


def _jwt(claims: dict[str, Any]) -> str:
    def part(value: dict[str, Any]) -> str:
        return base64.urlsafe_b64encode(json.dumps(value).encode()).rstrip(b"=").decode()

    return (
        f"{part({'alg': 'RS256', 'typ': 'JWT'})}.{part(claims)}.{base64.urlsafe_b64encode(b'sig').decode()}"
    )


class TokenEndpoints:
    """The server; ``url`` is its base. Close with :meth:`close`."""

    def __init__(
        self, *, federated_token: str, tenant: str = "tenant-1234", tls: tuple[Path, Path] | None = None
    ) -> None:
        self.federated_token = federated_token
        self.tenant = tenant
        self.exchanges: list[tuple[str, dict[str, str]]] = []
        self.issued: list[str] = []
        self.refuse = False
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def do_GET(self) -> None:
                outer._get(self)

            def do_POST(self) -> None:
                outer._post(self)

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        if tls is not None:  # Entra's authority must be https
            context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            context.load_cert_chain(str(tls[0]), str(tls[1]))
            self._server.socket = context.wrap_socket(self._server.socket, server_side=True)
        self.port = int(self._server.server_address[1])
        self.url = f"{'https' if tls else 'http'}://127.0.0.1:{self.port}"
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def _reply(
        self, handler: BaseHTTPRequestHandler, status: int, body: Any, headers: dict[str, str]
    ) -> None:
        data = json.dumps(body).encode() if not isinstance(body, bytes) else body
        handler.send_response(status)
        for name, value in {"Content-Type": "application/json", **headers}.items():
            handler.send_header(name, value)
        handler.send_header("Content-Length", str(len(data)))
        handler.end_headers()
        handler.wfile.write(data)

    def _issue(self, claims: dict[str, Any] | None = None) -> str:
        token = _jwt(claims) if claims is not None else f"ya29.test-{uuid.uuid4().hex}"
        self.issued.append(token)
        return token

    # --- GET: the metadata server and Entra's discovery ---------------------------------------------------

    def _get(self, handler: BaseHTTPRequestHandler) -> None:
        path = urlsplit(handler.path).path
        flavor = {"Metadata-Flavor": "Google"}
        if path in ("", "/") or path.startswith("/computeMetadata"):
            if handler.headers.get("Metadata-Flavor") != "Google":
                self._reply(handler, 403, {"error": "Metadata-Flavor header missing"}, flavor)
                return
            self.exchanges.append(("metadata", {"path": path}))
            if path.endswith("/service-accounts/default/token"):
                body = {"access_token": self._issue(), "expires_in": 3600, "token_type": "Bearer"}
                self._reply(handler, 200, body, flavor)
            elif path.endswith("/service-accounts/default/email"):
                self._reply(handler, 200, SERVICE_ACCOUNT.encode(), {**flavor, "Content-Type": "text/plain"})
            elif path.endswith("/project/project-id"):
                self._reply(handler, 200, b"modelload-test", {**flavor, "Content-Type": "text/plain"})
            elif path.endswith("/service-accounts/default/"):
                body = {
                    "email": SERVICE_ACCOUNT,
                    "scopes": ["https://www.googleapis.com/auth/cloud-platform"],
                }
                self._reply(handler, 200, body, flavor)
            else:
                self._reply(handler, 200, b"", flavor)
            return
        if path.endswith("/.well-known/openid-configuration"):
            base = f"{self.url}/{self.tenant}"
            body = {
                "token_endpoint": f"{base}/oauth2/v2.0/token",
                "authorization_endpoint": f"{base}/oauth2/v2.0/authorize",
                "issuer": f"{base}/v2.0",
                "device_authorization_endpoint": f"{base}/oauth2/v2.0/devicecode",
            }
            self._reply(handler, 200, body, {})
            return
        self._reply(handler, 404, {"error": "not_found"}, {})

    # --- POST: token exchanges ----------------------------------------------------------------------------

    def _post(self, handler: BaseHTTPRequestHandler) -> None:
        length = int(handler.headers.get("Content-Length") or 0)
        fields = {k: v[0] for k, v in parse_qs(handler.rfile.read(length).decode()).items()}
        path = urlsplit(handler.path).path
        if path == "/sts":
            self.exchanges.append(("sts", fields))
            good = (
                fields.get("grant_type") == "urn:ietf:params:oauth:grant-type:token-exchange"
                and fields.get("subject_token") == self.federated_token
            )
            if self.refuse or not good:
                self._reply(handler, 400, {"error": "invalid_grant", "error_description": "refused"}, {})
                return
            body = {
                "access_token": self._issue(),
                "issued_token_type": "urn:ietf:params:oauth:token-type:access_token",
                "token_type": "Bearer",
                "expires_in": 3600,
            }
            self._reply(handler, 200, body, {})
            return
        if path.endswith("/oauth2/v2.0/token"):
            self.exchanges.append(("entra", fields))
            good = fields.get("client_assertion") == self.federated_token
            if self.refuse or not good:
                body = {
                    "error": "invalid_client",
                    "error_description": "AADSTS70021: no matching federated identity",
                }
                self._reply(handler, 401, body, {})
                return
            now = int(time.time())
            claims = {
                "aud": "https://storage.azure.com",
                "iss": f"https://sts.windows.net/{self.tenant}/",
                "iat": now,
                "nbf": now,
                "exp": now + 3600,
                "oid": str(uuid.uuid4()),
                "tid": self.tenant,
            }
            body = {"access_token": self._issue(claims), "token_type": "Bearer", "expires_in": 3600}
            self._reply(handler, 200, body, {})
            return
        self._reply(handler, 404, {"error": "not_found"}, {})
