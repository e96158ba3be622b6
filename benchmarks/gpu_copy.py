"""The segment -> GPU path, measured in one run: throughput per memory mode and copy strategy against torch's
own copies, the overlap with a loading sidecar, bitwise checks, and the CUDA hand-off's app restart.

A safetensors model of ``--size`` GiB (bfloat16, Llama-shaped tensors, random bits) is generated locally;
nothing is downloaded. Sections, each a JSON line per measurement in ``--out`` (figures stay if the run is cut
short), then a table on standard output:

- ``ceiling``: torch copying the file's tensors to the GPU from pageable memory (the file read into an
  ordinary buffer) and from a ``pin_memory()`` buffer: the ceiling every strategy is held against;
- ``copy``: from a segment whose load finished before the copy started, in memory mode full (``modelload
  stage``), release (a real sidecar; this process registered and holds every tensor until it copies) and
  ring (a ring as large as the model, so the load completes), with each ``DeviceCopier`` strategy (pinned in
  place: ``cudaHostRegister`` read-only on the segment's mapping; staging: the pinned bounce buffers) and
  with ``Model.state_dict(device=...)`` as an app calls it;
- ``overlap``: a sidecar loading the model while this process copies (``state_dict``) in each mode, from the
  segment's first byte to the last tensor on the device, against loading then copying (the sidecar's load
  alone plus the full-mode copy);
- ``bitwise``: every device tensor of every case against the file's bytes (compared on the device);
- ``handoff``: ``modelload keeper`` holds the model on the GPU; a fresh app process maps it
  (``handoff.connect()``) against a fresh app process copying it from the segment (``attach()`` +
  ``state_dict(device)``): the restart of an app container, process start to weights usable.

Goal, checked at the end: pinned in place (memory mode full) >= 0.85 x the pinned ceiling; every tensor
bitwise equal. Each figure is the median of ``--rounds`` rounds, cases alternating within a round.

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
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
GiB = 1 << 30
MiB = 1 << 20
GOAL = 0.85


# --- the model --------------------------------------------------------------------------------------------


def make_model(path: Path, total: int) -> int:
    """A Llama-shaped bfloat16 safetensors file of about ``total`` bytes, random bits (seeded)."""
    from modelload.loader.dtypes import by_name
    from modelload.loader.formats.safetensors import RawTensor, save_file

    big = total >= GiB
    hidden, inter, vocab = (4096, 11008, 32000) if big else (256, 688, 2000)
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, hidden)}
    layer, used = 0, vocab * hidden * 2
    per_layer = (4 * hidden * hidden + 3 * hidden * inter + 2 * hidden) * 2
    while used + vocab * hidden * 2 < total or layer == 0:  # at least the size asked for
        prefix = f"model.layers.{layer}."
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            shapes[f"{prefix}self_attn.{name}.weight"] = (hidden, hidden)
        shapes[f"{prefix}mlp.gate_proj.weight"] = (inter, hidden)
        shapes[f"{prefix}mlp.up_proj.weight"] = (inter, hidden)
        shapes[f"{prefix}mlp.down_proj.weight"] = (hidden, inter)
        shapes[f"{prefix}input_layernorm.weight"] = (hidden,)
        shapes[f"{prefix}post_attention_layernorm.weight"] = (hidden,)
        used += per_layer
        layer += 1
    shapes["model.norm.weight"] = (hidden,)
    shapes["lm_head.weight"] = (vocab, hidden)
    rng = np.random.default_rng(24)
    bf16 = by_name("bfloat16")
    tensors = {
        name: RawTensor(bf16, shape, rng.integers(0, 1 << 16, int(np.prod(shape)), dtype=np.uint16))
        for name, shape in shapes.items()
    }
    save_file(tensors, path)
    return sum(t.data.nbytes for t in tensors.values())


@dataclass
class FileTensors:
    """The file's tensors: names, dtypes, shapes and where their bytes are in the file."""

    entries: list[Any]
    nbytes: int

    @classmethod
    def read(cls, path: Path) -> FileTensors:
        from modelload.loader.formats.safetensors import SafetensorsFile

        with SafetensorsFile(path) as f:
            entries = list(f.index.tensors)
        return cls(entries, sum(e.dtype.nbytes(e.shape) for e in entries))

    def views(self, flat: Any) -> dict[str, Any]:
        """Each tensor as a view of ``flat`` (a uint8 torch tensor holding the whole file)."""
        return {
            e.name: _typed(flat[e.data_offset : e.data_offset + e.dtype.nbytes(e.shape)], e)
            for e in self.entries
        }


