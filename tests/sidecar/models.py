"""Small models for the sidecar tests, written by modelload's own writers (interop with the real packages is
tested in tests/formats), and a byte-exact comparison of a segment with the model it came from."""

from __future__ import annotations

import io
import os
from pathlib import Path

import torch

from modelload.loader import attach
from modelload.loader.formats import read_index
from modelload.loader.formats.safetensors import serialize
from modelload.loader.formats.tensorizer import EncryptionParams, TensorizerWriter
from modelload.loader.formats.tensorizer.keys import Argon2Limits


def state_dict(*, layers: int = 6, width: int = 256, seed: int = 0) -> dict[str, torch.Tensor]:
    """A transformer-ish state dict: big and small tensors, several dtypes, an empty and a scalar tensor."""
    generator = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {
        "embed.weight": torch.randn(width * 4, width, generator=generator).bfloat16(),
    }
    for i in range(layers):
        tensors[f"layers.{i}.attn.weight"] = torch.randn(width, width, generator=generator)
        tensors[f"layers.{i}.mlp.weight"] = torch.randn(width * 2, width, generator=generator).half()
        tensors[f"layers.{i}.norm.weight"] = torch.randn(width, generator=generator)
    tensors["head.bias"] = torch.randint(-100, 100, (37,), dtype=torch.int64, generator=generator)
    tensors["empty"] = torch.empty(0, 4)
    tensors["step"] = torch.tensor(7, dtype=torch.int32)
    return tensors


def tensorizer_bytes(
    tensors: dict[str, torch.Tensor], *, encryption: EncryptionParams | None = None
) -> bytes:
    out = io.BytesIO()
    writer = TensorizerWriter(out, encryption=encryption)
    writer.write_state_dict(tensors)
    writer.close()
    return out.getvalue()


def safetensors_bytes(tensors: dict[str, torch.Tensor]) -> bytes:
    return serialize(tensors)


def corrupt_tensor(data: bytes, name: str) -> bytes:
    """``data`` with one byte flipped in the middle of tensor ``name``'s data (found through the index)."""
    index = read_index(lambda offset, length: data[offset : offset + length])
    entry = next(t for t in index.tensors if t.name == name)
    corrupted = bytearray(data)
    corrupted[entry.data_offset + entry.data_length // 2] ^= 0xFF
    return bytes(corrupted)


def password_params(password: str) -> EncryptionParams:
    """Argon2id at its minimum cost, to keep tests fast."""
    return EncryptionParams.from_password(password, limits=Argon2Limits.MIN)


def write_secret(directory: Path, name: str, data: bytes) -> Path:
    path = directory / name
    path.write_bytes(data)
    os.chmod(path, 0o600)
    return path


def as_bytes(tensor: torch.Tensor) -> bytes:
    return tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def assert_segment_matches(segment: Path, tensors: dict[str, torch.Tensor]) -> None:
    """Every tensor in the segment equals the original, byte for byte, with its dtype and shape."""
    with attach(segment, notify=False, timeout=30) as model:
        assert sorted(model.names) == sorted(tensors)
        loaded = model.state_dict()
        for name, expected in tensors.items():
            got = loaded[name]
            assert got.dtype == expected.dtype, name
            assert got.shape == expected.shape, name
            assert as_bytes(got) == as_bytes(expected), f"{name} differs"
