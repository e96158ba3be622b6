"""The webhook's TLS: a self-managed CA and serving certificate, or files that cert-manager mounts.

The API server calls the webhook through its Service (``<service>.<namespace>.svc``) and checks the serving
certificate against the configuration's ``caBundle``. Two ways to provide both:

* ``files`` (cert-manager, or your own PKI): ``tls.crt``/``tls.key`` are mounted into ``cert_dir``; the CA is
  injected into the MutatingWebhookConfiguration by cert-manager's CA injector. The server reloads the files
  when they change (renewals), so no restart is needed.
* ``self-signed``: at start-up the operator reads (or creates) the Secret ``tls_secret`` in its namespace
  holding a CA (certificate and key) and a serving certificate for the Service's names, writes them to
  ``cert_dir``, and patches the CA into every webhook of the configuration that calls this Service. The
  Secret makes every replica and every restart use the same CA, so they never fight over the caBundle.

Renewal while running (:func:`keep_renewed`): every replica re-reads the Secret on a timer. A serving
certificate past two thirds of its life is replaced by one signed with the same CA, so the caBundle does not
change and replicas that renew at once cannot disagree on what to trust. A CA past two thirds of its own
life (or one from a Secret that kept no CA key) is replaced by a new one, and the old CA stays in the
caBundle beside it until the next CA renewal, so a replica still serving a certificate of the old CA stays
trusted until it reloads. Each replica patches the caBundle *before* it serves a certificate of a new CA.

Private keys are written with mode 0600 and never logged.
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import datetime
import hashlib
import logging
import os
import random
import ssl
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from modelload.operator.kube import Kube, KubeConflictError, KubeError, KubeNotFoundError
from modelload.operator.settings import WebhookSettings

__all__ = [
    "CA_LIFETIME",
    "CERT_LIFETIME",
    "RENEW_AT",
    "Lifetimes",
    "TlsBundle",
    "TlsFiles",
    "bundle_is_usable",
    "ensure_self_signed",
    "generate_bundle",
    "keep_renewed",
    "patch_ca_bundle",
    "renew_bundle",
    "server_context",
    "service_names",
    "watch_and_reload",
]

logger = logging.getLogger(__name__)

CA_LIFETIME = datetime.timedelta(days=3650)
CERT_LIFETIME = datetime.timedelta(days=365)
RENEW_AT = 2 / 3
"""The fraction of a certificate's life after which it is replaced: a year's certificate is renewed with four
months left, so a renewal that fails (API server down, RBAC changed) has months of retries before expiry."""

CHECK_INTERVAL = 600.0
"""Seconds between two reads of the Secret by a running replica (one GET; jittered by up to 10 %)."""

_BACKDATE = datetime.timedelta(minutes=5)  # tolerate clocks a little behind the operator's


@dataclass(frozen=True)
class Lifetimes:
    """How long new certificates live (short ones in tests; the defaults otherwise)."""

    cert: datetime.timedelta = CERT_LIFETIME
    ca: datetime.timedelta = CA_LIFETIME


@dataclass(frozen=True)
class TlsBundle:
    """PEM bytes of a CA certificate, a serving certificate it signed, and the serving key.

    ``ca_key_pem`` lets a renewal sign a new serving certificate with the same CA (empty in Secrets written
    before renewal while running existed: their first renewal makes a new CA). ``previous_ca_pem`` is the CA
    that the last CA renewal replaced, still trusted so replicas can switch over without a refusal.
    """

    ca_pem: bytes
    cert_pem: bytes
    key_pem: bytes
    ca_key_pem: bytes = b""
    previous_ca_pem: bytes = b""

    def __repr__(self) -> str:
        return "TlsBundle(<pem>)"

    def trust_pem(self, *, now: datetime.datetime | None = None) -> bytes:
        """What the caBundle holds: the CA, then the previous CA while it has not expired."""
        previous = self.previous_ca_pem
        if previous and not _valid_at(previous, now or _now()):
            previous = b""
        return self.ca_pem + previous if previous and previous != self.ca_pem else self.ca_pem


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


def generate_bundle(
    names: list[str], *, now: datetime.datetime | None = None, lifetimes: Lifetimes = Lifetimes()
) -> TlsBundle:
    """A new CA (ECDSA P-256, 10 years) and a serving certificate for ``names`` (1 year) signed by it."""
    now = now or _now()
    ca_pem, ca_key_pem = _new_ca(now, lifetimes.ca)
    cert_pem, key_pem = _sign(names, ca_pem, ca_key_pem, now, lifetimes.cert)
    return TlsBundle(ca_pem=ca_pem, cert_pem=cert_pem, key_pem=key_pem, ca_key_pem=ca_key_pem)


def renew_bundle(
    bundle: TlsBundle,
    names: list[str],
    *,
    now: datetime.datetime | None = None,
    lifetimes: Lifetimes = Lifetimes(),
) -> TlsBundle:
    """The bundle to replace ``bundle`` with: a new serving certificate from the same CA when that CA has its
    key, is not due for renewal itself and outlives the new certificate; otherwise a new CA and certificate,
    with the old CA kept as the previous one (still trusted)."""
    now = now or _now()
    if bundle.ca_key_pem and _ca_can_sign(bundle, now, lifetimes.cert):
        cert_pem, key_pem = _sign(names, bundle.ca_pem, bundle.ca_key_pem, now, lifetimes.cert)
        return dataclasses.replace(bundle, cert_pem=cert_pem, key_pem=key_pem)
    fresh = generate_bundle(names, now=now, lifetimes=lifetimes)
    previous = bundle.ca_pem if bundle.ca_pem and _valid_at(bundle.ca_pem, now) else b""
    return dataclasses.replace(fresh, previous_ca_pem=previous)


def _new_ca(now: datetime.datetime, lifetime: datetime.timedelta) -> tuple[bytes, bytes]:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "modelload webhook CA")])
    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - _BACKDATE)
        .not_valid_after(now + lifetime)
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
    return ca.public_bytes(serialization.Encoding.PEM), _key_pem(ca_key)


def _sign(
    names: list[str], ca_pem: bytes, ca_key_pem: bytes, now: datetime.datetime, lifetime: datetime.timedelta
) -> tuple[bytes, bytes]:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    ca = x509.load_pem_x509_certificate(ca_pem)
    ca_key = serialization.load_pem_private_key(ca_key_pem, password=None)
    if not isinstance(ca_key, ec.EllipticCurvePrivateKey):
        raise ValueError("the webhook CA key is not an EC key")
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, names[0])]))
        .issuer_name(ca.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - _BACKDATE)
        .not_valid_after(min(now + lifetime, ca.not_valid_after_utc))
        .add_extension(x509.SubjectAlternativeName([x509.DNSName(n) for n in names]), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False
        )
        .sign(ca_key, hashes.SHA256())
    )
    return cert.public_bytes(serialization.Encoding.PEM), _key_pem(key)


def _key_pem(key: Any) -> bytes:
    from cryptography.hazmat.primitives import serialization

    pem: bytes = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    return pem


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.timezone.utc)


def _renewal_time(pem: bytes) -> datetime.datetime:
    """When a certificate is due for renewal: two thirds into its life."""
    from cryptography import x509

    cert = x509.load_pem_x509_certificate(pem)
    end = cert.not_valid_after_utc
    start = min(cert.not_valid_before_utc + _BACKDATE, end)  # when it was issued, not its backdated start
    return start + (end - start) * RENEW_AT


def _valid_at(pem: bytes, now: datetime.datetime) -> bool:
    from cryptography import x509

    try:
        cert = x509.load_pem_x509_certificate(pem)
    except ValueError:
        return False
    return cert.not_valid_before_utc <= now < cert.not_valid_after_utc


def _ca_can_sign(bundle: TlsBundle, now: datetime.datetime, lifetime: datetime.timedelta) -> bool:
    from cryptography import x509

    try:
        ca = x509.load_pem_x509_certificate(bundle.ca_pem)
    except ValueError:
        return False
    return now < _renewal_time(bundle.ca_pem) and ca.not_valid_after_utc >= now + lifetime


def bundle_is_usable(bundle: TlsBundle, names: list[str], *, now: datetime.datetime | None = None) -> bool:
    """Whether the serving certificate covers ``names``, chains to the CA, and neither is due for renewal
    (two thirds into its life)."""
    from cryptography import x509
    from cryptography.exceptions import InvalidSignature

    now = now or _now()
    try:
        cert = x509.load_pem_x509_certificate(bundle.cert_pem)
        ca = x509.load_pem_x509_certificate(bundle.ca_pem)
        cert.verify_directly_issued_by(ca)
        sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except (ValueError, TypeError, x509.ExtensionNotFound, InvalidSignature):
        return False
    if not set(names) <= set(sans.get_values_for_type(x509.DNSName)):
        return False
    return now < min(_renewal_time(bundle.cert_pem), _renewal_time(bundle.ca_pem))


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
    kube: Kube,
    *,
    namespace: str,
    webhook: WebhookSettings,
    lifetimes: Lifetimes = Lifetimes(),
    now: datetime.datetime | None = None,
) -> tuple[TlsBundle, TlsFiles]:
    """Read or create the CA and serving certificate Secret, renew what is due, and write the files the
    server loads."""
    bundle = await _current_bundle(kube, namespace=namespace, webhook=webhook, lifetimes=lifetimes, now=now)
    return bundle, write_files(bundle, webhook.cert_dir)


async def _current_bundle(
    kube: Kube,
    *,
    namespace: str,
    webhook: WebhookSettings,
    lifetimes: Lifetimes,
    now: datetime.datetime | None,
) -> TlsBundle:
    """The Secret's bundle, created or renewed first when it is missing or due."""
    names = service_names(webhook.service, namespace)
    secret = webhook.tls_secret
    bundle = await _read_bundle(kube, namespace, secret)
    if bundle is not None and bundle_is_usable(bundle, names, now=now):
        return bundle
    if bundle is None:
        fresh = generate_bundle(names, now=now, lifetimes=lifetimes)
        try:
            await kube.create_secret(namespace, _secret_body(secret, fresh))
            logger.info("created the webhook CA and certificate in Secret %s/%s", namespace, secret)
        except KubeConflictError:  # another replica created it first: use theirs
            pass
    else:
        fresh = renew_bundle(bundle, names, now=now, lifetimes=lifetimes)
        new_ca = fresh.ca_pem != bundle.ca_pem
        data = _secret_body(secret, fresh)["data"]
        gone = dict.fromkeys(_SECRET_KEYS - set(data))  # null in a merge patch removes the key
        await kube.patch_secret(namespace, secret, {"data": {**data, **gone}})
        logger.info(
            "renewed the webhook %s in Secret %s/%s",
            "CA and certificate (the old CA stays trusted beside the new one)" if new_ca else "certificate",
            namespace,
            secret,
        )
    # Read back what the Secret holds now: when replicas renew at once, the last write wins for all of them.
    stored = await _read_bundle(kube, namespace, secret)
    if stored is None:
        raise RuntimeError(f"the webhook TLS Secret {namespace}/{secret} vanished while being written")
    return stored


