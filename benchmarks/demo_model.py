"""The demo's model, and the inference process that runs it from a streaming segment.

A small decoder-only transformer (random weights, nothing downloaded). The inference side builds it on the
``meta`` device (no weights allocated), attaches to the segment the sidecar is filling, and runs the forward
pass block by block, each block as soon as its own weights are in: the first layers compute while the last
ones are still on the wire.

Run as ``python benchmarks/demo_model.py infer --segment PATH --expected PATH`` (the demo does this); it
prints one JSON line with its timeline and the check against the reference output.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import asdict, dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class Config:
    vocab: int = 16384
    width: int = 1024
    heads: int = 16
    layers: int = 12
    mlp: int = 2816
    context: int = 64

    @property
    def parameters(self) -> int:
        per_block = 4 * self.width * self.width + 3 * self.width * self.mlp + 2 * self.width
        return 2 * self.vocab * self.width + self.layers * per_block + self.width


class Block(nn.Module):
    def __init__(self, config: Config) -> None:
        super().__init__()
        self.heads = config.heads
        self.attn_norm = nn.RMSNorm(config.width)
        self.qkv = nn.Linear(config.width, 3 * config.width, bias=False)
        self.out = nn.Linear(config.width, config.width, bias=False)
        self.mlp_norm = nn.RMSNorm(config.width)
        self.gate = nn.Linear(config.width, config.mlp, bias=False)
        self.up = nn.Linear(config.width, config.mlp, bias=False)
        self.down = nn.Linear(config.mlp, config.width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, width = x.shape
        q, k, v = self.qkv(self.attn_norm(x)).split(width, dim=-1)
        shape = (batch, length, self.heads, width // self.heads)
        q, k, v = (t.view(shape).transpose(1, 2) for t in (q, k, v))
        attended = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.out(attended.transpose(1, 2).reshape(batch, length, width))
        hidden = self.mlp_norm(x)
        return x + self.down(nn.functional.silu(self.gate(hidden)) * self.up(hidden))


class TinyLM(nn.Module):
    def __init__(self, config: Config) -> None:
        super().__init__()
        self.embed = nn.Embedding(config.vocab, config.width)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.layers))
        self.norm = nn.RMSNorm(config.width)
        self.head = nn.Linear(config.width, config.vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def build(config: Config, *, seed: int = 0) -> TinyLM:
    """The reference model with random weights, scaled so activations stay in range."""
    torch.manual_seed(seed)
    model = TinyLM(config)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if parameter.dim() > 1:
                parameter.normal_(0.0, 1.0 / math.sqrt(parameter.shape[-1]))
            elif "norm" in name:
                parameter.uniform_(0.8, 1.2)
    return model.eval()


def prompt(config: Config) -> torch.Tensor:
    return torch.arange(config.context).remainder(config.vocab).unsqueeze(0)


def _warm_up() -> None:
    """One bf16 block forward on random weights: torch's first kernels (thread pool, bf16 paths) start once,
    before the segment is there, as in a server that has started but has no weights yet."""
    small = Config(vocab=256, width=256, heads=4, mlp=704, layers=1)
    with torch.no_grad():
        build(small).to(torch.bfloat16)(prompt(small))


def infer(segment: str, expected_path: str) -> dict[str, object]:
    """Attach to ``segment``, read the config from its model directory, and run the forward pass block by
    block as the weights arrive."""
    from modelload.loader import attach

    started = time.time()
    _warm_up()
    print("waiting for the segment", file=sys.stderr, flush=True)
    loaded = attach(segment, timeout=600)
    attached_at = time.time()
    ready_at_attach = loaded.progress().tensors_ready
    assert loaded.model_dir is not None, (
        "the sidecar loaded a model directory: its config is beside the segment"
    )
    saved = json.loads((loaded.model_dir / "config.json").read_text())
    config = Config(**{k: v for k, v in saved.items() if k in Config.__dataclass_fields__})
    with torch.device("meta"):
        model = TinyLM(config).eval()
    model_ready_at = time.time()
    steps: list[tuple[str, float]] = []

    def take(module: nn.Module, prefix: str) -> None:
        """Wait for ``prefix``'s tensors, then put them into ``module`` without copying."""
        names = [n for n in loaded.names if n.startswith(prefix)]
        state = loaded.state_dict(names=names)  # waits for exactly these tensors
        module.load_state_dict({n[len(prefix) :]: t for n, t in state.items()}, assign=True)

    with torch.no_grad():
        take(model.embed, "embed.")
        x = model.embed(prompt(config))
        steps.append(("embed", time.time()))
        for i, block in enumerate(model.blocks):
            take(block, f"blocks.{i}.")
            x = block(x)
            steps.append((f"block {i}", time.time()))
        take(model.norm, "norm.")
        take(model.head, "head.")
        logits = model.head(model.norm(x))
        steps.append(("head", time.time()))
    expected = torch.load(expected_path, weights_only=True)
    difference = (logits - expected).abs().max().item()
    complete_at_first_block = steps[1][1]
    return {
        "started": started,
        "model_on_meta_s": model_ready_at - started,
        "attached_at": attached_at,
        "tensors_ready_at_attach": ready_at_attach,
        "tensors": len(loaded),
        "steps": steps,
        "first_block_done_at": complete_at_first_block,
        "done_at": steps[-1][1],
        "max_abs_difference": difference,
        "matches": bool(torch.allclose(logits, expected, rtol=1e-4, atol=1e-4)),
        "bitwise_equal": bool(torch.equal(logits, expected)),
        "config": asdict(config),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("infer", help="attach to a segment and run the forward pass as weights arrive")
    run.add_argument("--segment", required=True)
    run.add_argument("--expected", required=True)
    run.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    result = infer(args.segment, args.expected)
    print(json.dumps(result))
    return 0 if result["matches"] else 1


if __name__ == "__main__":
    sys.exit(main())
