"""The webhook's TLS: a self-managed CA and serving certificate, or files that cert-manager mounts.

The API server calls the webhook through its Service (``<service>.<namespace>.svc``) and checks the serving
certificate against the configuration's ``caBundle``. Two ways to provide both:

* ``files`` (cert-manager, or your own PKI): ``tls.crt``/``tls.key`` are mounted into ``cert_dir``; the CA is
  injected into the MutatingWebhookConfiguration by cert-manager's CA injector. The server reloads the files
  when they change (renewals), so no restart is needed.
* ``self-signed``: at start-up the operator reads (or creates) the Secret ``tls_secret`` in its namespace
  holding a CA and a serving certificate for the Service's names, writes them to ``cert_dir``, and patches
  the CA into every webhook of the configuration that calls this Service. The Secret makes every replica and
  every restart use the same CA, so they never fight over the caBundle. Certificates close to expiry (or for
  other names) are replaced at start-up.

Private keys are written with mode 0600 and never logged.
"""

from __future__ import annotations

import asyncio
import base64
import datetime
import hashlib
import logging
import os
import ssl
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from modelload.operator.kube import Kube, KubeConflictError, KubeNotFoundError
from modelload.operator.settings import WebhookSettings

__all__ = [
    "TlsBundle",
    "TlsFiles",
    "ensure_self_signed",
    "generate_bundle",
    "patch_ca_bundle",
    "server_context",
    "service_names",
    "watch_and_reload",
]

logger = logging.getLogger(__name__)

CA_DAYS = 3650
CERT_DAYS = 365
RENEW_BEFORE = datetime.timedelta(days=30)


@dataclass(frozen=True)
class TlsBundle:
    """PEM bytes of a CA certificate, a serving certificate it signed, and the serving key."""

    ca_pem: bytes
    cert_pem: bytes
    key_pem: bytes

    def __repr__(self) -> str:
        return "TlsBundle(<pem>)"


@dataclass(frozen=True)
class TlsFiles:
    cert: Path
    key: Path


def service_names(service: str, namespace: str) -> list[str]:
    """The DNS names the API server may use for the Service (it uses ``<svc>.<ns>.svc``)."""
    return [
        service,
        f"{service}.{namespace}",
        f"{service}.{namespace}.svc",
        f"{service}.{namespace}.svc.cluster.local",
    ]


