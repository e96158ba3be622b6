"""The segment -> GPU path, measured in one run: throughput per memory mode and copy strategy against torch's
own copies, the overlap with a loading sidecar, bitwise checks, and the CUDA hand-off's app restart.

A safetensors model of ``--size`` GiB (bfloat16, Llama-shaped tensors, random bits) is generated locally;
nothing is downloaded. Each figure is a JSON line in ``--out`` as soon as it is measured, each case prints a
line when it starts and ends, and a table follows at the end:

- ``ceiling``: torch copying the file's tensors to the GPU from pageable memory (the file read into an
  ordinary buffer) and from a ``pin_memory()`` buffer: the ceiling every strategy is held against;
- ``copy``: from a segment whose load finished before the copy started, in memory mode full (``modelload
  stage``), ring (a ring as large as the model, loaded by a real sidecar while this process, registered,
  holds every tensor) and release, with each ``DeviceCopier`` strategy: ``in-place`` (the segment's mapping,
  or the ring, pinned once with a read-only registration, then copied from where it is: the pinning is
  reported apart, as ``pin_s`` and ``unpin_s``, and the copy with it as ``... with pinning``; in memory mode
  release each tensor is pinned for its own copy), ``staging`` (the pinned bounce buffers), and
  ``Model.state_dict(device=...)`` as an app calls it; ``full in-place, each tensor pinned`` is the same
  copy pinning tensor by tensor, as the first GPU run did;
- ``overlap``: a sidecar loading the model while this process copies (``state_dict``) in each mode (the ring
  ``--ring-size``), from the segment's first byte to the last tensor on the device, against loading then
  copying (the sidecar's load alone, to its end with its proofs, plus ``state_dict(device)`` of the loaded
  model), every round;
- ``bitwise``: every device tensor of every case against the file's bytes (compared on the device);
- ``handoff``: ``modelload keeper`` holds the model on the GPU; a fresh app process maps it
  (``handoff.connect()``) against a fresh app process copying it from the segment (``attach()`` +
  ``state_dict(device)``): the restart of an app container, process start to weights usable.

The most telling figures come first (ceilings, full in-place and staging, the ring, the overlap, the
restart), one round of everything, then further rounds of the first ones while ``--budget`` lasts; the
figures are medians over the rounds measured. Every case runs under ``--case-limit`` seconds
(``benchmarks/gpu/guard.py``): one that runs past it is a JSON line with every thread's stack, and the run
goes on. ``--cases`` picks groups (``ceiling,full,ring,overlap,handoff,release,pinning``).

Goal, checked at the end: pinned in place (memory mode full, the copy once pinned) >= 0.85 x the pinned
ceiling; every tensor bitwise equal.

Without a CUDA device, or with ``--dry``, the CUDA parts are skipped with a line saying so and the rest runs
on a tiny model (the test suite runs it so the script does not rot).

This script holds the cases and their schedule; ``benchmarks/gpu/`` holds the rest: the model
(``synthetic.py``), the copies and the run's figures (``copying.py``), the restart (``restart.py``), the
table and the goal (``summary.py``), the processes it starts (``children.py``) and the time limits
(``guard.py``).

    python benchmarks/gpu_copy.py [--size 4] [--rounds 3] [--out gpu_copy.jsonl] [--budget 300] [--dry]
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE / "gpu"))  # benchmarks/gpu/: this script's helpers, not a package
from children import sidecar, stop_all  # noqa: E402
from copying import Device, Refused, Run, copy_model, first_copy, timed  # noqa: E402
from guard import Guard  # noqa: E402
from restart import handoff  # noqa: E402
from summary import report  # noqa: E402
from synthetic import FileTensors, GiB, make_model, whole_ring  # noqa: E402

GROUPS = ("ceiling", "full", "ring", "overlap", "handoff", "release", "pinning")


# --- the cases --------------------------------------------------------------------------------------------


def ceilings(run: Run, round_number: int) -> None:
    """torch from pageable memory and from ``pin_memory()`` buffers, allocating targets as the loader does."""
    import torch

    flat = torch.from_numpy(np.fromfile(run.source, dtype=np.uint8))
    pageable = run.tensors.views(flat)
    if not run.device.cuda:
        seconds, out = timed(lambda: {n: t.clone() for n, t in pageable.items()}, run.device)
        run.note("ceiling", "host clone", seconds, round=round_number)
        if not run.reference:
            run.reference = out
        return
    seconds, out = timed(lambda: {n: t.to("cuda") for n, t in pageable.items()}, run.device)
    run.note("ceiling", "torch pageable", seconds, round=round_number)
    if not run.reference:
        run.reference = out  # the file's bytes on the device, by a path that shares nothing with modelload's
    pinned = run.tensors.views(flat.pin_memory())
    seconds, out = timed(lambda: {n: t.to("cuda", non_blocking=True) for n, t in pinned.items()}, run.device)
    run.note("ceiling", "torch pin_memory", seconds, round=round_number)
    run.check_bits("torch pin_memory", out)


def staged_segment(run: Run) -> Path:
    segment = run.shm / "full.seg"
    argv = [sys.executable, "-m", "modelload.loader.cli.main", "stage", str(run.source), str(segment),
            "--no-progress"]  # fmt: skip
    subprocess.run(argv, check=True, stdout=subprocess.DEVNULL, timeout=600)
    return segment


def measure(run: Run, model: Any, case: str, strategy: str, round_number: int, **extra: Any) -> None:
    """One copy of ``model`` with ``strategy``: its figure(s) and its bitwise check, or a refusal."""
    try:
        seconds, (out, phases) = timed(lambda: copy_model(model, strategy, run.device), run.device)
    except Refused as exc:
        run.emit({"section": "copy", "case": case, "refused": str(exc)})
        print(f"copy {case}: {exc}", flush=True)
        return
    if "pin_s" in phases:  # the mapping pinned once: the copy apart, and with the pinning
        pinning = phases["pin_s"] + phases["unpin_s"]
        run.note(
            "copy", case, seconds - pinning, round=round_number, with_pinning_s=seconds, **phases, **extra
        )
        run.note("copy", f"{case} with pinning", seconds, round=round_number, **phases, **extra)
    else:
        run.note("copy", case, seconds, round=round_number, **phases, **extra)
    run.check_bits(case, out)


def full_copies(run: Run, round_number: int, strategy: str) -> None:
    from modelload.loader import attach

    with attach(run.full, notify=False) as model:
        measure(run, model, f"full {strategy}", strategy, round_number)


def pinned_per_tensor(run: Run, round_number: int) -> None:
    """Full mode, each tensor pinned for its own copy (what the first GPU run measured): the price of
    pinning tensor by tensor against the mapping once."""
    from modelload.loader import attach

    with attach(run.full, notify=False) as model:
        model._pinnable = lambda wanted: None  # no region: the copier pins each tensor
        measure(run, model, "full in-place, each tensor pinned", "in-place", round_number)


def loaded_first(run: Run, mode: str, strategy: str, round_number: int) -> None:
    """A sidecar loads the whole model in ``mode`` (a ring as large as the model) while this process, a
    registered consumer, holds every tensor; then one copy with ``strategy``."""
    from modelload.loader import attach

    segment = run.shm / f"{mode}.seg"
    with (
        sidecar(run.source, segment, mode, run.args, ring=run.ring) as appeared,
        attach(segment, timeout=60) as model,  # registered before anything can be released
    ):
        model.wait(timeout=max(run.guard.left(), 1.0))
        loaded = time.monotonic() - appeared
        measure(run, model, f"{mode} {strategy}", strategy, round_number, load_seconds=loaded)


def load_alone(run: Run, round_number: int) -> None:
    from modelload.loader import attach

    segment = run.shm / "alone.seg"
    with sidecar(run.source, segment, "full", run.args) as appeared, attach(segment, timeout=60) as model:
        # to the load's end, its end-of-load proofs included: what state_dict() of the whole model waits for
        model.wait_complete(timeout=max(run.guard.left(), 1.0))
        run.note("overlap", "load alone (full)", time.monotonic() - appeared, round=round_number)


def streamed(run: Run, mode: str, round_number: int) -> None:
    """A sidecar loading in ``mode`` (the ring ``--ring-size``) while this process copies as tensors land."""
    from modelload.loader import attach

    strategy = "state_dict" if run.device.cuda else "host"
    segment = run.shm / f"stream-{mode}.seg"
    with sidecar(run.source, segment, mode, run.args, ring=run.args.ring_bytes) as appeared:
        with attach(segment, timeout=60) as model:
            model.timeout = max(run.guard.left(), 1.0)
            out, _ = copy_model(model, strategy, run.device)
            run.device.sync()
        seconds = time.monotonic() - appeared
    run.note("overlap", f"{mode} streamed", seconds, round=round_number)
    run.check_bits(f"{mode} streamed", out)


# --- the run ----------------------------------------------------------------------------------------------


def environment(run: Run) -> dict[str, Any]:
    import torch

    info: dict[str, Any] = {
        "section": "env", "python": platform.python_version(), "torch": torch.__version__,
        "torch_cuda": torch.version.cuda, "cpus": os.cpu_count(), "loadavg": os.getloadavg()[0],
        "size_bytes": run.tensors.nbytes, "tensors": len(run.tensors.entries), "rounds": run.args.rounds,
        "dry": run.args.dry, "commit": os.environ.get("MODELLOAD_COMMIT", "unknown"), "time": time.time(),
        "cases": sorted(run.args.groups), "budget_s": run.args.budget, "case_limit_s": run.args.case_limit,
    }  # fmt: skip
    if run.device.cuda:
        props = torch.cuda.get_device_properties(0)
        info |= {
            "gpu": props.name,
            "gpu_memory": props.total_memory,
            "capability": f"{props.major}.{props.minor}",
        }
    return info


def schedule(run: Run, round_number: int) -> list[tuple[str, Callable[[], None], float]]:
    """The cases of one round, most telling first: ``(label, case, seconds it needs at least)``. Rounds
    after the first repeat the copies of the first groups only."""
    groups, first = run.args.groups, round_number == 0
    cases: list[tuple[str, Callable[[], None], float]] = []
    r = round_number
    if "ceiling" in groups:
        cases.append((f"ceiling #{r}", lambda: ceilings(run, r), 5))
    strategies = run.strategies()
    if "full" in groups:
        for strategy in strategies[:2]:
            cases.append((f"full {strategy} #{r}", lambda s=strategy: full_copies(run, r, s), 5))
    if "ring" in groups:
        for strategy in strategies[:2]:
            cases.append((f"ring {strategy} #{r}", lambda s=strategy: loaded_first(run, "ring", s, r), 10))
        if first:
            cases.append((f"ring streamed #{r}", lambda: streamed(run, "ring", r), 10))
    if "overlap" in groups:  # every round: the overlap's line compares medians of these
        cases.append((f"load alone #{r}", lambda: load_alone(run, r), 10))
        for mode in ("full", "release"):
            cases.append((f"{mode} streamed #{r}", lambda m=mode: streamed(run, m, r), 10))
        if len(strategies) > 2:  # its baseline's copy: state_dict of the loaded model
            cases.append((f"full {strategies[2]} #{r}", lambda: full_copies(run, r, strategies[2]), 5))
    if not first:
        return cases
    if "handoff" in groups:
        cases.append(("handoff", lambda: handoff(run), 30))
    for strategy in strategies[2:]:
        if "full" in groups and "overlap" not in groups:
            cases.append((f"full {strategy} #{r}", lambda s=strategy: full_copies(run, r, s), 5))
        if "ring" in groups:
            cases.append((f"ring {strategy} #{r}", lambda s=strategy: loaded_first(run, "ring", s, r), 10))
    if "release" in groups:
        for strategy in strategies:
            cases.append(
                (f"release {strategy} #{r}", lambda s=strategy: loaded_first(run, "release", s, r), 10)
            )
    if "pinning" in groups and run.device.cuda:
        cases.append((f"full in-place, each tensor pinned #{r}", lambda: pinned_per_tensor(run, r), 10))
    return cases


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", type=float, default=4.0, help="model size in GiB (default 4; --dry: 1/64)")
    parser.add_argument("--rounds", type=int, default=3, help="at most this many rounds (budget permitting)")
    parser.add_argument("--readers", type=int, default=8)
    parser.add_argument(
        "--ring-size", default="1GiB", help="the ring of the streamed ring case (--dry: 4MiB)"
    )
    parser.add_argument("--out", help="append the figures here as JSON lines")
    parser.add_argument(
        "--budget", type=float, default=300.0, help="seconds for the whole run, model included"
    )
    parser.add_argument("--case-limit", type=float, default=90.0, help="seconds one case may take")
    parser.add_argument("--cases", default=",".join(GROUPS), help=f"groups to run, of {','.join(GROUPS)}")
    parser.add_argument(
        "--dry", action="store_true", help="a tiny model, CUDA parts skipped: checks the script"
    )
    parser.add_argument("--verbose", action="store_true", help="print every record as it is made")
    parser.add_argument("--stall", help=argparse.SUPPRESS)  # a case label made to hang: the guard's test
    args = parser.parse_args(argv)
    args.groups = {g.strip() for g in args.cases.split(",") if g.strip()}
    if args.groups - set(GROUPS):
        parser.error(
            f"--cases: unknown {', '.join(sorted(args.groups - set(GROUPS)))}; of {','.join(GROUPS)}"
        )
    if args.dry:
        args.size, args.rounds, args.ring_size = min(args.size, 1 / 64), 1, "4MiB"
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    started = time.monotonic()
    # The GPU check stops a step that runs past its limit with SIGTERM: end through the cleanup below
    # (sidecars, keeper, the model and segments in /dev/shm), keeping the figures already written.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    import torch

    from modelload.loader.segment import SegmentReader
    from modelload.loader.sizes import parse_size

    cuda = torch.cuda.is_available() and not args.dry
    if not cuda:
        print("CUDA: skipped (" + ("--dry" if args.dry else "torch sees no CUDA device") + "): the GPU copies, "
              "the pinned ceiling and the hand-off are not measured; the host parts run", flush=True)  # fmt: skip
    device = Device(cuda, torch.cuda.get_device_name(0) if cuda else "cpu (no CUDA)")
    shm_base = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None
    shm = Path(tempfile.mkdtemp(prefix="modelload-gpu-bench-", dir=shm_base))
    total = int(args.size * GiB)
    args.ring_bytes = parse_size(args.ring_size, setting="--ring-size")
    ok = False
    try:
        source = shm / "model.safetensors"  # the sidecar reads it from the page cache either way
        nbytes = make_model(source, total)
        print(f"[{time.monotonic() - started:6.1f} s] model: {nbytes / GiB:.2f} GiB made", flush=True)
        guard = Guard(lambda record: None, started, args.budget, args.case_limit, stop_all, args.stall)
        run = Run(args, device, shm, source, FileTensors.read(source), guard)
        guard.emit = run.emit
        run.emit(environment(run))
        setup = first_copy(device)
        if setup is not None:
            run.emit({"section": "setup", "case": "first copy through the copier", "seconds": setup})
            print(f"[{time.monotonic() - started:6.1f} s] the copier's first copy (2 MiB, once a process): "
                  f"{setup * 1000:.1f} ms", flush=True)  # fmt: skip
        run.full = staged_segment(run)
        with SegmentReader.open(run.full) as staged:
            run.ring = whole_ring(staged.header.data_length)
        for round_number in range(args.rounds):
            if round_number and guard.left() < 30:
                print(f"budget of {args.budget:g} s spent: {round_number} rounds measured", flush=True)
                break
            for label, case, needs in schedule(run, round_number):
                guard.run(label, case, needs=needs)
        ok = report(run)
    finally:
        stop_all()
        shutil.rmtree(shm, ignore_errors=True)
    return 0 if ok else 1


if __name__ == "__main__":
    try:
        raise SystemExit(main())
    except RuntimeError as exc:  # a failed load or app: its reason, not a traceback
        raise SystemExit(f"gpu_copy: {exc}") from None
