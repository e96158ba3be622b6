"""The copy from a segment to a GPU against the number of tensors: a mixture of experts' 100,000 small
tensors (float16, 4-16 KiB, packed: 0.95 GiB) and the same bytes as 32 big ones, by
``Model.state_dict(device="cuda")``.

Two ways, in the same run, alternating: ``per tensor`` (each tensor its own host-to-device copy, stream
switch and event: the copies before runs) and ``runs`` (small neighbours copied as one span, then cloned out
of it on the device in batches, each tensor into memory of its own: ``DeviceCopier.copy_run``; the 32 big
tensors are over the size a run takes, so both ways copy them alike). On two volumes: 4 KiB pages
(``/dev/shm``: copied through pinned staging buffers) and hugetlbfs (2 MiB pages: the mapping pinned whole,
read in place), where root may mount it. Each case: seconds from the call to the last byte on the device,
CPU-seconds per GiB of this process, and every device tensor bitwise against the segment's bytes (once per
case). The table at the end gives each way's median seconds, the GiB/s of that median, and the ratios: per
tensor / runs, and 100,000 tensors / 32 tensors. A new round starts only within ``--budget`` seconds; the
first always runs.

Needs a CUDA device (``make gpu-check`` runs it); ``--dry`` runs 2,000 tensors through the test suite's
stand-in of the device, so that the script does not rot::

    python benchmarks/gpu_many_tensors.py [--count 100000] [--rounds 2] [--out F.jsonl] [--dry]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import statistics
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from scratch import scratch  # noqa: E402

from modelload.loader import attach  # noqa: E402
from modelload.loader._api import cuda as cuda_api  # noqa: E402
from modelload.loader._api.model import Model  # noqa: E402
from modelload.loader.dtypes import by_name  # noqa: E402
from modelload.loader.segment import SegmentWriter, TensorSpec, plan_layout  # noqa: E402
from modelload.loader.segment.pages import volume_of  # noqa: E402
from tests.support.hugepages import Unavailable, huge_volume  # noqa: E402

GIB = 1 << 30
WAYS = ("per tensor", "runs")


def _cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def shapes(count: int) -> dict[str, list[int]]:
    """Element counts (float16) of each model: ``moe``, ``count`` tensors of 4-16 KiB, and ``dense``, the
    same elements (to 32 elements) as 32 equal tensors."""
    moe = np.random.default_rng(3).integers(2048, 8193, count).tolist()
    return {"dense": [sum(moe) // 32] * 32, "moe": moe}


def write_segment(path: Path, elements: list[int], noise: np.ndarray) -> int:
    """A complete segment of float16 tensors, each holding its own slice of ``noise``; its version."""
    specs = [TensorSpec(f"model.layers.{i // 384}.experts.{i % 384}.w", by_name("float16"), (n,))
             for i, n in enumerate(elements)]  # fmt: skip
    layout = plan_layout(specs, page_size=volume_of(path.parent).page_size)
    with SegmentWriter.create(path, layout, heartbeat=False) as writer:
        for slot in layout.slots:
            start = slot.index * 7919 % (len(noise) - slot.nbytes)
            writer.slot(slot.index)[:] = noise[start : start + slot.nbytes]
        writer.mark_ready_many(np.arange(len(layout.slots)))
        writer.mark_complete()
    return layout.layout_version


@contextlib.contextmanager
def way(name: str) -> Iterator[None]:
    """``per tensor``: state_dict as before runs (no data mapping given to the copies)."""
    if name == "runs":
        yield
        return
    runs_over = Model._runs_over
    Model._runs_over = lambda self: None  # type: ignore[method-assign]
    try:
        yield
    finally:
        Model._runs_over = runs_over  # type: ignore[method-assign]


def sync(cuda: bool) -> None:
    if cuda:
        torch.cuda.synchronize()


def flat(tensors: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.reshape(-1).view(torch.uint8) for t in tensors])


def copy_case(path: Path, how: str, cuda: bool, check: bool) -> dict[str, Any]:
    with attach(path, timeout=30, notify=False) as model, way(how):
        sync(cuda)
        cpu, started = _cpu(), time.perf_counter()
        on_device = model.state_dict(device="cuda")
        sync(cuda)
        seconds, cpu = time.perf_counter() - started, _cpu() - cpu
        nbytes = sum(t.nbytes for t in on_device.values())
        figures: dict[str, Any] = {"seconds": seconds, "gib_s": nbytes / seconds / GIB,
                                   "cpu_s_per_gib": cpu / (nbytes / GIB), "bytes": nbytes}  # fmt: skip
        if check:
            host = model.state_dict()
            names = list(host)
            want = flat([host[n] for n in names])
            got = flat([on_device[n] for n in names])
            figures["bitwise"] = bool(torch.equal(got.cpu() if not cuda else got, want.to(got.device)))
        return figures


@contextlib.contextmanager
def volumes(total: int) -> Iterator[list[tuple[str, Path]]]:
    """``(name, folder)``: a folder in /dev/shm, and one on hugetlbfs where this machine lets root mount it
    (room for ``total`` bytes)."""
    with scratch("modelload-many-tensors-") as work:
        made = [("4 KiB pages", work)]
        with contextlib.ExitStack() as stack:
            try:
                made.append(
                    ("hugetlbfs", stack.enter_context(huge_volume("hugetlbfs", work / "huge", total)))
                )
            except (Unavailable, OSError) as exc:
                print(f"hugetlbfs: skipped ({exc})", flush=True)
            yield made


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--count", type=int, default=100_000, help="tensors of the mixture of experts")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--budget", type=float, default=150.0, help="no round starts after this many seconds")
    parser.add_argument("--out", help="append each figure here as a JSON line")
    parser.add_argument("--dry", action="store_true", help="a small model through the device's stand-in")
    args = parser.parse_args(argv)
    cuda = torch.cuda.is_available() and not args.dry
    if not cuda:
        if not args.dry:
            print("no CUDA device: nothing measured (--dry runs the script through a stand-in)", flush=True)
            return 0
        from tests.support.fake_gpu import FakeGpu

        cuda_api.open_gpu = lambda device: FakeGpu()
        args.count, args.rounds = min(args.count, 2000), 1
    began = time.monotonic()
    count = args.count
    elements = shapes(count)
    total = sum(2 * sum(e) for e in elements.values())  # bytes of both models
    largest = 2 * max(max(e) for e in elements.values())
    noise = np.random.default_rng(0).integers(0, 256, largest + (64 << 20), dtype=np.uint8)
    records: list[dict[str, Any]] = []

    def emit(record: dict[str, Any]) -> None:
        records.append(record)
        print(json.dumps(record), flush=True)
        if args.out:
            with Path(args.out).open("a") as out:
                out.write(json.dumps(record) + "\n")

    device = torch.cuda.get_device_name(0) if cuda else "stand-in (--dry)"
    emit({"section": "many tensors env", "gpu": device, "torch": torch.__version__, "count": count,
          "loadavg": os.getloadavg()[0], "commit": os.environ.get("MODELLOAD_COMMIT", "unknown")})  # fmt: skip
    with volumes(total + (256 << 20)) as places:
        segments = []
        for volume, folder in places:
            for kind, sizes in elements.items():
                path = folder / f"{kind}.seg"
                version = write_segment(path, sizes, noise)
                segments.append((volume, kind, len(sizes), version, path))
        print(f"[{time.monotonic() - began:5.1f} s] segments written", flush=True)
        copy_case(segments[0][-1], "runs", cuda, check=False)  # a process's first copy pays for the set-up
        checked: set[tuple[str, str, str]] = set()
        try:
            for round_number in range(args.rounds):
                if round_number and time.monotonic() - began > args.budget:
                    print(f"budget spent: {round_number} rounds", flush=True)
                    break
                order = WAYS if round_number % 2 == 0 else WAYS[::-1]
                for volume, kind, tensors, version, path in segments:
                    for how in order:
                        key = (volume, kind, how)
                        figures = copy_case(path, how, cuda, key not in checked)
                        checked.add(key)
                        emit({"section": "many tensors", "volume": volume, "model": kind, "tensors": tensors,
                              "layout_version": version, "way": how, "round": round_number, **figures})  # fmt: skip
        finally:
            for *_, path in segments:
                path.unlink(missing_ok=True)
    return report(records)


def report(records: list[dict[str, Any]]) -> int:
    """The table of medians (GiB/s of the median seconds) and ratios; 0 when every tensor was equal."""
    cases: dict[tuple[str, str, str], list[dict[str, Any]]] = {}
    for r in records:
        if r.get("section") == "many tensors":
            cases.setdefault((r["volume"], r["model"], r["way"]), []).append(r)

    def seconds(volume: str, model: str, how: str) -> float:
        return statistics.median(r["seconds"] for r in cases[(volume, model, how)])

    print(f"\n{'volume':<12} {'model':<6} {'way':<11} {'n':>2} {'s':>8} {'GiB/s':>7} {'CPU-s/GiB':>9} "
          f"{'per tensor/runs':>15} {'moe/dense':>9}  bitwise")  # fmt: skip
    ok = True
    for (volume, model, how), rows in cases.items():
        bits = [r["bitwise"] for r in rows if "bitwise" in r]
        ok &= all(bits)
        median = seconds(volume, model, how)
        cpu = statistics.median(r["cpu_s_per_gib"] for r in rows)
        speedup = versus = ""
        if how == "runs" and (volume, model, "per tensor") in cases:
            speedup = f"{seconds(volume, model, 'per tensor') / median:.1f}x"
        if model == "moe" and (volume, "dense", how) in cases:
            versus = f"{median / seconds(volume, 'dense', how):.1f}x"
        print(f"{volume:<12} {model:<6} {how:<11} {len(rows):>2} {median:>8.4f} "
              f"{rows[0]['bytes'] / median / GIB:>7.2f} {cpu:>9.2f} {speedup:>15} {versus:>9}  "
              f"{'equal' if all(bits) else 'DIFFERENT'}")  # fmt: skip
    print(
        "every device tensor bitwise equal to the segment" if ok else "SOME DEVICE TENSORS DIFFER", flush=True
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
