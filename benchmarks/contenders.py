"""One contender, one load, one JSON line: the measurement every benchmark of modelload runs.

``python contenders.py CONTENDER --source URI [options]`` loads the model once with one contender and prints
``{"seconds", "nbytes", "cpu_s", "peak_rss", ...}``. It runs in a fresh process per measurement, on this
machine (``benchmarks/run.py`` spawns it) and in a cluster (``manifests/benchmarks/`` mounts this very file
into each Job), so both measure the same way. It needs only the standard library plus the contender's own
package, which is why it imports nothing of modelload.

Contenders:

- ``sidecar``: ``modelload sidecar`` as a pod starts it; timed by its own clock (``/status``) from the
  engine's start to the last tensor READY. Its CPU is read from ``/proc`` over exactly that interval;
  its peak RSS is what it holds *besides* the segment (anonymous + file pages), since the segment is the
  model itself, shared with the inference process.
- ``tensorizer``: ``TensorDeserializer(uri, device="cpu", num_readers=N)``, every tensor owned in memory;
  with ``--verify``, ``verify_hash=True`` (each tensor checked against the file's stored hashes).
- ``runai``: Run:ai Model Streamer's ``SafetensorsStreamer`` (file or S3), every tensor owned
  (``owned=True``): ``RUNAI_STREAMER_CONCURRENCY`` and ``RUNAI_STREAMER_OBJ_CONCURRENCY`` = readers,
  ``RUNAI_STREAMER_CHUNK_BYTESIZE`` = chunk.
- ``st-load``: ``safetensors.torch.load_file`` and a copy of every tensor into private memory (what a
  framework does when it keeps weights after the file is closed).
- ``st-open``: ``safe_open`` and ``get_tensor`` of every tensor, kept.
- ``torch-load``: ``torch.load(weights_only=True)`` of a ``.pt`` file (no mmap).
- ``curl``: ``curl`` fetching the object as ``readers`` parallel ranges into fresh files in tmpfs: the floor
  of landing bytes in new memory on this machine (and the throughput a raw client reaches).
- ``mapping``: the floor of landing through a mapping, where curl cannot write (hugetlbfs refuses
  ``write``): ``readers`` threads, each one HTTP/1.1 connection asking for ``chunk``-sized ranges in turn and
  reading each body straight into a shared mapping of a new file in ``--segment``'s folder, its pages taken
  first with ``posix_fallocate`` (hugetlbfs zeroes each page it hands out), as the sidecar does. No checks,
  no CRCs, no progress: what the sidecar's own work is measured against on huge pages. Each socket's
  low-water mark (``SO_RCVLOWAT``) is ``--low-water`` (4 MiB, at most what the body has left; 0 leaves it
  at 1 byte), as the sidecar's: a reader then wakes once per batch, not per packet, the cheapest way found
  here to receive into a mapping (0.47 CPU-s per GiB without it, 0.33 with it, 1 GiB on hugetlbfs).

For the library contenders the load is timed inside the process, imports excluded; CPU is user + system time of
the process and of the children it waited for (tensorizer runs curl) over the load; peak RSS is the
process's maximum resident set (the import of torch included, as it is in a real server).
"""

from __future__ import annotations

import argparse
import http.client
import json
import mmap
import os
import resource
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

