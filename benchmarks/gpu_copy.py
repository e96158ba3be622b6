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

    python benchmarks/gpu_copy.py [--size 4] [--rounds 3] [--out gpu_copy.jsonl] [--budget 300] [--dry]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE / "gpu"))  # benchmarks/gpu/: this script's helpers, not a package
from children import sidecar, spawn, stop, stop_all  # noqa: E402
from guard import Guard  # noqa: E402
from synthetic import FileTensors, GiB, make_model, whole_ring  # noqa: E402

GOAL = 0.85
GROUPS = ("ceiling", "full", "ring", "overlap", "handoff", "release", "pinning")


# --- copies -------------------------------------------------------------------------------------------------


@dataclass
class Device:
    """Where copies go: a CUDA device, or the host (``--dry``, or no GPU) where copies are clones."""

    cuda: bool
    name: str = "cpu"

    def sync(self) -> None:
        if self.cuda:
            import torch

            torch.cuda.synchronize()


class Refused(RuntimeError):
    """A strategy the driver refused here: its case gets a record saying so instead of a figure."""


def copy_model(model: Any, strategy: str, device: Device) -> tuple[dict[str, Any], dict[str, float]]:
    """Every tensor of an attached ``model`` on ``device`` with ``strategy``, consumed as it is copied; the
    results, and for ``in-place`` what its pinning cost: ``pin_s`` and ``unpin_s`` where the mapping (or the
    ring) was pinned once, before the first copy and unpinned after the last, so that the copy's own time
    is the rest; ``pinning_s`` in all (each tensor's pins, which overlap the copies, included)."""
    consume = model.consumed if model.memory_mode != "full" else None
    if strategy == "state_dict":
        return dict(model.state_dict(device="cuda" if device.cuda else None)), {}
    results = {}
    if not device.cuda:  # the host stand-in: a copy of each tensor's bytes
        for name in model.iter_ready():
            results[name] = model.tensor(name, wait=False).clone()
            if consume is not None:
                consume(name)
        return results, {}
    from modelload.loader._api.torch import DeviceCopier

    copier = DeviceCopier("cuda", pin_in_place=strategy != "staging")
    region = model._pinnable(list(model.names)) if strategy == "in-place" else None  # as state_dict's
    if region is not None and not copier.pin(region):
        copier.finish()
        raise Refused("pinning the segment's mapping (read-only registration) was refused")
    pinned = copier.register_seconds
    for name in model.iter_ready():
        done = None if consume is None else (lambda n=name: consume(n))
        results[name] = copier.copy(model.tensor(name, wait=False), on_done=done)
    device.sync()
    unpinning = time.perf_counter()
    copier.finish()
    phases: dict[str, float] = {}
    if region is not None:
        phases = {"pin_s": pinned, "unpin_s": time.perf_counter() - unpinning}
    if strategy != "staging":
        phases["pinning_s"] = copier.register_seconds + copier.unregister_seconds
        if not copier.pins_in_place:
            raise Refused("pinning a tensor in place (read-only registration) was refused")
    return results, phases


def first_copy(device: Device) -> float | None:
    """Seconds of a process's first copy through the loader's copier, of 2 MiB pinned in place: the copier's
    imports, the driver library, torch's pool of side streams, the completion thread. Paid here, once,
    before any case, so that the first round of the first case measured in place does not carry it: the
    ceilings' torch copies had paid theirs before they were timed (torch made its CUDA context when the
    device was named). None without CUDA."""
    if not device.cuda:
        return None
    import torch

    device.sync()
    started = time.perf_counter()
    from modelload.loader._api.torch import DeviceCopier

    copier = DeviceCopier("cuda")
    try:
        copier.copy(torch.zeros(2 << 20, dtype=torch.uint8))
    finally:
        copier.finish()
    device.sync()
    return time.perf_counter() - started


def timed(fn: Callable[[], Any], device: Device) -> tuple[float, Any]:
    device.sync()
    started = time.perf_counter()
    result = fn()
    device.sync()
    return time.perf_counter() - started, result


# --- the run ----------------------------------------------------------------------------------------------


