"""docs/vllm.md's server command for vLLM's CPU build, run exactly as written, answers a completion.

The command is read from the docs (the block after ``<!-- command: cpu-serve ... -->``) and run by a shell
with the variables a pod's containers get (``MODELLOAD_SEGMENT``, ``MODELLOAD_MODEL_DIR``), in a network
namespace of its own so that the port it serves on (vLLM's default, 8000) is free whatever else the machine
runs; a client in the same namespace waits for ``/health`` and asks ``/v1/completions``.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import find_executable, require

REPO = Path(__file__).resolve().parents[2]
DOC = REPO / "docs" / "vllm.md"

CLIENT = """
import json, sys, time, urllib.request
deadline = time.monotonic() + 600
while True:
    try:
        urllib.request.urlopen("http://127.0.0.1:8000/health", timeout=5).read()
        break
    except OSError:
        if time.monotonic() > deadline:
            sys.exit("the server did not come up")
        time.sleep(1)
request = urllib.request.Request(
    "http://127.0.0.1:8000/v1/completions",
    data=json.dumps({"model": sys.argv[1], "prompt": "w5 w6 w7", "max_tokens": 5, "temperature": 0}).encode(),
    headers={"Content-Type": "application/json"},
)
print("ANSWER " + urllib.request.urlopen(request, timeout=120).read().decode(), flush=True)
"""


def documented_command() -> str:
    text = DOC.read_text()
    match = re.search(r"<!-- command: cpu-serve[^>]*-->\s*```sh\n(.*?)\n```", text, flags=re.S)
    assert match, "docs/vllm.md has no cpu-serve command block"
    return match.group(1).strip()


def with_a_tokenizer(source: Path, target: Path) -> Path:
    """The model directory and a word-level tokenizer of its vocabulary (the server tokenizes prompts)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    shutil.copytree(source, target)
    vocab = {f"w{i}": i for i in range(1, 1024)} | {"[UNK]": 0}
    words = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=words, unk_token="[UNK]", eos_token="w1").save_pretrained(target)
    return target


@pytest.mark.timeout(900)
def test_the_documented_cpu_server_command_answers_a_completion(
    model_dirs: dict[str, Path], shm_dir: Path, tmp_path: Path
) -> None:
    unshare = find_executable("unshare")
    require(
        unshare is not None and os.geteuid() == 0, "a network namespace of its own needs unshare and root"
    )
    assert unshare is not None
    model = with_a_tokenizer(model_dirs["llama"], tmp_path / "llama")
    segment = shm_dir / "model.seg"
    subprocess.run(
        [
            str(Path(sys.executable).with_name("modelload")),
            "stage",
            "--no-progress",
            str(model),
            str(segment),
        ],
        check=True,
        capture_output=True,
    )
    model_dir = shm_dir / "model"
    script = (
        "ip link set lo up || exit 3\n"
        f"{documented_command()} > server.log 2>&1 &\n"
        "server=$!\n"
        f'"$PYTHON" -c "$CLIENT" "$MODELLOAD_MODEL_DIR"\n'
        "status=$?\n"
        "kill $server; wait $server\n"
        "exit $status\n"
    )
    env = {
        **os.environ,
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
        "MODELLOAD_SEGMENT": str(segment),
        "MODELLOAD_MODEL_DIR": str(model_dir),
        "PYTHON": sys.executable,
        "CLIENT": CLIENT,
    }
    result = subprocess.run(
        [unshare, "--net", "sh", "-c", script],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=840,
        check=False,
    )
    log = (tmp_path / "server.log").read_text() if (tmp_path / "server.log").exists() else ""
    assert result.returncode == 0, f"{result.stdout}\n{result.stderr}\n--- server log ---\n{log[-4000:]}"
    (line,) = [x for x in result.stdout.splitlines() if x.startswith("ANSWER ")]
    answer = json.loads(line.removeprefix("ANSWER "))
    assert answer["usage"]["completion_tokens"] == 5
    assert answer["choices"][0]["text"].strip(), answer
    assert "modelload: attached to" in log, "the weights came from the segment through the load format"
