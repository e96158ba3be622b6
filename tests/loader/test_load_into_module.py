"""load_into_module on the modules real models are: transformers' Llama (tied embeddings, rotary buffers) and
BERT (non-persistent position buffers), from files written by save_pretrained and by tensorizer."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch

from modelload.loader import attach
from modelload.loader.cli.main import main
from modelload.loader.dtypes import by_name
from modelload.loader.errors import ConfigError, LeftOnMetaError, ModuleLoadError, ModuleMismatchError
from modelload.loader.segment import SegmentWriter, TensorSpec, plan_layout

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

ROTARY = ("model.rotary_emb.inv_freq", "model.rotary_emb.original_inv_freq")
BERT_BUFFERS = ("embeddings.position_ids", "embeddings.token_type_ids")


# --- models and files ---------------------------------------------------------------------------------------


def llama_config(*, tied: bool = True) -> Any:
    return transformers.LlamaConfig(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=tied,
    )


def bert_config() -> Any:
    return transformers.BertConfig(
        vocab_size=96,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=64,
    )


def reference(cls: Any, config: Any, *, seed: int = 0) -> Any:
    torch.manual_seed(seed)
    return cls(config).eval()


def on_meta(cls: Any, config: Any) -> Any:
    with torch.device("meta"):
        return cls(config).eval()


def saved_pretrained(net: Any, directory: Path) -> dict[str, torch.Tensor]:
    """What save_pretrained writes (a tied weight stored once), read back from its shards."""
    net.save_pretrained(directory, max_shard_size="20KB")
    shards = sorted(directory.glob("*.safetensors"))
    assert len(shards) > 1, "the file is sharded, as real checkpoints are"
    state: dict[str, torch.Tensor] = {}
    for shard in shards:
        state.update(safetensors_torch.load_file(shard))
    return state


def publish(path: Path, tensors: dict[str, torch.Tensor]) -> Path:
    specs = [
        TensorSpec(n, by_name(str(t.dtype).removeprefix("torch.")), tuple(t.shape))
        for n, t in tensors.items()
    ]
    with SegmentWriter.create(
        path, plan_layout(specs, metadata={"format": "test"}), heartbeat=False
    ) as writer:
        for i, tensor in enumerate(tensors.values()):
            if tensor.numel():
                writer.slot(i)[:] = tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
            writer.mark_ready(i)
        writer.mark_complete()
    return path


def staged_write_module(net: Any, directory: Path) -> Path:
    """``net`` written by tensorizer's own write_module (parameters and every buffer), then staged."""
    # Imported here: only the tests that write with tensorizer need it; the GPU image has none.
    tensorizer = pytest.importorskip("tensorizer")
    source, segment = directory / "model.tensors", directory / "model.seg"
    serializer = tensorizer.TensorSerializer(str(source))
    serializer.write_module(net)
    serializer.close()
    assert main(["stage", "--no-progress", str(source), str(segment)]) == 0
    return segment


def llama_logits(net: Any) -> torch.Tensor:
    tokens = torch.tensor([[1, 5, 9, 33, 2, 70, 11, 3]])
    with torch.no_grad():
        return net(input_ids=tokens).logits


def bert_output(net: Any) -> torch.Tensor:
    tokens = torch.tensor([[2, 17, 40, 8, 3, 90]])
    with torch.no_grad():
        return net(input_ids=tokens).last_hidden_state


def rotary_from_config(config: Any) -> Any:
    """A caller's re-creation of the rotary buffers that __init__ computed on meta: build that one module."""
    rotary = transformers.models.llama.modeling_llama.LlamaRotaryEmbedding(config)

    def recreate(name: str, meta: torch.Tensor) -> torch.Tensor:
        return getattr(rotary, name.rsplit(".", 1)[1])

    return recreate


def on_meta_names(net: Any) -> list[str]:
    tensors = [*net.named_parameters(remove_duplicate=False), *net.named_buffers(remove_duplicate=False)]
    return sorted(name for name, tensor in tensors if tensor.is_meta)


# --- ties -------------------------------------------------------------------------------------------------


