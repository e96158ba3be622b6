"""Raw source throughput: how fast each way of reading ranges moves bytes from nginx, before any format work.

Serves a file from /dev/shm with nginx on loopback (the page cache is the disk), then, for each method,
reads the whole file with N threads in ranges of CHUNK bytes and prints GiB/s (median of R rounds, each
round running every method once):

- ``http``: modelload's HttpSource, ``read_into`` a buffer reused per thread (the ceiling of the client);
- ``s3``: modelload's S3Source (SigV4-signed per request) against nginx's path-style S3 stand-in;
- ``boto3``: ``get_object(Range=...)['Body'].readinto`` a reused buffer, same stand-in (what other loaders do);
- ``mmap``: HttpSource ``read_into`` slices of a fresh /dev/shm file's mmap (page faults included);
- ``splice``: HttpSource ``read_into_fd`` into a fresh /dev/shm file at each range's offset;
- ``curl``: one ``curl -o /dev/null`` stream, for reference.

Usage: python benchmarks/sources_raw.py [--size-mib 1536] [--threads 8] [--chunk-mib 32] [--runs 3]
"""

from __future__ import annotations

import argparse
import mmap
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from scratch import scratch

from modelload.sidecar.sources import HttpSettings, S3Settings, SourceSettings, open_source

GIB = 1 << 30


def _ranges(size: int, chunk: int) -> list[tuple[int, int]]:
    return [(offset, min(chunk, size - offset)) for offset in range(0, size, chunk)]


def _timed(threads: int, work: Callable[[int, int], None], size: int, chunk: int) -> float:
    start = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(lambda r: work(*r), _ranges(size, chunk)))
    return size / (time.perf_counter() - start) / GIB


def _reused_buffers(chunk: int) -> Callable[[], memoryview]:
    import threading

    local = threading.local()

    def get() -> memoryview:
        buf = getattr(local, "buf", None)
        if buf is None:
            buf = local.buf = memoryview(bytearray(chunk))
        return buf

    return get


def bench_source_reused(uri: str, settings: SourceSettings, size: int, threads: int, chunk: int) -> float:
    buffers = _reused_buffers(chunk)
    with open_source(uri, settings) as source:
        source.stat()
        return _timed(threads, lambda off, n: source.read_into(off, buffers()[:n]), size, chunk)


def bench_boto3(endpoint: str, bucket: str, key: str, size: int, threads: int, chunk: int) -> float:
    import boto3
    from botocore.config import Config

    client: Any = boto3.client(
        "s3",
        endpoint_url=endpoint,
        region_name="us-east-1",
        aws_access_key_id="bench",
        aws_secret_access_key="bench-secret",
        config=Config(s3={"addressing_style": "path"}, max_pool_connections=threads * 2),
    )
    buffers = _reused_buffers(chunk)

    def work(offset: int, n: int) -> None:
        body = client.get_object(Bucket=bucket, Key=key, Range=f"bytes={offset}-{offset + n - 1}")["Body"]
        view, got = buffers()[:n], 0
        while got < n:
            step = body.readinto(view[got:])
            if not step:
                raise EOFError("short body")
            got += step

    work(0, 1)  # warm the client's connection pool and endpoint resolution
    return _timed(threads, work, size, chunk)


def bench_fresh_file(uri: str, size: int, threads: int, chunk: int, *, splice: bool) -> float:
    with open_source(uri, SourceSettings()) as source:
        source.stat()
        fd, name = tempfile.mkstemp(dir="/dev/shm", prefix="modelload-bench-")
        try:
            os.ftruncate(fd, size)
            if splice:
                return _timed(threads, lambda off, n: source.read_into_fd(off, n, fd, off), size, chunk)
            with mmap.mmap(fd, size) as mapped:
                view = memoryview(mapped)
                try:
                    return _timed(
                        threads, lambda off, n: source.read_into(off, view[off : off + n]), size, chunk
                    )
                finally:
                    view.release()
        finally:
            os.close(fd)
            os.unlink(name)


def bench_curl(url: str, size: int) -> float:
    start = time.perf_counter()
    subprocess.run(["curl", "-s", "-o", "/dev/null", url], check=True)
    return size / (time.perf_counter() - start) / GIB


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mib", type=int, default=1536)
    parser.add_argument("--threads", type=int, default=8)
    parser.add_argument("--chunk-mib", type=int, default=32)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root, for tests.support
    from tests.support.nginx import start_nginx  # the benchmark reuses the test fixture's nginx

    size, chunk, threads = args.size_mib << 20, args.chunk_mib << 20, args.threads
    with scratch("modelload-bench-root-") as root:
        with (root / "model.bin").open("wb") as handle:
            block = os.urandom(64 << 20)
            for offset in range(0, size, len(block)):
                handle.write(block[: size - offset])
        with start_nginx(root, workers=2) as server:
            url = server.url("model.bin")
            s3 = SourceSettings(s3=S3Settings(endpoint_url=server.s3_endpoint, addressing="path"))
            os.environ.setdefault("AWS_ACCESS_KEY_ID", "bench")
            os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "bench-secret")
            os.environ.setdefault("AWS_EC2_METADATA_DISABLED", "true")
            methods: dict[str, Callable[[], float]] = {
                "http": lambda: bench_source_reused(
                    url, SourceSettings(http=HttpSettings()), size, threads, chunk
                ),
                "s3": lambda: bench_source_reused(
                    f"s3://{server.bucket}/model.bin", s3, size, threads, chunk
                ),
                "boto3": lambda: bench_boto3(
                    server.s3_endpoint, server.bucket, "model.bin", size, threads, chunk
                ),
                "mmap": lambda: bench_fresh_file(url, size, threads, chunk, splice=False),
                "splice": lambda: bench_fresh_file(url, size, threads, chunk, splice=True),
            }
            if shutil.which("curl"):
                methods["curl"] = lambda: bench_curl(url, size)
            print(
                f"{args.size_mib} MiB from nginx (/dev/shm), {threads} threads, {args.chunk_mib} MiB ranges"
            )
            # Round-robin over the methods, so minute-to-minute swings of a shared machine hit all alike.
            figures: dict[str, list[float]] = {name: [] for name in methods}
            for _ in range(args.runs):
                for name, run in methods.items():
                    figures[name].append(run())
            for name, runs in figures.items():
                shown = " ".join(f"{f:.2f}" for f in runs)
                print(f"{name:>7}: {statistics.median(runs):5.2f} GiB/s (runs: {shown})", flush=True)


if __name__ == "__main__":
    main()
