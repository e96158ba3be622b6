"""S3 sources against moto's S3 server: signed range reads, credentials, errors, addressing, endpoints."""

from __future__ import annotations

import json
import socket
import sys
import textwrap
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from modelload.loader.errors import (
    ConfigError,
    SourceAccessDeniedError,
    SourceChangedError,
    SourceError,
    SourceNotFoundError,
)
from modelload.sidecar.sources import (
    HttpSettings,
    RetryPolicy,
    S3Credentials,
    S3Settings,
    S3Source,
    SourceSettings,
    open_source,
    stat_with_prefix,
)
from tests.support.fault_proxy import FaultProxy
from tests.support.moto_s3 import Credentials, MotoS3Server

from .conftest import payload

BUCKET = "sources-s3"
DATA = payload(300_001, seed=4)
KEY = "models/tiny model.bin"
URI = f"s3://{BUCKET}/{KEY}"


@pytest.fixture(scope="module")
def uploaded(moto_s3: MotoS3Server) -> str:
    return moto_s3.put(BUCKET, KEY, DATA)


def _settings(endpoint: str, **s3: Any) -> SourceSettings:
    return SourceSettings(
        http=HttpSettings(connect_timeout=2, stall_timeout=5), s3=S3Settings(endpoint_url=endpoint, **s3)
    )


def _read_all(source: S3Source, *, threads: int = 1, chunk: int = 64 * 1024) -> bytes:
    out = bytearray(len(DATA))
    with ThreadPoolExecutor(threads) as pool:
        list(
            pool.map(
                lambda off: source.read_into(off, memoryview(out)[off : off + chunk]),
                range(0, len(DATA), chunk),
            )
        )
    return bytes(out)


def test_ranges_are_byte_exact_including_the_last_partial_one(
    moto_s3: MotoS3Server, uploaded: str, aws_env: Credentials
) -> None:
    with open_source(uploaded, _settings(moto_s3.endpoint)) as source:
        assert isinstance(source, S3Source)
        info = source.stat()
        assert info.size == len(DATA) and info.etag == moto_s3.etag(BUCKET, KEY)
        assert _read_all(source) == DATA
        assert source.read_bytes(len(DATA) - 1, 1) == DATA[-1:]
        assert source.read_bytes(len(DATA), 0) == b""


def test_eight_threads_read_one_object_with_one_connection_each(
    moto_proxy: FaultProxy, uploaded: str, aws_env: Credentials
) -> None:
    with open_source(uploaded, _settings(moto_proxy.endpoint)) as source:
        source.stat()
        assert _read_all(source, threads=8, chunk=16 * 1024) == DATA
    assert moto_proxy.connections <= 9
    assert all(r.headers["authorization"].startswith("AWS4-HMAC-SHA256 ") for r in moto_proxy.requests)


def test_an_empty_object_has_size_zero(moto_s3: MotoS3Server, aws_env: Credentials) -> None:
    uri = moto_s3.put(BUCKET, "empty.bin", b"")
    with open_source(uri, _settings(moto_s3.endpoint)) as source:
        assert source.stat().size == 0


def test_an_object_stored_with_a_content_encoding_is_refused_not_loaded_encoded(
    moto_s3: MotoS3Server, aws_env: Credentials
) -> None:
    """S3 serves an object uploaded with ``--content-encoding gzip`` (as web assets often are) as it is
    stored, saying so: the sidecar took the compressed bytes for the file (a tokenizer.json of gzip, which
    the app then failed to parse), and the store's checksum, of the stored bytes, agreed."""
    import gzip

    moto_s3.create_bucket(BUCKET)
    moto_s3.client().put_object(
        Bucket=BUCKET,
        Key="gz/tokenizer.json",
        Body=gzip.compress(b'{"version": "1.0"}'),
        ContentEncoding="gzip",
    )
    with (
        pytest.raises(SourceError, match=r"served with Content-Encoding 'gzip'.*without a content encoding"),
        open_source(f"s3://{BUCKET}/gz/tokenizer.json", _settings(moto_s3.endpoint)) as source,
    ):
        stat_with_prefix(source, 1 << 20, policy=RetryPolicy())


