"""The restart of an app container, measured: ``modelload keeper`` holds the model on the GPU, and a fresh app
process either maps it (``handoff.connect()``) or copies it from the segment (``attach()`` +
``state_dict(device)``), process start to weights usable.

Run as a script it is that app process: ``restart.py KIND TARGET SPAWNED`` gets the weights one way and
prints its timings as a JSON line.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from children import spawn, stop

__all__ = ["handoff"]


def app_main(kind: str, target: str, spawned: float) -> None:
    """A fresh app process (this file run as a script): get the weights on the GPU one way (``kind``
    ``handoff`` from the keeper's socket ``target``, else ``attach()`` of the segment ``target``), print its
    timings as JSON."""
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
    argv = [sys.executable, str(Path(__file__).resolve()), kind, str(target), str(time.time())]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=300, check=False)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode or not lines:
        raise RuntimeError(f"the {kind} app failed: {done.stderr[-2000:]}")
    figures: dict[str, Any] = json.loads(lines[-1])
    return figures


def handoff(run: Any) -> None:
    """The keeper's load, its mapping checked bitwise, then ``--rounds`` restarts each way (``run``: a
    ``copying.Run``)."""
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


if __name__ == "__main__":
    app_main(sys.argv[1], sys.argv[2], float(sys.argv[3]))
