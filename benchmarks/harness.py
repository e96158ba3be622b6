"""Measuring one contender at a time, each in a fresh process: the raw source, the sidecar, tensorizer.

Every measurement starts a new Python process (imports are not timed for the libraries, and are timed for
the sidecar since it is a process a pod starts). Memory is sampled from /proc every 10 ms: for the sidecar,
its resident memory *besides* the segment (RssAnon + RssFile: the segment's pages are RssShmem).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from attach import shapes
from contenders import ProcSampler, wait_complete

from modelload.loader.formats.tensorizer import TensorizerWriter

__all__ = ["Figures", "make_model", "raw_ceiling", "sidecar", "tensorizer_load"]


@dataclass(frozen=True)
class Figures:
    seconds: float
    nbytes: int
    peak_rss_bytes: int = 0
    first_tensor_s: float | None = None
    manifest_s: float | None = None
    extra: str = ""

    @property
    def gib_per_s(self) -> float:
        return self.nbytes / self.seconds / 2**30


def make_model(path: Path, total_bytes: int) -> int:
    """A tensorizer file of TinyLlama-like bf16 tensors summing to about ``total_bytes``; returns the bytes."""
    block = np.random.default_rng(0).integers(0, 1 << 16, 32 << 20, dtype=np.uint16)
    writer = TensorizerWriter(path)
    nbytes = 0
    for name, shape in shapes(total_bytes):
        count = int(np.prod(shape))
        data = np.resize(block, count).reshape(shape) if count > len(block) else block[:count].reshape(shape)
        writer.write_tensor(name, data, dtype="bfloat16")
        nbytes += count * 2
    writer.close()
    return nbytes


def make_safetensors(directory: Path, total_bytes: int, *, shards: int) -> list[str]:
    """The tensors of :func:`make_model` as safetensors: one ``model.safetensors`` (``shards`` = 1), or a
    Hugging Face directory of ``shards`` files with ``model.safetensors.index.json``. Returns the files."""
    from modelload.loader.formats.safetensors import save_file

    directory.mkdir(parents=True, exist_ok=True)
    block = np.random.default_rng(0).integers(0, 1 << 16, 32 << 20, dtype=np.uint16).view(np.float16)
    named = shapes(total_bytes)
    per_shard = -(-len(named) // shards)
    weight_map: dict[str, str] = {}
    files = []
    for number in range(shards):
        group = named[number * per_shard : (number + 1) * per_shard]
        name = "model.safetensors" if shards == 1 else f"model-{number + 1:05d}-of-{shards:05d}.safetensors"
        tensors = {}
        for tensor, shape in group:
            count = int(np.prod(shape))
            tensors[tensor] = np.resize(block, count).reshape(shape).copy()  # tensors must not share memory
        save_file(tensors, directory / name, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, name))
        files.append(name)
    if shards > 1:
        (directory / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
        files.append("model.safetensors.index.json")
    (directory / "config.json").write_text("{}")
    return [*files, "config.json"]


RAW = """
import json, os, sys, threading, time
from modelload.sidecar.sources import SourceSettings, S3Settings, open_source
uri, threads, chunk, endpoint, fresh = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5]
settings = SourceSettings(s3=S3Settings(endpoint_url=endpoint or None, addressing="path"))
source = open_source(uri, settings)
size = source.stat().size
offsets = list(range(0, size, chunk))
lock = threading.Lock()
fd = os.open(fresh, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600) if fresh else None
def work():
    buffer = memoryview(bytearray(chunk))
    while True:
        with lock:
            if not offsets:
                return
            offset = offsets.pop()
        n = min(chunk, size - offset)
        if fd is None:
            source.read_into(offset, buffer[:n])
        else:
            source.read_into_fd(offset, n, fd, offset)
