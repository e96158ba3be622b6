"""``modelload stage`` (a local file into a fresh segment) against ``cat FILE > /dev/null``, in one run.

Both read the same file from the page cache; ``cat`` throws the bytes away, ``stage`` lands them in new
shared memory and publishes every tensor, which is what bounds it (see ``benchmarks/landing.py``). Each round
runs every command in a fresh process, alternating; figures are medians. ``stage`` is timed twice: the whole
process (Python start and imports included, like ``cat``), and by its own clock (what it prints).

    python benchmarks/stage.py [--size 2] [--runs 5]
"""

from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from harness import make_model  # noqa: E402
from scratch import scratch  # noqa: E402

from modelload.loader.dtypes import by_name  # noqa: E402
from modelload.loader.formats.safetensors import RawTensor, save_file  # noqa: E402


def make_safetensors(path: Path, total_bytes: int) -> None:
    block = np.random.default_rng(1).integers(0, 1 << 16, 16 << 20, dtype=np.uint16)
    count = total_bytes // (2 * len(block))
    bf16 = by_name("bfloat16")
    save_file({f"t{i:03d}": RawTensor(bf16, (len(block),), block.copy()) for i in range(count)}, path)


def timed(argv: list[str]) -> tuple[float, str]:
    started = time.perf_counter()
    out = subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, check=True).stdout
    return time.perf_counter() - started, out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=float, default=2.0, help="GiB")
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args(argv)
    with scratch("modelload-stage-") as work:
        files = {"tensorizer": work / "model.tensors", "safetensors": work / "model.safetensors"}
        make_model(files["tensorizer"], int(args.size * 2**30))
        make_safetensors(files["safetensors"], int(args.size * 2**30))
        print(f"median of {args.runs} rounds, fresh processes, page cache warm")
        for kind, path in files.items():
            nbytes = path.stat().st_size
            cat, whole, own = [], [], []
            for _ in range(args.runs):
                seconds, _ = timed(["sh", "-c", f"cat {path} > /dev/null"])
                cat.append(nbytes / seconds / 2**30)
                segment = work / "model.seg"
                seconds, out = timed(
                    [
                        sys.executable,
                        "-m",
                        "modelload.loader.cli.main",
                        "stage",
                        "--no-progress",
                        str(path),
                        str(segment),
                    ]
                )
                segment.unlink()
                whole.append(nbytes / seconds / 2**30)
                match = re.search(r"in ([0-9.]+) s", out)
                if match:
                    own.append(nbytes / float(match.group(1)) / 2**30)
            c, w = statistics.median(cat), statistics.median(whole)
            o = statistics.median(own) if own else float("nan")
            print(
                f"[{kind}, {nbytes / 2**30:.2f} GiB]  cat {c:5.2f} GiB/s   stage {w:5.2f} GiB/s whole process "
                f"({w / c:.2f} x cat), {o:5.2f} GiB/s by its own clock ({o / c:.2f} x cat)"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
