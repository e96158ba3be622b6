"""The GPU benchmark's table and verdict: medians of the rounds measured, each copy against the pinned ceiling,
the bitwise checks, the overlap and the restart, and the goal."""

from __future__ import annotations

import os
import statistics

from copying import Run
from synthetic import GiB

__all__ = ["GOAL", "report"]

GOAL = 0.85
"""Pinned in place (memory mode full, the copy once pinned) against the pinned ceiling, at least."""


def median(run: Run, section: str, case: str) -> float | None:
    values = run.figures.get((section, case))
    return statistics.median(values) if values else None


def report(run: Run) -> bool:
    """Print the table and the verdicts; whether the goal was met, every tensor equal and no case cut."""
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