def test_a_tied_llama_saved_by_save_pretrained_loads_tied_and_runs(shm_dir: Path, tmp_path: Path) -> None:
    config = llama_config()
    ref = reference(transformers.LlamaForCausalLM, config)
    segment = publish(shm_dir / "llama.seg", saved_pretrained(ref, tmp_path / "llama"))
    with attach(segment, notify=False) as model:
        assert "lm_head.weight" not in model, "save_pretrained stores a tied weight once"
        net = on_meta(transformers.LlamaForCausalLM, config)
        result = model.load_into_module(net, leftover=rotary_from_config(config))
        assert list(result.missing_keys) == [] and list(result.unexpected_keys) == []
        assert net.lm_head.weight is net.model.embed_tokens.weight, "the tie is the same Parameter"
        assert net.lm_head.weight.data_ptr() == model.tensor("model.embed_tokens.weight").data_ptr()
        assert on_meta_names(net) == []
        assert torch.equal(llama_logits(net), llama_logits(ref))


def test_a_file_storing_both_tied_names_loads_tied(shm_dir: Path, tmp_path: Path) -> None:
    config = llama_config()
    ref = reference(transformers.LlamaForCausalLM, config)
    segment = staged_write_module(ref, tmp_path)
    with attach(segment, notify=False) as model:
        assert {"lm_head.weight", "model.embed_tokens.weight", *ROTARY} <= set(model.names)
        net = on_meta(transformers.LlamaForCausalLM, config)
        model.load_into_module(net)
        assert net.lm_head.weight is net.model.embed_tokens.weight
        assert on_meta_names(net) == []
        assert torch.equal(llama_logits(net), llama_logits(ref))


def test_a_file_whose_tied_names_differ_is_refused_before_anything_is_assigned(shm_dir: Path) -> None:
    config = llama_config()
    ref = reference(transformers.LlamaForCausalLM, config)
    state = {k: v.clone() for k, v in ref.state_dict().items()}
    state["lm_head.weight"] = state["lm_head.weight"] + 1
    with attach(publish(shm_dir / "m.seg", state), notify=False) as model:
        net = on_meta(transformers.LlamaForCausalLM, config)
        with pytest.raises(
            ModuleMismatchError,
            match=r"lm_head\.weight.*model\.embed_tokens\.weight|"
            r"model\.embed_tokens\.weight.*lm_head\.weight",
        ) as caught:
            model.load_into_module(net, leftover="keep")
        assert "tie" in str(caught.value)
        assert net.model.embed_tokens.weight.is_meta, "nothing was assigned"


# --- nothing left on meta -----------------------------------------------------------------------------------


def test_buffers_computed_in_init_are_named_instead_of_left_on_meta(shm_dir: Path, tmp_path: Path) -> None:
    config = llama_config()
    ref = reference(transformers.LlamaForCausalLM, config)
    segment = publish(shm_dir / "llama.seg", saved_pretrained(ref, tmp_path / "llama"))
    with attach(segment, notify=False) as model:
        for strict in (True, False):
            net = on_meta(transformers.LlamaForCausalLM, config)
            with pytest.raises(LeftOnMetaError) as caught:
                model.load_into_module(net, strict=strict)
            assert caught.value.names == ROTARY
            assert all(name in str(caught.value) for name in ROTARY)
            assert "leftover" in str(caught.value), "the message names the way out"
            assert net.model.embed_tokens.weight.is_meta, "refused before anything was assigned"


def test_bert_position_buffers_are_an_error_not_silent_nan(shm_dir: Path) -> None:
    config = bert_config()
    ref = reference(transformers.BertModel, config)
    with attach(publish(shm_dir / "bert.seg", dict(ref.state_dict())), notify=False) as model:
        net = on_meta(transformers.BertModel, config)
        with pytest.raises(LeftOnMetaError) as caught:
            model.load_into_module(net)
        assert caught.value.names == BERT_BUFFERS
        assert isinstance(caught.value, ModuleLoadError)


