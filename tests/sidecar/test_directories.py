"""Model directories through the engine: every shard into one segment, small files into the model directory.

Sources are real: a local directory, nginx serving a directory over HTTP (no listing: the index names the
shards), and moto's S3 server listing a prefix. Shards are written by the real ``safetensors`` package.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import pytest

from modelload.loader import attach
from modelload.loader.errors import (
    ConfigError,
    DuplicateNameError,
    FormatError,
    SourceChangedError,
    SourceNotFoundError,
)
from modelload.loader.formats import _directory
from modelload.loader.segment import SegmentReader
from modelload.loader.segment.modeldir import MARKER
from modelload.sidecar.load import LoadSettings
from modelload.sidecar.load.engine import Engine
from modelload.sidecar.progress import LoadTracker, Observers
from modelload.sidecar.sources import S3Settings, SourceSettings
from tests.sidecar import models
from tests.sidecar.test_engine import FAST, Recorder, load
from tests.support import hfdir
from tests.support.failures import assert_load_failed


def tensors(seed: int = 40) -> dict[str, Any]:
    return models.state_dict(seed=seed, layers=4)


def assert_model_dir(segment: Path, expected_dir: Path) -> None:
    """The segment names the model directory, which holds exactly the small files, byte for byte (and the
    marker that lets the next load replace it)."""
    with attach(segment, notify=False, timeout=30) as model:
        assert model.model_dir == expected_dir
    present = sorted(p.name for p in expected_dir.iterdir())
    assert present == sorted([*hfdir.SMALL_FILES, "model.safetensors.index.json", MARKER])
    for name, data in hfdir.SMALL_FILES.items():
        assert (expected_dir / name).read_bytes() == data, name
    assert not any(p.name.endswith(".safetensors") for p in expected_dir.iterdir()), (
        "weights are never copied"
    )


def test_a_local_directory_loads_every_shard_into_one_segment(tmp_path: Path, shm_dir: Path) -> None:
    weights = tensors()
    source = hfdir.write(tmp_path / "llama", hfdir.files(weights, shards=3))
    _, tracker = load(str(source), shm_dir / "model.seg")
    assert tracker.snapshot().phase == "complete"
    models.assert_segment_matches(shm_dir / "model.seg", weights)
    assert_model_dir(shm_dir / "model.seg", shm_dir / "model")
    with SegmentReader.open(shm_dir / "model.seg") as reader:
        assert reader.header.layout_version == 2
        assert reader.files == tuple(f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3))
        index = json.loads(hfdir.files(weights, shards=3)["model.safetensors.index.json"])["weight_map"]
        for slot in reader.slots:
            assert slot.file is not None
            assert reader.files[slot.file] == index[slot.name], slot.name


def test_an_s3_prefix_loads_while_an_app_is_attached(moto_s3: Any, aws_env: Any, shm_dir: Path) -> None:
    weights = tensors(41)
    moto_s3.create_bucket("hub")
    for name, data in hfdir.files(weights, shards=4).items():
        moto_s3.put("hub", f"models/llama/{name}", data)
    moto_s3.put("hub", "models/llama-other/config.json", b"{}")  # a sibling prefix stays out
    moto_s3.put("hub", "models/llama/original/consolidated.pth", b"nested: ignored")
    seen: list[str] = []

    def app() -> None:
        with attach(shm_dir / "model.seg", notify=False, timeout=30) as model:
            seen.extend(model.iter_ready())

    attached = threading.Thread(target=app)
    attached.start()
    settings = SourceSettings(http=FAST.http, retry=FAST.retry, s3=S3Settings(endpoint_url=moto_s3.endpoint))
    load("s3://hub/models/llama/", shm_dir / "model.seg", sources=settings, chunk_size=64 << 10)
    attached.join(30)
    assert sorted(seen) == sorted(weights)
    models.assert_segment_matches(shm_dir / "model.seg", weights)
    assert_model_dir(shm_dir / "model.seg", shm_dir / "model")
    with attach(shm_dir / "model.seg", notify=False) as model:
        assert model.metadata["source"] == "s3://hub/models/llama/"


def test_an_http_directory_is_found_through_its_index(
    nginx: Any, shm_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    weights = tensors(42)
    for name, data in hfdir.files(weights, shards=2).items():
        nginx.put(f"hf/qwen/{name}", data)
    target = shm_dir / "elsewhere" / "qwen"
    parsed: list[str] = []
    shards_of = _directory._shards_of

    def counted(document: Any, *, where: str) -> str:
        parsed.append(where)
        return shards_of(document, where=where)

    monkeypatch.setattr(_directory, "_shards_of", counted)
    load(nginx.url("hf/qwen/"), shm_dir / "model.seg", model_dir=target)
    models.assert_segment_matches(shm_dir / "model.seg", weights)
    assert_model_dir(shm_dir / "model.seg", target)
    assert parsed == [nginx.url("hf/qwen/")], "the index is parsed once, for the shards and the weights"


def test_an_http_directory_without_an_index_takes_an_explicit_file_list(nginx: Any, shm_dir: Path) -> None:
    weights = tensors(43)
    content = hfdir.files(weights, shards=2, index=False, small={"config.json": b"{}"})
    for name, data in content.items():
        nginx.put(f"hf/plain/{name}", data)
    shards = tuple(n for n in content if n.endswith(".safetensors"))
    with pytest.raises(ConfigError, match="holds no weight files"):
        load(nginx.url("hf/plain/"), shm_dir / "model.seg")
    load(nginx.url("hf/plain/"), shm_dir / "model.seg", files=(*shards, "config.json"))
    models.assert_segment_matches(shm_dir / "model.seg", weights)
    assert (shm_dir / "model" / "config.json").read_bytes() == b"{}"


def test_a_tensorizer_directory_loads_its_files_in_name_order(tmp_path: Path, shm_dir: Path) -> None:
    weights = tensors(44)
    names = list(weights)
    half = len(names) // 2
    directory = tmp_path / "tz"
    directory.mkdir()
    (directory / "part-1.tensors").write_bytes(models.tensorizer_bytes({n: weights[n] for n in names[:half]}))
    (directory / "part-2.tensors").write_bytes(models.tensorizer_bytes({n: weights[n] for n in names[half:]}))
    (directory / "config.json").write_bytes(b'{"a": 1}')
    load(str(directory), shm_dir / "model.seg", priority=(names[-1],))
    models.assert_segment_matches(shm_dir / "model.seg", weights)
    with SegmentReader.open(shm_dir / "model.seg") as reader:
        assert reader.files == ("part-1.tensors", "part-2.tensors")
        assert reader.metadata["format"] == "tensorizer"


def test_shards_load_in_the_order_of_their_names_not_of_the_index_weight_map(
    tmp_path: Path, shm_dir: Path
) -> None:
    # An index lists its tensors by name: "lm_head.weight" (in the last shard) comes first. The first shard
    # holds the first layers, which a streaming engine asks for first.
    weights = tensors(45)
    names = sorted(weights)
    directory = tmp_path / "sharded"
    directory.mkdir()
    parts = {"model-00001-of-00002.safetensors": names[1:], "model-00002-of-00002.safetensors": names[:1]}
    for shard, held in parts.items():
        (directory / shard).write_bytes(models.safetensors_bytes({n: weights[n] for n in held}))
    weight_map = {name: shard for shard, held in parts.items() for name in held}
    index = {"metadata": {}, "weight_map": dict(sorted(weight_map.items()))}  # the last shard's tensor first
    (directory / "model.safetensors.index.json").write_text(json.dumps(index))
    load(str(directory), shm_dir / "model.seg", readers=1)
    models.assert_segment_matches(shm_dir / "model.seg", weights)
    with SegmentReader.open(shm_dir / "model.seg") as reader:
        assert reader.files == tuple(parts)


def test_a_restarted_sidecar_reuses_a_complete_directory_segment(nginx: Any, shm_dir: Path) -> None:
    weights = tensors(45)
    for name, data in hfdir.files(weights, shards=2).items():
        nginx.put(f"hf/reuse/{name}", data)
    load(nginx.url("hf/reuse/"), shm_dir / "model.seg")
    with SegmentReader.open(shm_dir / "model.seg") as reader:
        first = reader.load_id
    shutil_rm(shm_dir / "model")
    load(nginx.url("hf/reuse/"), shm_dir / "model.seg")
    with SegmentReader.open(shm_dir / "model.seg") as reader:
        assert reader.load_id == first, "the same objects: the segment is reused, not loaded again"
    assert_model_dir(shm_dir / "model.seg", shm_dir / "model")


def shutil_rm(path: Path) -> None:
    import shutil

    shutil.rmtree(path)


# --- what bad input gets ------------------------------------------------------------------------------------


def test_a_directory_without_weights_is_a_clear_error(tmp_path: Path, shm_dir: Path) -> None:
    directory = hfdir.write(tmp_path / "empty", {"config.json": b"{}", "pytorch_model.bin": b"x"})
    with pytest.raises(
        ConfigError, match=r"holds no safetensors or tensorizer weights, only pytorch_model\.bin"
    ):
        load(str(directory), shm_dir / "model.seg")
    assert not (shm_dir / "model.seg").exists()


def test_shards_that_share_a_tensor_name_are_refused_naming_both(tmp_path: Path, shm_dir: Path) -> None:
    weights = tensors(46)
    content = hfdir.files(weights, shards=2, index=False)
    first = next(iter(weights))
    content["model-extra.safetensors"] = hfdir._safetensors({first: weights[first]})
    directory = hfdir.write(tmp_path / "overlap", content)
    with pytest.raises(DuplicateNameError) as caught:
        load(str(directory), shm_dir / "model.seg")
    assert "model-00001-of-00002.safetensors" in str(caught.value)
    assert "model-extra.safetensors" in str(caught.value)


def test_an_index_naming_a_missing_shard_is_refused(moto_s3: Any, aws_env: Any, shm_dir: Path) -> None:
    weights = tensors(47)
    moto_s3.create_bucket("hub-missing")
    for name, data in hfdir.files(weights, shards=3).items():
        if name != "model-00002-of-00003.safetensors":
            moto_s3.put("hub-missing", f"m/{name}", data)
    settings = SourceSettings(http=FAST.http, retry=FAST.retry, s3=S3Settings(endpoint_url=moto_s3.endpoint))
    with pytest.raises(SourceNotFoundError, match=r"does not have \(model-00002-of-00003\.safetensors\)"):
        load("s3://hub-missing/m/", shm_dir / "model.seg", sources=settings)


def test_an_http_index_naming_a_missing_shard_is_not_found(nginx: Any, shm_dir: Path) -> None:
    weights = tensors(48)
    for name, data in hfdir.files(weights, shards=2).items():
        if name != "model-00002-of-00002.safetensors":
            nginx.put(f"hf/missing/{name}", data)
    with pytest.raises(SourceNotFoundError, match=r"model-00002-of-00002\.safetensors"):
        load(nginx.url("hf/missing/"), shm_dir / "model.seg")


def test_a_small_file_over_the_bound_is_refused(
    tmp_path: Path, shm_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_directory, "SMALL_FILE_LIMIT", 1500)
    content = hfdir.files(tensors(49), shards=1, small={"tokenizer.json": b"x" * 1600})
    directory = hfdir.write(tmp_path / "big", content)
    with pytest.raises(ConfigError, match=r"tokenizer\.json is 1600 bytes, over the"):
        load(str(directory), shm_dir / "model.seg")


def test_an_index_that_is_not_json_is_a_format_error(tmp_path: Path, shm_dir: Path) -> None:
    content = hfdir.files(tensors(50), shards=2)
    content["model.safetensors.index.json"] = b"[" * 100000
    directory = hfdir.write(tmp_path / "badindex", content)
    with pytest.raises(FormatError, match="not valid JSON"):
        load(str(directory), shm_dir / "model.seg")


def test_a_shard_replaced_mid_load_fails_the_segment_rather_than_mixing(nginx: Any, shm_dir: Path) -> None:
    weights = tensors(51)
    content = hfdir.files(weights, shards=2)
    for name, data in content.items():
        nginx.put(f"hf/changing/{name}", data)
    replaced = threading.Event()

    class ReplaceSecondShard(Recorder):
        def tensor_ready(self, **kwargs: Any) -> None:
            if not replaced.is_set():
                replaced.set()
                nginx.put(
                    "hf/changing/model-00002-of-00002.safetensors", hfdir._safetensors({"x": weights["step"]})
                )

    engine = Engine(
        LoadSettings(source=nginx.url("hf/changing/"), segment=shm_dir / "model.seg", readers=1),
        sources=FAST,
        observer=Observers(ReplaceSecondShard(), LoadTracker()),
    )
    with pytest.raises(SourceChangedError):
        engine.run()
    reason = assert_load_failed(shm_dir / "model.seg", match="changed")
    assert "model-00002-of-00002.safetensors" in reason


def test_a_private_http_directory_sends_the_token_for_every_file_and_never_shows_it(
    nginx: Any, shm_dir: Path
) -> None:
    from modelload.loader.errors import SourceAccessDeniedError
    from modelload.sidecar.sources import HttpSettings, parse_headers
    from tests.support.nginx import TOKEN

    weights = tensors(52)
    for name, data in hfdir.files(weights, shards=3).items():
        nginx.put(f"private-hf/llama/{name}", data)
    base = nginx.private_url("private-hf/llama/")

    def with_token(token: str) -> SourceSettings:
        headers = parse_headers(token, where="the test's token")
        return SourceSettings(http=HttpSettings(stall_timeout=2.0, headers=headers), retry=FAST.retry)

    load(base, shm_dir / "model.seg", sources=with_token(TOKEN))
    models.assert_segment_matches(shm_dir / "model.seg", weights)
    assert_model_dir(shm_dir / "model.seg", shm_dir / "model")
    with pytest.raises(SourceAccessDeniedError) as caught:
        load(base, shm_dir / "again.seg", sources=with_token("not-the-token"))
    assert "private-hf/llama/" in str(caught.value)
    assert TOKEN not in str(caught.value) and "not-the-token" not in str(caught.value)
