"""Model directories as the Hub has them, staged into segments with a model directory beside them."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from modelload.loader.cli.main import main

StageDir = Callable[[Path], Path]


@pytest.fixture
def stage_dir(shm_dir: Path) -> StageDir:
    """``stage_dir(directory) -> segment``: ``modelload stage DIRECTORY SEGMENT``, which puts every weight
    shard into one segment and the small files (config, tokenizer) into a model directory beside it, named
    in the segment's metadata. Each directory gets a segment and a model directory of its own."""

    def stage(directory: Path) -> Path:
        segment = shm_dir / f"{directory.name}.seg"
        model_dir = shm_dir / f"{directory.name}.model"
        code = main(["stage", "--no-progress", "--model-dir", str(model_dir), str(directory), str(segment)])
        assert code == 0, f"modelload stage {directory} failed"
        return segment

    return stage
