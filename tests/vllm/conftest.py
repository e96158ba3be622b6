"""Fixtures of the vLLM tests: small models with random weights in several shards, and segments of them.

These tests run vLLM itself, so they run in the vLLM virtualenv (``make test-vllm``, which ``make test``
calls). The main virtualenv has no vLLM: there this folder is not collected at all.

:func:`stage` turns a model directory into a segment plus a model directory: with ``modelload stage DIR
SEGMENT`` when the load just has to be there, and with a writer thread of this process when a test needs to
hold the load half-way or break it at a chosen tensor, which no real source does on cue.
"""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

if importlib.util.find_spec("vllm") is None:
    collect_ignore_glob = ["test_*.py"]

SHARD_BYTES = "300KB"


@dataclass(frozen=True)
class ModelSpec:
    """A small model of one architecture, big enough for several shards, with head_dim 64 (vLLM's CPU
    attention kernels take no smaller head)."""

    name: str
    config: Callable[[], object]


def _llama() -> object:
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=1024,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=3,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )


def _qwen() -> object:
    from transformers import Qwen2Config

    return Qwen2Config(
        vocab_size=1024,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=3,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=256,
        tie_word_embeddings=True,
    )


MODELS = {"llama": ModelSpec("llama", _llama), "qwen": ModelSpec("qwen", _qwen)}


def save_model(kind: str, directory: Path, *, seed: int = 0) -> Path:
    """Build ``kind`` from its config with random bfloat16 weights and save it in several shards."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    config = MODELS[kind].config()
    model = AutoModelForCausalLM.from_config(config).to(torch.bfloat16)
    model.save_pretrained(directory, max_shard_size=SHARD_BYTES)
    shards = sorted(directory.glob("*.safetensors"))
    assert len(shards) >= 3, f"{kind} saved in {len(shards)} shards; the tests want several"
    return directory


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf")
    return {kind: save_model(kind, root / kind) for kind in MODELS}


@dataclass
class Staged:
    """A segment being written from a model directory by a thread of this process."""

    segment: Path
    model_dir: Path
    total: int
    published: threading.Event = field(default_factory=threading.Event)
    release: threading.Event = field(default_factory=threading.Event)
    done: threading.Event = field(default_factory=threading.Event)
    error: list[BaseException] = field(default_factory=list)

    def finish(self, timeout: float = 60.0) -> None:
        self.release.set()
        assert self.done.wait(timeout), "the staging thread did not finish"
        if self.error:
            raise self.error[0]


def _read_shards(source: Path) -> list[tuple[str, object]]:
    from safetensors import safe_open

    tensors: list[tuple[str, object]] = []
    for shard in sorted(source.glob("*.safetensors")):
        with safe_open(str(shard), framework="pt") as handle:
            tensors.extend((name, handle.get_tensor(name)) for name in handle.keys())  # noqa: SIM118
    return tensors


def _copy_small_files(source: Path, target: Path) -> None:
    target.mkdir(parents=True, exist_ok=True)
    for item in source.iterdir():
        if item.is_file() and item.suffix != ".safetensors":
            shutil.copy2(item, target / item.name)


@pytest.fixture
def stage(shm_dir: Path) -> Iterator[Callable[..., Staged]]:
    """``stage(source, hold_after=None, fail_after=None)``: a segment of ``source``'s shards in ``shm_dir``.

    Without options, ``modelload stage`` loads it. Otherwise a thread publishes the tensors in segment order,
    in the layout the sidecar writes: ``hold_after=N`` stops after N tensors until ``staged.release`` is set
    (a load still streaming); ``fail_after=(N, reason)`` marks the load failed after N tensors, as the
    sidecar does when its source breaks.
    """
    import numpy as np
    import torch

    from modelload.loader.dtypes import by_name
    from modelload.loader.segment import SegmentWriter, TensorSpec, plan_layout

    threads: list[threading.Thread] = []

    def start(
        source: Path,
        *,
        hold_after: int | None = None,
        fail_after: tuple[int, str] | None = None,
        name: str = "model",
    ) -> Staged:
        model_dir = shm_dir / f"{name}-dir"
        if hold_after is None and fail_after is None:
            return _stage_command(source, shm_dir / f"{name}.seg", model_dir)
        tensors = _read_shards(source)
        _copy_small_files(source, model_dir)
        specs = [TensorSpec(n, by_name(str(t.dtype)), tuple(t.shape)) for n, t in tensors]  # type: ignore[attr-defined]
        layout = plan_layout(specs, metadata={"format": "safetensors", "model_dir": str(model_dir)})
        staged = Staged(segment=shm_dir / f"{name}.seg", model_dir=model_dir, total=len(specs))
        writer = SegmentWriter.create(staged.segment, layout)

        def fill() -> None:
            try:
                for slot, (_, tensor) in zip(layout.slots, tensors, strict=True):
                    if fail_after is not None and slot.index == fail_after[0]:
                        writer.mark_failed(fail_after[1])
                        return
                    if hold_after is not None and slot.index == hold_after:
                        staged.published.set()
                        assert staged.release.wait(120), "the test never released the held load"
                    raw = tensor.contiguous().view(torch.uint8).reshape(-1).numpy()  # type: ignore[attr-defined]
                    np.frombuffer(writer.slot(slot.index), dtype=np.uint8)[:] = raw
                    writer.mark_ready(slot.index)
                writer.mark_complete()
            except BaseException as exc:
                staged.error.append(exc)
            finally:
                staged.published.set()
                staged.done.set()
                writer.close()

        thread = threading.Thread(target=fill, name=f"stage-{name}", daemon=True)
        threads.append(thread)
        thread.start()
        return staged

    yield start
    for thread in threads:
        thread.join(timeout=5)


def _stage_command(source: Path, segment: Path, model_dir: Path) -> Staged:
    argv = [sys.executable, "-m", "modelload.loader.cli.main", "stage", str(source), str(segment)]
    subprocess.run([*argv, "--model-dir", str(model_dir), "--no-progress"], check=True, timeout=120)
    from modelload.loader.segment import SegmentReader

    with SegmentReader.open(segment) as reader:
        assert reader.metadata.get("model_dir") == str(model_dir)
        staged = Staged(segment=segment, model_dir=model_dir, total=len(reader.slots))
    staged.published.set()
    staged.done.set()
    return staged


@dataclass
class Baseline:
    """vLLM's own ``safetensors`` loader on a model directory, with modelload left out by VLLM_PLUGINS."""

    tokens: list[list[int]]
    log: list[str]


@pytest.fixture(scope="session")
def baseline(model_dirs: dict[str, Path]) -> Callable[[str], Baseline]:
    """``baseline(kind)``: greedy tokens of vLLM reading ``kind``'s directory itself, one engine per kind
    for the whole session (engine starts are what these tests spend their time on)."""
    from tests.vllm.engine import Engine

    found: dict[str, Baseline] = {}

    def get(kind: str) -> Baseline:
        if kind not in found:
            engine = Engine(
                model_dirs[kind], load_format="safetensors", env={"VLLM_PLUGINS": "some-other-plugin"}
            )
            found[kind] = Baseline(engine.result(), list(engine.lines))
        return found[kind]

    return get


from tests.support.fixtures import aws_env, moto_s3, nginx, nginx_proxy  # noqa: E402

__all__ = ["aws_env", "moto_s3", "nginx", "nginx_proxy"]
