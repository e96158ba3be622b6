"""How much memory a model needs: quantities, the segment bound, and the volume and sidecar sizes."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from modelload.loader.errors import ConfigError
from modelload.loader.formats import read_index
from modelload.loader.sizes import format_bytes, parse_size
from modelload.operator.model_source import check_priority, segment_bound
from modelload.operator.quantity import format_mib, parse_bytes
from modelload.operator.schema import parse_spec
from modelload.operator.sizing import FIXED_HEADROOM, SizingDefaults, plan_sizing
from tests.support.counting import CountingName


@pytest.mark.parametrize(
    ("text", "nbytes"),
    [
        ("512Mi", 512 << 20),
        ("2Gi", 2 << 30),
        ("1G", 10**9),
        ("1.5Gi", 3 << 29),
        ("2e9", 2 * 10**9),
        ("100", 100),
    ],
)
def test_memory_quantities_parse_to_bytes(text: str, nbytes: int) -> None:
    assert parse_bytes(text) == nbytes


@pytest.mark.parametrize("text", ["lots", "-1Gi", "1GB", ""])
def test_a_bad_quantity_is_a_config_error(text: str) -> None:
    with pytest.raises(ConfigError):
        parse_bytes(text)


def test_sizes_and_their_human_forms() -> None:
    assert parse_size("32MiB") == 32 << 20
    assert parse_size("65536") == 65536
    assert format_mib((1 << 30) + 1) == "1025Mi"
    assert format_bytes(15 * (1 << 30)) == "15.0 GiB"
    assert format_bytes(100) == "100 B"


def tensorizer_index(tmp_path: Path, shapes: list[tuple[int, ...]]):  # type: ignore[no-untyped-def]
    torch = pytest.importorskip("torch")
    tensorizer = pytest.importorskip("tensorizer")
    path = tmp_path / "model.tensors"
    serializer = tensorizer.TensorSerializer(str(path))
    tensors = {f"block.{i}.{'n' * (7 * i)}": torch.ones(shape) for i, shape in enumerate(shapes)}
    serializer.write_state_dict(tensors)
    serializer.close()
    data = path.read_bytes()
    return read_index(lambda offset, length: data[offset : offset + length], size=len(data))


def test_the_bound_covers_the_sidecars_own_plan_for_every_load_order(tmp_path: Path) -> None:
    planner = pytest.importorskip("modelload.sidecar.planner")
    index = tensorizer_index(tmp_path, [(3, 1000), (1,), (2049,), (17, 33), (4096,)])
    bound = segment_bound(index, source="s3://models/model.tensors")
    names = [t.name for t in index.tensors]
    for order in itertools.permutations(names, 3):
        plan = planner.plan_load(
            index, chunk_size=1 << 20, priority=list(order), metadata={"source": "s3://models/model.tensors"}
        )
        assert plan.layout.segment_length <= bound
    assert bound - plan.layout.segment_length < 64 << 10  # tight enough not to waste a pod's memory


def test_a_priority_entry_that_matches_no_tensor_is_refused(tmp_path: Path) -> None:
    index = tensorizer_index(tmp_path, [(2, 2), (3,)])
    check_priority(index, ["block.0.", "block.1"])
    with pytest.raises(ConfigError, match=r"spec.priority\[1\]: 'blocks.' matches no tensor"):
        check_priority(index, ["block.0.", "blocks."])


def test_the_volume_holds_the_bound_plus_headroom_and_the_sidecar_limit_covers_it() -> None:
    spec = parse_spec({"source": "s3://models/m.tensors"})
    sizing = plan_sizing(
        model_bytes=10 << 30, tensors=500, spec=spec, defaults=SizingDefaults(), segment=(10 << 30) + 5
    )
    assert parse_bytes(sizing.volume_size_limit) >= (10 << 30) + 5 + FIXED_HEADROOM
    limit = parse_bytes(sizing.resources["limits"]["memory"])
    assert limit >= sizing.volume_bytes + SizingDefaults().working_set_bytes
    assert sizing.resources["requests"]["memory"] == sizing.resources["limits"]["memory"]


def test_an_override_above_what_the_model_needs_is_used_as_given() -> None:
    spec = parse_spec({"source": "s3://models/m.tensors", "volumeSizeLimit": "20Gi"})
    sizing = plan_sizing(model_bytes=1 << 30, tensors=10, spec=spec, defaults=SizingDefaults())
    assert sizing.volume_size_limit == "20Gi"
    assert parse_bytes(sizing.resources["limits"]["memory"]) >= 20 << 30


def test_a_memory_request_above_the_limit_is_refused() -> None:
    spec = parse_spec(
        {"source": "s3://models/m.tensors", "sidecar": {"resources": {"requests": {"memory": "100Gi"}}}}
    )
    with pytest.raises(ConfigError, match="request 100Gi is above the limit"):
        plan_sizing(model_bytes=1 << 30, tensors=10, spec=spec, defaults=SizingDefaults())


def test_checking_a_long_priority_list_against_many_tensors_costs_no_product_of_the_two() -> None:
    from types import SimpleNamespace

    count, entries = 5000, 1000  # the schema allows 4096 entries; MoE models have 100,000 tensors
    names = [CountingName(f"model.layers.{i}.mlp.experts.weight") for i in range(count)]
    index = SimpleNamespace(
        tensors=[SimpleNamespace(name=n) for n in names], table=SimpleNamespace(names=names)
    )
    priority = [f"model.layers.{count - 1 - i}." for i in range(entries)]  # each matches near the end
    CountingName.calls = 0
    check_priority(index, priority)  # type: ignore[arg-type]
    # Each entry against each name made 5,000,000 comparisons (33 CPU-seconds per resolve at 100,000
    # tensors and 4,096 entries, under the GIL the webhook shares); a sorted look-up makes ~100,000.
    assert CountingName.calls < 20 * (count + entries)
    with pytest.raises(ConfigError, match=r"spec.priority\[1\]: 'model.layer.' matches no tensor"):
        check_priority(index, ["model.layers.1.", "model.layer."])  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("quantity", "nbytes"),
    [("1E", 10**18), ("2E", 2 * 10**18), ("1e3", 1000), ("1E3", 1000), ("1Ei", 1 << 60)],
)
def test_the_exa_suffix_is_told_from_an_exponent(quantity: str, nbytes: int) -> None:
    assert parse_bytes(quantity) == nbytes  # "1E" used to raise int()'s ValueError: a traceback, no condition
