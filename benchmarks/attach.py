"""How long an inference process takes to attach to a ready segment and hold every tensor as torch tensors.

The goal is flat in model size: attaching maps the segment and makes views, it copies nothing. For each size
(about 300 tensors, TinyLlama-like shapes scaled to the size) this writes a complete segment in /dev/shm,
then measures in fresh processes (imports not timed, as for the contenders in run.py):

- ``attach()``: open, check the header and manifest, map;
- ``state_dict()``: every tensor as a zero-copy torch tensor (afterwards, outside the timing, one element of
  each is read, so the views are known to reach the segment's memory).

    python benchmarks/attach.py [--sizes 0.5,1,2] [--runs 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

import numpy as np
from scratch import scratch

from modelload.loader.dtypes import by_name
from modelload.loader.segment import SegmentWriter, TensorSpec, plan_layout

CHILD = """
import json, sys, time
import torch
from modelload.loader import attach
path = sys.argv[1]
t0 = time.perf_counter()
model = attach(path, notify=False)
t1 = time.perf_counter()
state = model.state_dict()
t2 = time.perf_counter()
touched = sum(float(t.reshape(-1)[:1].float().sum()) for t in state.values() if t.numel())
print(json.dumps({"attach_ms": (t1 - t0) * 1e3, "state_dict_ms": (t2 - t1) * 1e3, "tensors": len(state)}))
"""


def shapes(total_bytes: int, *, layers: int = 32) -> list[tuple[str, tuple[int, ...]]]:
    """TinyLlama-like tensor shapes (9 per layer, plus embeddings, norm, head) scaled to ``total_bytes`` in bf16."""
    width = 64
    while _size(width * 2, layers) <= total_bytes:
        width *= 2
    while _size(width + 16, layers) <= total_bytes:
        width += 16
    vocab, mlp, kv = 8 * width, (width * 11) // 4, width // 4
    result: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (vocab, width))]
    for i in range(layers):
        p = f"model.layers.{i}."
        result += [
            (p + "self_attn.q_proj.weight", (width, width)),
            (p + "self_attn.k_proj.weight", (kv, width)),
            (p + "self_attn.v_proj.weight", (kv, width)),
            (p + "self_attn.o_proj.weight", (width, width)),
            (p + "mlp.gate_proj.weight", (mlp, width)),
            (p + "mlp.up_proj.weight", (mlp, width)),
            (p + "mlp.down_proj.weight", (width, mlp)),
            (p + "input_layernorm.weight", (width,)),
            (p + "post_attention_layernorm.weight", (width,)),
        ]
    return [*result, ("model.norm.weight", (width,)), ("lm_head.weight", (vocab, width))]


def _size(width: int, layers: int) -> int:
    vocab, mlp, kv = 8 * width, (width * 11) // 4, width // 4
    per_layer = 2 * width * width + 2 * kv * width + 3 * mlp * width + 2 * width
    return 2 * (2 * vocab * width + layers * per_layer + width)


def write_segment(path: Path, total_bytes: int) -> tuple[int, int]:
    specs = [TensorSpec(name, by_name("bfloat16"), shape) for name, shape in shapes(total_bytes)]
    layout = plan_layout(specs, metadata={"format": "benchmark"})
    rng = np.random.default_rng(0)
    block = rng.integers(0, 256, 64 << 20, dtype=np.uint8)
    with SegmentWriter.create(path, layout, heartbeat=False) as writer:
        for slot in layout.slots:
            view = writer.slot(slot.index)
            for start in range(0, slot.nbytes, len(block)):
                n = min(len(block), slot.nbytes - start)
                view[start : start + n] = block[:n]
            writer.mark_ready(slot.index)
        writer.mark_complete()
    return len(layout.slots), layout.nbytes


def measure(path: Path, runs: int) -> dict[str, float]:
    results = []
    for _ in range(runs):
        out = subprocess.run(
            [sys.executable, "-c", CHILD, str(path)], capture_output=True, text=True, check=True
        )
        results.append(json.loads(out.stdout))
    return {
        "attach_ms": statistics.median(r["attach_ms"] for r in results),
        "state_dict_ms": statistics.median(r["state_dict_ms"] for r in results),
        "total_ms": statistics.median(r["attach_ms"] + r["state_dict_ms"] for r in results),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="0.5,1,2", help="model sizes in GiB")
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args(argv)
    with scratch("modelload-attach-") as directory:
        print(
            f"{'size':>8} {'tensors':>8} {'attach':>10} {'state_dict':>11} {'total':>9}   (median of {args.runs}, fresh processes)"
        )
        for gib in (float(s) for s in args.sizes.split(",")):
            path = directory / f"{gib}.seg"
            count, nbytes = write_segment(path, int(gib * 2**30))
            figures = measure(path, args.runs)
            print(
                f"{nbytes / 2**30:7.2f}G {count:8d} {figures['attach_ms']:8.2f}ms {figures['state_dict_ms']:9.2f}ms "
                f"{figures['total_ms']:7.2f}ms"
            )
            path.unlink()
    return 0


if __name__ == "__main__":
    sys.exit(main())