@dataclass
class Run:
    args: argparse.Namespace
    device: Device
    shm: Path
    source: Path
    tensors: FileTensors
    guard: Guard
    full: Path = Path()
    ring: int = 0
    """The ring of the loaded-first ring cases: the whole model (:func:`whole_ring`)."""
    reference: dict[str, Any] = field(default_factory=dict)
    figures: dict[tuple[str, str], list[float]] = field(default_factory=dict)

    def emit(self, record: dict[str, Any]) -> None:
        line = json.dumps(record)
        if self.args.out:
            with Path(self.args.out).open("a") as out:
                out.write(line + "\n")
        if self.args.verbose:
            print(line, flush=True)

    def note(self, section: str, case: str, seconds: float, **extra: Any) -> None:
        gib_s = self.tensors.nbytes / seconds / GiB
        self.figures.setdefault((section, case), []).append(seconds)
        self.emit({"section": section, "case": case, "seconds": seconds, "gib_s": gib_s,
                   "bytes": self.tensors.nbytes, **extra})  # fmt: skip

    def check_bits(self, case: str, results: dict[str, Any]) -> None:
        """Every tensor of ``results`` against the file's bytes, once per case."""
        if ("bitwise", case) in self.figures:
            return
        import torch

        equal = 0
        for name, expected in self.reference.items():
            got = results.get(name)
            if got is not None and got.dtype == expected.dtype and got.shape == expected.shape:
                equal += bool(
                    torch.equal(got.reshape(-1).view(torch.uint8), expected.reshape(-1).view(torch.uint8))
                )
        self.figures[("bitwise", case)] = [float(equal == len(self.reference))]
        self.emit({"section": "bitwise", "case": case, "tensors": len(self.reference), "equal": equal})

    def strategies(self) -> list[str]:
        return ["in-place", "staging", "state_dict"] if self.device.cuda else ["host"]


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


# --- the hand-off -----------------------------------------------------------------------------------------


def app_main(kind: str, target: str, spawned: float) -> None:
    """A fresh app process (``--app``): get the weights on the GPU one way, print its timings as JSON."""
    import torch

    torch.cuda.init()
    torch.empty(0, device="cuda")
    imported = time.time()
    started = time.perf_counter()
    if kind == "handoff":
        from modelload.loader.handoff import connect

        weights = connect(target, timeout=120).state_dict()
    else:
        from modelload.loader import attach

        weights = attach(target, notify=False).state_dict(device="cuda")
    torch.cuda.synchronize()
    inside = time.perf_counter() - started
    total = sum(int(t.numel() * t.element_size()) for t in weights.values())
    print(json.dumps({"inside_s": inside, "since_spawn_s": time.time() - spawned,
                      "import_s": imported - spawned, "bytes": total}), flush=True)  # fmt: skip


def fresh_app(kind: str, target: Path) -> dict[str, Any]:
    argv = [sys.executable, str(Path(__file__).resolve()), "--app", kind, str(target), str(time.time())]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=300, check=False)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode or not lines:
        raise RuntimeError(f"the {kind} app failed: {done.stderr[-2000:]}")
    figures: dict[str, Any] = json.loads(lines[-1])
    return figures


def handoff(run: Run) -> None:
    if not run.device.cuda:
        print("handoff: skipped, it needs a CUDA device (the CPU tests drive its protocol with memfds)")
        run.emit({"section": "handoff", "skipped": "no CUDA device"})
        return
    from modelload.loader.handoff import connect, status

    sock = Path(tempfile.mkdtemp(prefix="ml-bench-")) / "keeper.sock"
    argv = [sys.executable, "-m", "modelload.loader.cli.main", "keeper", "--segment", str(run.full), "--socket",
            str(sock), "--timeout", "60"]  # fmt: skip
    log = sock.parent / "keeper.log"
    with log.open("wb") as err:
        keeper = spawn(argv, stderr=err)
    try:
        while True:
            with contextlib.suppress(Exception):
                state = status(sock)
                if state["state"] in ("ready", "failed"):
                    break
            if keeper.poll() is not None:
                raise RuntimeError(f"the keeper did not get ready: {log.read_text(errors='replace')[-2000:]}")
            time.sleep(0.05)
        if state["state"] != "ready":
            raise RuntimeError(f"the keeper's load failed: {state.get('error')}")
        run.note("handoff", "keeper load (segment -> GPU)", float(state["seconds"]))
        with connect(sock, timeout=60) as weights:
            run.check_bits("handoff mapped", weights.state_dict())
            run.emit({"section": "handoff", "case": "mapping", "writable": weights.writable})
        for round_number in range(run.args.rounds):
            if round_number and run.guard.left() < 60:
                break
            for kind, target in (("handoff", sock), ("reload", run.full)):
                figures = fresh_app(kind, target)
                run.figures.setdefault(("restart", kind), []).append(figures["since_spawn_s"])
                run.figures.setdefault(("restart inside", kind), []).append(figures["inside_s"])
                run.emit({"section": "restart", "case": kind, "round": round_number, **figures})
    finally:
        stop(keeper)
        shutil.rmtree(sock.parent, ignore_errors=True)


