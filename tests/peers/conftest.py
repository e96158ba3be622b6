"""The peer tests' hosts: one namespace topology for the module, a 64 MiB model, sidecars stopped after each
test. Skips (or fails under ``make test``) with the reason where namespaces cannot be made."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tests.conftest import require
from tests.sidecar.models import safetensors_bytes
from tests.support.sidecars import sidecars  # noqa: F401 - the fixture, for the loopback tests

from .topology import Topology, can_make_namespaces

MODEL = "model.safetensors"
TENSORS = 64
"""64 tensors of 1 MiB: enough for the rendezvous to spread them over 8 sidecars."""


def model_tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {f"layers.{i}.weight": torch.randn(512, 512, generator=generator) for i in range(TENSORS)}


@pytest.fixture(scope="module")
def tensors() -> dict[str, torch.Tensor]:
    return model_tensors()


@pytest.fixture(scope="module")
def topology(tensors: dict[str, torch.Tensor]) -> Iterator[Topology]:
    why = can_make_namespaces()
    require(why is None, why or "")
    root = Path(tempfile.mkdtemp(prefix="ml-peers-origin-", dir="/dev/shm"))
    work = Path(tempfile.mkdtemp(prefix="ml-peers-", dir="/dev/shm"))
    (root / MODEL).write_bytes(safetensors_bytes(tensors))
    topology = Topology(root=root, work=work)
    try:
        for i in range(8):
            topology.add_host(f"pod{i}")
        yield topology
    finally:
        topology.close()
        shutil.rmtree(root, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)


@pytest.fixture
def fast_origin(fleet: Topology) -> Iterator[Topology]:
    """The topology with the origin's link as fast as the pods': for the fault tests, whose figures do not
    depend on the origin's rate, so their holders load in a second instead of five."""
    fleet.shape(fleet.origin, fleet.pod_rate)
    try:
        yield fleet
    finally:
        fleet.shape(fleet.origin, fleet.origin_rate)


@pytest.fixture
def fleet(topology: Topology) -> Iterator[Topology]:
    """The topology with a fresh origin count; every sidecar a test starts is stopped after it."""
    topology.reset_log()
    try:
        yield topology
    finally:
        topology.stop_sidecars()
