"""Model directories as the Hugging Face Hub has them, written with the real ``safetensors`` package.

A directory holds weight shards named ``model-0000K-of-0000N.safetensors``, ``model.safetensors.index.json``
mapping every tensor to its shard, and small files (config, generation config, tokenizer). Shards are cut
by a byte budget, in the order of the state dict, as ``save_pretrained(max_shard_size=...)`` does.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

SMALL_FILES = {
    "config.json": json.dumps({"model_type": "toy", "hidden_size": 256}).encode(),
    "generation_config.json": json.dumps({"do_sample": False}).encode(),
    "tokenizer.json": json.dumps({"version": "1.0", "model": {"type": "BPE", "vocab": {"a": 0}}}).encode(),
    "tokenizer_config.json": b'{"model_max_length": 2048}',
    "chat_template.jinja": b"{% for m in messages %}{{ m.content }}{% endfor %}",
    "tokenizer.model": bytes(range(256)) * 4,
}
IGNORED_FILES = {"README.md": b"# a model\n", "pytorch_model.bin": b"old weights, never fetched"}


def shard(tensors: dict[str, torch.Tensor], shards: int) -> list[dict[str, torch.Tensor]]:
    """Split ``tensors`` into ``shards`` groups of consecutive tensors of roughly equal bytes."""
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    budget = total / shards
    groups: list[dict[str, torch.Tensor]] = [{}]
    filled = 0
    for name, tensor in tensors.items():
        if filled >= budget * len(groups) and len(groups) < shards:
            groups.append({})
        groups[-1][name] = tensor.contiguous()
        filled += tensor.numel() * tensor.element_size()
    return groups


def files(
    tensors: dict[str, torch.Tensor],
    *,
    shards: int = 3,
    small: dict[str, bytes] | None = None,
    index: bool = True,
) -> dict[str, bytes]:
    """A model directory's files by name: shards, the index (when ``index``), small and ignored files."""
    out: dict[str, bytes] = {}
    groups = shard(tensors, shards)
    weight_map: dict[str, str] = {}
    for number, group in enumerate(groups, 1):
        name = f"model-{number:05d}-of-{len(groups):05d}.safetensors"
        out[name] = _safetensors(group)
        weight_map.update(dict.fromkeys(group, name))
    if index:
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        out["model.safetensors.index.json"] = json.dumps(
            {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2
        ).encode()
    out.update(SMALL_FILES if small is None else small)
    out.update(IGNORED_FILES)
    return out


def write(directory: Path, content: dict[str, bytes]) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    for name, data in content.items():
        (directory / name).write_bytes(data)
    return directory


def _safetensors(tensors: dict[str, torch.Tensor]) -> bytes:
    import tempfile

    with tempfile.TemporaryDirectory() as scratch:
        path = Path(scratch) / "shard.safetensors"
        save_file(tensors, str(path), metadata={"format": "pt"})
        return path.read_bytes()
