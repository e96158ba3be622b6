"""vLLM itself, loading through the ``modelload`` load format: the same tokens as its own safetensors loader,
weights taken while they still stream, a failed load reported rather than waited on, and a plugin that stays
out of the way when VLLM_PLUGINS leaves it out.

Each engine start costs about 30 s on two cores, so each test starts as few as it can: one engine per load
format and model.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.vllm.conftest import Staged
from tests.vllm.engine import Engine

log = logging.getLogger(__name__)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

REGISTERED = r"Registered model loader .* with load format `modelload`"


def test_llama_streamed_from_the_segment_generates_what_vllm_generates_from_disk(
    model_dirs: dict[str, Path], stage: Callable[..., Staged]
) -> None:
    source = model_dirs["llama"]
    staged = stage(source, hold_after=5)
    assert staged.published.wait(30)
    engine = Engine(staged.model_dir, load_format="modelload", env={"MODELLOAD_SEGMENT": str(staged.segment)})
    try:
        attached = engine.wait_for_line(r"modelload: attached to")
    finally:
        staged.finish()  # the other tensors arrive only now, while vLLM is loading
    log.info("vLLM began loading with part of the model still streaming: %s", attached)
    assert f"5 of {staged.total} tensors in" in attached
    streamed = engine.result()
    fed = engine.matching(r"modelload: fed vLLM")
    log.info("%s", fed)
    assert fed and f"fed vLLM {staged.total} tensors" in fed[0]
    assert f"{staged.total - 5} of them arriving while vLLM was loading" in fed[0]
    assert engine.matching(r"modelload: the segment .* is no longer mapped in this process")
    assert engine.matching(REGISTERED)

    # vLLM's own loader on the same directory, with the plugin left out by VLLM_PLUGINS.
    baseline = Engine(source, load_format="safetensors", env={"VLLM_PLUGINS": "some-other-plugin"})
    expected = baseline.result()
    assert not baseline.matching(REGISTERED), "VLLM_PLUGINS left modelload out, yet it registered"
    assert not baseline.matching(r"modelload")
    assert streamed == expected
    assert len(streamed) == 3 and all(len(tokens) == 12 for tokens in streamed)


def test_qwen_with_tied_embeddings_loads_the_same_as_from_disk(
    model_dirs: dict[str, Path], stage: Callable[..., Staged]
) -> None:
    source = model_dirs["qwen"]
    staged = stage(source, name="qwen")
    staged.finish()
    engine = Engine(
        staged.model_dir,
        load_format="modelload",
        extra={"segment": str(staged.segment), "attach_timeout": 30},
    )
    streamed = engine.result()
    baseline = Engine(source, load_format="safetensors")
    assert streamed == baseline.result()
    assert engine.matching(rf"modelload: attached to .*{staged.total} of {staged.total} tensors in")


def test_a_failed_load_stops_vllm_with_the_sidecars_reason(
    model_dirs: dict[str, Path], stage: Callable[..., Staged]
) -> None:
    reason = "s3://models/llama/model-00002-of-00004.safetensors: access denied (403); check the Secret"
    staged = stage(model_dirs["llama"], hold_after=3, fail_after=(4, reason))
    assert staged.published.wait(30)
    engine = Engine(staged.model_dir, load_format="modelload", env={"MODELLOAD_SEGMENT": str(staged.segment)})
    try:
        engine.wait_for_line(r"modelload: attached to")
    finally:
        staged.finish()  # one more tensor, then the source breaks while vLLM waits for the next
    code = engine.finish(timeout=180)
    assert code != 0
    failures = engine.matching(r"the model load failed")
    log.info("vLLM reported: %s", failures[:1])
    assert failures and reason in failures[0]
    assert not engine.matching(r"^RESULT ")
