"""What landing bytes in a fresh segment costs, by landing path and by the kind of memory the volume gives.

The sidecar lands a chunk either through the segment's file descriptor (``os.splice``: the kernel fills the
file's pages) or through its mapping (``readinto``/``preadv`` straight into a slice of the mapped segment).
Which is cheaper depends on the pages under the volume: most of the cost of landing in fresh shared memory
is allocating, zeroing and faulting in its pages, 262,144 of them per GiB at 4 KiB, 512 at 2 MiB. This
benchmark measures every path on every kind of volume in one run, so the choice the sidecar makes
(``modelload.loader.segment.pages.prefers_mapping``) rests on figures, not on a guess.

A 1 GiB source file in /dev/shm (the page cache: no disk) is copied in chunk-sized pieces by T threads into
a fresh destination file on each volume; per method, per volume, the median of ``--runs`` of GiB/s and of
CPU-seconds per GiB (user + system time of this process over the copy, every thread's):

- ``reused``: ``preadv`` into one reused buffer per thread: lands nowhere new, the ceiling of the source;
- ``mapping``: ``preadv`` into a slice of a fresh ``MAP_SHARED`` mapping of the destination (pages faulted
  in as they are written);
- ``mapping+reserve``: the same after ``posix_fallocate`` of the whole file, which is what the sidecar does
  before landing through a mapping (a full volume is then an error, not a SIGBUS);
- ``splice``: source → pipe → destination file at its offset (the sidecar's path through the descriptor);
- ``copy_file_range``: the kernel's file-to-file copy (``modelload stage`` for safetensors);
- ``pwrite``: ``preadv`` into a reused buffer, then ``pwrite`` (two copies, no faults in this process).

Volumes (``--volumes``; mounted here, so root is needed for all but ``shm``): ``tmpfs`` (4 KiB pages, what an
``emptyDir`` with ``medium: Memory`` is), ``tmpfs-huge`` (mounted ``huge=always``), ``hugetlbfs`` (2 MiB
pages from the kernel's pool, what ``medium: HugePages-2Mi`` is), or ``shm`` (/dev/shm as it is). hugetlbfs
files take no ``write``, ``splice`` or ``copy_file_range``: those rows say so.

    python benchmarks/landing.py [--size 1] [--threads 8] [--chunk 32] [--runs 5] [--volumes ...] [--json F]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import mmap
import os
import resource
import statistics
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from scratch import scratch  # noqa: E402

from tests.support.hugepages import HUGE_PAGE, Unavailable, huge_volume, warm  # noqa: E402

METHODS = ("reused", "mapping", "mapping+reserve", "splice", "copy_file_range", "pwrite")
VOLUMES = ("tmpfs", "tmpfs-huge", "hugetlbfs")
GIB = 1 << 30


def _cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _worker(method: str, fd_in: int, fd_out: int, view: memoryview | None, jobs: list[int], size: int,
            chunk: int, lock: threading.Lock, errors: list[OSError]) -> None:  # fmt: skip
    try:
        _copy(method, fd_in, fd_out, view, jobs, size, chunk, lock)
    except OSError as exc:
        with lock:
            jobs.clear()
            errors.append(exc)


def _copy(method: str, fd_in: int, fd_out: int, view: memoryview | None, jobs: list[int], size: int,
          chunk: int, lock: threading.Lock) -> None:  # fmt: skip
    reused = bytearray(chunk)
    pipe_r, pipe_w = os.pipe()
    with contextlib.suppress(OSError):
        import fcntl

        fcntl.fcntl(pipe_w, getattr(fcntl, "F_SETPIPE_SZ", 1031), 1 << 20)
    try:
        while True:
            with lock:
                if not jobs:
                    return
                offset = jobs.pop(0)
            length = min(chunk, size - offset)
            done = 0
            if method == "reused":
                os.preadv(fd_in, [memoryview(reused)[:length]], offset)
            elif method.startswith("mapping"):
                assert view is not None
                while done < length:
                    done += os.preadv(fd_in, [view[offset + done : offset + length]], offset + done)
            elif method == "splice":
                while done < length:
                    moved = os.splice(fd_in, pipe_w, min(1 << 20, length - done), offset_src=offset + done)
                    left = moved
                    while left:
                        left -= os.splice(pipe_r, fd_out, left, offset_dst=offset + done + moved - left)
                    done += moved
            elif method == "copy_file_range":
                while done < length:
                    done += os.copy_file_range(fd_in, fd_out, length - done, offset + done, offset + done)
            elif method == "pwrite":
                os.preadv(fd_in, [memoryview(reused)[:length]], offset)
                os.pwrite(fd_out, memoryview(reused)[:length], offset)
    finally:
        os.close(pipe_r)
        os.close(pipe_w)


def run(method: str, src: Path, folder: Path, size: int, threads: int, chunk: int) -> tuple[float, float]:
    """One copy of ``src`` into a fresh file in ``folder``: (GiB/s, CPU-s per GiB). Raises the OSError of a
    method the volume refuses (``copy_file_range`` across file systems is EXDEV)."""
    dst = folder / f"{method}.bin"
    fd_in = os.open(src, os.O_RDONLY)
    fd_out = os.open(dst, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    mapping = view = None
    try:
        os.ftruncate(fd_out, size)
        jobs = list(range(0, size, chunk))
        lock = threading.Lock()
        errors: list[OSError] = []
        cpu0, t0 = _cpu(), time.perf_counter()
        if method == "mapping+reserve":
            os.posix_fallocate(fd_out, 0, size)
        if method.startswith("mapping"):
            mapping = mmap.mmap(fd_out, size, flags=mmap.MAP_SHARED)
            view = memoryview(mapping)
        pool = [
            threading.Thread(
                target=_worker, args=(method, fd_in, fd_out, view, jobs, size, chunk, lock, errors)
            )
            for _ in range(threads)
        ]
        for thread in pool:
            thread.start()
        for thread in pool:
            thread.join()
        seconds, cpu = time.perf_counter() - t0, _cpu() - cpu0
        if errors:
            raise errors[0]
    finally:
        if view is not None:
            view.release()
        if mapping is not None:
            mapping.close()
        os.close(fd_in)
        os.close(fd_out)
        dst.unlink()
    return size / seconds / GIB, cpu / (size / GIB)


def _refused(method: str, kind: str) -> str:
    if kind == "hugetlbfs" and method in ("splice", "copy_file_range", "pwrite"):
        return "hugetlbfs files take no write(), splice or copy_file_range"
    return ""


@contextlib.contextmanager
def volume(kind: str, work: Path, size: int) -> Iterator[Path]:
    if kind == "shm":
        folder = work / "shm"
        folder.mkdir()
        yield folder
        return
    room = -(-(size + (64 << 20)) // HUGE_PAGE) * HUGE_PAGE
    with huge_volume(kind, work / kind, room) as folder:
        warm(folder, size)  # pages used once, as a node's pool is after its first load
        yield folder


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=float, default=1.0, help="GiB")
    parser.add_argument("--threads", type=int, default=8, help="copying threads (the sidecar's readers)")
    parser.add_argument("--chunk", type=int, default=32, help="MiB per piece")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--volumes", default=",".join(VOLUMES))
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = parser.parse_args(argv)
    size, chunk = int(args.size * GIB), args.chunk << 20
    methods = args.methods.split(",")
    results: list[dict[str, object]] = []
    load = os.getloadavg()[0]
    with scratch("modelload-landing-") as work:
        src = work / "source.bin"
        with src.open("wb") as out:
            block = os.urandom(64 << 20)
            for _ in range(0, size, len(block)):
                out.write(block)
        print(f"{size / GIB:.2f} GiB from /dev/shm in {args.chunk} MiB pieces, {args.threads} threads, "
              f"median of {args.runs}; load average {load:.2f}")  # fmt: skip
        print(f"{'volume':<11} {'method':<16} {'GiB/s':>6} {'CPU-s/GiB':>10}")
        for kind in args.volumes.split(","):
            try:
                with volume(kind, work, size) as folder:
                    rates: dict[str, list[tuple[float, float]]] = {m: [] for m in methods}
                    refused = {m: _refused(m, kind) for m in methods}
                    for number in range(args.runs):
                        live = [m for m in methods if not refused[m]]
                        shift = number % max(1, len(live))
                        for method in live[shift:] + live[:shift]:
                            try:
                                rates[method].append(run(method, src, folder, size, args.threads, chunk))
                            except OSError as exc:
                                refused[method] = f"{method}: {exc.strerror or exc}"
                    for method in methods:
                        reason = refused[method]
                        if reason:
                            print(f"{kind:<11} {method:<16} {'—':>6} {'—':>10}  ({reason})")
                            results.append({"volume": kind, "method": method, "refused": reason})
                            continue
                        gib_s = statistics.median(r[0] for r in rates[method])
                        cpu = statistics.median(r[1] for r in rates[method])
                        print(f"{kind:<11} {method:<16} {gib_s:6.2f} {cpu:10.2f}")
                        results.append(
                            {"volume": kind, "method": method, "gib_s": gib_s, "cpu_s_per_gib": cpu}
                        )
            except Unavailable as exc:
                print(f"{kind:<11} skipped: {exc}")
                results.append({"volume": kind, "skipped": str(exc)})
    print(f"load average at the end {os.getloadavg()[0]:.2f}")
    if args.json is not None:
        meta = {"size": size, "threads": args.threads, "chunk": chunk, "runs": args.runs, "load_avg": load,
                "load_avg_end": os.getloadavg()[0], "kernel": os.uname().release}  # fmt: skip
        args.json.write_text(json.dumps({"meta": meta, "results": results}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
