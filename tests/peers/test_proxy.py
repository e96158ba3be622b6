"""Origin reads through an HTTP proxy (Dragonfly's dfdaemon in a cluster; a forwarding nginx here)."""

from __future__ import annotations

import os
import subprocess
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from modelload.loader.errors import ConfigError
from modelload.sidecar.settings import parse_settings
from modelload.sidecar.sources import (
    HttpSettings,
    ProxySettings,
    SourceSettings,
    open_source,
    proxy_from_environ,
    read_range,
    read_range_into_fd,
)
from tests.conftest import find_executable, require
from tests.support.fixtures import nginx  # noqa: F401 - the fixture
from tests.support.nginx import NginxServer
from tests.support.ports import free_port, wait_for_port
from tests.support.waiting import wait_for


@pytest.fixture
def forward_proxy(tmp_path: Path) -> Iterator[tuple[int, Path]]:
    """A plain-HTTP forward proxy on loopback (nginx), and its access log of absolute-form requests."""
    binary = find_executable("nginx")
    require(binary is not None, "nginx is not installed")
    assert binary is not None
    port, log = free_port(), tmp_path / "proxy-access.log"
    (tmp_path / "tmp").mkdir()
    user = "user root root;" if os.geteuid() == 0 else ""
    config = tmp_path / "proxy.conf"
    config.write_text(
        f"""{user}
worker_processes 1;
pid {tmp_path}/proxy.pid;
error_log {tmp_path}/proxy-error.log warn;
events {{ worker_connections 256; }}
http {{
    log_format line '$request $status $body_bytes_sent';
    access_log {log} line;
    client_body_temp_path {tmp_path}/tmp;
    proxy_temp_path {tmp_path}/tmp;
    fastcgi_temp_path {tmp_path}/tmp;
    uwsgi_temp_path {tmp_path}/tmp;
    scgi_temp_path {tmp_path}/tmp;
    server {{
        listen 127.0.0.1:{port};
        location / {{ proxy_pass http://$http_host$request_uri; proxy_http_version 1.1; }}
    }}
}}
"""
    )
    process = subprocess.Popen([binary, "-c", str(config), "-g", "daemon off;"], stderr=subprocess.DEVNULL)
    try:
        wait_for_port(port)
        yield port, log
    finally:
        process.terminate()
        process.wait(10)


def _read(log: Path) -> list[str]:
    return log.read_text().splitlines() if log.exists() else []


def _lines(log: Path, count: int) -> list[str]:
    """The proxy's access log once it holds ``count`` lines: nginx writes each line after its response."""
    wait_for(lambda: len(_read(log)) >= count, timeout=10, what=f"{count} lines in the proxy's log")
    return _read(log)


def test_origin_ranges_go_through_the_proxy_and_land_intact(
    nginx: NginxServer,  # noqa: F811 - the fixture
    forward_proxy: tuple[int, Path],
    tmp_path: Path,
) -> None:
    port, log = forward_proxy
    data = os.urandom(3 << 20)
    (nginx.root / "proxied.bin").write_bytes(data)
    proxy = ProxySettings(http=("127.0.0.1", port))
    with open_source(nginx.url("proxied.bin"), SourceSettings(http=HttpSettings(proxy=proxy))) as source:
        assert source.stat().size == len(data)
        buf = bytearray(1 << 20)
        read_range(source, 4096, memoryview(buf), policy=SourceSettings().retry)
        assert bytes(buf) == data[4096 : 4096 + (1 << 20)]
        out = tmp_path / "landed"
        out.write_bytes(b"\0" * (1 << 20))
        with open(out, "r+b") as file:
            read_range_into_fd(source, 1 << 20, 1 << 20, file.fileno(), 0, policy=SourceSettings().retry)
        assert out.read_bytes() == data[1 << 20 : 2 << 20]
    lines = _lines(log, 3)
    assert len(lines) == 3, lines
    assert all(line.startswith(f"GET {nginx.url('proxied.bin')} ") for line in lines), lines
    assert all(line.split()[-2] == "206" for line in lines), lines


def test_no_proxy_hosts_are_read_directly(
    nginx: NginxServer,  # noqa: F811 - the fixture
    forward_proxy: tuple[int, Path],
) -> None:
    port, log = forward_proxy
    (nginx.root / "direct.bin").write_bytes(b"x" * 8192)
    proxy = proxy_from_environ({"HTTP_PROXY": f"http://127.0.0.1:{port}", "NO_PROXY": "localhost,127.0.0.1"})
    assert proxy is not None
    with open_source(nginx.url("direct.bin"), SourceSettings(http=HttpSettings(proxy=proxy))) as source:
        assert source.read_bytes(0, 10) == b"x" * 10
    # A request of our own through the proxy, after the source's: its line is the proxy's first and only.
    marker = nginx.url("direct.bin") + "?marker"
    proxied = urllib.request.build_opener(urllib.request.ProxyHandler({"http": f"http://127.0.0.1:{port}"}))
    with proxied.open(marker, timeout=5) as answer:
        answer.read()
    lines = _lines(log, 1)
    assert len(lines) == 1 and lines[0].startswith(f"GET {marker} "), lines


def test_the_proxy_comes_from_the_flag_or_the_standard_variables() -> None:
    env = {"https_proxy": "http://dfdaemon.dragonfly:4001", "NO_PROXY": ".svc, 10.0.0.5"}
    proxy = proxy_from_environ(env)
    assert proxy == ProxySettings(
        http=None, https=("dfdaemon.dragonfly", 4001), no_proxy=(".svc", "10.0.0.5")
    )
    assert proxy.for_origin("https", "s3.amazonaws.com") == ("dfdaemon.dragonfly", 4001)
    assert proxy.for_origin("https", "minio.storage.svc") is None
    assert proxy.for_origin("http", "s3.amazonaws.com") is None  # no HTTP_PROXY
    settings = parse_settings(["--source", "s3://b/k", "--proxy", "dfdaemon:4001"], env)
    assert settings.sources.http.proxy is not None
    assert settings.sources.http.proxy.http == ("dfdaemon", 4001)
    assert proxy_from_environ({}) is None
    with pytest.raises(ConfigError, match="credentials in the proxy URL"):
        proxy_from_environ({"HTTPS_PROXY": "http://user:pw@proxy:3128"})
    with pytest.raises(ConfigError, match="plain-HTTP proxy URL"):
        parse_settings(["--source", "s3://b/k", "--proxy", "socks5://proxy:1080"], {})