async def keep_renewed(
    kube: Kube,
    *,
    namespace: str,
    webhook: WebhookSettings,
    context: ssl.SSLContext,
    files: TlsFiles,
    interval: float = CHECK_INTERVAL,
    lifetimes: Lifetimes = Lifetimes(),
) -> None:
    """Keep the self-signed certificate valid while the operator runs: every ``interval`` seconds (jittered),
    renew what is due in the Secret, make the caBundle trust the Secret's CAs, then serve the Secret's
    certificate. Runs until cancelled; a failed round is logged and tried again at the next one."""
    served = files.cert.read_bytes() if files.cert.is_file() else b""
    while True:
        await asyncio.sleep(interval * (1 + random.random() / 10))
        try:
            bundle = await _current_bundle(
                kube, namespace=namespace, webhook=webhook, lifetimes=lifetimes, now=None
            )
            try:
                await patch_ca_bundle(
                    kube,
                    configuration=webhook.configuration,
                    namespace=namespace,
                    service=webhook.service,
                    ca_pem=bundle.trust_pem(),
                )
            except KubeNotFoundError:
                logger.warning("MutatingWebhookConfiguration %r not found", webhook.configuration)
            if bundle.cert_pem != served:  # only once the caBundle trusts its CA
                write_files(bundle, webhook.cert_dir)
                context.load_cert_chain(files.cert, files.key)
                served = bundle.cert_pem
                logger.info("serving the renewed webhook certificate")
        except (KubeError, OSError, ssl.SSLError, ValueError) as exc:
            logger.warning(
                "could not renew or reload the webhook certificate (retrying in %.0f s): %s", interval, exc
            )


async def _read_bundle(kube: Kube, namespace: str, name: str) -> TlsBundle | None:
    try:
        data = await kube.read_secret(namespace, name)
    except KubeNotFoundError:
        return None
    if not {"ca.crt", "tls.crt", "tls.key"} <= set(data):
        return TlsBundle(b"", b"", b"")  # present but unusable: replaced by the caller
    return TlsBundle(
        ca_pem=data["ca.crt"],
        cert_pem=data["tls.crt"],
        key_pem=data["tls.key"],
        ca_key_pem=data.get("ca.key", b""),
        previous_ca_pem=data.get("ca-previous.crt", b""),
    )


def _secret_body(name: str, bundle: TlsBundle) -> dict[str, Any]:
    pems = {
        "ca.crt": bundle.ca_pem,
        "ca.key": bundle.ca_key_pem,
        "ca-previous.crt": bundle.previous_ca_pem,
        "tls.crt": bundle.cert_pem,
        "tls.key": bundle.key_pem,
    }

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
        "data": {key: b64(value) for key, value in pems.items() if value},
    }


_SECRET_KEYS = frozenset({"ca.crt", "ca.key", "ca-previous.crt", "tls.crt", "tls.key"})


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
