"""modelload.loader.transformers.from_pretrained against transformers loading the same directory itself:
architectures built from config with random weights, saved sharded by save_pretrained."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from modelload.loader import attach
from modelload.loader.errors import ConfigError
from tests.transformers.conftest import StageDir

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from modelload.loader.transformers import from_pretrained  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

TOKENS = [[1, 5, 9, 33, 2, 70, 11, 3]]


def llama() -> Any:
    return transformers.LlamaConfig(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=True,
    )


def gpt2() -> Any:
    return transformers.GPT2Config(vocab_size=96, n_positions=64, n_embd=64, n_layer=3, n_head=4)


def bert() -> Any:
    return transformers.BertConfig(
        vocab_size=96,
        hidden_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        intermediate_size=128,
        max_position_embeddings=64,
    )


ARCHITECTURES = {
    "llama": (llama, transformers.AutoModelForCausalLM),
    "gpt2": (gpt2, transformers.AutoModelForCausalLM),
    "bert": (bert, transformers.AutoModel),
}


def save(config: Any, auto: Any, directory: Path, *, seed: int = 0, **save_kwargs: Any) -> Path:
    """Random weights from the config, saved as the Hub has them: shards, config, generation config."""
    torch.manual_seed(seed)
    net = auto.from_config(config)
    net.save_pretrained(directory, max_shard_size="60KB", **save_kwargs)
    assert len(list(directory.glob("*.safetensors"))) >= 3, "sharded, as real checkpoints are"
    return directory


def outputs(net: Any) -> torch.Tensor:
    with torch.no_grad():
        out = net(input_ids=torch.tensor(TOKENS))
    return out.logits if hasattr(out, "logits") else out.last_hidden_state


def mappings_of(path: str) -> list[tuple[int, int]]:
    """The address ranges where this process maps the file at ``path``."""
    spans = []
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split()
        if len(fields) >= 6 and fields[5] == path:
            start, end = (int(x, 16) for x in fields[0].split("-"))
            spans.append((start, end))
    return spans


def tensors_of(net: Any) -> dict[str, Any]:
    return dict(net.state_dict(keep_vars=True)) | dict(net.named_buffers())


@pytest.mark.parametrize("slots", ["paged", "packed"])
@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_outputs_are_bitwise_those_of_transformers_loading_the_directory(
    arch: str, slots: str, tmp_path: Path, stage_dir: StageDir, monkeypatch: pytest.MonkeyPatch
) -> None:
    from modelload.loader.segment import SegmentReader, placing

    if (
        slots == "packed"
    ):  # what a mixture of experts' thousands of small tensors get: slots as the files hold them
        monkeypatch.setattr(placing, "PACKING_MIN", 0)
    make_config, auto = ARCHITECTURES[arch]
    directory = save(make_config(), auto, tmp_path / arch)
    expected = auto.from_pretrained(directory)
    segment = stage_dir(directory)
    with SegmentReader.open(segment) as reader:
        assert reader.header.layout_version == (5 if slots == "packed" else 2)
    with attach(segment, notify=False) as model:
        net = from_pretrained(auto, segment=model)
        assert type(net) is type(expected)
        assert not net.training
        assert torch.equal(outputs(net), outputs(expected))
        got, want = tensors_of(net), tensors_of(expected)
        assert sorted(got) == sorted(want)
        for name, tensor in got.items():
            assert not tensor.is_meta, name
            assert tensor.dtype == want[name].dtype, name
            assert torch.equal(tensor, want[name]), f"{name} differs from transformers' own load"
        shared = [name for name in model.names if name in got]
        assert shared, "the segment's names are the module's"
        for name in shared:
            assert got[name].data_ptr() == model.tensor(name).data_ptr(), f"{name} is a view of the segment"
        spans = mappings_of(model.path)
        for name, parameter in net.named_parameters():  # renamed or tied ones too: none is a private copy
            assert any(a <= parameter.data_ptr() < b for a, b in spans), f"{name} is not in the segment"
        if arch != "bert":
            assert net.get_output_embeddings().weight is net.get_input_embeddings().weight, "still tied"


def test_a_mixture_of_experts_is_views_but_for_the_experts_transformers_fuses(
    tmp_path: Path, stage_dir: StageDir
) -> None:
    # The checkpoint keeps each expert apart (experts.N.w1/w2/w3); transformers 5 keeps one fused
    # gate_up_proj and down_proj per layer, concatenated at load: new memory for its own load too
    # (docs/loader.md). Everything else stays in the segment.
    config = transformers.MixtralConfig(
        vocab_size=96, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=64,
    )  # fmt: skip
    directory = save(config, transformers.AutoModelForCausalLM, tmp_path / "mixtral")
    with attach(stage_dir(directory), notify=False) as model:
        assert "model.layers.0.block_sparse_moe.experts.3.w2.weight" in model, "per-expert checkpoint tensors"
        net = from_pretrained(transformers.AutoModelForCausalLM, segment=model)
        spans = mappings_of(model.path)
        copies = {
            name
            for name, parameter in net.named_parameters()
            if not any(a <= parameter.data_ptr() < b for a, b in spans)
        }
        expected = transformers.AutoModelForCausalLM.from_pretrained(directory)
        assert torch.equal(outputs(net), outputs(expected))
    fused = {f"model.layers.{i}.mlp.experts.{w}" for i in range(2) for w in ("gate_up_proj", "down_proj")}
    assert copies == fused


def test_a_model_class_works_as_well_as_an_auto_class(tmp_path: Path, stage_dir: StageDir) -> None:
    directory = save(llama(), transformers.AutoModelForCausalLM, tmp_path / "llama")
    segment = stage_dir(directory)
    net = from_pretrained(transformers.LlamaForCausalLM, segment=segment)
    assert isinstance(net, transformers.LlamaForCausalLM)
    assert net.model.rotary_emb.inv_freq.device.type == "cpu"
    expected = transformers.LlamaForCausalLM.from_pretrained(directory)
    assert torch.equal(outputs(net), outputs(expected))


def test_an_explicit_cpu_device_goes_through_transformers_placement_and_still_copies_nothing(
    tmp_path: Path, stage_dir: StageDir
) -> None:
    directory = save(llama(), transformers.AutoModelForCausalLM, tmp_path / "llama")
    with attach(stage_dir(directory), notify=False) as model:
        net = from_pretrained(transformers.AutoModelForCausalLM, segment=model, device="cpu")
        assert (
            net.model.layers[0].mlp.up_proj.weight.data_ptr()
            == model.tensor("model.layers.0.mlp.up_proj.weight").data_ptr()
        )
        assert net.lm_head.weight is net.model.embed_tokens.weight
        expected = transformers.AutoModelForCausalLM.from_pretrained(directory)
        assert torch.equal(outputs(net), outputs(expected))


def test_the_segment_comes_from_the_environment_by_default(
    tmp_path: Path, stage_dir: StageDir, monkeypatch: pytest.MonkeyPatch
) -> None:
    segment = stage_dir(save(bert(), transformers.AutoModel, tmp_path / "bert"))
    monkeypatch.setenv("MODELLOAD_SEGMENT", str(segment))
    net = from_pretrained(transformers.AutoModel)
    assert isinstance(net, transformers.BertModel)


def test_the_weights_keep_their_dtype_even_when_the_config_names_another(
    tmp_path: Path, stage_dir: StageDir
) -> None:
    directory = save(llama(), transformers.AutoModelForCausalLM, tmp_path / "llama")
    config = json.loads((directory / "config.json").read_text())
    config["dtype"] = "bfloat16"
    (directory / "config.json").write_text(json.dumps(config))
    with attach(stage_dir(directory), notify=False) as model:
        assert model.dtype("model.embed_tokens.weight") == "float32"
        net = from_pretrained(transformers.AutoModelForCausalLM, segment=model)
        assert {p.dtype for p in net.parameters()} == {torch.float32}, "no silent cast to the config's dtype"
        cast = from_pretrained(transformers.AutoModelForCausalLM, segment=model, dtype=torch.bfloat16)
        assert {p.dtype for p in cast.parameters()} == {torch.bfloat16}
        expected = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.bfloat16)
        assert torch.equal(outputs(cast), outputs(expected))


def test_the_generation_config_comes_from_the_model_directory(tmp_path: Path, stage_dir: StageDir) -> None:
    torch.manual_seed(0)
    net = transformers.AutoModelForCausalLM.from_config(gpt2())
    net.generation_config.max_new_tokens = 7
    net.generation_config.do_sample = True
    net.generation_config.top_k = 3
    net.save_pretrained(tmp_path / "gpt2", max_shard_size="60KB")
    loaded = from_pretrained(transformers.AutoModelForCausalLM, segment=stage_dir(tmp_path / "gpt2"))
    assert (loaded.generation_config.max_new_tokens, loaded.generation_config.top_k) == (7, 3)
    generated = loaded.generate(torch.tensor(TOKENS), do_sample=False, max_new_tokens=4)
    expected = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "gpt2")
    assert torch.equal(generated, expected.generate(torch.tensor(TOKENS), do_sample=False, max_new_tokens=4))


# --- what the caller gets wrong -----------------------------------------------------------------------------


def test_a_segment_without_a_model_directory_says_what_to_load(shm_dir: Path) -> None:
    from tests.loader.test_load_into_module import publish

    segment = publish(shm_dir / "weights.seg", {"w": torch.ones(2)})
    with pytest.raises(ConfigError, match=r"no model directory.*stage DIR SEGMENT"):
        from_pretrained(transformers.AutoModel, segment=segment)


def test_a_model_directory_without_config_says_what_is_missing(tmp_path: Path, stage_dir: StageDir) -> None:
    directory = save(bert(), transformers.AutoModel, tmp_path / "bert")
    (directory / "config.json").unlink()
    with pytest.raises(ConfigError, match=r"no config\.json"):
        from_pretrained(transformers.AutoModel, segment=stage_dir(directory))


def test_an_auto_class_that_does_not_fit_the_config_is_refused(tmp_path: Path, stage_dir: StageDir) -> None:
    segment = stage_dir(save(bert(), transformers.AutoModel, tmp_path / "bert"))
    with pytest.raises(ConfigError, match=r"AutoModelForSeq2SeqLM has no model for a BertConfig"):
        from_pretrained(transformers.AutoModelForSeq2SeqLM, segment=segment)


def test_weights_or_placement_given_twice_are_refused(tmp_path: Path, stage_dir: StageDir) -> None:
    segment = stage_dir(save(bert(), transformers.AutoModel, tmp_path / "bert"))
    with pytest.raises(ConfigError, match=r"device_map.*pass device="):
        from_pretrained(transformers.AutoModel, segment=segment, device_map="auto")
    with pytest.raises(ConfigError, match="neither a transformers model class"):
        from_pretrained(torch.nn.Linear, segment=segment)


def test_a_hub_model_id_instead_of_a_class_says_to_pass_the_class(
    tmp_path: Path, stage_dir: StageDir
) -> None:
    # transformers' own from_pretrained takes a model id first: the habit passes one here. Before the fix
    # the message said only that the id was "neither a transformers model class nor an AutoModel class"
    segment = stage_dir(save(bert(), transformers.AutoModel, tmp_path / "bert"))
    with pytest.raises(ConfigError) as raised:
        from_pretrained("google-bert/bert-base-uncased", segment=segment)  # type: ignore[arg-type]
    message = str(raised.value)
    assert "pass the model class (AutoModelForCausalLM, BertModel, ...)" in message
    assert "config and weights come from the segment" in message


def test_a_device_without_accelerate_says_what_to_install(
    tmp_path: Path, stage_dir: StageDir, monkeypatch: pytest.MonkeyPatch
) -> None:
    segment = stage_dir(save(bert(), transformers.AutoModel, tmp_path / "bert"))
    monkeypatch.setattr(transformers.utils, "is_accelerate_available", lambda *args: False)
    with pytest.raises(ConfigError, match=r"needs accelerate: pip install 'modelload\[transformers\]'"):
        from_pretrained(transformers.AutoModel, segment=segment, device="cuda")
    assert isinstance(from_pretrained(transformers.AutoModel, segment=segment), transformers.BertModel)


# --- no second copy -----------------------------------------------------------------------------------------

_RSS_CHILD = r"""
import json, sys
import torch, transformers
from modelload.loader import attach
from modelload.loader.transformers import from_pretrained