def _typed(raw: Any, entry: Any) -> Any:
    import torch

    target = entry.dtype.torch()
    return (raw if target == torch.uint8 else raw.view(target)).reshape(entry.shape)


# --- processes --------------------------------------------------------------------------------------------

CHILDREN: list[subprocess.Popen[bytes]] = []


def spawn(argv: list[str], **kwargs: Any) -> subprocess.Popen[bytes]:
    process = subprocess.Popen(argv, **kwargs)
    CHILDREN.append(process)
    return process


def stop(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=30)
    with contextlib.suppress(ValueError):
        CHILDREN.remove(process)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def sidecar(
    source: Path, segment: Path, mode: str, args: argparse.Namespace, *, ring: int = 0
) -> Iterator[float]:
    """A ``modelload sidecar`` loading ``source`` into ``segment``; yields when the segment appears (the
    monotonic time of that moment: the load's first byte is right after)."""
    argv = [
        sys.executable, "-m", "modelload.loader.cli.main", "sidecar", "--source", str(source),
        "--segment", str(segment), "--readers", str(args.readers), "--chunk-size", "32MiB",
        "--host", "127.0.0.1", "--port", str(_free_port()), "--memory-mode", mode,
        "--notify", f"ipc://{segment.parent}/notify-{segment.stem}.sock",
    ]  # fmt: skip
    if mode == "ring":
        argv += ["--ring-size", str(ring)]
    log = segment.with_suffix(".log")  # a file, not a pipe: a pipe nobody reads would stall a chatty sidecar
    with log.open("wb") as err:
        process = spawn(argv, stdout=subprocess.DEVNULL, stderr=err)
    try:
        deadline = time.monotonic() + 120
        while not segment.exists():
            if process.poll() is not None:
                raise RuntimeError(f"the {mode} sidecar died: {log.read_text(errors='replace')[-2000:]}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the {mode} sidecar made no segment in 120 s")
            time.sleep(0.001)
        yield time.monotonic()
    finally:
        stop(process)
        for path in segment.parent.glob(f"{segment.name}*"):
            path.unlink(missing_ok=True)


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


def copy_model(model: Any, strategy: str, device: Device) -> dict[str, Any]:
    """Every tensor of an attached ``model`` on ``device`` with ``strategy``, consumed as it is copied."""
    consume = model.consumed if model.memory_mode != "full" else None
    if strategy == "state_dict":
        return dict(model.state_dict(device="cuda" if device.cuda else None))
    results = {}
    if not device.cuda:  # the host stand-in: a copy of each tensor's bytes
        for name in model.iter_ready():
            results[name] = model.tensor(name, wait=False).clone()
            if consume is not None:
                consume(name)
        return results
    from modelload.loader._api.torch import DeviceCopier

    copier = DeviceCopier("cuda", pin_in_place=strategy == "in-place")
    for name in model.iter_ready():
        done = None if consume is None else (lambda n=name: consume(n))
        results[name] = copier.copy(model.tensor(name, wait=False), on_done=done)
    copier.finish()
    if strategy == "in-place" and not copier.pins_in_place:
        raise Refused("cudaHostRegister(read-only) was refused on the segment's mapping")
    return results


class Refused(RuntimeError):
    """A strategy the driver refused here: its case gets a record saying so instead of a figure."""


def timed(fn: Callable[[], dict[str, Any]], device: Device) -> tuple[float, dict[str, Any]]:
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
    work: Path
    shm: Path
    source: Path
    tensors: FileTensors
    started: float
    """When the script started (``--budget`` counts from here: the model's making included)."""
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

    def over_budget(self) -> bool:
        return time.monotonic() - self.started > self.args.budget


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


