"""A Hugging Face directory served from S3 (moto) and HTTP (nginx), streamed by the sidecar's engine, and
built by transformers in an app that starts before the load ends."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest

from modelload.sidecar.load import LoadSettings
from modelload.sidecar.load.engine import Engine
from modelload.sidecar.progress import LoadTracker
from modelload.sidecar.sources import HttpSettings, RetryPolicy, S3Settings, SourceSettings
from tests.support.fixtures import aws_env, moto_s3, nginx  # noqa: F401 - fixtures

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from modelload.loader.transformers import from_pretrained  # noqa: E402
from tests.transformers.test_from_pretrained import TOKENS, llama  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

RETRY = RetryPolicy(attempts=4, initial_backoff=0.01, max_backoff=0.05, jitter=0.0, deadline=20.0)


def checkpoint(directory: Path) -> dict[str, bytes]:
    """A tied Llama saved by save_pretrained in several shards: every file of the directory, by name."""
    torch.manual_seed(3)
    net = transformers.AutoModelForCausalLM.from_config(llama())
    net.save_pretrained(directory, max_shard_size="60KB")
    files = {p.name: p.read_bytes() for p in sorted(directory.iterdir())}
    assert sum(name.endswith(".safetensors") for name in files) >= 3
    return files


def load_while_an_app_builds(source: str, segment: Path, sources: SourceSettings) -> Any:
    """Run the engine; an app thread calls from_pretrained as soon as it starts. Return the app's model."""
    built: list[Any] = []
    failed: list[BaseException] = []

    def app() -> None:
        try:
            built.append(from_pretrained(transformers.AutoModelForCausalLM, segment=segment))
        except BaseException as exc:
            failed.append(exc)

    thread = threading.Thread(target=app)
    thread.start()
    tracker = LoadTracker()
    settings = LoadSettings(source=source, segment=segment, chunk_size=32 << 10)
    Engine(settings, sources=sources, observer=tracker).run()
    thread.join(60)
    assert not failed, failed
    assert tracker.snapshot().phase == "complete"
    return built[0]


def logits(net: Any) -> torch.Tensor:
    with torch.no_grad():
        return net(input_ids=torch.tensor(TOKENS)).logits


def test_an_s3_prefix_becomes_a_transformers_model(
    moto_s3: Any,  # noqa: F811
    aws_env: Any,  # noqa: F811
    tmp_path: Path,
    shm_dir: Path,
) -> None:
    files = checkpoint(tmp_path / "llama")
    moto_s3.create_bucket("tx-hub")
    for name, data in files.items():
        moto_s3.put("tx-hub", f"models/llama/{name}", data)
    sources = SourceSettings(
        http=HttpSettings(connect_timeout=2.0, stall_timeout=2.0),
        retry=RETRY,
        s3=S3Settings(endpoint_url=moto_s3.endpoint),
    )
    net = load_while_an_app_builds("s3://tx-hub/models/llama/", shm_dir / "model.seg", sources)
    expected = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "llama")
    assert net.lm_head.weight is net.model.embed_tokens.weight
    assert torch.equal(logits(net), logits(expected))


def test_an_http_directory_becomes_a_transformers_model(
    nginx: Any,  # noqa: F811
    tmp_path: Path,
    shm_dir: Path,
) -> None:
    files = checkpoint(tmp_path / "llama")
    for name, data in files.items():
        nginx.put(f"tx/llama/{name}", data)
    sources = SourceSettings(http=HttpSettings(connect_timeout=2.0, stall_timeout=2.0), retry=RETRY)
    net = load_while_an_app_builds(nginx.url("tx/llama/"), shm_dir / "model.seg", sources)
    expected = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "llama")
    assert torch.equal(logits(net), logits(expected))