def test_a_missing_weight_with_strict_false_is_an_error_unless_kept(shm_dir: Path) -> None:
    config = llama_config(tied=False)
    ref = reference(transformers.LlamaForCausalLM, config)
    state = dict(ref.state_dict())
    del state["model.layers.1.mlp.up_proj.weight"]
    with attach(publish(shm_dir / "m.seg", state), notify=False) as model:
        net = on_meta(transformers.LlamaForCausalLM, config)
        with pytest.raises(LeftOnMetaError) as caught:
            model.load_into_module(net, strict=False)
        assert caught.value.names == ("model.layers.1.mlp.up_proj.weight", *ROTARY)
        result = model.load_into_module(net, strict=False, leftover="keep")
        assert list(result.missing_keys) == ["model.layers.1.mlp.up_proj.weight"]
        assert on_meta_names(net) == ["model.layers.1.mlp.up_proj.weight", *ROTARY]
        assert net.model.layers[1].mlp.down_proj.weight.device.type == "cpu"


def test_a_recreated_tensor_of_the_wrong_shape_is_refused(shm_dir: Path, tmp_path: Path) -> None:
    config = llama_config()
    ref = reference(transformers.LlamaForCausalLM, config)
    segment = publish(shm_dir / "llama.seg", saved_pretrained(ref, tmp_path / "llama"))
    with attach(segment, notify=False) as model:
        net = on_meta(transformers.LlamaForCausalLM, config)
        with pytest.raises(ModuleLoadError, match=r"model\.rotary_emb\.inv_freq.*shape"):
            model.load_into_module(net, leftover=lambda name, meta: torch.zeros(3))


# --- buffers in the file ------------------------------------------------------------------------------------


def test_a_file_written_by_tensorizer_write_module_loads_strictly_with_its_buffers(tmp_path: Path) -> None:
    config = bert_config()
    ref = reference(transformers.BertModel, config)
    with attach(staged_write_module(ref, tmp_path), notify=False) as model:
        assert set(BERT_BUFFERS) <= set(model.names), "write_module stores non-persistent buffers"
        net = on_meta(transformers.BertModel, config)
        result = model.load_into_module(net, strict=True)
        assert list(result.unexpected_keys) == []
        assert net.embeddings.position_ids.data_ptr() == model.tensor("embeddings.position_ids").data_ptr()
        assert "position_ids" in net.embeddings._non_persistent_buffers_set, "the buffer stays non-persistent"
        assert on_meta_names(net) == []
        out = bert_output(net)
        assert not out.isnan().any()
        assert torch.equal(out, bert_output(ref))


# --- what strict reports ------------------------------------------------------------------------------------


def _plain_net() -> torch.nn.Module:
    net = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3), torch.nn.Linear(3, 2))
    net.register_buffer("scale", torch.ones(1))
    return net


def test_strict_reports_the_names_torch_reports(shm_dir: Path) -> None:
    torch.manual_seed(1)
    state = {k: v.clone() for k, v in _plain_net().state_dict().items()}
    del state["2.bias"]
    state["3.weight"] = torch.ones(2)
    state["extra"] = torch.ones(1)
    expected = _plain_net().load_state_dict(state, strict=False)
    with attach(publish(shm_dir / "m.seg", state), notify=False) as model:
        with pytest.raises(ModuleMismatchError) as caught:
            model.load_into_module(_plain_net())
        assert caught.value.missing_keys == tuple(expected.missing_keys)
        assert sorted(caught.value.unexpected_keys) == sorted(expected.unexpected_keys)
        assert isinstance(caught.value, RuntimeError), "caught where torch's own strict error is caught"
        result = model.load_into_module(_plain_net(), strict=False)
        assert list(result.missing_keys) == list(expected.missing_keys)
        assert sorted(result.unexpected_keys) == sorted(expected.unexpected_keys)


def test_a_shape_mismatch_is_refused_before_anything_is_assigned(shm_dir: Path) -> None:
    state = {k: v.clone() for k, v in _plain_net().state_dict().items()}
    state["2.weight"] = torch.ones(5, 3)
    with attach(publish(shm_dir / "m.seg", state), notify=False) as model:
        with torch.device("meta"):
            net = _plain_net()
        for strict in (True, False):
            with pytest.raises(ModuleMismatchError, match=r"2\.weight.*\(5, 3\).*\(2, 3\)"):
                model.load_into_module(net, strict=strict)
            assert net[0].weight.is_meta


# --- dtypes -------------------------------------------------------------------------------------------------


