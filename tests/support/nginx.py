"""A real nginx on loopback serving a folder with Range, ETag and If-Match: the HTTP server of the tests.

nginx is what model files are often served from, and it is fast enough to measure against (2+ GiB/s here).
One process listens on two ports:

- ``port``: the folder at ``/NAME``, with byte ranges, strong ETags (``"<mtime>-<size>"``) and If-Match
  (a 412 when the file changed). The same folder is also at ``/BUCKET/NAME``: a path-style, read-only
  **S3 stand-in** that ignores auth, so boto3 or our S3 source pointed at ``endpoint`` with path addressing
  reads the files at nginx speed (moto is for S3 behaviour, not throughput: it reads the whole object for
  every range).
  ``/forbidden/...`` always answers 403; ``/moved/NAME`` redirects (302, relative Location) to ``/NAME``;
  ``/private/NAME`` serves the folder only to requests with ``Authorization: Bearer`` :data:`TOKEN`
  (401 otherwise): a private artifact server (``private_url(name)``).
- ``norange_port``: the same folder with ``max_ranges 0``: Range headers are ignored (200, whole file), for
  RangeNotSupportedError tests.
- ``tls_port`` (when started with ``tls=(cert, key)``, see ``tests/support/tls.py``): the folder over
  HTTPS (``/private/`` included; ``/to-http/NAME`` redirects to the plain HTTP server's ``/NAME``);
  ``https_url(name)``; trust it with ``ca_bundle=cert``.

Started with ``access_log=PATH``, nginx writes a line per request it answered there (off by default): what
counts the requests of a load at the server.

Use the pytest fixtures in ``tests.support.fixtures`` (``nginx``: one server per session over a fresh folder),
or start one yourself, for example over a folder in /dev/shm for a benchmark::

    with start_nginx(Path("/dev/shm/bench"), workers=2) as server:
        url = server.url("model.tensors")                 # http://127.0.0.1:PORT/model.tensors
        s3 = server.s3_endpoint, server.bucket            # path-style S3 stand-in

Missing nginx: the fixtures skip (or fail under MODELLOAD_REQUIRE_SERVERS=1), see ``tests.conftest.require``.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from tests.conftest import find_executable

from .ports import free_port, wait_for_port
from .processes import stop_process

__all__ = ["TOKEN", "NginxServer", "find_nginx", "start_nginx"]

TOKEN = "mlt-7f3c9e-private-bearer-token-EXAMPLE"
"""The bearer token ``/private/`` wants; tests check it never appears in messages, logs or statuses."""

_CONFIG = """\
{user}
worker_processes {workers};
pid {state}/nginx.pid;
error_log {state}/error.log warn;
events {{ worker_connections 1024; }}
http {{
    access_log {access_log};
    default_type application/octet-stream;
    sendfile on;
    tcp_nopush on;
    keepalive_timeout 60s;
    keepalive_requests 1000000;
    absolute_redirect off;
    client_body_temp_path {state}/tmp/body;
    proxy_temp_path {state}/tmp/proxy;
    fastcgi_temp_path {state}/tmp/fastcgi;
    uwsgi_temp_path {state}/tmp/uwsgi;
    scgi_temp_path {state}/tmp/scgi;
    server {{
        listen 127.0.0.1:{port};
        root {root};
        location / {{ }}
        location /{bucket}/ {{ alias {root}/; }}
        location /forbidden/ {{ return 403; }}
        location /moved/ {{ rewrite ^/moved/(.*)$ /$1 redirect; }}
        location /private/ {{
            if ($http_authorization != "Bearer {token}") {{ return 401; }}
            alias {root}/;
        }}
    }}
    server {{
        listen 127.0.0.1:{norange_port};
        root {root};
        max_ranges 0;
    }}
{tls_server}}}
"""
_TLS_SERVER = """\
    server {{
        listen 127.0.0.1:{tls_port} ssl;
        ssl_certificate {cert};
        ssl_certificate_key {key};
        root {root};
        location /private/ {{
            if ($http_authorization != "Bearer {token}") {{ return 401; }}
            alias {root}/;
        }}
        location /to-http/ {{ rewrite ^/to-http/(.*)$ http://127.0.0.1:{port}/$1 redirect; }}
    }}
"""


def find_nginx() -> str | None:
    """The nginx binary, or None."""
    return find_executable("nginx")


class NginxServer:
    """A running nginx (see the module docstring). Stop it with :meth:`stop` or use :func:`start_nginx`."""

    def __init__(
        self,
        root: Path,
        *,
        bucket: str = "bucket",
        workers: int = 1,
        tls: tuple[Path, Path] | None = None,
        access_log: Path | None = None,
    ) -> None:
        binary = find_nginx()
        if binary is None:
            raise FileNotFoundError("nginx is not installed (apt-get install nginx-light)")
        self.root = Path(root)
        self.bucket = bucket
        self._state = Path(tempfile.mkdtemp(prefix="modelload-nginx-"))
        (self._state / "tmp").mkdir()
        self._process: subprocess.Popen[bytes] | None = None
        self.tls_port: int | None = None
        self.ca_cert: Path | None = tls[0] if tls else None
        for _ in range(5):  # a free port can be taken between the probe and nginx's bind: try again
            self.port, self.norange_port = free_port(), free_port()
            tls_server = ""
            if tls is not None:
                self.tls_port = free_port()
                tls_server = _TLS_SERVER.format(
                    tls_port=self.tls_port, cert=tls[0], key=tls[1], root=self.root.resolve(), token=TOKEN,
                    port=self.port,
                )  # fmt: skip
            config = self._state / "nginx.conf"
            config.write_text(
                _CONFIG.format(
                    user="user root root;" if os.geteuid() == 0 else "",
                    access_log=access_log or "off",
                    workers=workers,
                    state=self._state,
                    root=self.root.resolve(),
                    bucket=bucket,
                    token=TOKEN,
                    port=self.port,
                    norange_port=self.norange_port,
                    tls_server=tls_server,
                )
            )
            process = subprocess.Popen(
                [
                    binary,
                    "-p",
                    str(self._state),
                    "-c",
                    str(config),
                    "-e",
                    str(self._state / "error.log"),
                    "-g",
                    "daemon off;",
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            ports = [self.port, self.norange_port] + ([self.tls_port] if self.tls_port else [])
            if all(wait_for_port(port, alive=process) for port in ports):
                self._process = process
                return
            process.kill()
            process.wait()
        log = (
            (self._state / "error.log").read_text(errors="replace")
            if (self._state / "error.log").exists()
            else ""
        )
        shutil.rmtree(self._state, ignore_errors=True)
        raise RuntimeError(f"nginx did not start: {log[-2000:]}")

    @property
    def pid(self) -> int:
        """The master process's id (its workers are its children): what a benchmark reads nginx's CPU from."""
        if self._process is None:
            raise RuntimeError("nginx is not running")
        return self._process.pid

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def s3_endpoint(self) -> str:
        """The endpoint of the path-style S3 stand-in (bucket :attr:`bucket`, auth ignored)."""
        return self.base_url

    def url(self, name: str) -> str:
        """The URL of file ``name`` (relative to the root) on the Range-capable port."""
        return f"{self.base_url}/{name}"

    def private_url(self, name: str) -> str:
        """The URL of file ``name`` behind the bearer token :data:`TOKEN`."""
        return f"{self.base_url}/private/{name}"

    def norange_url(self, name: str) -> str:
        """The URL of file ``name`` on the port that ignores Range headers."""
        return f"http://127.0.0.1:{self.norange_port}/{name}"

    def https_url(self, name: str) -> str:
        """The URL of file ``name`` over HTTPS (the server was started with ``tls``)."""
        if self.tls_port is None:
            raise RuntimeError("this nginx was started without tls=(cert, key)")
        return f"https://127.0.0.1:{self.tls_port}/{name}"

    def put(self, name: str, data: bytes) -> str:
        """Write ``data`` to ``root/name`` and return its URL."""
        path = self.root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        return self.url(name)

    def stop(self) -> None:
        """Stop nginx (graceful, then forced) and remove its state folder; the served folder stays."""
        process, self._process = self._process, None
        if process is not None:
            stop_process(process, sig=signal.SIGQUIT, timeout=5)
        shutil.rmtree(self._state, ignore_errors=True)


@contextmanager
def start_nginx(
    root: Path, *, bucket: str = "bucket", workers: int = 1, tls: tuple[Path, Path] | None = None
) -> Iterator[NginxServer]:
    """Run nginx over ``root`` for the duration of the block."""
    server = NginxServer(root, bucket=bucket, workers=workers, tls=tls)
    try:
        yield server
    finally:
        server.stop()
