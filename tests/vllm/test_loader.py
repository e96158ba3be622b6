"""The ``modelload`` load format without starting an engine: how vLLM finds it, what it checks before a load
(and the errors a user gets when the sidecar, the volume or the load is wrong), and that attaching never
imports it."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

import pytest

from modelload.loader.dtypes import by_name
from modelload.loader.errors import ConfigError, LoadFailedError, SegmentError, SidecarUnavailableError
from modelload.loader.segment import SegmentWriter, TensorSpec, plan_layout
from tests.vllm.conftest import Staged


@pytest.fixture(scope="module")
def model_config(model_dirs: dict[str, Path]) -> Any:
    from vllm.config import ModelConfig

    return ModelConfig(model=str(model_dirs["llama"]), skip_tokenizer_init=True)


def loader(**extra: Any) -> Any:
    from vllm.config.load import LoadConfig
    from vllm.model_executor.model_loader import get_model_loader

    from modelload.loader.vllm import register

    register()
    return get_model_loader(LoadConfig(load_format="modelload", model_loader_extra_config=extra))


def test_vllm_finds_the_load_format_through_its_plugin_entry_point() -> None:
    found = {ep.name: ep.value for ep in entry_points(group="vllm.general_plugins")}
    assert found.get("modelload") == "modelload.loader.vllm:register"
    assert type(loader(segment="/run/modelload/model.seg")).__name__ == "ModelloadLoader"


def test_attaching_never_imports_vllm_or_the_load_format() -> None:
    code = (
        "import json, sys\n"
        "def engines():\n"
        "    return sorted(m for m in sys.modules if m.split('.')[0] == 'vllm' or m.endswith('.vllm'))\n"
        "import modelload.loader\n"
        "from modelload.loader import attach, errors\n"
        "import modelload.loader.cli.main, modelload.loader.segment, modelload.loader.formats\n"
        "before = engines()\n"
        "import modelload.loader.vllm\n"
        "print(json.dumps([before, 'modelload.loader.vllm' in engines()]))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    before, seen_after_import = json.loads(out.strip().splitlines()[-1])
    assert before == []
    assert seen_after_import  # the check above sees the module when it is imported


def test_the_segment_comes_from_the_extra_config_over_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("MODELLOAD_SEGMENT", "/run/modelload/model.seg")
    assert str(loader().settings.segment) == "/run/modelload/model.seg"
    assert str(loader(segment="/mnt/other.seg").settings.segment) == "/mnt/other.seg"
    assert loader().settings.load_timeout is None
    assert loader(load_timeout=30).settings.load_timeout == 30.0


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"segmnet": "/x"}, r"unknown --model-loader-extra-config keys .*'segmnet'.* known keys"),
        ({}, r"set MODELLOAD_SEGMENT"),
        ({"segment": 3}, r"'segment' must be a path"),
        ({"segment": "/x", "attach_timeout": 0}, r"'attach_timeout' must be a positive number of seconds"),
        ({"segment": "/x", "load_timeout": "soon"}, r"'load_timeout' must be a positive number"),
    ],
)
def test_bad_settings_say_what_to_fix(
    extra: dict[str, Any], message: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("MODELLOAD_SEGMENT", raising=False)
    with pytest.raises(ConfigError, match=message):
        loader(**extra)


def test_no_sidecar_is_named_as_such(shm_dir: Path, model_config: Any) -> None:
    with pytest.raises(SidecarUnavailableError, match=r"is the modelload sidecar running"):
        loader(segment=str(shm_dir / "model.seg"), attach_timeout=0.2).download_model(model_config)


def test_a_failed_load_is_reported_with_its_reason(
    model_dirs: dict[str, Path], stage: Callable[..., Staged], model_config: Any
) -> None:
    staged = stage(model_dirs["llama"], fail_after=(2, "https://example.test/m/: 401 Unauthorized"))
    staged.finish()
    with pytest.raises(LoadFailedError, match=r"load failed .*401 Unauthorized"):
        loader(segment=str(staged.segment)).download_model(model_config)


def test_a_model_directory_missing_from_this_container_means_the_wrong_volume(
    model_dirs: dict[str, Path], stage: Callable[..., Staged], model_config: Any
) -> None:
    staged = stage(model_dirs["llama"])
    staged.finish()
    loader(segment=str(staged.segment)).download_model(model_config)  # all there: no error
    for item in staged.model_dir.iterdir():
        item.unlink()
    with pytest.raises(SidecarUnavailableError, match=r"mount the modelload volume here"):
        loader(segment=str(staged.segment)).download_model(model_config)


def test_a_single_file_segment_has_no_config_for_vllm(shm_dir: Path, model_config: Any) -> None:
    layout = plan_layout([TensorSpec("w", by_name("bfloat16"), (2,))], metadata={"format": "safetensors"})
    with SegmentWriter.create(shm_dir / "one.seg", layout, heartbeat=False) as writer:
        writer.slot(0)[:] = b"\0" * 4
        writer.mark_ready(0)
        writer.mark_complete()
    with pytest.raises(ConfigError, match=r"names no model directory.*S3 prefix ending in '/'"):
        loader(segment=str(shm_dir / "one.seg")).download_model(model_config)


def test_weights_the_segment_lacks_are_named(model_config: Any) -> None:
    import torch

    net = torch.nn.Sequential(torch.nn.Embedding(4, 2), torch.nn.LayerNorm(2))
    check = loader(segment="/run/modelload/model.seg")._check_complete
    with pytest.raises(SegmentError, match=r"lacks 1 weights this model needs \(1\.bias\)"):
        check(net, model_config, {"0.weight", "1.weight"}, "/run/modelload/model.seg")
    check(net, model_config, {"0.weight", "1.weight", "1.bias"}, "/run/modelload/model.seg")
