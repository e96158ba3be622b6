"""Origins that behave like the ones users load from, made on this machine and removed afterwards.

- :func:`s3_like`: nginx in its own network namespace behind a veth link with delay (``tc netem``) and a
  bandwidth, every response capped at about one S3 request's rate (nginx ``limit_rate``). Over loopback a
  single stream moves gigabytes per second and a round trip costs microseconds, which hides what matters
  with object storage: throughput comes from many ranges in flight. Here, as in a cloud, it does. nginx
  serves the folder as plain HTTP (``/NAME``) and as a read-only, path-style S3 stand-in (``/BUCKET/NAME``,
  signatures ignored).
- :func:`s3rver`: npm's ``s3rver``, a real S3 server (SigV4, buckets, uploads, ranged GETs) that stays fast
  under parallel ranges, unlike moto's server which reads the whole object for every ranged GET. Installed
  by ``make bench`` / ``make demo`` into ``.bench-tools/``.

Both raise :class:`Unavailable` with the reason when they cannot be made (not root, no ``ip``/``tc``, no
Node), so a benchmark can report the reason and go on.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the repository root, for tests.support (report.py imports this module too)

from tests.support.processes import stop_process  # noqa: E402

S3RVER = ROOT / ".bench-tools" / "node_modules" / ".bin" / "s3rver"
S3RVER_KEY, S3RVER_SECRET = "S3RVER", "S3RVER"  # s3rver's built-in account: it checks SigV4 against it
RATE_MB_S = 90.0  # one S3 GET's rate (AWS: 85-90 MB/s per request)
DELAY_MS = 2.0  # each way: a 4 ms round trip
LINK_GBIT = 8.0  # the origin's link: 0.93 GiB/s, reached with 11 readers


class Unavailable(RuntimeError):
    """An origin that cannot be made here; the message says why."""


@dataclass(frozen=True)
class Origin:
    base: str  # http://HOST:PORT
    bucket: str
    description: str

    def url(self, name: str) -> str:
        return f"{self.base}/{name}"

    @property
    def s3_endpoint(self) -> str:
        return self.base

    def s3_uri(self, name: str) -> str:
        return f"s3://{self.bucket}/{name}"


_NGINX = """\
user root root;
worker_processes 2;
pid {state}/nginx.pid;
error_log {state}/error.log warn;
events {{ worker_connections 4096; }}
http {{
    access_log {access_log};
    default_type application/octet-stream;
    sendfile on;
    tcp_nopush on;
    keepalive_timeout 60s;
    keepalive_requests 1000000;
    client_body_temp_path {state}/body;
    server {{
        # A small send buffer: otherwise each response starts with a socket buffer's worth of burst
        # above limit_rate, which one S3 request does not get.
        listen {address}:{port} sndbuf=256k;
        root {root};
        limit_rate {limit_rate};
        location / {{ }}
        location /{bucket}/ {{ alias {root}/; }}
    }}
}}
"""


def _run(*argv: str) -> None:
    done = subprocess.run(argv, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise Unavailable(f"`{' '.join(argv)}` failed: {done.stderr.strip()[:300]}")


def _claim_namespace() -> tuple[str, int]:
    """A network namespace of our own, ``mlbN``, and its number N (1-250), which names its subnet
    10.231.N.0/30. ``ip netns add`` fails when the name is taken, so two benchmarks running at once (the
    machine is shared) never take over each other's origin: a fixed name did, one run's cleanup deleting
    the other's namespace mid-measurement."""
    for number in range(1, 251):
        done = subprocess.run(
            ["ip", "netns", "add", f"mlb{number}"], capture_output=True, text=True, check=False
        )
        if done.returncode == 0:
            return f"mlb{number}", number
        if "exists" not in done.stderr.lower():
            raise Unavailable(f"`ip netns add` failed: {done.stderr.strip()[:300]}")
    raise Unavailable("network namespaces mlb1 to mlb250 are all taken (leftovers: `ip netns del mlbN`)")


