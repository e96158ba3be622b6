"""Who an Azure Blob request is from: Azure's own libraries make the credential, this module only asks them.

One of, in this order (the first that is given wins, never a mix):

1. explicit credentials (:class:`~._settings.AzureCredentials`: the operator's copy of a ModelLoad's Secret);
2. the environment Azure's tools read: ``AZURE_STORAGE_CONNECTION_STRING`` (Azurite's too), then
   ``AZURE_STORAGE_SAS_TOKEN``, then ``AZURE_STORAGE_KEY``;
3. azure-identity's ``DefaultAzureCredential``: Entra Workload ID on AKS (the federated token file, client
   and tenant ids the webhook injects), a service principal (``AZURE_CLIENT_SECRET``), a managed identity.
   Its tokens (audience ``https://storage.azure.com``) are cached here until five minutes before they expire.

Shared-key requests are signed by azure-storage-blob's own ``SharedKeyCredentialPolicy`` over the request
as it is sent (method, ``x-ms-*`` headers, path, query); a SAS token is appended to the query string and
never shown (display URIs carry no query). ``repr`` of anything here holds no secret.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from email.utils import formatdate
from typing import Any
from urllib.parse import parse_qsl

from modelload.loader.errors import ConfigError, SourceAccessDeniedError

from ._base import InterruptedReadError
from ._cloud_errors import scrub
from ._settings import AzureCredentials, AzureSettings

__all__ = ["API_VERSION", "AzureAuth", "parse_connection_string", "resolve_auth"]

API_VERSION = "2023-11-03"
"""The Blob service version asked for: bearer tokens need 2017-11-09 or later."""
STORAGE_SCOPE = "https://storage.azure.com/.default"
CONNECTION_STRING_ENV = "AZURE_STORAGE_CONNECTION_STRING"
SAS_TOKEN_ENV = "AZURE_STORAGE_SAS_TOKEN"  # noqa: S105 - the variable's name
ACCOUNT_KEY_ENV = "AZURE_STORAGE_KEY"
_REFRESH_MARGIN = 300.0
# The development storage account every Azure emulator serves (Azurite's documented, public key).
_DEV_ACCOUNT = "devstoreaccount1"
_DEV_ENDPOINT = "http://127.0.0.1:10000/devstoreaccount1"


def parse_connection_string(text: str) -> dict[str, str]:
    """``Key=Value;...`` as a dict (case kept); values may hold ``=`` (keys and SAS tokens do)."""
    fields: dict[str, str] = {}
    for part in text.strip().strip(";").split(";"):
        if not part.strip():
            continue
        key, sep, value = part.partition("=")
        if not sep or not key.strip():
            raise ConfigError("the Azure Storage connection string is not Key=Value pairs separated by ';'")
        fields[key.strip()] = value.strip()
    if fields.get("UseDevelopmentStorage", "").lower() == "true":
        fields.setdefault("AccountName", _DEV_ACCOUNT)
        fields.setdefault("BlobEndpoint", _DEV_ENDPOINT)
    return fields


def _endpoint_of(fields: Mapping[str, str]) -> str | None:
    if fields.get("BlobEndpoint"):
        return fields["BlobEndpoint"].rstrip("/")
    account = fields.get("AccountName")
    if account:
        protocol = fields.get("DefaultEndpointsProtocol", "https")
        return f"{protocol}://{account}.blob.{fields.get('EndpointSuffix', 'core.windows.net')}"
    return None


@dataclass
class AzureAuth:
    """How requests to one account are authorised, and the endpoint the credentials point at."""

    kind: str
    """``shared-key``, ``sas``, ``token`` or ``anonymous``."""
    identity: str
    """Who the requests are from, for messages (never a secret)."""
    endpoint: str | None = None
    """The blob endpoint the credentials name (a connection string's), when they name one."""
    account: str | None = None
    """The account the credentials are for, when they say."""
    _key: str | None = field(default=None, repr=False)
    _sas: str | None = field(default=None, repr=False)
    _credential: Any = field(default=None, repr=False)
    _token: Any = field(default=None, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def query(self) -> list[tuple[str, str]]:
        """Query parameters to add to every request (a SAS token's), never shown."""
        return parse_qsl(self._sas.lstrip("?"), keep_blank_values=True) if self._sas else []

    def sign(self, method: str, url: str, headers: dict[str, str], *, display: str) -> None:
        """Add ``x-ms-date``, ``x-ms-version`` and the Authorization header to ``headers`` for ``url``."""
        headers["x-ms-version"] = API_VERSION
        headers["x-ms-date"] = formatdate(usegmt=True)
        if self.kind == "shared-key":
            self._sign_shared_key(method, url, headers)
        elif self.kind == "token":
            headers["Authorization"] = f"Bearer {self._bearer(display)}"

    def _sign_shared_key(self, method: str, url: str, headers: dict[str, str]) -> None:
        from azure.core.pipeline import PipelineContext, PipelineRequest
        from azure.core.pipeline.transport import HttpRequest
        from azure.storage.blob._shared.authentication import SharedKeyCredentialPolicy

        request = HttpRequest(method, url, headers=dict(headers))
        policy = SharedKeyCredentialPolicy(self.account, self._key)
        policy.on_request(PipelineRequest(request, PipelineContext(None)))
        headers["Authorization"] = request.headers["Authorization"]

    def _bearer(self, display: str) -> str:
        from azure.core.exceptions import ClientAuthenticationError, ServiceRequestError

        with self._lock:
            token = self._token
            if token is not None and token.expires_on - _REFRESH_MARGIN > time.time():
                return str(token.token)
            try:
                self._token = token = self._credential.get_token(STORAGE_SCOPE)
            except ServiceRequestError as exc:
                raise InterruptedReadError(
                    f"{display}: reaching Entra ID for a token for {self.identity} failed; will retry",
                    uri=display,
                ) from exc
            except ClientAuthenticationError as exc:
                raise SourceAccessDeniedError(
                    f"{display}: no Entra ID token could be obtained for {self.identity}"
                    f" ({type(exc).__name__}: {scrub(exc.message or str(exc))}): on AKS, check the"
                    " ServiceAccount's azure.workload.identity/client-id annotation, the pod label"
                    ' azure.workload.identity/use: "true" and the identity\'s federated credential; or give a'
                    " connection string or SAS token in credentialsSecretRef",
                    uri=display,
                ) from exc
            return str(token.token)


def _client_identity() -> str:
    client = os.environ.get("AZURE_CLIENT_ID", "").strip()
    if os.environ.get("AZURE_FEDERATED_TOKEN_FILE"):
        return f"the workload identity (client id {client or 'unknown'})"
    if client:
        return f"the Entra identity with client id {client}"
    return "the pod's Entra identity (DefaultAzureCredential: managed identity or workload identity)"


def _from_fields(fields: Mapping[str, str], account: str) -> AzureAuth:
    named = fields.get("AccountName")
    if named and named != account:
        raise ConfigError(
            f"the Azure Storage connection string is for account {named!r}, and the source names account"
            f" {account!r}: use az://{named}/CONTAINER/PATH or the connection string of {account!r}"
        )
    endpoint = _endpoint_of({**fields, "AccountName": named or account})
    if fields.get("SharedAccessSignature"):
        return AzureAuth(
            "sas",
            "the connection string's SAS token",
            endpoint,
            account,
            _sas=fields["SharedAccessSignature"],
        )
    if fields.get("AccountKey"):
        return AzureAuth(
            "shared-key", f"the account key of {account!r}", endpoint, account, _key=fields["AccountKey"]
        )
    raise ConfigError(
        "the Azure Storage connection string has neither AccountKey nor SharedAccessSignature: copy it whole"
        " from the portal (Access keys) or give a SAS token"
    )


def _explicit(given: AzureCredentials, account: str) -> AzureAuth:
    if given.connection_string:
        return _from_fields(parse_connection_string(given.connection_string), account)
    if given.sas_token:
        return AzureAuth("sas", "the SAS token", None, account, _sas=given.sas_token)
    return AzureAuth("shared-key", f"the account key of {account!r}", None, account, _key=given.account_key)


def resolve_auth(azure: AzureSettings, account: str) -> AzureAuth:
    """The credentials for ``account`` under ``azure`` (see the module's docstring for the order)."""
    if azure.anonymous:
        return AzureAuth("anonymous", "anonymous access", None, account)
    if azure.credentials is not None:
        return _explicit(azure.credentials, account)
    environ = os.environ
    if environ.get(CONNECTION_STRING_ENV, "").strip():
        return _from_fields(parse_connection_string(environ[CONNECTION_STRING_ENV]), account)
    if environ.get(SAS_TOKEN_ENV, "").strip():
        return AzureAuth(
            "sas", f"the SAS token of {SAS_TOKEN_ENV}", None, account, _sas=environ[SAS_TOKEN_ENV].strip()
        )
    if environ.get(ACCOUNT_KEY_ENV, "").strip():
        return AzureAuth(
            "shared-key",
            f"the account key of {account!r}",
            None,
            account,
            _key=environ[ACCOUNT_KEY_ENV].strip(),
        )
    try:
        from azure.identity import DefaultAzureCredential
    except ImportError as exc:
        raise ConfigError(
            "az:// sources need azure-identity: install modelload[azure] (the sidecar image has it)"
        ) from exc
    try:
        credential = DefaultAzureCredential(exclude_interactive_browser_credential=True)
    except ValueError as exc:  # a malformed AZURE_* variable (an authority that is not https...)
        raise ConfigError(f"Azure credentials cannot be set up: {scrub(str(exc))}") from None
    return AzureAuth("token", _client_identity(), None, account, _credential=credential)