def copies(run: Run, full: Path, round_number: int) -> None:
    from modelload.loader import attach

    strategies = ["in-place", "staging", "state_dict"] if run.device.cuda else ["host"]
    for strategy in strategies:
        with attach(full, notify=False) as model:
            try:
                seconds, out = timed(lambda m=model, s=strategy: copy_model(m, s, run.device), run.device)
            except Refused as exc:
                run.emit({"section": "copy", "case": f"full {strategy}", "refused": str(exc)})
                print(f"copy full {strategy}: {exc}")
                continue
        run.note("copy", f"full {strategy}", seconds, round=round_number)
        run.check_bits(f"full {strategy}", out)
        del out
    for mode in ("release", "ring"):
        for strategy in strategies:
            segment = run.shm / f"{mode}.seg"
            # A ring as large as the model: the load completes before the copy starts, as in the others.
            with (
                sidecar(run.source, segment, mode, run.args, ring=run.args.whole_ring) as appeared,
                attach(segment, timeout=60) as model,  # registered before anything can be released
            ):
                model.wait(timeout=600)
                loaded = time.monotonic() - appeared
                try:
                    seconds, out = timed(lambda m=model, s=strategy: copy_model(m, s, run.device), run.device)
                except Refused as exc:
                    run.emit({"section": "copy", "case": f"{mode} {strategy}", "refused": str(exc)})
                    print(f"copy {mode} {strategy}: {exc}")
                    continue
            run.note("copy", f"{mode} {strategy}", seconds, round=round_number, load_seconds=loaded)
            run.check_bits(f"{mode} {strategy}", out)
            del out


def overlap(run: Run, round_number: int) -> None:
    from modelload.loader import attach

    strategy = "state_dict" if run.device.cuda else "host"
    segment = run.shm / "alone.seg"
    with sidecar(run.source, segment, "full", run.args) as appeared, attach(segment, timeout=60) as model:
        model.wait(timeout=600)
        run.note("overlap", "load alone (full)", time.monotonic() - appeared, round=round_number)
    for mode in ("full", "release", "ring"):
        segment = run.shm / f"stream-{mode}.seg"
        with sidecar(run.source, segment, mode, run.args, ring=run.args.ring_bytes) as appeared:
            with attach(segment, timeout=60) as model:
                out = copy_model(model, strategy, run.device)
                run.device.sync()
            seconds = time.monotonic() - appeared
        run.note("overlap", f"{mode} streamed", seconds, round=round_number)
        run.check_bits(f"{mode} streamed", out)
        del out


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


def handoff(run: Run, full: Path) -> None:
    if not run.device.cuda:
        print("handoff: skipped, it needs a CUDA device (the CPU tests drive its protocol with memfds)")
        run.emit({"section": "handoff", "skipped": "no CUDA device"})
        return
    from modelload.loader.handoff import connect, status

    sock = Path(tempfile.mkdtemp(prefix="ml-bench-")) / "keeper.sock"
    argv = [sys.executable, "-m", "modelload.loader.cli.main", "keeper", "--segment", str(full), "--socket",
            str(sock), "--timeout", "60"]  # fmt: skip
    log = sock.parent / "keeper.log"
    with log.open("wb") as err:
        keeper = spawn(argv, stderr=err)
    try:
        deadline = time.monotonic() + 300
        while True:
            with contextlib.suppress(Exception):
                state = status(sock)
                if state["state"] in ("ready", "failed"):
                    break
            if keeper.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the keeper did not get ready: {log.read_text(errors='replace')[-2000:]}")
            time.sleep(0.05)
        if state["state"] != "ready":
            raise RuntimeError(f"the keeper's load failed: {state.get('error')}")
        run.note("handoff", "keeper load (segment -> GPU)", float(state["seconds"]))
        with connect(sock, timeout=60) as weights:
            run.check_bits("handoff mapped", weights.state_dict())
            run.emit({"section": "handoff", "case": "mapping", "writable": weights.writable})
        for round_number in range(1 if run.over_budget() else run.args.rounds):
            for kind, target in (("handoff", sock), ("reload", full)):
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
          f"median of {run.args.rounds} rounds; load average {os.getloadavg()[0]:.1f}")  # fmt: skip
    print(f"{'section':<9} {'case':<30} {'seconds':>8} {'GiB/s':>7} {'/ pinned':>9}")
    for (section, case), values in run.figures.items():
        if section in ("bitwise", "restart", "restart inside"):
            continue
        seconds = statistics.median(values)
        ratio = f"{(pinned / seconds):.2f}x" if pinned and section != "overlap" else ""
        print(f"{section:<9} {case:<30} {seconds:>8.3f} {nbytes / seconds / GiB:>7.2f} {ratio:>9}")
    ok = True
    for (section, case), values in run.figures.items():
        if section == "bitwise" and not values[0]:
            print(f"bitwise: {case}: NOT EQUAL to the file")
            ok = False
    checked = sum(1 for (section, _) in run.figures if section == "bitwise")
    print(f"bitwise: {checked} cases checked against the file: {'all equal' if ok else 'MISMATCH'}")
    load = median(run, "overlap", "load alone (full)")
    copy = median(run, "copy", "full in-place") or median(run, "copy", "full host")
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
    in_place = median(run, "copy", "full in-place")
    if in_place and pinned:
        met = pinned / in_place >= GOAL
        print(f"goal: pinned in place (full) {nbytes / in_place / GiB:.2f} GiB/s >= {GOAL} x pinned ceiling "
              f"{nbytes / pinned / GiB:.2f} GiB/s: {'yes' if met else 'NO'} ({pinned / in_place:.2f}x)")  # fmt: skip
        ok = ok and met
    else:
        print("goal: not measured here (no CUDA device): pinned in place >= 0.85 x the pinned ceiling")
    return ok