@contextlib.contextmanager
def s3_like(
    root: Path,
    *,
    bucket: str = "bench",
    rate_mb_s: float = RATE_MB_S,
    delay_ms: float = DELAY_MS,
    link_gbit: float = LINK_GBIT,
    access_log: Path | None = None,
) -> Iterator[Origin]:
    """nginx in a network namespace of its own (``mlbN``, at 10.231.N.2), behind a veth with ``delay_ms``
    each way (so a round trip of twice that) and ``link_gbit`` of bandwidth each way, each response capped
    at ``rate_mb_s`` MB/s. ``access_log``: where nginx writes a line per request (off by default), to count
    a load's requests."""
    if os.geteuid() != 0:
        raise Unavailable("a network namespace needs root (run as root, or skip the S3-like origin)")
    for tool in ("ip", "tc", "nginx"):
        if shutil.which(tool) is None and not Path(f"/usr/sbin/{tool}").exists():
            raise Unavailable(f"`{tool}` is not installed (iproute2 / nginx-light)")
    name, number = _claim_namespace()
    host, peer = f"{name}-h", f"{name}-o"
    ours, theirs = f"10.231.{number}.1", f"10.231.{number}.2"
    state = Path(tempfile.mkdtemp(prefix="modelload-s3like-"))
    nginx: subprocess.Popen[bytes] | None = None
    proxy: subprocess.Popen[bytes] | None = None
    subprocess.run(["ip", "link", "del", host], capture_output=True, check=False)  # a leftover of a crash
    try:
        _run("ip", "link", "add", host, "type", "veth", "peer", "name", peer)
        _run("ip", "link", "set", peer, "netns", name)
        _run("ip", "addr", "add", f"{ours}/30", "dev", host)
        _run("ip", "link", "set", host, "up")
        _run("ip", "netns", "exec", name, "ip", "addr", "add", f"{theirs}/30", "dev", peer)
        _run("ip", "netns", "exec", name, "ip", "link", "set", peer, "up")
        _run("ip", "netns", "exec", name, "ip", "link", "set", "lo", "up")
        # netem adds the delay on the link itself; a kernel built without it (CONFIG_NET_SCH_NETEM) gets
        # tbf for the bandwidth and a proxy that holds each request one round trip (delay_proxy.py).
        shape = ["delay", f"{delay_ms}ms", "rate", f"{link_gbit}gbit", "limit", "100000"]
        netem = (
            subprocess.run(
                ["tc", "qdisc", "add", "dev", host, "root", "netem", *shape], capture_output=True, check=False
            ).returncode
            == 0
        )
        if netem:
            _run("ip", "netns", "exec", name, "tc", "qdisc", "add", "dev", peer, "root", "netem", *shape)
            how = f"{delay_ms:g} ms each way on the link (netem)"
        else:
            tbf = ["tbf", "rate", f"{link_gbit}gbit", "burst", "8mb", "latency", "50ms"]
            _run("tc", "qdisc", "add", "dev", host, "root", *tbf)
            _run("ip", "netns", "exec", name, "tc", "qdisc", "add", "dev", peer, "root", *tbf)
            how = f"{2 * delay_ms:g} ms before each request reaches nginx (no netem in this kernel: a proxy)"
        port = 8080
        (state / "body").mkdir()
        (state / "nginx.conf").write_text(
            _NGINX.format(
                state=state,
                address=theirs if netem else "127.0.0.1",
                port=port if netem else port + 1,
                root=root.resolve(),
                bucket=bucket,
                limit_rate=int(rate_mb_s * 1e6),
                access_log=access_log or "off",
            )
        )
        binary = shutil.which("nginx") or "/usr/sbin/nginx"
        nginx = subprocess.Popen(
            ["ip", "netns", "exec", name, binary, "-p", str(state), "-c", str(state / "nginx.conf"),
             "-e", str(state / "error.log"), "-g", "daemon off;"],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        )  # fmt: skip
        if not netem:
            proxy = subprocess.Popen(
                ["ip", "netns", "exec", name, sys.executable, str(Path(__file__).with_name("delay_proxy.py")),
                 theirs, str(port), "127.0.0.1", str(port + 1), str(2 * delay_ms)],
                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
            )  # fmt: skip
            _wait_port(theirs, port, proxy)
        _wait_port(theirs, port, nginx)
        yield Origin(
            base=f"http://{theirs}:{port}",
            bucket=bucket,
            description=(
                f"nginx in a network namespace: {rate_mb_s:.0f} MB/s per response (limit_rate), "
                f"{how}, a {link_gbit:g} Gbit/s link"
            ),
        )
    finally:
        for child in (proxy, nginx):
            if child is not None:
                stop_process(child, timeout=10)
        subprocess.run(["ip", "link", "del", host], capture_output=True, check=False)
        subprocess.run(["ip", "netns", "del", name], capture_output=True, check=False)
        shutil.rmtree(state, ignore_errors=True)


@contextlib.contextmanager
def s3rver(data: Path, *, bucket: str = "bench", log: Path | None = None) -> Iterator[Origin]:
    """npm's s3rver on loopback, storing in ``data``, with ``bucket`` created; with ``log``, its own log
    there (a line per request answered, which counts a load's requests), silent otherwise."""
    if shutil.which("node") is None:
        raise Unavailable("Node.js is not installed, and s3rver runs on it (apt-get install nodejs npm)")
    if not S3RVER.exists():
        raise Unavailable(f"s3rver is not installed in {S3RVER.parents[2]} (make bench-tools installs it)")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = int(probe.getsockname()[1])
    data.mkdir(parents=True, exist_ok=True)
    logged = log.open("ab") if log is not None else None
    process = subprocess.Popen(
        [str(S3RVER), "--directory", str(data), "--address", "127.0.0.1", "--port", str(port),
         *(() if logged else ("--silent",)), "--configure-bucket", bucket],
        stdout=logged or subprocess.DEVNULL, stderr=subprocess.PIPE,
    )  # fmt: skip
    try:
        _wait_port("127.0.0.1", port, process)
        yield Origin(base=f"http://127.0.0.1:{port}", bucket=bucket, description="s3rver 3.7 (Node)")
    finally:
        stop_process(process, timeout=10)
        if logged is not None:
            logged.close()


def upload(origin: Origin, files: dict[str, Path]) -> None:
    """Put ``files`` (key → local path) into the origin's bucket with boto3, in 64 MiB parts."""
    import boto3
    from boto3.s3.transfer import TransferConfig
    from botocore.config import Config

    client = boto3.client(
        "s3",
        endpoint_url=origin.s3_endpoint,
        region_name="us-east-1",
        aws_access_key_id=S3RVER_KEY,
        aws_secret_access_key=S3RVER_SECRET,
        config=Config(s3={"addressing_style": "path"}),
    )
    for key, path in files.items():
        client.upload_file(str(path), origin.bucket, key, Config=TransferConfig(multipart_chunksize=64 << 20))


def _wait_port(host: str, port: int, process: subprocess.Popen[bytes], timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            error = process.stderr.read().decode()[-500:] if process.stderr else ""
            raise Unavailable(f"the server exited with {process.returncode}: {error}")
        with contextlib.suppress(OSError), socket.create_connection((host, port), timeout=1):
            return
        time.sleep(0.05)
    raise Unavailable(f"nothing answered on {host}:{port} within {timeout:g} s")