GIB = 1 << 30
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def _cpu_now() -> float:
    own = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def _in_process(load: Any) -> dict[str, Any]:
    """Time ``load()`` (returns the bytes it holds) with the CPU it and its reaped children used."""
    cpu0, t0 = _cpu_now(), time.perf_counter()
    nbytes, held = load()
    seconds, cpu = time.perf_counter() - t0, _cpu_now() - cpu0
    del held
    return {
        "seconds": seconds,
        "nbytes": nbytes,
        "cpu_s": cpu,
        "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    }


def _tensor_bytes(tensors: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def load_tensorizer(args: argparse.Namespace) -> dict[str, Any]:
    import torch  # noqa: F401  (imported before timing, as a server would have it)
    from tensorizer import TensorDeserializer

    def load() -> tuple[int, Any]:
        tensors = TensorDeserializer(
            args.source, device="cpu", num_readers=args.readers, verify_hash=args.verify
        )
        return _tensor_bytes(tensors.values()), tensors

    return _in_process(load)


def load_runai(args: argparse.Namespace) -> dict[str, Any]:
    from runai_model_streamer import SafetensorsStreamer

    def load() -> tuple[int, Any]:
        held = {}
        with SafetensorsStreamer() as streamer:
            streamer.stream_file(args.source, device="cpu", owned=True)
            for name, tensor in streamer.get_tensors():
                held[name] = tensor
        return _tensor_bytes(held.values()), held

    return _in_process(load)


def load_st(args: argparse.Namespace) -> dict[str, Any]:
    from safetensors.torch import load_file

    def load() -> tuple[int, Any]:
        held = {name: tensor.clone() for name, tensor in load_file(args.source).items()}
        return _tensor_bytes(held.values()), held

    return _in_process(load)


def load_st_open(args: argparse.Namespace) -> dict[str, Any]:
    from safetensors import safe_open

    def load() -> tuple[int, Any]:
        with safe_open(args.source, framework="pt") as handle:
            held = {name: handle.get_tensor(name) for name in handle.keys()}  # noqa: SIM118
        return _tensor_bytes(held.values()), held

    return _in_process(load)


def load_torch(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    def load() -> tuple[int, Any]:
        held = torch.load(args.source, weights_only=True, mmap=False)
        return _tensor_bytes(held.values()), held

    return _in_process(load)


def load_curl(args: argparse.Namespace) -> dict[str, Any]:
    """``readers`` ranges in flight in one curl process, each into its own new tmpfs file."""
    source = args.source
    size = args.size
    if size <= 0:
        raise SystemExit("curl needs --size, the object's bytes")
    step = -(-size // args.readers)
    base = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None
    with tempfile.TemporaryDirectory(prefix="modelload-curl-", dir=base) as folder:
        argv = [
            "curl",
            "-sSf",
            "--no-progress-meter",
            "--parallel",
            "--parallel-immediate",
            "--parallel-max",
            str(args.readers),
        ]
        if args.sigv4:
            key, secret = os.environ["AWS_ACCESS_KEY_ID"], os.environ["AWS_SECRET_ACCESS_KEY"]
            argv += ["--aws-sigv4", args.sigv4, "--user", f"{key}:{secret}"]
        for number, start in enumerate(range(0, size, step)):
            end = min(size, start + step) - 1
            argv += ["-r", f"{start}-{end}", "-o", f"{folder}/part{number}", source]
        t0 = time.perf_counter()
        process = subprocess.Popen(argv)
        _, status, usage = os.wait4(process.pid, 0)
        seconds = time.perf_counter() - t0
        if status != 0:
            raise SystemExit(f"curl failed with status {status}")
        landed = sum(p.stat().st_size for p in Path(folder).iterdir())
    return {
        "seconds": seconds,
        "nbytes": landed,
        "cpu_s": usage.ru_utime + usage.ru_stime,
        "peak_rss": usage.ru_maxrss * 1024,
    }


def load_mapping(args: argparse.Namespace) -> dict[str, Any]:
    """``readers`` connections receiving ``chunk``-sized ranges straight into a shared mapping."""
    if args.size <= 0 or not args.segment:
        raise SystemExit("mapping needs --size (the object's bytes) and --segment (a file on the volume)")
    url = urllib.parse.urlsplit(args.source)
    size, chunk, target = args.size, args.chunk, Path(args.segment)
    page = os.statvfs(target.parent).f_bsize  # hugetlbfs reports its page size here; files are whole pages
    length = -(-size // page) * page
    ranges = iter(range(0, size, chunk))
    lock = threading.Lock()

    def receive(view: memoryview) -> None:
        # A timeout makes each receive a poll, then a receive of all that is queued, as the sidecar's: a
        # blocking receive that got part of what it asked for would wait for a whole mark more.
        connection = http.client.HTTPConnection(url.hostname or "127.0.0.1", url.port or 80, timeout=60)
        try:
            while True:
                with lock:
                    start = next(ranges, None)
                if start is None:
                    return
                end = min(size, start + chunk)
                connection.request("GET", url.path, headers={"Range": f"bytes={start}-{end - 1}"})
                response = connection.getresponse()
                if response.status != 206:
                    raise SystemExit(f"the range {start}-{end - 1} got HTTP {response.status}")
                # The bytes the response's reader took in with the headers, then straight from the socket,
                # the mark set before each receive (a buffered readinto would loop below it, unwoken).
                head = response.fp.read1(min(end - start, 8192)) if response.fp is not None else b""
                view[start : start + len(head)] = head
                at, mark, sock = start + len(head), 1, connection.sock
                while at < end:
                    wanted = min(args.low_water, end - at) if args.low_water else 1
                    if wanted != mark:
                        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, wanted)
                        mark = wanted
                    got = sock.recv_into(view[at:end])
                    if not got:
                        raise SystemExit("the server closed the connection early")
                    at += got
                if mark != 1:  # the next answer's headers are short
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, 1)
                response.close()  # the body is in: the connection carries the next request
        finally:
            connection.close()

    before, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    fd = os.open(target, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, length)
        os.posix_fallocate(fd, 0, length)
        with mmap.mmap(fd, length, flags=mmap.MAP_SHARED) as mapped:
            view = memoryview(mapped)
            threads = [threading.Thread(target=receive, args=(view,)) for _ in range(args.readers)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
            view.release()
        seconds = time.perf_counter() - t0
        after = resource.getrusage(resource.RUSAGE_SELF)
    finally:
        os.close(fd)
        target.unlink(missing_ok=True)
    return {
        "seconds": seconds,
        "nbytes": size,
        "cpu_s": (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime),
        "peak_rss": after.ru_maxrss * 1024,
    }


class ProcSampler:
    """Every 10 ms: the process's CPU ticks (own and reaped children) and its RSS besides shared memory.

    ``harness.py`` imports it too, so that every benchmark reads a sidecar's memory the same way.
    """

    def __init__(self, pid: int) -> None:
        self.samples: list[tuple[float, float]] = []
        self.peak = 0
        self._pid = pid
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.01):
            try:
                stat = Path(f"/proc/{self._pid}/stat").read_text()
                status = Path(f"/proc/{self._pid}/status").read_text()
            except OSError:
                return
            fields = stat.rsplit(")", 1)[1].split()
            ticks = sum(int(fields[i]) for i in (11, 12, 13, 14))  # utime stime cutime cstime
            self.samples.append((time.time(), ticks / CLOCK_TICKS))
            rss = sum(
                int(line.split()[1]) * 1024
                for line in status.splitlines()
                if line.split(":")[0] in ("RssAnon", "RssFile")
            )
            self.peak = max(self.peak, rss)

    def stop(self) -> int:
        """Stop sampling; the peak RSS besides shared memory, in bytes."""
        self._stop.set()
        self._thread.join()
        return self.peak

    def cpu_at(self, when: float) -> float:
        """CPU seconds used by ``when`` (the last sample at or before it)."""
        before = [cpu for at, cpu in self.samples if at <= when]
        return before[-1] if before else 0.0


def load_sidecar(args: argparse.Namespace) -> dict[str, Any]:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = int(probe.getsockname()[1])
    segment = Path(args.segment or f"/dev/shm/modelload-bench-{os.getpid()}.seg")
    argv = [
        *args.sidecar_command.split(), "sidecar", "--source", args.source, "--segment", str(segment),
        "--readers", str(args.readers), "--chunk-size", str(args.chunk), "--host", "127.0.0.1",
        "--port", str(port), "--notify", "none", "--verify" if args.verify else "--no-verify",
    ]  # fmt: skip
    if args.s3_endpoint:
        argv += ["--s3-endpoint", args.s3_endpoint, "--s3-addressing", "path"]
    if args.landing != "auto":
        argv += ["--landing", args.landing]
    process = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    sampler = ProcSampler(process.pid)
    try:
        try:
            status = wait_complete(port, process)
        except (RuntimeError, TimeoutError) as exc:
            raise SystemExit(str(exc)) from None  # run.py reports the last line of stderr
        time.sleep(0.05)  # one more CPU sample after the finish
    finally:
        sampler.stop()
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=30)
        segment.unlink(missing_ok=True)
        segment.with_name(segment.name + ".lock").unlink(
            missing_ok=True
        )  # the writer's lock file, left behind
    started, finished = float(status["started_at"]), float(status["finished_at"])
    return {
        "seconds": finished - started,
        "nbytes": int(status["bytes_total"]),
        "cpu_s": sampler.cpu_at(finished + 0.01) - sampler.cpu_at(started),
        "peak_rss": sampler.peak,
        "first_tensor_s": float(status["first_tensor_at"]) - started,
    }


def wait_complete(port: int, process: subprocess.Popen[bytes], *, timeout_s: float = 900) -> dict[str, Any]:
    """Poll the sidecar's ``/status`` until the load completes, and return that status.

    Raises RuntimeError when the load fails or the sidecar exits, TimeoutError past ``timeout_s``. Here
    rather than in ``harness.py`` (which imports it) because this file must run alone, standard library only.
    """
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            error = process.stderr.read().decode()[-2000:] if process.stderr else ""
            raise RuntimeError(f"the sidecar exited: {error}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/status", timeout=2) as response:
                status = json.load(response)
        except OSError:
            time.sleep(0.02)
            continue
        if status["phase"] == "complete":
            return dict(status)
        if status["phase"] == "failed":
            raise RuntimeError(f"the load failed: {status['error']}")
        # The sidecar's own clock stamps the phases, so slow polling loses nothing and leaves it the CPU
        # (polling every 10 ms cost the sidecar about 20 % on 2 cores).
        time.sleep(0.1)
    raise TimeoutError(f"the sidecar did not finish in {timeout_s:g} seconds")


CONTENDERS = {
    "sidecar": load_sidecar,
    "tensorizer": load_tensorizer,
    "runai": load_runai,
    "st-load": load_st,
    "st-open": load_st_open,
    "torch-load": load_torch,
    "curl": load_curl,
    "mapping": load_mapping,
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("contender", choices=sorted(CONTENDERS))
    parser.add_argument("--source", required=True, help="path, http(s):// URL or s3://bucket/key")
    parser.add_argument("--readers", type=int, default=8, help="ranges in flight (tensorizer: num_readers)")
    parser.add_argument("--chunk", type=int, default=32 << 20, help="bytes per range request")
    parser.add_argument("--s3-endpoint", default="", help="an S3 endpoint other than AWS's")
    parser.add_argument("--size", type=int, default=0, help="the object's bytes (curl, mapping)")
    parser.add_argument("--sigv4", default="", help="curl --aws-sigv4 provider, for an S3 origin")
    parser.add_argument("--verify", action="store_true", help="sidecar, tensorizer: check the file's hashes")
    parser.add_argument(
        "--segment", default=None, help="sidecar, mapping: the segment path (sidecar default: in /dev/shm)"
    )
    parser.add_argument(
        "--landing", default="auto", choices=("auto", "splice", "mapping"), help="sidecar: how bytes land"
    )
    parser.add_argument(
        "--low-water",
        type=int,
        default=4 << 20,
        help="mapping: each socket's SO_RCVLOWAT in bytes (0: 1 byte)",
    )
    parser.add_argument("--sidecar-command", default=f"{sys.executable} -m modelload.loader.cli.main")
    args = parser.parse_args(argv)
    if args.readers < 1:
        parser.error("--readers must be at least 1")
    if args.s3_endpoint:
        # tensorizer reads AWS_ENDPOINT_URL_S3 (its default is CoreWeave's), Run:ai the AWS SDK's variables.
        os.environ["AWS_ENDPOINT_URL"] = os.environ["AWS_ENDPOINT_URL_S3"] = args.s3_endpoint
        os.environ["RUNAI_STREAMER_S3_USE_VIRTUAL_ADDRESSING"] = "0"
    os.environ.setdefault("AWS_EC2_METADATA_DISABLED", "true")
    # Run:ai: CONCURRENCY for files, OBJ_CONCURRENCY for object storage (its default there is its own).
    os.environ["RUNAI_STREAMER_CONCURRENCY"] = os.environ["RUNAI_STREAMER_OBJ_CONCURRENCY"] = str(
        args.readers
    )
    os.environ["RUNAI_STREAMER_CHUNK_BYTESIZE"] = str(args.chunk)
    os.environ.setdefault("RUNAI_STREAMER_LOG_LEVEL", "WARNING")
    figures = CONTENDERS[args.contender](args)
    figures["gib_s"] = figures["nbytes"] / figures["seconds"] / GIB
    figures["cpu_s_per_gib"] = figures["cpu_s"] / (figures["nbytes"] / GIB)
    print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