def test_a_missing_key_names_the_bucket_and_the_key(
    moto_s3: MotoS3Server, uploaded: str, aws_env: Credentials
) -> None:
    with pytest.raises(
        SourceNotFoundError, match=rf"no object 'models/absent.bin' in bucket '{BUCKET}'.*NoSuchKey"
    ):
        open_source(f"s3://{BUCKET}/models/absent.bin", _settings(moto_s3.endpoint)).stat()


def test_a_missing_bucket_names_the_bucket(moto_s3: MotoS3Server, aws_env: Credentials) -> None:
    with pytest.raises(SourceNotFoundError, match=r"bucket 'no-such-bucket' does not exist.*NoSuchBucket"):
        open_source("s3://no-such-bucket/k.bin", _settings(moto_s3.endpoint)).stat()


def test_an_object_replaced_during_the_load_fails_as_changed(
    moto_s3: MotoS3Server, aws_env: Credentials
) -> None:
    uri = moto_s3.put(BUCKET, "replaced.bin", DATA[:1000])
    with open_source(uri, _settings(moto_s3.endpoint)) as source:
        source.stat()
        moto_s3.put(BUCKET, "replaced.bin", DATA[1:1001])
        with pytest.raises(SourceChangedError):
            source.read_bytes(0, 100)


def _denied(
    endpoint: str, credentials: Credentials, monkeypatch: pytest.MonkeyPatch
) -> SourceAccessDeniedError:
    monkeypatch.delenv("AWS_SESSION_TOKEN", raising=False)
    for name, value in credentials.env().items():
        monkeypatch.setenv(name, value)
    with pytest.raises(SourceAccessDeniedError) as caught:
        open_source(URI, _settings(endpoint)).stat()
    for secret in (*credentials.secrets(), credentials.access_key):
        assert secret not in str(caught.value)
    return caught.value


def test_refused_credentials_are_access_denied_without_secrets(
    moto_s3: MotoS3Server, uploaded: str, aws_env: Credentials, monkeypatch: pytest.MonkeyPatch
) -> None:
    with moto_s3.enforce_auth() as kit:
        stranger = _denied(moto_s3.endpoint, kit.stranger, monkeypatch)
        assert "AccessDenied" in str(stranger) and f"arn:aws:s3:::{BUCKET}/{KEY}" in str(stranger)
        wrong_secret = Credentials(kit.reader.access_key, "not-the-secret-of-this-key-000000000000")
        assert "SignatureDoesNotMatch" in str(_denied(moto_s3.endpoint, wrong_secret, monkeypatch))
        unknown = Credentials("AKIAUNKNOWNKEY000000", "unknown-secret-00000000000000000000000000")
        assert "InvalidAccessKeyId" in str(_denied(moto_s3.endpoint, unknown, monkeypatch))
        wrong_token = Credentials(kit.temporary.access_key, kit.temporary.secret_key, "not-the-session-token")
        assert "InvalidToken" in str(_denied(moto_s3.endpoint, wrong_token, monkeypatch))


def test_allowed_and_temporary_credentials_read_under_enforced_auth(
    moto_s3: MotoS3Server, uploaded: str, aws_env: Credentials, monkeypatch: pytest.MonkeyPatch
) -> None:
    with moto_s3.enforce_auth() as kit:
        for credentials in (kit.reader, kit.temporary):  # moto checks the session token of temporary keys
            monkeypatch.delenv("AWS_SESSION_TOKEN", raising=False)
            for name, value in credentials.env().items():
                monkeypatch.setenv(name, value)
            with open_source(URI, _settings(moto_s3.endpoint)) as source:
                assert source.read_bytes(1000, 5000) == DATA[1000:6000]


def test_explicit_credentials_replace_the_chain_and_stay_out_of_reprs(
    moto_s3: MotoS3Server, uploaded: str, aws_env: Credentials, monkeypatch: pytest.MonkeyPatch
) -> None:
    with moto_s3.enforce_auth() as kit:
        for name, value in kit.stranger.env().items():  # the chain holds an identity that is refused
            monkeypatch.setenv(name, value)
        for allowed in (kit.reader, kit.temporary):
            given = S3Credentials(allowed.access_key, allowed.secret_key, allowed.token)
            settings = _settings(moto_s3.endpoint, credentials=given)
            with open_source(URI, settings) as source:
                assert source.read_bytes(1000, 5000) == DATA[1000:6000]
            for secret in allowed.secrets():
                assert secret not in repr(settings) and secret not in repr(given)
        denied = _settings(
            moto_s3.endpoint, credentials=S3Credentials(kit.stranger.access_key, kit.stranger.secret_key)
        )
        with open_source(URI, denied) as source, pytest.raises(SourceAccessDeniedError):
            source.read_bytes(0, 10)


