"""Memory modes full, release and ring, in one run, on one model: host memory held and throughput.

``make bench`` runs this after ``run.py``. A real ``modelload sidecar`` process loads a safetensors model
from a local file into a segment in /dev/shm while this process, attached with the loader, copies each tensor
out as it becomes ready (into a reused buffer: the CPU stand-in for a host-to-device copy) and marks it
consumed. Sampled every 5 ms during each load:

- volume bytes in use: the allocated blocks of the segment file and of its consumer table (what a
  memory-backed ``emptyDir`` charges the pod);
- the sidecar's RSS: its anonymous and file-backed pages (``RssAnon + RssFile``); its ``RssShmem`` is the
  segment's pages mapped in, already counted as volume bytes.

Figures per mode (median of ``--runs``, modes alternating within a round): seconds from the consumer
attaching to its last copy, GiB/s, CPU seconds per GiB over that time (the sidecar's and the consumer's,
user and system: the kernel's page work is charged to whichever of them touches the pages), the peak of
volume bytes + sidecar RSS, and the volume's bytes once the consumer is done. The goals checked at the end:

- ring (``--ring-size``, default 256 MiB): peak <= ring + 128 MiB;
- release: volume under 64 MiB once the consumer is done;
- ring throughput >= 0.85 x full mode's.

The two memory bounds are properties of the modes: the script exits with status 1 when either is broken.
The throughput goal is reported, yes or NO, and does not change the exit status: on a shared machine a
ratio of two timings moves with the neighbours' load.

    python benchmarks/memory_modes.py [--size 2] [--ring-size 256MiB] [--runs 3] [--readers 8]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from modelload.loader import attach  # noqa: E402
from modelload.loader.formats.safetensors import serialize  # noqa: E402
from modelload.loader.segment.consumers import table_path  # noqa: E402
from modelload.loader.segment.failure import read_failure  # noqa: E402

MiB = 1 << 20
GiB = 1 << 30
TENSOR_BYTES = 32 * MiB


@dataclass
class Run:
    seconds: float
    nbytes: int
    peak_bytes: int
    peak_volume: int
    peak_rss: int
    volume_after: int
    cpu_seconds: float

    @property
    def gib_s(self) -> float:
        return self.nbytes / self.seconds / GiB

    @property
    def cpu_per_gib(self) -> float:
        return self.cpu_seconds / (self.nbytes / GiB)


def _cpu(pid: int) -> float:
    """User and system CPU seconds of process ``pid`` so far, every thread included."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def make_model(path: Path, total: int) -> int:
    """A safetensors file of float16 tensors of 32 MiB (and one smaller at the end), written in one go."""
    import torch

    tensors = {}
    left, i = total, 0
    while left > 0:
        n = min(TENSOR_BYTES, left)
        tensors[f"layers.{i}.weight"] = torch.full((n // 2,), float(i % 7), dtype=torch.float16)
        left -= n
        i += 1
    path.write_bytes(serialize(tensors))
    return total


class Sampler:
    """Peak of (volume bytes + sidecar RSS), sampled every 5 ms in a thread."""

    def __init__(self, pid: int, files: list[Path]) -> None:
        self.pid, self.files = pid, files
        self.peak = self.peak_volume = self.peak_rss = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def volume(self) -> int:
        total = 0
        for path in self.files:
            with contextlib.suppress(FileNotFoundError):
                total += os.stat(path).st_blocks * 512
        return total

    def rss(self) -> int:
        try:
            text = Path(f"/proc/{self.pid}/status").read_text()
        except OSError:
            return 0
        fields = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
        return sum(int(fields.get(k, "0 kB").split()[0]) * 1024 for k in ("RssAnon", "RssFile"))

    def _run(self) -> None:
        while not self._stop.wait(0.005):
            volume, rss = self.volume(), self.rss()
            self.peak_volume = max(self.peak_volume, volume)
            self.peak_rss = max(self.peak_rss, rss)
            self.peak = max(self.peak, volume + rss)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def one_load(source: Path, work: Path, mode: str, args: argparse.Namespace) -> Run:
    segment = work / f"{mode}.seg"
    port = _free_port()
    argv = [
        sys.executable, "-m", "modelload.loader.cli.main", "sidecar",
        "--source", str(source), "--segment", str(segment), "--readers", str(args.readers),
        "--chunk-size", args.chunk_size, "--host", "127.0.0.1", "--port", str(port),
        "--notify", f"ipc://{work}/notify-{mode}.sock",
        "--memory-mode", mode,
    ]  # fmt: skip
    if mode == "ring":
        argv += ["--ring-size", args.ring_size]
    process = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    sampler = Sampler(process.pid, [segment, table_path(segment)])
    try:
        while not segment.exists():
            if process.poll() is not None:
                raise RuntimeError(
                    process.stderr.read().decode()[-2000:] if process.stderr else "sidecar died"
                )
            failure = read_failure(segment)  # a refused plan (a tensor larger than the ring, say)
            if failure is not None:
                raise RuntimeError(f"the {mode} load failed: {failure}")
            time.sleep(0.002)
        model = attach(segment, timeout=60)  # ready notifications from the sidecar, as in a pod
        buffer = np.empty(TENSOR_BYTES, dtype=np.uint8)
        started = time.monotonic()
        cpu_before = _cpu(process.pid) + time.process_time()
        nbytes = 0
        for name in model.iter_ready():
            view = model.numpy(name).view(np.uint8).reshape(-1)
            np.copyto(buffer[: view.size], view)
            nbytes += view.size
            model.consumed(name)
        seconds = time.monotonic() - started
        cpu_seconds = _cpu(process.pid) + time.process_time() - cpu_before
        model.close()
        deadline = time.monotonic() + 5
        after = sampler.volume()
        while mode != "full" and after > MiB and time.monotonic() < deadline:  # until the releases settle
            time.sleep(0.01)
            after = sampler.volume()
        status = _status(port)
        if status["phase"] != "complete":
            raise RuntimeError(f"the {mode} load ended {status['phase']}: {status['error']}")
    finally:
        sampler.stop()
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=30)
        segment.unlink(missing_ok=True)
        table_path(segment).unlink(missing_ok=True)
    return Run(seconds, nbytes, sampler.peak, sampler.peak_volume, sampler.peak_rss, after, cpu_seconds)


def _status(port: int) -> dict[str, object]:
    deadline = time.monotonic() + 30
    while True:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/status", timeout=2) as response:
                status: dict[str, object] = json.load(response)
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
            continue
        if status["phase"] != "loading" or time.monotonic() > deadline:
            return status
        time.sleep(0.05)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", type=float, default=2.0, help="model size in GiB (default 2)")
    parser.add_argument("--ring-size", default="256MiB")
    parser.add_argument("--chunk-size", default="32MiB")
    parser.add_argument("--readers", type=int, default=8)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args(argv)
    from modelload.loader.sizes import parse_size

    ring = parse_size(args.ring_size, setting="--ring-size")
    disk = Path(tempfile.mkdtemp(prefix="modelload-memory-bench-"))
    shm = Path(tempfile.mkdtemp(prefix="modelload-memory-bench-", dir="/dev/shm"))
    try:
        source = disk / "model.safetensors"
        make_model(source, int(args.size * GiB))
        one_load(source, shm, "full", args)  # warm the page cache and the imports
        load_before = os.getloadavg()[0]
        runs: dict[str, list[Run]] = {"full": [], "release": [], "ring": []}
        for _ in range(args.runs):
            for mode, results in runs.items():
                results.append(one_load(source, shm, mode, args))
    finally:
        shutil.rmtree(disk, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)

    print(f"\nmemory modes: {args.size:g} GiB safetensors model from a local file, {args.readers} readers, "
          f"{args.chunk_size} chunks, ring {args.ring_size}; median of {args.runs}; load average "
          f"{load_before:.1f} before, {os.getloadavg()[0]:.1f} after")  # fmt: skip
    print(f"{'mode':<8} {'seconds':>8} {'GiB/s':>7} {'CPU s/GiB':>10} {'peak vol+rss':>13} {'peak vol':>9} "
          f"{'peak rss':>9} {'vol after':>10}")  # fmt: skip
    medians: dict[str, dict[str, float]] = {}
    for mode, results in runs.items():
        m = {
            "seconds": statistics.median(r.seconds for r in results),
            "gib_s": statistics.median(r.gib_s for r in results),
            "cpu": statistics.median(r.cpu_per_gib for r in results),
            "peak": statistics.median(r.peak_bytes for r in results),
            "peak_volume": statistics.median(r.peak_volume for r in results),
            "peak_rss": statistics.median(r.peak_rss for r in results),
            "after": statistics.median(r.volume_after for r in results),
        }
        medians[mode] = m
        print(f"{mode:<8} {m['seconds']:>8.2f} {m['gib_s']:>7.2f} {m['cpu']:>10.2f} {m['peak'] / MiB:>9.0f} MiB "
              f"{m['peak_volume'] / MiB:>5.0f} MiB {m['peak_rss'] / MiB:>5.0f} MiB {m['after'] / MiB:>6.1f} MiB")  # fmt: skip
    ring_peak_ok = medians["ring"]["peak"] <= ring + 128 * MiB
    release_ok = medians["release"]["after"] < 64 * MiB
    ratio = medians["ring"]["gib_s"] / medians["full"]["gib_s"]
    print(f"ring peak {medians['ring']['peak'] / MiB:.0f} MiB <= {(ring + 128 * MiB) / MiB:.0f} MiB: "
          f"{'yes' if ring_peak_ok else 'NO'}")  # fmt: skip
    print(f"release volume after the consumer {medians['release']['after'] / MiB:.1f} MiB < 64 MiB: "
          f"{'yes' if release_ok else 'NO'}")  # fmt: skip
    print(f"ring throughput / full: {ratio:.2f} (goal >= 0.85): {'yes' if ratio >= 0.85 else 'NO'}")
    print("GPU path (state_dict(device='cuda') per mode, H2D against pinned memory): "
          + (_gpu_note() or "no CUDA device here: skipped"))  # fmt: skip
    return 0 if ring_peak_ok and release_ok else 1


def _gpu_note() -> str | None:
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    return "a CUDA device is present, but this script measures the CPU stand-in only (not yet the H2D path)"


if __name__ == "__main__":
    try:
        raise SystemExit(main())
    except RuntimeError as exc:  # a load that failed: its reason, not a traceback
        raise SystemExit(f"memory_modes: {exc}") from None
