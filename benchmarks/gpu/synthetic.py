"""The GPU benchmark's model: Llama-shaped bfloat16 tensors of random bits, generated where it runs (nothing
is downloaded), the file's tensors as torch views for the ceilings, and the ring that holds it whole."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

GiB = 1 << 30
MiB = 1 << 20

__all__ = ["FileTensors", "make_model", "model_shapes", "whole_ring"]


def model_shapes(total: int) -> dict[str, tuple[int, ...]]:
    """Llama-shaped tensors of at least ``total`` bytes in bfloat16 (a 7B's layer shapes from 1 GiB up)."""
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
    return shapes


def make_model(path: Path, total: int) -> int:
    """A safetensors file of :func:`model_shapes`, random bits (seeded); returns its tensors' bytes."""
    from modelload.loader.dtypes import by_name
    from modelload.loader.formats.safetensors import RawTensor, save_file

    rng = np.random.default_rng(24)
    bf16 = by_name("bfloat16")
    tensors = {
        name: RawTensor(bf16, shape, np.frombuffer(rng.bytes(int(np.prod(shape)) * 2), dtype=np.uint16))
        for name, shape in model_shapes(total).items()
    }
    save_file(tensors, path)
    return sum(t.data.nbytes for t in tensors.values())


def whole_ring(data_length: int) -> int:
    """A ring that holds the whole model: the data span of the model's segment (``data_length``), to the next
    MiB.

    The ring is sized from the model as generated, never from the size asked for: the first GPU run asked a
    sidecar for ``--size`` + 256 MiB (4.25 GiB) for a 4.26 GiB model, so its load could not finish before
    the copy started, and the copy waited for it until the step was killed.
    """
    return -(-data_length // MiB) * MiB


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
