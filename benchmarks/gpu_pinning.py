"""The loader's copy to a GPU from a segment on 4 KiB pages against one on hugetlbfs (2 MiB pages).

``Model.state_dict(device="cuda")`` pins the host bytes it reads (a read-only registration) and copies them
on a side stream. Pinned tensor by tensor, 4 KiB pages cost one registration per page; on hugetlbfs it pins
the whole mapping once, in whole huge pages (``DeviceCopier``, ``loader/modelload/loader/_api/gpu_copy.py``). This measures both on the same tensors in the same run:
seconds from the call to the last byte on the device, GiB/s, and CPU-seconds per GiB of this process.

Needs a CUDA device and root (it mounts hugetlbfs and reserves the pages, ``tests/support/hugepages.py``).
Not part of ``make bench`` (CI has no GPU)::

    python benchmarks/gpu_pinning.py [--size 1] [--tensor-mib 8] [--runs 5]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from scratch import scratch  # noqa: E402

from modelload.loader import attach  # noqa: E402
from modelload.loader.dtypes import by_name  # noqa: E402
from modelload.loader.segment import SegmentWriter, TensorSpec, plan_layout  # noqa: E402
from modelload.loader.segment.pages import volume_of  # noqa: E402
from tests.support.hugepages import huge_volume  # noqa: E402

GIB, MIB = 1 << 30, 1 << 20


def _cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def write_segment(path: Path, sizes: list[int]) -> None:
    page = volume_of(path.parent).page_size
    specs = [TensorSpec(f"t{i}", by_name("uint8"), (n,)) for i, n in enumerate(sizes)]
    layout = plan_layout(specs, page_size=page)
    block = np.random.default_rng(0).integers(0, 256, max(sizes), dtype=np.uint8).tobytes()
    with SegmentWriter.create(path, layout, heartbeat=False) as writer:
        for slot in layout.slots:
            writer.slot(slot.index)[:] = block[: slot.nbytes]
            writer.mark_ready(slot.index)
        writer.mark_complete()


def copy_once(path: Path, *, whole_pages: bool = True) -> tuple[float, float, int]:
    with attach(path, timeout=10, notify=False) as model:
        if not whole_pages:  # the per-tensor registration of 4 KiB pages, on the huge pages
            model._pinnable = lambda wanted: None  # type: ignore[method-assign]
        torch.cuda.synchronize()
        cpu0, t0 = _cpu(), time.perf_counter()
        on_gpu = model.state_dict(device="cuda")
        torch.cuda.synchronize()
        seconds, cpu = time.perf_counter() - t0, _cpu() - cpu0
        nbytes = sum(t.numel() for t in on_gpu.values())
        del on_gpu
    return seconds, cpu, nbytes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=float, default=1.0, help="GiB of tensors")
    parser.add_argument("--tensor-mib", type=float, default=8.0, help="MiB per tensor (sizes vary +-50%%)")
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args(argv)
    rng = np.random.default_rng(1)
    sizes, total = [], int(args.size * GIB)
    while sum(sizes) < total:
        sizes.append(int(args.tensor_mib * MIB * rng.uniform(0.5, 1.5)) + int(rng.integers(0, 4096)))
    nbytes = sum(sizes)
    torch.zeros(1, device="cuda")  # the CUDA context, outside the timings
    results: dict[str, list[tuple[float, float]]] = {"tmpfs": [], "hugetlbfs per tensor": [], "hugetlbfs": []}
    print(
        f"{len(sizes)} tensors, {nbytes / GIB:.2f} GiB; {torch.cuda.get_device_name()}; median of {args.runs}"
    )
    with scratch("modelload-gpu-pinning-") as work:
        small = work / "small.seg"
        write_segment(small, sizes)
        with huge_volume("hugetlbfs", work / "huge", nbytes + 64 * MIB) as folder:
            huge = folder / "model.seg"
            write_segment(huge, sizes)
            cases = [
                ("tmpfs", small, False),
                ("hugetlbfs per tensor", huge, False),
                ("hugetlbfs", huge, True),
            ]
            for number in range(args.runs):
                for kind, path, whole in cases[number % 3 :] + cases[: number % 3]:
                    try:
                        seconds, cpu, copied = copy_once(path, whole_pages=whole)
                    except Exception as exc:  # say which case failed, and go on with the others
                        print(f"{kind}: {type(exc).__name__}: {str(exc).splitlines()[0]}")
                        continue
                    assert copied == nbytes
                    results[kind].append((seconds, cpu))
            huge.unlink()
    summary = {}
    for kind, runs in results.items():
        if not runs:
            continue
        seconds = statistics.median(r[0] for r in runs)
        cpu = statistics.median(r[1] for r in runs)
        summary[kind] = {
            "seconds": seconds,
            "gib_s": nbytes / GIB / seconds,
            "cpu_s_per_gib": cpu / (nbytes / GIB),
        }
        print(
            f"{kind:<10} {seconds:7.3f} s  {nbytes / GIB / seconds:6.2f} GiB/s  {cpu / (nbytes / GIB):5.2f} CPU-s/GiB"
        )
    print(json.dumps({"tensors": len(sizes), "bytes": nbytes, "load_avg": os.getloadavg()[0], **summary}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
