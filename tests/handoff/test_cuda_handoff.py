"""The CUDA hand-off on a GPU: ``modelload keeper`` holds a model in VMM memory, app processes map it.

These run only where torch sees a CUDA device (``make gpu-check`` runs them on a GPU machine); elsewhere
they skip with that reason. The protocol, the keeper's logic and the error cases are tested without a GPU
in test_keeper.py, test_protocol.py and test_cli.py.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from modelload.loader import attach
from modelload.loader.errors import DeviceError, ModelloadError
from modelload.loader.handoff import connect, status
from modelload.loader.handoff.device import CudaMapper, CudaMemory
from modelload.loader.handoff.keeper import Keeper
from modelload.loader.segment import MemoryMode
from modelload.loader.segment.consumers import ConsumerTable
from tests.handoff.helpers import digest, model_tensors, write_segment
from tests.support.waiting import wait_for

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

ROOT = Path(__file__).resolve().parents[2]

APP = textwrap.dedent(
    """
    import hashlib, json, sys
    import torch
    from modelload.loader.handoff import connect

    weights = connect(sys.argv[1], timeout=60)
    out = {"digests": {}, "writable": weights.writable, "device": str(weights.device)}
    for name in weights.names:
        tensor = weights.tensor(name)
        assert tensor.is_cuda
        raw = tensor.contiguous().reshape(-1).view(torch.uint8).cpu().numpy().tobytes()
        out["digests"][name] = hashlib.sha256(raw).hexdigest()
    if sys.argv[2] == "write":
        floats = [n for n in weights.names if weights.tensor(n).is_floating_point()]
        name = next(n for n in floats if weights.tensor(n).numel())
        try:
            weights.tensor(name).add_(1)
            torch.cuda.synchronize()
            out["write"] = "done"
        except RuntimeError as exc:
            out["write"] = "refused: " + str(exc).splitlines()[0]
    print(json.dumps(out), flush=True)
    """
)


def raw(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes (a 0-dim tensor too, which ``view(torch.uint8)`` alone refuses)."""
    return tensor.reshape(-1).view(torch.uint8)


def run_app(sock: Path, action: str = "read") -> dict:
    done = subprocess.run(
        [sys.executable, "-c", APP, str(sock), action],
        capture_output=True, text=True, timeout=120, cwd=ROOT, check=False,
    )  # fmt: skip
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    assert lines, f"the app printed nothing (exit {done.returncode}): {done.stderr[-3000:]}"
    return json.loads(lines[-1])


@contextmanager
def keeper_process(segment: Path, sock: Path) -> Iterator[subprocess.Popen[str]]:
    """``modelload keeper`` as a pod runs it, ready (weights on the GPU) when this yields."""
    argv = [sys.executable, "-m", "modelload.loader.cli.main", "keeper", "--segment", str(segment),
            "--socket", str(sock), "--block-size", "2MiB", "--timeout", "60"]  # fmt: skip
    process = subprocess.Popen(argv, cwd=ROOT, stderr=subprocess.PIPE, text=True)
    try:

        def ready() -> bool:
            assert process.poll() is None, process.stderr.read() if process.stderr else "the keeper exited"
            return status(sock)["state"] == "ready"

        starting = (ModelloadError, OSError)  # no keeper answers yet, or not yet whole
        wait_for(ready, timeout=120, what="the keeper ready", interval=0.05, ignoring=starting)
        yield process
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            process.wait(timeout=30)


def test_app_processes_map_the_keepers_gpu_memory_one_after_the_other(shm_dir: Path, sock_dir: Path) -> None:
    tensors = model_tensors()
    write_segment(shm_dir / "m.seg", tensors)
    sock = sock_dir / "k.sock"
    with keeper_process(shm_dir / "m.seg", sock):
        first = run_app(sock)
        assert first["digests"] == {name: digest(t) for name, t in tensors.items()}
        second = run_app(sock)  # a restarted app: the same bytes, mapped again
        assert second["digests"] == first["digests"]
        assert status(sock)["tensors_ready"] == len(tensors)


