"""The webhook's self-managed CA: certificates the API server accepts, kept in one Secret, renewed in time."""

from __future__ import annotations

import asyncio
import datetime
import ssl
from pathlib import Path
from typing import Any

import pytest
from cryptography import x509

from modelload.operator.kube import Kube
from modelload.operator.settings import WebhookSettings
from modelload.operator.tls import (
    bundle_is_usable,
    ensure_self_signed,
    generate_bundle,
    server_context,
    service_names,
    watch_and_reload,
    write_files,
)
from tests.operator.conftest import MWC, MWC_NAME, OPERATOR_NAMESPACE, current, wait_for

NAMES = service_names("modelload-webhook", "modelload-system")


def test_the_serving_certificate_names_the_service_and_chains_to_the_ca() -> None:
    bundle = generate_bundle(NAMES)
    cert = x509.load_pem_x509_certificate(bundle.cert_pem)
    ca = x509.load_pem_x509_certificate(bundle.ca_pem)
    cert.verify_directly_issued_by(ca)
    sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert "modelload-webhook.modelload-system.svc" in sans.get_values_for_type(x509.DNSName)
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca is True
    assert cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca is False
    assert "PRIVATE KEY" not in repr(bundle)


def test_a_client_trusting_the_ca_verifies_the_service_name(tmp_path: Path) -> None:
    """What the API server does: trust the caBundle, check the name it dialled."""
    bundle = generate_bundle(NAMES)
    files = write_files(bundle, tmp_path)
    assert files.key.stat().st_mode & 0o777 == 0o600
    server = server_context(files)
    client = ssl.create_default_context(cadata=bundle.ca_pem.decode())
    for name, ok in (("modelload-webhook.modelload-system.svc", True), ("evil.example.com", False)):
        incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
        s_in, s_out = ssl.MemoryBIO(), ssl.MemoryBIO()
        c = client.wrap_bio(incoming, outgoing, server_hostname=name)
        s = server.wrap_bio(s_in, s_out, server_side=True)
        error = None
        completed = False
        for _ in range(10):
            for side in (c, s):
                try:
                    side.do_handshake()
                    completed = completed or side is c
                except ssl.SSLWantReadError:
                    pass
                except ssl.SSLCertVerificationError as exc:
                    error = exc
                except ssl.SSLError:
                    pass
            s_in.write(outgoing.read())
            incoming.write(s_out.read())
            if error or completed:
                break
        assert (error is None and completed) is ok, (name, error)


def test_old_or_foreign_certificates_are_not_reused() -> None:
    bundle = generate_bundle(NAMES)
    assert bundle_is_usable(bundle, NAMES)
    later = datetime.datetime.now(datetime.timezone.utc) + datetime.timedelta(days=340)
    assert not bundle_is_usable(bundle, NAMES, now=later)  # under 30 days left: renew
    assert not bundle_is_usable(bundle, service_names("other", "modelload-system"))
    other = generate_bundle(NAMES)
    mixed = type(bundle)(ca_pem=other.ca_pem, cert_pem=bundle.cert_pem, key_pem=bundle.key_pem)
    assert not bundle_is_usable(mixed, NAMES)


@pytest.fixture
def webhook(tmp_path: Path) -> WebhookSettings:
    return WebhookSettings(cert_dir=tmp_path / "certs")


async def test_replicas_and_restarts_share_one_ca_through_the_secret(
    kube: Any, client_configuration: Any, webhook: WebhookSettings, tmp_path: Path
) -> None:
    api = Kube(client_configuration)
    try:
        first, _ = await ensure_self_signed(api, namespace=OPERATOR_NAMESPACE, webhook=webhook)
        other = WebhookSettings(cert_dir=tmp_path / "other")
        second, files = await ensure_self_signed(api, namespace=OPERATOR_NAMESPACE, webhook=other)
    finally:
        await api.close()
    assert second.ca_pem == first.ca_pem and second.cert_pem == first.cert_pem
    assert files.cert.read_bytes() == first.cert_pem
    secret = current(kube, "v1/secrets", OPERATOR_NAMESPACE, webhook.tls_secret)
    assert secret is not None and secret["type"] == "kubernetes.io/tls"


async def test_an_expiring_certificate_in_the_secret_is_replaced(
    kube: Any, client_configuration: Any, webhook: WebhookSettings
) -> None:
    old = generate_bundle(
        NAMES, now=datetime.datetime.now(datetime.timezone.utc) - datetime.timedelta(days=350)
    )
    from modelload.operator.tls import _secret_body

    kube.objects["v1/secrets", OPERATOR_NAMESPACE, webhook.tls_secret] = {
        **_secret_body(webhook.tls_secret, old),
        "metadata": {"name": webhook.tls_secret, "namespace": OPERATOR_NAMESPACE, "resourceVersion": "1"},
    }
    api = Kube(client_configuration)
    try:
        fresh, _ = await ensure_self_signed(api, namespace=OPERATOR_NAMESPACE, webhook=webhook)
    finally:
        await api.close()
    assert fresh.cert_pem != old.cert_pem
    assert bundle_is_usable(fresh, NAMES)


