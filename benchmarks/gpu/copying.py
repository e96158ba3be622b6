"""How the GPU benchmark copies a segment's tensors to the device, and what one run keeps: the device (or the
host standing in for it), each ``DeviceCopier`` strategy as a case measures it, and the figures, each a JSON
line as soon as it is measured, with each case's bitwise check against the file."""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from guard import Guard
from synthetic import FileTensors, GiB

__all__ = ["Device", "Refused", "Run", "copy_model", "first_copy", "timed"]


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
    from modelload.loader._api.gpu_copy import DeviceCopier

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
    from modelload.loader._api.gpu_copy import DeviceCopier

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