# --- report -----------------------------------------------------------------------------------------------


def median(run: Run, section: str, case: str) -> float | None:
    values = run.figures.get((section, case))
    return statistics.median(values) if values else None


def report(run: Run) -> bool:
    nbytes = run.tensors.nbytes
    pinned = median(run, "ceiling", "torch pin_memory")
    print(f"\nsegment -> {run.device.name}: {nbytes / GiB:.2f} GiB, {len(run.tensors.entries)} tensors; "
          f"medians (n: rounds measured); load average {os.getloadavg()[0]:.1f}")  # fmt: skip
    print(f"{'section':<9} {'case':<38} {'n':>2} {'seconds':>8} {'GiB/s':>7} {'/ pinned':>9}")
    for (section, case), values in run.figures.items():
        if section in ("bitwise", "restart", "restart inside"):
            continue
        seconds = statistics.median(values)
        ratio = f"{(pinned / seconds):.2f}x" if pinned and section != "overlap" else ""
        print(
            f"{section:<9} {case:<38} {len(values):>2} {seconds:>8.3f} {nbytes / seconds / GiB:>7.2f} {ratio:>9}"
        )
    ok = True
    for (section, case), values in run.figures.items():
        if section == "bitwise" and not values[0]:
            print(f"bitwise: {case}: NOT EQUAL to the file")
            ok = False
    checked = sum(1 for (section, _) in run.figures if section == "bitwise")
    print(f"bitwise: {checked} cases checked against the file: {'all equal' if ok else 'MISMATCH'}")
    load = median(run, "overlap", "load alone (full)")
    # the copy an app makes of a loaded segment: state_dict(device), which picks its strategy itself
    copy = median(run, "copy", "full state_dict") or median(run, "copy", "full host")
    for mode in ("full", "release", "ring"):
        streamed = median(run, "overlap", f"{mode} streamed")
        if streamed and load and copy:
            print(f"overlap {mode}: first byte -> last tensor {streamed:.2f} s against load then copy "
                  f"{load + copy:.2f} s ({load:.2f} + {copy:.2f}): {streamed / (load + copy):.2f}x")  # fmt: skip
    for kind in ("handoff", "reload"):
        total, inside = median(run, "restart", kind), median(run, "restart inside", kind)
        if total is not None and inside is not None:
            print(f"app restart, {kind}: {total:.2f} s from process start to weights on the GPU "
                  f"({inside:.3f} s of it getting the weights)")  # fmt: skip
    cut = {case: status for case, status in run.guard.outcomes.items() if status != "ok"}
    if cut:
        print("cases not measured: " + ", ".join(f"{case} ({status})" for case, status in cut.items()))
    in_place = median(run, "copy", "full in-place")
    if in_place and pinned:
        met = pinned / in_place >= GOAL
        print(f"goal: pinned in place (full, once pinned) {nbytes / in_place / GiB:.2f} GiB/s >= {GOAL} x pinned "
              f"ceiling {nbytes / pinned / GiB:.2f} GiB/s: {'yes' if met else 'NO'} ({pinned / in_place:.2f}x)")  # fmt: skip
        whole = median(run, "copy", "full in-place with pinning")
        if whole:
            print(
                f"       with the pinning (paid once per copy of the segment): {nbytes / whole / GiB:.2f} GiB/s"
            )
        ok = ok and met
    else:
        print("goal: not measured here: pinned in place (full) >= 0.85 x the pinned ceiling")
    return ok and not any(status in ("timeout", "error") for status in cut.values())


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
    parser.add_argument("--app", nargs=3, metavar=("KIND", "TARGET", "SPAWNED"), help=argparse.SUPPRESS)
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
    if args.app:
        app_main(args.app[0], args.app[1], float(args.app[2]))
        return 0
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