def environment(run: Run) -> dict[str, Any]:
    import torch

    info: dict[str, Any] = {
        "section": "env", "python": platform.python_version(), "torch": torch.__version__,
        "torch_cuda": torch.version.cuda, "cpus": os.cpu_count(), "loadavg": os.getloadavg()[0],
        "size_bytes": run.tensors.nbytes, "tensors": len(run.tensors.entries), "rounds": run.args.rounds,
        "dry": run.args.dry, "commit": os.environ.get("MODELLOAD_COMMIT", "unknown"), "time": time.time(),
    }  # fmt: skip
    if run.device.cuda:
        props = torch.cuda.get_device_properties(0)
        info |= {
            "gpu": props.name,
            "gpu_memory": props.total_memory,
            "capability": f"{props.major}.{props.minor}",
        }
    return info


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", type=float, default=4.0, help="model size in GiB (default 4; --dry: 1/64)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--readers", type=int, default=8)
    parser.add_argument(
        "--ring-size", default="1GiB", help="the ring of the streamed ring case (--dry: 4MiB)"
    )
    parser.add_argument("--out", help="append the figures here as JSON lines")
    parser.add_argument("--budget", type=float, default=300.0, help="seconds; no new round starts after")
    parser.add_argument(
        "--dry", action="store_true", help="a tiny model, CUDA parts skipped: checks the script"
    )
    parser.add_argument("--verbose", action="store_true", help="print every record as it is made")
    parser.add_argument("--app", nargs=3, metavar=("KIND", "TARGET", "SPAWNED"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.app:
        app_main(args.app[0], args.app[1], float(args.app[2]))
        return 0
    started = time.monotonic()
    # The GPU check stops a step that runs past its limit with SIGTERM: end through the cleanup below
    # (sidecars, keeper, the model and segments in /dev/shm), keeping the figures already written.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    import torch

    from modelload.loader.sizes import parse_size

    if args.dry:
        args.size, args.rounds, args.ring_size = min(args.size, 1 / 64), 1, "4MiB"
    cuda = torch.cuda.is_available() and not args.dry
    if not cuda:
        print("CUDA: skipped (" + ("--dry" if args.dry else "torch sees no CUDA device") + "): the GPU copies, "
              "the pinned ceiling and the hand-off are not measured; the host parts run")  # fmt: skip
    device = Device(cuda, torch.cuda.get_device_name(0) if cuda else "cpu (no CUDA)")
    work = Path(tempfile.mkdtemp(prefix="modelload-gpu-bench-"))
    shm_base = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None
    shm = Path(tempfile.mkdtemp(prefix="modelload-gpu-bench-", dir=shm_base))
    total = int(args.size * GiB)
    args.ring_bytes = parse_size(args.ring_size, setting="--ring-size")
    args.whole_ring = -(-(total + 256 * MiB) // MiB) * MiB  # the whole model fits: the load can finish
    try:
        # The model on tmpfs when there is room for it and three segments (writing it to a disk would sync
        # gigabytes first); the sidecar reads it from the page cache either way.
        room = shutil.disk_usage(shm).free > 4 * total
        source = (shm if room else work) / "model.safetensors"
        make_model(source, total)
        run = Run(args, device, work, shm, source, FileTensors.read(source), started)
        run.emit(environment(run))
        full = staged_segment(run)
        for round_number in range(args.rounds):
            if round_number and run.over_budget():
                print(f"budget of {args.budget:g} s spent: {round_number} rounds measured")
                break
            ceilings(run, round_number)
            copies(run, full, round_number)
            overlap(run, round_number)
        handoff(run, full)
        ok = report(run)
    finally:
        for process in list(CHILDREN):
            stop(process)
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)
    return 0 if ok else 1


if __name__ == "__main__":
    try:
        raise SystemExit(main())
    except RuntimeError as exc:  # a failed load or app: its reason, not a traceback
        raise SystemExit(f"gpu_copy: {exc}") from None