def generate_bundle(names: list[str], *, now: datetime.datetime | None = None) -> TlsBundle:
    """A new CA (ECDSA P-256, 10 years) and a serving certificate for ``names`` (1 year) signed by it."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = now or datetime.datetime.now(datetime.timezone.utc)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "modelload webhook CA")])
    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=CA_DAYS))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, names[0])]))
        .issuer_name(ca_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=CERT_DAYS))
        .add_extension(x509.SubjectAlternativeName([x509.DNSName(n) for n in names]), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False
        )
        .sign(ca_key, hashes.SHA256())
    )
    return TlsBundle(
        ca_pem=ca.public_bytes(serialization.Encoding.PEM),
        cert_pem=cert.public_bytes(serialization.Encoding.PEM),
        key_pem=key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        ),
    )


def bundle_is_usable(bundle: TlsBundle, names: list[str], *, now: datetime.datetime | None = None) -> bool:
    """Whether the serving certificate covers ``names``, chains to the CA, and has 30+ days left."""
    from cryptography import x509
    from cryptography.exceptions import InvalidSignature

    now = now or datetime.datetime.now(datetime.timezone.utc)
    try:
        cert = x509.load_pem_x509_certificate(bundle.cert_pem)
        ca = x509.load_pem_x509_certificate(bundle.ca_pem)
        cert.verify_directly_issued_by(ca)
        sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except (ValueError, TypeError, x509.ExtensionNotFound, InvalidSignature):
        return False
    if not set(names) <= set(sans.get_values_for_type(x509.DNSName)):
        return False
    return min(cert.not_valid_after_utc, ca.not_valid_after_utc) - now > RENEW_BEFORE


def write_files(bundle: TlsBundle, cert_dir: Path) -> TlsFiles:
    cert_dir.mkdir(parents=True, exist_ok=True)
    files = TlsFiles(cert=cert_dir / "tls.crt", key=cert_dir / "tls.key")
    files.cert.write_bytes(bundle.cert_pem)
    fd = os.open(files.key, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as out:
        out.write(bundle.key_pem)
    (cert_dir / "ca.crt").write_bytes(bundle.ca_pem)
    return files


async def ensure_self_signed(
    kube: Kube, *, namespace: str, webhook: WebhookSettings
) -> tuple[TlsBundle, TlsFiles]:
    """Read or create the CA and serving certificate Secret, and write the files the server loads."""
    names = service_names(webhook.service, namespace)
    bundle = await _read_bundle(kube, namespace, webhook.tls_secret)
    if bundle is None or not bundle_is_usable(bundle, names):
        fresh = generate_bundle(names)
        body = _secret_body(webhook.tls_secret, fresh)
        if bundle is None:
            try:
                await kube.create_secret(namespace, body)
                bundle = fresh
                logger.info(
                    "created the webhook CA and certificate in Secret %s/%s", namespace, webhook.tls_secret
                )
            except KubeConflictError:  # another replica created it first: use theirs
                bundle = await _read_bundle(kube, namespace, webhook.tls_secret)
        else:
            await kube.patch_secret(namespace, webhook.tls_secret, {"data": body["data"]})
            bundle = fresh
            logger.info("renewed the webhook certificate in Secret %s/%s", namespace, webhook.tls_secret)
    if bundle is None:
        raise RuntimeError(
            f"the webhook TLS Secret {namespace}/{webhook.tls_secret} vanished while being created"
        )
    return bundle, write_files(bundle, webhook.cert_dir)


async def _read_bundle(kube: Kube, namespace: str, name: str) -> TlsBundle | None:
    try:
        data = await kube.read_secret(namespace, name)
    except KubeNotFoundError:
        return None
    if not {"ca.crt", "tls.crt", "tls.key"} <= set(data):
        return TlsBundle(b"", b"", b"")  # present but unusable: replaced by the caller
    return TlsBundle(ca_pem=data["ca.crt"], cert_pem=data["tls.crt"], key_pem=data["tls.key"])


def _secret_body(name: str, bundle: TlsBundle) -> dict[str, Any]:
    def b64(data: bytes) -> str:
        return base64.b64encode(data).decode("ascii")

    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "type": "kubernetes.io/tls",
        "metadata": {
            "name": name,
            "labels": {"app.kubernetes.io/name": "modelload", "app.kubernetes.io/component": "webhook"},
        },
        "data": {
            "ca.crt": b64(bundle.ca_pem),
            "tls.crt": b64(bundle.cert_pem),
            "tls.key": b64(bundle.key_pem),
        },
    }


async def patch_ca_bundle(
    kube: Kube, *, configuration: str, namespace: str, service: str, ca_pem: bytes
) -> int:
    """Set ``caBundle`` on each webhook of ``configuration`` that calls ``service``; returns how many changed.

    A JSON patch per webhook index, guarded by a ``test`` of the webhook's name, so a concurrent edit of the
    list fails the patch instead of writing the CA into the wrong entry.
    """
    mwc = await kube.read_mutating_webhook_configuration(configuration)
    encoded = base64.b64encode(ca_pem).decode("ascii")
    ops: list[dict[str, Any]] = []
    for index, hook in enumerate(mwc.get("webhooks") or []):
        svc = (hook.get("clientConfig") or {}).get("service") or {}
        if svc.get("name") != service or svc.get("namespace") != namespace:
            continue
        if (hook.get("clientConfig") or {}).get("caBundle") == encoded:
            continue
        ops.append({"op": "test", "path": f"/webhooks/{index}/name", "value": hook.get("name")})
        ops.append({"op": "add", "path": f"/webhooks/{index}/clientConfig/caBundle", "value": encoded})
    if ops:
        await kube.json_patch_mutating_webhook_configuration(configuration, ops)
        logger.info("set the caBundle of %d webhook(s) in %s", len(ops) // 2, configuration)
    return len(ops) // 2


def server_context(files: TlsFiles) -> ssl.SSLContext:
    """A TLS 1.2+ server context with the serving certificate loaded."""
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.load_cert_chain(files.cert, files.key)
    return context


def _digest(files: TlsFiles) -> str:
    hasher = hashlib.sha256()
    for path in (files.cert, files.key):
        try:
            hasher.update(path.read_bytes())
        except OSError:
            hasher.update(b"missing")
    return hasher.hexdigest()


async def watch_and_reload(context: ssl.SSLContext, files: TlsFiles, *, interval: float = 30.0) -> None:
    """Reload the certificate into ``context`` whenever the files change (new handshakes use it).

    Mounted Secrets change by an atomic symlink swap that sends no usable file event, so the files are
    re-read on a timer; a hash of their bytes is all that is kept between reads.
    """
    seen = _digest(files)
    while True:
        await asyncio.sleep(interval)
        current = _digest(files)
        if current == seen:
            continue
        try:
            context.load_cert_chain(files.cert, files.key)
        except (OSError, ssl.SSLError) as exc:
            logger.warning(
                "the webhook certificate files changed but cannot be loaded yet: %s", type(exc).__name__
            )
            continue
        seen = current
        logger.info("reloaded the webhook certificate")