t0 = time.perf_counter()
pool = [threading.Thread(target=work) for _ in range(threads)]
[t.start() for t in pool]; [t.join() for t in pool]
print(json.dumps({"seconds": time.perf_counter() - t0, "nbytes": size}))
"""


def raw_ceiling(
    uri: str, *, threads: int, chunk: int, s3_endpoint: str = "", fresh: Path | None = None
) -> Figures:
    """Parallel range reads of the whole object with the sources layer's client: into reused buffers (the
    wire's ceiling), or with ``fresh`` spliced into a new file there (the ceiling of landing in new memory)."""
    try:
        out = subprocess.run(
            [sys.executable, "-c", RAW, uri, str(threads), str(chunk), s3_endpoint, str(fresh or "")],
            capture_output=True, text=True, check=True, env=_aws_env(),
        )  # fmt: skip
    finally:
        if fresh is not None:
            fresh.unlink(missing_ok=True)
    result = json.loads(out.stdout)
    return Figures(result["seconds"], result["nbytes"])


def command_ceiling(argv: list[str], nbytes: int) -> Figures:
    """A command such as ``cat FILE`` or ``curl URL`` with its output thrown away."""
    started = time.perf_counter()
    subprocess.run(argv, stdout=subprocess.DEVNULL, check=True)
    return Figures(time.perf_counter() - started, nbytes)


def sidecar(
    uri: str,
    segment: Path,
    *,
    readers: int,
    chunk: str,
    verify: bool,
    s3_endpoint: str = "",
    files: list[str] | None = None,
) -> Figures:
    """``modelload sidecar`` from process start to the last tensor READY, and its memory besides the segment."""
    port = _free_port()
    argv = [
        sys.executable, "-m", "modelload.loader.cli.main", "sidecar",
        "--source", uri, "--segment", str(segment), "--readers", str(readers), "--chunk-size", chunk,
        "--host", "127.0.0.1", "--port", str(port), "--notify", "none",
        "--verify" if verify else "--no-verify",
    ]  # fmt: skip
    if s3_endpoint:
        argv += ["--s3-endpoint", s3_endpoint, "--s3-addressing", "path"]
    if files:
        argv += ["--files", ",".join(files)]
    spawned = time.time()
    process = subprocess.Popen(argv, env=_aws_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    sampler = ProcSampler(process.pid)
    try:
        status = wait_complete(port, process, timeout_s=600)
    finally:
        peak = sampler.stop()
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=30)
        segment.unlink(missing_ok=True)
    finished = float(status["finished_at"])
    return Figures(
        seconds=finished - spawned,
        nbytes=int(status["bytes_total"]),
        peak_rss_bytes=peak,
        first_tensor_s=float(status["first_tensor_at"]) - spawned,
        manifest_s=float(status["manifest_at"]) - spawned,
        extra=f"engine {int(status['bytes_total']) / (finished - float(status['started_at'])) / 2**30:.2f} GiB/s",
    )


TENSORIZER = """
import json, resource, sys, time
import torch
from tensorizer import TensorDeserializer
uri, readers = sys.argv[1], int(sys.argv[2])
t0 = time.perf_counter()
deserializer = TensorDeserializer(uri, device="cpu", num_readers=readers, verify_hash=False)
nbytes = sum(t.numel() * t.element_size() for t in deserializer.values())
seconds = time.perf_counter() - t0
print(json.dumps({"seconds": seconds, "nbytes": nbytes, "maxrss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}))
"""


def tensorizer_load(uri: str, *, readers: int, s3_endpoint: str = "") -> Figures:
    """tensorizer 2.12's TensorDeserializer loading every tensor to CPU memory (no hash check)."""
    env = _aws_env()
    if s3_endpoint:
        env["AWS_ENDPOINT_URL_S3"] = s3_endpoint  # tensorizer's default endpoint is CoreWeave's
    out = subprocess.run(
        [sys.executable, "-c", TENSORIZER, uri, str(readers)],
        capture_output=True,
        text=True,
        env=env,
        check=False,
    )
    if out.returncode != 0:
        raise RuntimeError(out.stderr[-2000:])
    result = json.loads(out.stdout.strip().splitlines()[-1])
    return Figures(
        result["seconds"], result["nbytes"], peak_rss_bytes=result["maxrss"], extra=f"{readers} readers"
    )


def _aws_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env.update(
        AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench-secret", AWS_DEFAULT_REGION="us-east-1"
    )
    return env


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