def test_the_module_ends_with_the_files_dtype_unless_a_cast_is_asked(shm_dir: Path) -> None:
    config = bert_config()
    ref = reference(transformers.BertModel, config).half()
    state = {k: v.clone() for k, v in ref.state_dict().items()}
    state.update({name: getattr(ref.embeddings, name.split(".")[1]) for name in BERT_BUFFERS})
    with attach(publish(shm_dir / "bert.seg", state), notify=False) as model:
        net = on_meta(transformers.BertModel, config)  # built in float32
        model.load_into_module(net)
        assert net.embeddings.word_embeddings.weight.dtype == torch.float16, (
            "the file's dtype, not the module's"
        )
        cast = on_meta(transformers.BertModel, config)
        model.load_into_module(cast, dtype=torch.bfloat16)
        assert {p.dtype for p in cast.parameters()} == {torch.bfloat16}
        assert cast.embeddings.position_ids.dtype == torch.int64, "integer buffers are never cast"
        expected = ref.embeddings.word_embeddings.weight.to(torch.bfloat16)
        assert torch.equal(cast.embeddings.word_embeddings.weight, expected)


def test_a_dtype_that_is_not_floating_is_refused(shm_dir: Path) -> None:
    segment = publish(shm_dir / "m.seg", {"weight": torch.ones(2)})
    with attach(segment, notify=False) as model, pytest.raises(ModuleLoadError, match="floating"):
        model.load_into_module(torch.nn.Linear(2, 1, bias=False), dtype=torch.int8)


def test_a_module_already_on_the_cpu_is_assigned_not_copied_into(shm_dir: Path) -> None:
    net = _plain_net()
    state = {k: v.clone() + 1 for k, v in net.state_dict().items()}
    original = copy.deepcopy(net)
    with attach(publish(shm_dir / "m.seg", state), notify=False) as model:
        model.load_into_module(net)
        assert net[0].weight.data_ptr() == model.tensor("0.weight").data_ptr()
        assert torch.equal(net[0].weight, original[0].weight + 1)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_tied_llama_loads_onto_the_gpu_tied_with_one_copy(shm_dir: Path, tmp_path: Path) -> None:
    config = llama_config()
    ref = reference(transformers.LlamaForCausalLM, config)
    segment = publish(shm_dir / "llama.seg", saved_pretrained(ref, tmp_path / "llama"))
    with attach(segment, notify=False) as model:
        net = on_meta(transformers.LlamaForCausalLM, config)
        recreate = rotary_from_config(config)
        model.load_into_module(net, device="cuda", leftover=lambda n, t: recreate(n, t).cuda())
        assert net.lm_head.weight is net.model.embed_tokens.weight
        assert net.lm_head.weight.device.type == "cuda"
        tokens = torch.tensor([[1, 5, 9, 33, 2, 70, 11, 3]])
        with torch.no_grad():
            got = net(input_ids=tokens.cuda()).logits.cpu()
        torch.testing.assert_close(got, llama_logits(ref), rtol=1e-4, atol=1e-5)


def test_an_unknown_leftover_choice_is_refused(shm_dir: Path) -> None:
    segment = publish(shm_dir / "m.seg", {"weight": torch.ones(1, 2)})
    with attach(segment, notify=False) as model, pytest.raises(ConfigError, match="leftover='recreate'"):
        model.load_into_module(torch.nn.Linear(2, 1, bias=False), leftover="recreate")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("given", "said"),
    [
        (torch.nn.Linear, "the class Linear, not a module built from it: build it first"),
        ({"weight": torch.ones(1, 2)}, "a dict: a state dict is what model.state_dict() returns"),
        (None, "None"),
    ],
)
def test_something_other_than_a_module_is_refused_saying_what_to_pass(
    shm_dir: Path, given: Any, said: str
) -> None:
    # before the fix: TypeError "Module.named_modules() missing 1 required positional argument: 'self'"
    # for the class, AttributeError "'dict' object has no attribute 'named_modules'" for a state dict
    segment = publish(shm_dir / "m.seg", {"weight": torch.ones(1, 2)})
    with attach(segment, notify=False) as model, pytest.raises(ModuleLoadError) as raised:
        model.load_into_module(given)
    assert "load_into_module takes a torch.nn.Module" in str(raised.value) and said in str(raised.value)
