"""moto's S3 server in a child process on loopback: real S3 behaviour (signatures, errors, ACLs, policies).

moto answers like S3 (XML errors with codes, 206 ranges, If-Match, ACLs, bucket policies, IAM and STS), so it
is what the S3 source is tested against. It is slow under parallel ranges (0.12 GiB/s for 8 streams): keep
objects small, and measure throughput against nginx's S3 stand-in instead (``tests/support/nginx.py``).

By default moto accepts any credentials. :meth:`MotoS3Server.enforce_auth` turns on its IAM checks for the
duration of a block and hands out real keys: a user allowed to read, a user allowed nothing, temporary
credentials (with a session token) of a role allowed to read; unknown keys then get InvalidAccessKeyId, a
wrong secret SignatureDoesNotMatch, a wrong session token InvalidToken, a user without the permission
AccessDenied. moto cannot expire a token: test ExpiredToken through the fault proxy (``s3_error``).

Usage, with the fixtures of ``tests.support.fixtures``::

    def test_reads(moto_s3, aws_env):                  # aws_env: test credentials, no IMDS, no profiles
        uri = moto_s3.put("bucket-a", "model.bin", b"...")       # creates the bucket when needed
        settings = SourceSettings(s3=S3Settings(endpoint_url=moto_s3.endpoint))
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import urllib.request
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["AuthKit", "Credentials", "MotoS3Server", "TEST_CREDENTIALS"]

_MAIN = Path(__file__).with_name("_moto_main.py")
_READ_POLICY = {
    "Version": "2012-10-17",
    "Statement": [{"Effect": "Allow", "Action": ["s3:GetObject", "s3:ListBucket"], "Resource": "*"}],
}


@dataclass(frozen=True)
class Credentials:
    """An access key pair, with a session token for temporary credentials."""

    access_key: str
    secret_key: str
    token: str | None = None

    def env(self) -> dict[str, str]:
        """As the AWS_* variables botocore's chain reads."""
        env = {"AWS_ACCESS_KEY_ID": self.access_key, "AWS_SECRET_ACCESS_KEY": self.secret_key}
        if self.token:
            env["AWS_SESSION_TOKEN"] = self.token
        return env

    def secrets(self) -> tuple[str, ...]:
        """The values that must never appear in a message or log line."""
        return (self.secret_key,) + ((self.token,) if self.token else ())


TEST_CREDENTIALS = Credentials("AKIAMODELLOADTEST000", "modelload-test-secret-do-not-print-0123456789")


@dataclass(frozen=True)
class AuthKit:
    """Keys handed out by :meth:`MotoS3Server.enforce_auth`."""

    reader: Credentials  # an IAM user allowed s3:GetObject on everything
    stranger: Credentials  # an IAM user allowed nothing
    temporary: Credentials  # STS credentials (with a session token) of a role allowed s3:GetObject