def test_explicit_credentials_and_unsigned_access_exclude_each_other() -> None:
    with pytest.raises(ConfigError, match="not both"):
        S3Settings(unsigned=True, credentials=S3Credentials("AKIAEXAMPLE", "secret"))
    with pytest.raises(ConfigError, match="both an access key id and a secret"):
        S3Credentials("AKIAEXAMPLE", "")


def test_the_session_token_is_sent_with_every_request(
    moto_proxy: FaultProxy, uploaded: str, aws_env: Credentials, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AWS_SESSION_TOKEN", "session-token-value")
    with open_source(URI, _settings(moto_proxy.endpoint)) as source:
        source.read_bytes(0, 10)
    # the look-up, the checksums' HEAD, the read
    assert [r.headers.get("x-amz-security-token") for r in moto_proxy.requests] == ["session-token-value"] * 3


def test_no_credentials_anywhere_is_access_denied_naming_the_chain(
    moto_s3: MotoS3Server, uploaded: str, aws_env: Credentials, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    with pytest.raises(
        SourceAccessDeniedError, match=r"no AWS credentials found.*web identity.*instance metadata"
    ):
        open_source(URI, _settings(moto_s3.endpoint)).stat()


def test_unsigned_requests_read_public_objects_without_authorization(
    moto_s3: MotoS3Server, moto_proxy: FaultProxy, aws_env: Credentials, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")  # unsigned access must not need credentials
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    public = moto_s3.put(BUCKET, "public.bin", DATA, public=True)
    with open_source(public, _settings(moto_proxy.endpoint, unsigned=True)) as source:
        assert source.read_bytes(10, 100) == DATA[10:110]
    assert all("authorization" not in r.headers for r in moto_proxy.requests)


def test_unsigned_requests_for_private_objects_say_it_is_not_public(
    moto_s3: MotoS3Server, uploaded: str, aws_env: Credentials
) -> None:
    with pytest.raises(SourceAccessDeniedError, match="not public"):
        open_source(URI, _settings(moto_s3.endpoint, unsigned=True)).stat()


def test_a_bucket_policy_granting_public_read_lets_unsigned_requests_in(
    moto_s3: MotoS3Server, aws_env: Credentials
) -> None:
    bucket = "sources-s3-policy"
    uri = moto_s3.put(bucket, "open.bin", DATA)  # a private ACL: only the policy makes it public
    settings = _settings(moto_s3.endpoint, unsigned=True)
    with pytest.raises(SourceAccessDeniedError):
        open_source(uri, settings).stat()
    statement = {
        "Effect": "Allow",
        "Principal": "*",
        "Action": "s3:GetObject",
        "Resource": f"arn:aws:s3:::{bucket}/*",
    }
    moto_s3.set_bucket_policy(bucket, {"Version": "2012-10-17", "Statement": [statement]})
    with open_source(uri, settings) as source:
        assert source.read_bytes(0, 100) == DATA[:100]


def test_the_endpoint_can_come_from_aws_endpoint_url(
    moto_s3: MotoS3Server, uploaded: str, aws_env: Credentials, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AWS_ENDPOINT_URL", moto_s3.endpoint)
    with open_source(URI, SourceSettings()) as source:
        assert source.read_bytes(5, 10) == DATA[5:15]


def test_the_endpoint_can_come_from_aws_endpoint_url_s3(
    moto_s3: MotoS3Server, uploaded: str, aws_env: Credentials, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", moto_s3.endpoint)
    with open_source(URI, SourceSettings()) as source:
        assert isinstance(source, S3Source)
        assert source.location.url == f"{moto_s3.endpoint}/{BUCKET}/models/tiny%20model.bin"
        assert source.read_bytes(0, 10) == DATA[:10]


def test_the_explicit_endpoint_wins_over_the_environment(
    moto_s3: MotoS3Server, uploaded: str, aws_env: Credentials, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", "http://127.0.0.1:9")
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")
    with open_source(URI, _settings(moto_s3.endpoint)) as source:
        assert source.read_bytes(0, 10) == DATA[:10]


def test_without_an_endpoint_aws_is_addressed_by_virtual_host(
    aws_env: Credentials, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AWS_DEFAULT_REGION", "eu-west-3")
    source = open_source("s3://models-bucket/w.bin", SourceSettings())
    assert isinstance(source, S3Source)
    assert source.region == "eu-west-3"
    assert source.location.url == "https://models-bucket.s3.eu-west-3.amazonaws.com/w.bin"
    assert not source.supports_fd


def test_opening_with_the_collector_held_off_leaves_no_botocore_session_behind_but_the_kept_one(
    aws_env: Credentials, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The sidecar opens a model with the collector held off (segment.collector.LongLived): the session
    # whose client resolved the endpoint, and the S3 service model it loaded, must not live on as
    # uncollected cycles.
    import gc

    from botocore.session import Session

    from modelload.loader.segment.collector import paused_collector

    monkeypatch.setenv("AWS_DEFAULT_REGION", "eu-west-3")
    gc.collect()
    before = sum(type(o) is Session for o in gc.get_objects())
    with paused_collector():
        source = open_source("s3://models-bucket/w.bin", SourceSettings())
        sessions = sum(type(o) is Session for o in gc.get_objects()) - before
    assert sessions == 1  # the one kept for the credentials, which loads no service model
    assert isinstance(source, S3Source)
    assert source.region == "eu-west-3"
    assert source.location.url == "https://models-bucket.s3.eu-west-3.amazonaws.com/w.bin"


def test_an_explicit_endpoint_is_used_as_botocore_would_without_making_a_client(
    moto_s3: MotoS3Server, uploaded: str, aws_env: Credentials, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A client loads the S3 service model and endpoint rules (about 14 MiB that stay resident, 0.07 CPU-s)
    # only to give back an endpoint that was given: with one in the settings none is made, and the endpoint
    # and signing region are the ones botocore's client would have used.
    from botocore import UNSIGNED
    from botocore.config import Config
    from botocore.session import Session

    def resolved(endpoint: str, region: str | None) -> tuple[str, str]:
        client = Session().create_client(
            "s3", region_name=region, endpoint_url=endpoint, config=Config(signature_version=UNSIGNED)
        )
        return str(client.meta.endpoint_url), str(client.meta.region_name)

    def use_default_region(region: str | None) -> None:
        if region is None:
            monkeypatch.delenv("AWS_DEFAULT_REGION", raising=False)
        else:
            monkeypatch.setenv("AWS_DEFAULT_REGION", region)

    cases = [(moto_s3.endpoint, None), (moto_s3.endpoint + "/", "ap-south-1")]
    expected = {}
    for default_region in (None, "eu-west-2"):
        use_default_region(default_region)
        for endpoint, region in cases:
            expected[default_region, endpoint, region] = resolved(endpoint, region)

    def no_client(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("a botocore client was made for an explicit endpoint")

    monkeypatch.setattr(Session, "create_client", no_client)
    for default_region in (None, "eu-west-2"):
        use_default_region(default_region)
        for endpoint, region in cases:
            with open_source(URI, _settings(endpoint, region=region)) as source:
                assert isinstance(source, S3Source)
                assert source.region == expected[default_region, endpoint, region][1]
                assert source.location.url.startswith(
                    expected[default_region, endpoint, region][0].rstrip("/")
                )
                if region is None and default_region is None:  # moto signs with any region: a real read
                    assert source.read_bytes(0, 10) == DATA[:10]


@pytest.mark.parametrize("endpoint", ["http://", "http://a b"])
def test_an_endpoint_botocore_would_refuse_is_refused_with_its_reason(
    endpoint: str, aws_env: Credentials
) -> None:
    with pytest.raises(ConfigError, match=f"cannot set up S3 access for {URI}: ValueError: Invalid endpoint"):
        open_source(URI, _settings(endpoint))


def test_the_region_setting_is_the_signing_region(
    moto_proxy: FaultProxy, uploaded: str, aws_env: Credentials
) -> None:
    with open_source(URI, _settings(moto_proxy.endpoint, region="eu-central-1")) as source:
        source.read_bytes(0, 1)
    assert "/eu-central-1/s3/aws4_request" in moto_proxy.requests[0].headers["authorization"]


def test_virtual_host_addressing_against_a_loopback_endpoint(
    moto_s3: MotoS3Server, uploaded: str, aws_env: Credentials, monkeypatch: pytest.MonkeyPatch
) -> None:
    # No wildcard DNS here: resolve *.s3.modelload.test to loopback for this test, so the request really
    # goes to BUCKET.s3.modelload.test and moto finds the bucket in the Host header.
    real = socket.getaddrinfo

    def resolve(host: Any, *args: Any, **kwargs: Any) -> Any:
        if isinstance(host, str) and host.endswith(".modelload.test"):
            host = "127.0.0.1"
        return real(host, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", resolve)
    endpoint = f"http://s3.modelload.test:{moto_s3.port}"
    with open_source(URI, _settings(endpoint, addressing="virtual")) as source:
        assert isinstance(source, S3Source)
        assert source.location.origin.host == f"{BUCKET}.s3.modelload.test"
        assert source.location.path == "/models/tiny%20model.bin"
        assert source.read_bytes(100, 1000) == DATA[100:1100]


def test_expiring_credentials_are_refreshed_through_botocores_chain(
    moto_proxy: FaultProxy,
    uploaded: str,
    aws_env: Credentials,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    # A credential_process profile whose credentials expire in a minute: botocore refreshes them on every
    # get_frozen_credentials() (inside its 10-minute mandatory window), so every request re-runs the process.
    keys = tmp_path / "keys.json"
    calls = tmp_path / "calls"
    script = tmp_path / "creds.py"
    script.write_text(
        textwrap.dedent(
            f"""
            import datetime, json, pathlib
            pathlib.Path({str(calls)!r}).open("a").write("x")
            keys = json.loads(pathlib.Path({str(keys)!r}).read_text())
            expiry = datetime.datetime.now(datetime.timezone.utc) + datetime.timedelta(seconds=60)
            print(json.dumps({{"Version": 1, **keys, "Expiration": expiry.isoformat()}}))
            """
        )
    )
    config = tmp_path / "config"
    config.write_text(f"[profile loader]\ncredential_process = {sys.executable} {script}\n")
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    monkeypatch.setenv("AWS_CONFIG_FILE", str(config))
    monkeypatch.setenv("AWS_PROFILE", "loader")
    keys.write_text(json.dumps({"AccessKeyId": "AKIAFIRSTKEY00000000", "SecretAccessKey": "first-secret"}))
    with open_source(URI, _settings(moto_proxy.endpoint)) as source:
        assert source.read_bytes(0, 10) == DATA[:10]
        keys.write_text(
            json.dumps({"AccessKeyId": "AKIASECONDKEY0000000", "SecretAccessKey": "second-secret"})
        )
        assert source.read_bytes(10, 10) == DATA[10:20]
    used = [r.headers["authorization"].split("Credential=")[1].split("/")[0] for r in moto_proxy.requests]
    assert used[0] == "AKIAFIRSTKEY00000000" and used[-1] == "AKIASECONDKEY0000000"
    assert len(calls.read_text()) >= 3


def test_splice_lands_exact_bytes_from_s3_over_plain_http(
    moto_s3: MotoS3Server, uploaded: str, aws_env: Credentials, shm_dir: Path
) -> None:
    with open_source(URI, _settings(moto_s3.endpoint)) as source, (shm_dir / "s3.seg").open("w+b") as handle:
        assert source.supports_fd
        source.read_into_fd(1, len(DATA) - 1, handle.fileno(), 4096)
        handle.seek(4096)
        assert handle.read() == DATA[1:]


def test_a_bad_endpoint_is_a_config_error(aws_env: Credentials) -> None:
    with pytest.raises(ConfigError):
        open_source(URI, SourceSettings(s3=S3Settings(endpoint_url="http://")))