def test_weights_mapped_by_an_app_stay_on_the_gpu_after_the_keeper_is_killed(
    shm_dir: Path, sock_dir: Path
) -> None:
    tensors = model_tensors()
    write_segment(shm_dir / "m.seg", tensors)
    sock = sock_dir / "k.sock"
    with keeper_process(shm_dir / "m.seg", sock) as keeper:
        weights = connect(sock, timeout=60)
        views = weights.state_dict()
        keeper.send_signal(signal.SIGKILL)
        keeper.wait(timeout=30)
    torch.cuda.synchronize()
    for name, expected in tensors.items():
        assert torch.equal(raw(views[name]), raw(expected.cuda())), name


def test_a_read_only_mapping_keeps_the_keepers_copy_intact_for_the_next_app(
    shm_dir: Path, sock_dir: Path
) -> None:
    tensors = model_tensors()
    write_segment(shm_dir / "m.seg", tensors)
    sock = sock_dir / "k.sock"
    with keeper_process(shm_dir / "m.seg", sock):
        writer = run_app(sock, "write")
        if writer["writable"]:  # the driver refused read-only access and the client said so
            assert writer["write"] == "done"
            pytest.fail("this driver refused read-only mappings: apps map the keeper's memory read-write")
        assert writer["write"].startswith("refused"), writer
        after = run_app(sock)
        assert after["digests"] == {name: digest(t) for name, t in tensors.items()}


def test_the_keeper_consumes_what_it_copied_in_memory_mode_release(shm_dir: Path, sock_dir: Path) -> None:
    tensors = model_tensors()
    writer = write_segment(shm_dir / "m.seg", tensors, mode=MemoryMode.RELEASE)
    keeper = Keeper(CudaMemory("cuda"), socket_path=sock_dir / "k.sock", block_size=2 << 20)
    keeper.start()
    try:
        with attach(shm_dir / "m.seg", notify=False) as model:
            keeper.load(model)
        table = ConsumerTable.open(
            shm_dir / "m.seg", load_id=writer.load_id, tensor_count=len(tensors), write=False
        )
        try:
            assert [list(table.consumed_bits(e.slot)) for e in table.entries()] == [[(1 << len(tensors)) - 1]]
        finally:
            table.close()
        with connect(sock_dir / "k.sock", timeout=60) as weights:
            for name, expected in tensors.items():
                assert torch.equal(raw(weights.tensor(name)), raw(expected.cuda())), name
    finally:
        keeper.close()


def test_load_into_module_on_the_gpu_shares_the_keepers_memory(shm_dir: Path, sock_dir: Path) -> None:
    reference = torch.nn.Sequential(torch.nn.Embedding(16, 8), torch.nn.Linear(8, 16, bias=False)).cuda()
    reference[1].weight = reference[0].weight
    write_segment(shm_dir / "m.seg", {"0.weight": reference[0].weight.detach().cpu()})
    sock = sock_dir / "k.sock"
    with keeper_process(shm_dir / "m.seg", sock), connect(sock, timeout=60) as weights:
        with torch.device("meta"):
            net = torch.nn.Sequential(torch.nn.Embedding(16, 8), torch.nn.Linear(8, 16, bias=False))
        net[1].weight = net[0].weight
        weights.load_into_module(net)
        assert net[0].weight.data_ptr() == weights.tensor("0.weight").data_ptr()
        tokens = torch.tensor([1, 5, 7], device="cuda")
        with torch.no_grad():
            assert torch.equal(net(tokens), reference(tokens))


def test_a_keepers_gpu_this_container_does_not_see_is_refused_naming_it() -> None:
    with pytest.raises(DeviceError, match="GPU-00000000-0000-0000-0000-000000000000 is not visible"):
        CudaMapper().map({"uuid": "GPU-00000000-0000-0000-0000-000000000000"}, [], [], writable=False)
