"""The commands README.md shows for running the parts by hand, outside Kubernetes, its transformers example,
and docs/loader.md's command line run as written.

The block is read from README.md, so a changed README is what is run. What a one-machine test cannot keep is
swapped, and only that: ``/dev/shm/model.seg`` becomes a test folder's segment, ``s3://models/llama/`` is
served by moto (the model uploaded there first, ``AWS_ENDPOINT_URL`` pointing at it), and the sidecar's status
port is a free one, which ``modelload monitor`` is told through ``MODELLOAD_STATUS_URL`` (the variable the
operator sets in a pod). Each command must succeed and print what its comment in the README promises.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import numpy as np

from modelload.loader.formats.safetensors import save_file
from tests.support.fixtures import aws_env, moto_s3
from tests.support.moto_s3 import MotoS3Server
from tests.support.ports import free_port
from tests.support.processes import stop_process

__all__ = ["aws_env", "moto_s3"]  # fixtures

README = Path(__file__).resolve().parent.parent / "README.md"
LOADER_DOC = README.parent / "docs" / "loader.md"
MODELLOAD = [sys.executable, "-m", "modelload.loader.cli.main"]


def by_hand() -> list[list[str]]:
    """The README's commands after "Outside Kubernetes", each as its words (comments dropped)."""
    text = README.read_text()
    match = re.search(r"Outside Kubernetes, the same parts run by hand:\n\n```sh\n(.*?)```", text, re.S)
    assert match is not None, "README.md has no block of commands to run outside Kubernetes"
    return [shlex.split(line, comments=True) for line in match.group(1).splitlines() if line.strip()]


def model_folder(where: Path) -> Path:
    """A Hugging Face-style directory of two shards, its index and its config."""
    folder = where / "Llama-3.2-1B"
    folder.mkdir()
    shards = {
        "model-00001-of-00002.safetensors": {"embed.weight": np.arange(512, dtype=np.float32).reshape(64, 8)},
        "model-00002-of-00002.safetensors": {"head.weight": np.ones((8, 64), dtype=np.float32)},
    }
    weight_map = {}
    for name, tensors in shards.items():
        save_file(tensors, folder / name)
        weight_map.update(dict.fromkeys(tensors, name))
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map})
    )
    (folder / "config.json").write_text('{"model_type": "llama"}')
    return folder


def test_the_commands_to_run_by_hand_run_as_written(
    moto_s3: MotoS3Server, aws_env: object, tmp_path: Path, shm_dir: Path
) -> None:
    folder = model_folder(tmp_path)
    for path in folder.iterdir():
        moto_s3.put("models", f"llama/{path.name}", path.read_bytes())
    port = free_port()
    env = {
        **os.environ,
        "AWS_ENDPOINT_URL": moto_s3.endpoint,
        "MODELLOAD_STATUS_URL": f"http://127.0.0.1:{port}",
    }
    segment = str(shm_dir / "model.seg")
    commands = by_hand()
    assert [words[:2] for words in commands] == [
        ["modelload", "inspect"],
        ["modelload", "stage"],
        ["modelload", "sidecar"],
        ["modelload", "monitor"],
        ["modelload", "serialize"],
    ], "README.md's commands changed: teach this test what each one must do"
    sidecar = None
    try:
        for words in commands:
            argv = [*MODELLOAD, *(segment if w == "/dev/shm/model.seg" else w for w in words[1:])]
            if words[1] == "sidecar":
                sidecar = subprocess.Popen(
                    [*argv, "--port", str(port)], cwd=tmp_path, env=env, stderr=subprocess.DEVNULL
                )
                continue
            done = subprocess.run(
                argv, check=False, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
            )
            assert done.returncode == 0, f"{shlex.join(words)}: {done.stderr}"
            assert "Traceback" not in done.stderr
            if words[1] == "inspect":  # every shard as one model: tensors, files, bytes
                assert re.search(r"^tensors +2, ", done.stdout, re.M), done.stdout
                assert "model-00001-of-00002.safetensors" in done.stdout
                assert "verify      ok" in done.stdout
            elif words[1] == "stage":  # a local directory into a segment + /dev/shm/model/
                assert f"staged {segment} (safetensors): 2 tensors from 2 files" in done.stdout
                assert (shm_dir / "model" / "config.json").is_file()
            elif words[1] == "monitor":  # live progress of that sidecar, until its load ends
                assert sidecar is not None and "complete:" in done.stdout, done.stdout
            else:  # shards merged into one file
                assert "wrote model.tensors (tensorizer): 2 tensors" in done.stdout
                assert (tmp_path / "model.tensors").is_file()
    finally:
        if sidecar is not None:
            stop_process(sidecar, timeout=10)
    assert sidecar is not None and sidecar.returncode == 0, "the sidecar did not end its load complete"


def test_the_loader_docs_command_line_runs_as_written(tmp_path: Path, shm_dir: Path) -> None:
    text = LOADER_DOC.read_text()
    match = re.search(r"<!-- commands: command-line\b[^>]*-->\n```sh\n(.*?)```", text, re.S)
    assert match is not None, "docs/loader.md has no command-line block"
    save_file({"w": np.arange(64, dtype=np.float32).reshape(8, 8)}, tmp_path / "model.safetensors")
    model_folder(tmp_path)
    expected = {
        "serialize": "wrote model.tensors (tensorizer): 1 tensors",
        "inspect": "verify      ok",
        "stage": "staged ",
    }
    for line in filter(str.strip, match.group(1).splitlines()):
        words = [w.replace("/dev/shm/", f"{shm_dir}/") for w in shlex.split(line, comments=True)]
        assert words[0] == "modelload", line
        done = subprocess.run(
            [*MODELLOAD, *words[1:]], check=False, cwd=tmp_path, capture_output=True, text=True, timeout=120
        )
        assert done.returncode == 0, f"{line}: {done.stderr}"
        assert expected[words[1]] in done.stdout, f"{line}: {done.stdout}"
    assert (shm_dir / "llama" / "config.json").is_file()


def test_the_transformers_example_runs_as_written(tmp_path: Path, shm_dir: Path) -> None:
    text = README.read_text()
    match = re.search(r"With transformers:\n\n```python\n(.*?)```", text, re.S)
    assert match is not None, "README.md has no transformers example"
    folder = tmp_path / "tiny-llama"
    subprocess.run([sys.executable, "-c", _TINY_LLAMA, str(folder)], check=True, timeout=300)
    segment = shm_dir / "llama.seg"
    staged = subprocess.run(
        [*MODELLOAD, "stage", "--no-progress", str(folder), str(segment)],
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert staged.returncode == 0, staged.stderr
    check = "\nprint(type(model).__name__, tokenizer('hello world').input_ids)\n"
    done = subprocess.run(
        [sys.executable, "-c", match.group(1) + check],
        check=False,
        env={**os.environ, "MODELLOAD_SEGMENT": str(segment)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().endswith("LlamaForCausalLM [1, 2]"), done.stdout


_TINY_LLAMA = """
import sys
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

folder = sys.argv[1]
config = LlamaConfig(vocab_size=16, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2)
LlamaForCausalLM(config).save_pretrained(folder, max_shard_size="20KB")
words = Tokenizer(models.WordLevel({"[UNK]": 0, "hello": 1, "world": 2}, unk_token="[UNK]"))
words.pre_tokenizer = pre_tokenizers.Whitespace()
PreTrainedTokenizerFast(tokenizer_object=words, unk_token="[UNK]").save_pretrained(folder)
"""