class MotoS3Server:
    """A moto server process. ``endpoint`` is ``http://127.0.0.1:PORT``; stop it with :meth:`stop`."""

    def __init__(self, *, region: str = "us-east-1") -> None:
        self.region = region
        env = {**os.environ, "MOTO_CALL_RESET_API": "false"}
        self._process = subprocess.Popen(
            [sys.executable, str(_MAIN)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            env=env,
        )
        assert self._process.stdout is not None
        line = self._process.stdout.readline().strip()
        if not line.isdigit():
            self._process.kill()
            raise RuntimeError(f"moto's server did not start (printed {line!r})")
        self.port = int(line)
        self.endpoint = f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        """Close the child's stdin (it shuts down), then make sure it is gone."""
        if self._process.poll() is None:
            assert self._process.stdin is not None
            self._process.stdin.close()
            try:
                self._process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()

    # --- setting up objects (with the default, accepted credentials) -------------------------------------

    def client(self, credentials: Credentials = TEST_CREDENTIALS, *, service: str = "s3") -> Any:
        """A boto3 client of this server (path addressing, the server's region)."""
        import boto3
        from botocore.config import Config

        return boto3.client(
            service,
            endpoint_url=self.endpoint,
            region_name=self.region,
            aws_access_key_id=credentials.access_key,
            aws_secret_access_key=credentials.secret_key,
            aws_session_token=credentials.token,
            config=Config(s3={"addressing_style": "path"}, retries={"max_attempts": 1}),
        )

    def create_bucket(self, bucket: str) -> None:
        """Create ``bucket`` unless it exists."""
        client = self.client()
        with contextlib.suppress(client.exceptions.BucketAlreadyOwnedByYou):
            client.create_bucket(Bucket=bucket)

    def put(self, bucket: str, key: str, data: bytes, *, public: bool = False) -> str:
        """Upload ``data`` (creating the bucket), optionally with a public-read ACL; returns ``s3://bucket/key``."""
        self.create_bucket(bucket)
        extra = {"ACL": "public-read"} if public else {}
        self.client().put_object(Bucket=bucket, Key=key, Body=data, **extra)
        return f"s3://{bucket}/{key}"

    def make_public(self, bucket: str, key: str) -> None:
        """Give an existing object a public-read ACL (readable by unsigned requests)."""
        self.client().put_object_acl(Bucket=bucket, Key=key, ACL="public-read")

    def set_bucket_policy(self, bucket: str, policy: dict[str, Any]) -> None:
        """Attach a bucket policy (a dict, serialised to JSON)."""
        self.client().put_bucket_policy(Bucket=bucket, Policy=json.dumps(policy))

    def etag(self, bucket: str, key: str) -> str:
        """The object's ETag, quotes included."""
        return str(self.client().head_object(Bucket=bucket, Key=key)["ETag"])

    # --- authentication -----------------------------------------------------------------------------------

    @contextmanager
    def enforce_auth(self) -> Iterator[AuthKit]:
        """Check signatures and IAM permissions for the duration of the block (see the module docstring).

        Objects must be uploaded before the block (the default test credentials are unknown to IAM).
        """
        suffix = uuid.uuid4().hex[:8]
        iam = self.client(service="iam")
        reader = self._user(iam, f"reader-{suffix}", _READ_POLICY)
        stranger = self._user(iam, f"stranger-{suffix}", None)
        trust = {
            "Version": "2012-10-17",
            "Statement": [{"Effect": "Allow", "Principal": {"AWS": "*"}, "Action": "sts:AssumeRole"}],
        }
        role = iam.create_role(RoleName=f"loader-{suffix}", AssumeRolePolicyDocument=json.dumps(trust))
        iam.put_role_policy(
            RoleName=f"loader-{suffix}", PolicyName="read", PolicyDocument=json.dumps(_READ_POLICY)
        )
        assumed = self.client(service="sts").assume_role(
            RoleArn=role["Role"]["Arn"], RoleSessionName="modelload-test"
        )["Credentials"]
        temporary = Credentials(assumed["AccessKeyId"], assumed["SecretAccessKey"], assumed["SessionToken"])
        self._reset_auth("0")
        try:
            yield AuthKit(reader=reader, stranger=stranger, temporary=temporary)
        finally:
            self._reset_auth("inf")

    @staticmethod
    def _user(iam: Any, name: str, policy: dict[str, Any] | None) -> Credentials:
        iam.create_user(UserName=name)
        if policy is not None:
            iam.put_user_policy(UserName=name, PolicyName="read", PolicyDocument=json.dumps(policy))
        key = iam.create_access_key(UserName=name)["AccessKey"]
        return Credentials(key["AccessKeyId"], key["SecretAccessKey"])

    def _reset_auth(self, count: str) -> None:
        """Allow ``count`` more unauthenticated requests, then enforce (``inf``: never enforce)."""
        request = urllib.request.Request(
            f"{self.endpoint}/moto-api/reset-auth",
            data=count.encode(),
            method="POST",
            headers={"Content-Type": "text/plain"},  # not a form: moto reads the raw body
        )
        with urllib.request.urlopen(request, timeout=10) as response:
            response.read()
