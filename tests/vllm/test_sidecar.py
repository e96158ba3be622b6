"""vLLM served by the real sidecar, as in a pod: ``modelload sidecar`` streams a Hugging Face directory from
S3 (moto) or HTTP (nginx) into a segment and a model directory, and ``vllm`` runs on that model directory
with ``--load-format modelload``, started once the sidecar's startup probe passes. The tokens are those of
vLLM reading the original directory itself.
"""

from __future__ import annotations

import logging
import re
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from modelload.loader.formats import open_reader
from modelload.loader.segment import SegmentReader, TensorState
from tests.support.fault_proxy import Stall
from tests.support.ports import free_port
from tests.support.waiting import wait_for
from tests.vllm.conftest import Baseline
from tests.vllm.engine import Engine

log = logging.getLogger(__name__)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


@contextmanager
def sidecar(source: str, shm_dir: Path, *flags: str) -> Iterator[tuple[Path, Path]]:
    """``modelload sidecar`` as a process of its own; yields (segment, model dir) once it is started."""
    segment, model_dir, port = shm_dir / "model.seg", shm_dir / "model", free_port()
    argv = [sys.executable, "-m", "modelload.loader.cli.main", "sidecar", "--source", source]
    argv += ["--segment", str(segment), "--model-dir", str(model_dir), "--host", "127.0.0.1"]
    argv += ["--port", str(port), *flags]
    process = subprocess.Popen(argv, stderr=subprocess.PIPE, text=True)
    try:
        _wait_started(port, process)
        yield segment, model_dir
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            _, errors = process.communicate(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()
            _, errors = process.communicate()
        log.info("sidecar log:\n%s", errors[-3000:])


def _wait_started(port: int, process: subprocess.Popen[str]) -> None:
    def published() -> bool:
        if process.poll() is not None:
            raise AssertionError(f"the sidecar exited ({process.returncode}): {process.stderr.read()}")  # type: ignore[union-attr]
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/startupz", timeout=2) as answer:
            return answer.status == 200

    not_yet = (urllib.error.URLError, ConnectionError)
    wait_for(published, timeout=30, what="the sidecar to publish its segment", interval=0.1, ignoring=not_yet)


def serve(model_dir: Path, segment: Path) -> Engine:
    engine = Engine(model_dir, load_format="modelload", env={"MODELLOAD_SEGMENT": str(segment)})
    engine.result()
    log.info("%s", engine.matching(r"modelload: (attached|fed)"))
    assert engine.matching(r"modelload: fed vLLM")
    return engine


def _ring_below(model_dir: Path) -> int:
    """A ring of half the model's tensor bytes (4096-aligned), at least twice its largest tensor and 1 MiB."""
    sizes = []
    for shard in model_dir.glob("*.safetensors"):
        with open_reader(shard, "safetensors") as reader:
            sizes += [entry.nbytes for entry in reader.index.tensors]
    ring = max(sum(sizes) // 2, 2 * max(sizes) + 8192, 1 << 20)  # the sidecar takes 1 MiB at least
    assert ring < sum(sizes), "the model is too small for a ring below its size"
    return -(-ring // 4096) * 4096


@pytest.mark.parametrize("mode", ["release", "ring"])
def test_llama_from_an_s3_prefix_through_the_sidecar_gives_pages_back(
    mode: str,
    model_dirs: dict[str, Path],
    moto_s3: Any,
    aws_env: Any,
    shm_dir: Path,
    baseline: Callable[[str], Baseline],
) -> None:
    moto_s3.create_bucket("hub")
    for item in model_dirs["llama"].iterdir():
        moto_s3.put("hub", f"meta/llama-tiny/{item.name}", item.read_bytes())
    flags = ["--s3-endpoint", moto_s3.endpoint, "--memory-mode", mode]
    if mode == "ring":
        # A ring of half the model: vLLM's weight loaders read read-only views that wrap the ring's end, and
        # the load only finishes because vLLM consumes tensors as it goes.
        flags += ["--ring-size", str(_ring_below(model_dirs["llama"]))]
    with sidecar("s3://hub/meta/llama-tiny/", shm_dir, *flags) as (segment, model):
        assert (model / "config.json").read_bytes() == (model_dirs["llama"] / "config.json").read_bytes()
        assert serve(model, segment).result() == baseline("llama").tokens
        # vLLM's worker consumed every tensor as it copied it, so the sidecar gave every page back.
        with SegmentReader.open(segment) as reader:
            wait_for(
                lambda: {reader.state(i) for i in range(len(reader.slots))} == {TensorState.RELEASED},
                timeout=10,
                what="every tensor released",
                interval=0.1,
            )
            if mode == "ring":
                assert 0 < reader.header.ring_size < sum(slot.nbytes for slot in reader.slots)


def test_qwen_from_an_http_directory_through_the_sidecar_while_a_shard_is_still_on_the_wire(
    model_dirs: dict[str, Path],
    nginx: Any,
    nginx_proxy: Any,
    shm_dir: Path,
    baseline: Callable[[str], Baseline],
) -> None:
    for item in model_dirs["qwen"].iterdir():
        nginx.put(f"hf/qwen-tiny/{item.name}", item.read_bytes())
    last = sorted(model_dirs["qwen"].glob("*.safetensors"))[-1].name
    # The last shard's first two requests (its size, its header) pass, so the sidecar publishes the segment;
    # then every request for that shard stalls past the sidecar's 30 s stall timeout (each retry too) until
    # vLLM has begun taking weights, and the rest of the shard arrives while vLLM loads.
    nginx_proxy.push(Stall(0, 0.0), Stall(0, 0.0), path=last)
    nginx_proxy.always(Stall(0, 40.0), path=last)
    with sidecar(nginx_proxy.url("hf/qwen-tiny/"), shm_dir) as (segment, model):
        assert not list(model.glob("*.safetensors")), "weights stay in the segment"
        engine = Engine(model, load_format="modelload", env={"MODELLOAD_SEGMENT": str(segment)})
        try:
            attached = engine.wait_for_line(r"modelload: attached to", timeout=200)
        finally:
            nginx_proxy.clear()
        log.info("vLLM began loading with part of the model still streaming: %s", attached)
        ready, total = map(int, re.findall(r"; (\d+) of (\d+) tensors in", attached)[0])
        assert ready < total, "the load was over before vLLM began: nothing streamed into vLLM"
        assert engine.result() == baseline("qwen").tokens
        fed = engine.matching(r"modelload: fed vLLM")
        log.info("%s", fed)
        assert fed and f"{total - ready} of them arriving while vLLM was loading" in fed[0]
