"""The fault suite, once per case: reset, truncation, 500, 503, S3 SlowDown and a stall, against the index
read and against a data range, over HTTP (nginx) and S3 (moto). Every case ends COMPLETE and byte-exact,
with the fault applied and retried (``benchmarks/fault_suite.py`` runs each case many times)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.sidecar import models
from tests.support.fault_cases import FAULTS, ORIGINS, TARGETS, Target, run_case, source_settings

TENSORS = models.state_dict(seed=90, layers=2)
EXPECTED = {name: models.as_bytes(tensor) for name, tensor in TENSORS.items()}


@pytest.mark.parametrize("fault", sorted(FAULTS))
@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("origin", ORIGINS)
def test_a_transient_fault_ends_in_a_complete_byte_exact_load(
    origin: str, target: Target, fault: str, request: pytest.FixtureRequest, shm_dir: Path
) -> None:
    fmt = "safetensors" if origin == "http" else "tensorizer"
    data = models.safetensors_bytes(TENSORS) if fmt == "safetensors" else models.tensorizer_bytes(TENSORS)
    if origin == "http":
        nginx: Any = request.getfixturevalue("nginx")
        proxy: Any = request.getfixturevalue("nginx_proxy")
        nginx.put("fault-suite.bin", data)
        url = proxy.url("fault-suite.bin")
    else:
        moto: Any = request.getfixturevalue("moto_s3")
        request.getfixturevalue("aws_env")
        proxy = request.getfixturevalue("moto_proxy")
        url = moto.put("fault-suite", "model.bin", data)
    outcome = run_case(
        url=url,
        fault=FAULTS[fault](target),
        target=target,
        proxy=proxy,
        sources=source_settings(origin, proxy),
        segment=shm_dir / "model.seg",
        expected=EXPECTED,
    )
    assert outcome.error is None, outcome.error
    assert outcome.applied, "the proxy never applied the fault"
    assert outcome.complete and outcome.exact
    assert outcome.retries >= 1, "the broken request was retried"
