"""How fast can bytes land in a fresh tmpfs segment on this machine? The bound under the sidecar's figures.

A source file in the page cache (or /dev/shm) is copied in chunk-sized pieces by T threads, each method in a
fresh destination file in /dev/shm, against the "raw ceiling" the sidecar benchmark uses (reads into a reused
buffer, which never allocates a page):

- ``reused``: ``preadv`` into one reused buffer per thread (nothing lands anywhere: the ceiling);
- ``mmap``: ``preadv`` into a slice of a fresh MAP_SHARED mapping (a page fault per 4 KiB page);
- ``mmap+populate``: the same after ``madvise(MADV_POPULATE_WRITE)`` on the chunk (faults in bulk);
- ``splice``: file → pipe → destination file at its offset (the kernel copies into page-cache pages);
- ``copy_file_range``: the kernel's own file-to-file copy;
- ``pwrite``: ``preadv`` into a reused buffer, then ``pwrite`` (two copies, no user faults).

    python benchmarks/landing.py [--size 2] [--threads 1,2,4,8] [--chunk 32]
"""

from __future__ import annotations

import argparse
import mmap
import os
import statistics
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

from scratch import scratch

MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)
Method = Callable[[int, int, int, int], None]  # (src fd, dst fd, offset, length)


def run(method: str, src: Path, dst_dir: Path, size: int, threads: int, chunk: int) -> float:
    dst = dst_dir / f"{method}-{threads}.bin"
    fd_in = os.open(src, os.O_RDONLY)
    fd_out = os.open(dst, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    os.ftruncate(fd_out, size)
    mapping = mmap.mmap(fd_out, size, flags=mmap.MAP_SHARED) if method.startswith("mmap") else None
    view = memoryview(mapping) if mapping is not None else None
    offsets = list(range(0, size, chunk))
    lock = threading.Lock()

    def worker() -> None:
        reused = bytearray(chunk)
        pipe_r, pipe_w = os.pipe()
        try:
            import fcntl

            fcntl.fcntl(pipe_w, 1031, 1 << 20)  # F_SETPIPE_SZ
        except OSError:
            pass
        while True:
            with lock:
                if not offsets:
                    break
                offset = offsets.pop(0)
            length = min(chunk, size - offset)
            if method == "reused":
                os.preadv(fd_in, [memoryview(reused)[:length]], offset)
            elif method in ("mmap", "mmap+populate"):
                assert view is not None and mapping is not None
                if method == "mmap+populate":
                    mapping.madvise(MADV_POPULATE_WRITE, offset, length)
                done = 0
                while done < length:
                    done += os.preadv(fd_in, [view[offset + done : offset + length]], offset + done)
            elif method == "splice":
                done = 0
                while done < length:
                    moved = os.splice(fd_in, pipe_w, min(1 << 20, length - done), offset_src=offset + done)
                    left = moved
                    while left:
                        left -= os.splice(pipe_r, fd_out, left, offset_dst=offset + done + moved - left)
                    done += moved
            elif method == "copy_file_range":
                done = 0
                while done < length:
                    done += os.copy_file_range(fd_in, fd_out, length - done, offset + done, offset + done)
            elif method == "pwrite":
                os.preadv(fd_in, [memoryview(reused)[:length]], offset)
                os.pwrite(fd_out, memoryview(reused)[:length], offset)
        os.close(pipe_r)
        os.close(pipe_w)

    started = time.perf_counter()
    pool = [threading.Thread(target=worker) for _ in range(threads)]
    for thread in pool:
        thread.start()
    for thread in pool:
        thread.join()
    seconds = time.perf_counter() - started
    if view is not None:
        view.release()
    if mapping is not None:
        mapping.close()
    os.close(fd_in)
    os.close(fd_out)
    dst.unlink()
    return size / seconds / 2**30


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=float, default=2.0, help="GiB")
    parser.add_argument("--threads", default="1,2,4,8")
    parser.add_argument("--chunk", type=int, default=32, help="MiB")
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args(argv)
    size, chunk = int(args.size * 2**30), args.chunk << 20
    with scratch("modelload-landing-") as work:
        src = work / "source.bin"
        with src.open("wb") as out:
            block = os.urandom(64 << 20)
            for _ in range(0, size, len(block)):
                out.write(block)
        size = src.stat().st_size
        methods = ["reused", "mmap", "mmap+populate", "splice", "copy_file_range", "pwrite"]
        print(f"{size / 2**30:.1f} GiB in {args.chunk} MiB chunks, median of {args.runs}, GiB/s")
        print(f"{'threads':>8} " + " ".join(f"{m:>16}" for m in methods))
        for threads in (int(t) for t in args.threads.split(",")):
            rates = {m: [] for m in methods}
            for _ in range(args.runs):
                for method in methods:
                    rates[method].append(run(method, src, work, size, threads, chunk))
            print(f"{threads:>8} " + " ".join(f"{statistics.median(rates[m]):16.2f}" for m in methods))
    return 0


if __name__ == "__main__":
    sys.exit(main())