def anon_kib():
    for line in open("/proc/self/status"):
        if line.startswith("RssAnon:"):
            return int(line.split()[1])

small, big = sys.argv[1], sys.argv[2]
from_pretrained(transformers.AutoModelForCausalLM, segment=small)  # the same code path, warmed up
model = attach(big, notify=False)
before = anon_kib()
net = from_pretrained(transformers.AutoModelForCausalLM, segment=model)
after_load = anon_kib()
with torch.no_grad():
    net(input_ids=torch.tensor([[1, 2, 3, 4]]))
views = all(p.data_ptr() == model.tensor(n).data_ptr() for n, p in net.named_parameters() if n in model)
before_cast = anon_kib()
cast = from_pretrained(transformers.AutoModelForCausalLM, segment=model, dtype=torch.bfloat16)
cast_kib = anon_kib() - before_cast
figures = {"load_kib": after_load - before, "cast_kib": cast_kib, "views": views, "bytes": model.nbytes}
print(json.dumps(figures))
"""


@pytest.mark.slow
def test_loading_on_the_cpu_adds_no_second_copy_of_the_weights(tmp_path: Path, stage_dir: StageDir) -> None:
    big = transformers.LlamaConfig(
        vocab_size=16000,
        hidden_size=1024,
        intermediate_size=2816,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=8,
        tie_word_embeddings=False,
    )
    small = save(llama(), transformers.AutoModelForCausalLM, tmp_path / "small")
    torch.manual_seed(0)
    net = transformers.AutoModelForCausalLM.from_config(big)
    net.save_pretrained(tmp_path / "big", max_shard_size="50MB")
    del net
    segments = [stage_dir(small), stage_dir(tmp_path / "big")]
    run = subprocess.run(
        [sys.executable, "-c", _RSS_CHILD, *map(str, segments)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    figures = json.loads(run.stdout.strip().splitlines()[-1])
    weights_kib = figures["bytes"] // 1024
    assert weights_kib > 150_000, "big enough that a copy would show"
    assert figures["views"], "every parameter is a view of the segment"
    assert figures["load_kib"] < weights_kib // 20, (
        f"private memory grew by {figures['load_kib']} KiB loading {weights_kib} KiB of weights"
    )
    assert figures["cast_kib"] > weights_kib // 3, "the measure sees a copy: a bfloat16 cast is half the size"


# --- the GPU ------------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("slots", ["paged", "packed"])
@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_a_cuda_device_gets_the_weights_through_pinned_copies(
    arch: str, slots: str, tmp_path: Path, stage_dir: StageDir, monkeypatch: pytest.MonkeyPatch
) -> None:
    from modelload.loader.segment import placing

    if slots == "packed":
        monkeypatch.setattr(placing, "PACKING_MIN", 0)
    make_config, auto = ARCHITECTURES[arch]
    directory = save(make_config(), auto, tmp_path / arch)
    net = from_pretrained(auto, segment=stage_dir(directory), device="cuda")
    expected = auto.from_pretrained(directory, device_map={"": "cuda"})
    for name, tensor in tensors_of(net).items():
        assert tensor.device.type == "cuda", name
    with torch.no_grad():
        got = net(input_ids=torch.tensor(TOKENS, device="cuda"))
        want = expected(input_ids=torch.tensor(TOKENS, device="cuda"))
    key = "logits" if hasattr(got, "logits") else "last_hidden_state"
    assert torch.equal(getattr(got, key), getattr(want, key))


def test_attaching_never_imports_transformers(tmp_path: Path, stage_dir: StageDir) -> None:
    segment = stage_dir(save(bert(), transformers.AutoModel, tmp_path / "bert"))
    code = (
        "import sys; from modelload.loader import attach; "
        f"m = attach({str(segment)!r}, notify=False); m.state_dict(); m.model_dir; "
        "print(sorted(n for n in sys.modules if 'transformers' in n.split('.')))"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert run.stdout.strip() == "[]"
