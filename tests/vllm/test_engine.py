"""vLLM itself, loading through the ``modelload`` load format: the same tokens as its own safetensors loader,
weights taken while they still stream, a failed load reported rather than waited on, and a plugin that stays
out of the way when VLLM_PLUGINS leaves it out.

Each engine start costs about 30 s on two cores, so each test starts as few as it can, and vLLM's own loader
runs once per model for the whole session (the ``baseline`` fixture).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.vllm.conftest import Baseline, Staged
from tests.vllm.engine import MAX_TOKENS, PROMPTS, Engine

log = logging.getLogger(__name__)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

REGISTERED = r"Registered model loader .* with load format `modelload`"


def test_llama_taken_while_it_streams_generates_what_vllm_generates_from_disk(
    model_dirs: dict[str, Path], stage: Callable[..., Staged], baseline: Callable[[str], Baseline]
) -> None:
    staged = stage(model_dirs["llama"], hold_after=5)
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
    assert streamed == baseline("llama").tokens
    assert len(streamed) == len(PROMPTS) and all(len(tokens) == MAX_TOKENS for tokens in streamed)


def test_vllm_plugins_without_modelload_leaves_vllm_untouched(baseline: Callable[[str], Baseline]) -> None:
    lines = baseline("llama").log
    assert any(re.search(r"Loading weights took", line) for line in lines), "vLLM's own loader ran"
    assert not any(re.search(REGISTERED, line) for line in lines)
    assert not any("modelload" in line for line in lines)


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