async def test_the_ca_goes_only_into_webhooks_that_call_the_operators_service(
    kube: Any, client_configuration: Any
) -> None:
    from modelload.operator.tls import patch_ca_bundle

    mwc = current(kube, MWC, None, MWC_NAME)
    assert mwc is not None
    foreign = {"name": "other.example.com", "clientConfig": {"url": "https://example.com/hook"}}
    kube.objects[MWC, None, MWC_NAME] = {**mwc, "webhooks": [foreign, *mwc["webhooks"]]}
    api = Kube(client_configuration)
    try:
        changed = await patch_ca_bundle(
            api,
            configuration=MWC_NAME,
            namespace=OPERATOR_NAMESPACE,
            service="modelload-webhook",
            ca_pem=b"CA",
        )
        again = await patch_ca_bundle(
            api,
            configuration=MWC_NAME,
            namespace=OPERATOR_NAMESPACE,
            service="modelload-webhook",
            ca_pem=b"CA",
        )
    finally:
        await api.close()
    assert (changed, again) == (1, 0)
    hooks = (current(kube, MWC, None, MWC_NAME) or {})["webhooks"]
    assert "caBundle" not in hooks[0]["clientConfig"]
    assert hooks[1]["clientConfig"]["caBundle"] == "Q0E="


async def test_renewed_certificate_files_are_loaded_without_a_restart(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from modelload.operator import tls

    looks: list[object] = []
    digest = tls._digest
    monkeypatch.setattr(tls, "_digest", lambda files: looks.append(files) or digest(files))
    first = generate_bundle(NAMES)
    files = write_files(first, tmp_path)
    context = server_context(files)
    reloads: list[str] = []
    original = context.load_cert_chain

    def spy(*args: Any, **kwargs: Any) -> None:
        reloads.append(str(args[0]))
        original(*args, **kwargs)

    context.load_cert_chain = spy  # type: ignore[method-assign]
    task = asyncio.create_task(watch_and_reload(context, files, interval=0.05))
    try:
        await wait_for(lambda: len(looks) >= 3, what="two looks at the unchanged files")
        assert reloads == [], "unchanged files are not loaded again"
        write_files(generate_bundle(NAMES), tmp_path)
        await wait_for(lambda: reloads, what="the renewed files loaded")
    finally:
        task.cancel()
    assert reloads == [str(files.cert)]


# --- renewal while running ---------------------------------------------------------------------------------

SERVICE_NAME = "modelload-webhook.modelload-system.svc"


def trusted_by_the_api_server(kube: Any) -> bytes:
    """The caBundle the emulated API server would use to call the webhook."""
    import base64

    mwc = current(kube, MWC, None, MWC_NAME) or {}
    return base64.b64decode(mwc["webhooks"][0]["clientConfig"]["caBundle"])


async def served_serial(port: int, trust: bytes) -> int:
    """Handshake as the API server does (trusting ``trust``, dialling the Service name); the served serial."""
    client = ssl.create_default_context(cadata=trust.decode())
    _, writer = await asyncio.open_connection("127.0.0.1", port, ssl=client, server_hostname=SERVICE_NAME)
    der = writer.get_extra_info("ssl_object").getpeercert(binary_form=True)
    writer.close()
    return int(x509.load_der_x509_certificate(der).serial_number)


class Replica:
    """One operator replica's TLS side: its cert files, a TLS server on loopback, and its renewal task."""

    def __init__(self, api: Kube, settings: WebhookSettings, lifetimes: Any) -> None:
        self.api, self.settings, self.lifetimes = api, settings, lifetimes

    async def __aenter__(self) -> Replica:
        from modelload.operator.tls import keep_renewed, patch_ca_bundle

        bundle, files = await ensure_self_signed(
            self.api, namespace=OPERATOR_NAMESPACE, webhook=self.settings, lifetimes=self.lifetimes
        )
        await patch_ca_bundle(
            self.api,
            configuration=MWC_NAME,
            namespace=OPERATOR_NAMESPACE,
            service="modelload-webhook",
            ca_pem=bundle.trust_pem(),
        )
        context = server_context(files)
        self.server = await asyncio.start_server(lambda r, w: w.close(), "127.0.0.1", 0, ssl=context)
        self.port = self.server.sockets[0].getsockname()[1]
        self.task = asyncio.create_task(
            keep_renewed(
                self.api,
                namespace=OPERATOR_NAMESPACE,
                webhook=self.settings,
                context=context,
                files=files,
                interval=0.1,
                lifetimes=self.lifetimes,
            )
        )
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.task.cancel()
        self.server.close()
        await self.server.wait_closed()


async def watch_replicas(
    kube: Any, replicas: list[Replica], seconds: float
) -> tuple[list[set[int]], list[bytes]]:
    """Handshake with every replica for ``seconds``, trusting the caBundle of that moment: any refusal
    raises. Returns the serials each replica served and the caBundles seen, in order."""
    seen: list[set[int]] = [set() for _ in replicas]
    bundles: list[bytes] = []
    deadline = asyncio.get_running_loop().time() + seconds
    while asyncio.get_running_loop().time() < deadline:
        trust = trusted_by_the_api_server(kube)
        if not bundles or bundles[-1] != trust:
            bundles.append(trust)
        for replica, serials in zip(replicas, seen, strict=True):
            serials.add(await served_serial(replica.port, trust))
        await asyncio.sleep(0.05)
    return seen, bundles


@pytest.mark.slow
async def test_two_running_replicas_renew_the_certificate_before_it_expires_and_stay_trusted(
    kube: Any, client_configuration: Any, tmp_path: Path
) -> None:
    """Certificates of 6 s: renewed at 4 s by one of two replicas, served by both before the first expires,
    with the same CA (the caBundle never changes), and never refused on the way. (Lifetimes leave seconds of
    slack: a loaded CI machine must not make a renewal look late.)"""
    from modelload.operator.tls import Lifetimes

    short = Lifetimes(cert=datetime.timedelta(seconds=6))
    api = Kube(client_configuration)
    try:
        async with (
            Replica(api, WebhookSettings(cert_dir=tmp_path / "a"), short) as a,
            Replica(api, WebhookSettings(cert_dir=tmp_path / "b"), short) as b,
        ):
            ca_before = trusted_by_the_api_server(kube)
            seen, bundles = await watch_replicas(kube, [a, b], 7.0)  # past the first certificate's expiry
            secret = await api.read_secret(OPERATOR_NAMESPACE, "modelload-webhook-tls")
    finally:
        await api.close()
    assert all(len(serials) >= 2 for serials in seen), seen  # each replica moved to a renewed certificate
    assert bundles == [ca_before]  # same CA throughout: nothing for the API server to learn
    final = int(x509.load_pem_x509_certificate(secret["tls.crt"]).serial_number)
    assert all(final in serials for serials in seen)  # both ended on the Secret's certificate
    assert "ca-previous.crt" not in secret


@pytest.mark.slow
async def test_a_ca_due_for_renewal_is_replaced_with_the_old_one_still_trusted(
    kube: Any, client_configuration: Any, tmp_path: Path
) -> None:
    """A CA of 7.5 s: at 5 s a new CA and certificate replace it; the caBundle holds both while the replica
    switches (until the old CA expires), and the replica is never refused."""
    from modelload.operator.tls import Lifetimes

    short = Lifetimes(cert=datetime.timedelta(seconds=7.5), ca=datetime.timedelta(seconds=7.5))
    api = Kube(client_configuration)
    try:
        async with Replica(api, WebhookSettings(cert_dir=tmp_path / "a"), short) as a:
            first_ca = trusted_by_the_api_server(kube)
            seen, bundles = await watch_replicas(kube, [a], 6.5)
            secret = await api.read_secret(OPERATOR_NAMESPACE, "modelload-webhook-tls")
    finally:
        await api.close()
    assert len(seen[0]) >= 2, seen
    assert secret["ca.crt"] != first_ca and secret["ca-previous.crt"] == first_ca
    assert bundles[:2] == [first_ca, secret["ca.crt"] + first_ca]  # the new CA joins before it is served


def test_renewal_keeps_the_ca_when_it_can_and_replaces_it_when_it_must() -> None:
    from modelload.operator.tls import TlsBundle, renew_bundle

    now = datetime.datetime.now(datetime.timezone.utc)
    bundle = generate_bundle(NAMES, now=now)
    later = now + datetime.timedelta(days=250)  # the certificate is due (2/3 of a year), the CA is not
    assert not bundle_is_usable(bundle, NAMES, now=later)
    renewed = renew_bundle(bundle, NAMES, now=later)
    assert renewed.ca_pem == bundle.ca_pem and renewed.cert_pem != bundle.cert_pem
    assert bundle_is_usable(renewed, NAMES, now=later) and renewed.trust_pem(now=later) == bundle.ca_pem
    # A Secret from before the CA key was kept: the first renewal makes a new CA; the old one stays trusted.
    keyless = TlsBundle(ca_pem=bundle.ca_pem, cert_pem=bundle.cert_pem, key_pem=bundle.key_pem)
    replaced = renew_bundle(keyless, NAMES, now=later)
    assert replaced.ca_pem != bundle.ca_pem and replaced.previous_ca_pem == bundle.ca_pem
    assert replaced.trust_pem(now=later) == replaced.ca_pem + bundle.ca_pem
    # Once the old CA has expired, it leaves the caBundle.
    assert replaced.trust_pem(now=now + datetime.timedelta(days=3651)) == replaced.ca_pem
