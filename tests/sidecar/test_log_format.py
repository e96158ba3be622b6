"""``--log-format json`` (``MODELLOAD_LOG_FORMAT``): the sidecar's lines as JSON objects a pipeline parses.

One real sidecar process loads a small file and every line it writes to stderr must parse; the formatter
itself is checked for the fields it promises, tracebacks included.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
from pathlib import Path

from modelload.loader._logjson import JsonFormatter, use_log_format
from modelload.loader.errors import SidecarUnavailableError
from modelload.loader.segment import SegmentReader, WriterState
from tests.sidecar import models
from tests.support.waiting import wait_for

MODELLOAD = str(Path(sys.executable).with_name("modelload"))


def test_a_sidecar_asked_for_json_writes_only_json_lines(tmp_path: Path, shm_dir: Path) -> None:
    source = tmp_path / "model.safetensors"
    source.write_bytes(models.safetensors_bytes(models.state_dict(layers=1, width=64)))
    segment = shm_dir / "model.seg"
    env = {**os.environ, "MODELLOAD_LOG_FORMAT": "json"}
    command = [MODELLOAD, "sidecar", "--source", str(source), "--segment", str(segment), "--port", "0"]
    process = subprocess.Popen([*command, "--notify", "none"], env=env, stderr=subprocess.PIPE, text=True)

    def complete() -> bool:
        with SegmentReader.open(segment) as reader:
            return reader.writer_state == WriterState.COMPLETE

    try:
        wait_for(
            complete, timeout=30, what="the sidecar's load complete", ignoring=(SidecarUnavailableError,)
        )
    finally:
        process.send_signal(signal.SIGTERM)
        _, stderr = process.communicate(timeout=30)
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert lines, "the sidecar logged nothing"
    records = [json.loads(line) for line in lines]  # every line is one JSON object
    assert all({"time", "level", "logger", "message"} <= record.keys() for record in records)
    assert all(record["time"].endswith("Z") for record in records)
    assert any(record["logger"].startswith("modelload.sidecar") for record in records)
    assert any("loaded" in record["message"] or "complete" in record["message"] for record in records), lines


def test_an_unknown_log_format_is_refused_before_anything_starts(shm_dir: Path) -> None:
    command = [MODELLOAD, "sidecar", "--source", "/nonexistent", "--segment", str(shm_dir / "m.seg")]
    done = subprocess.run(
        [*command, "--log-format", "yaml"], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 2
    assert "--log-format: 'yaml' is not one of text, json" in done.stderr
    assert "Traceback" not in done.stderr


def test_the_formatter_writes_the_promised_fields_and_the_traceback() -> None:
    logger = logging.getLogger("modelload.test.json")
    try:
        raise ValueError("the cause")
    except ValueError:
        record = logger.makeRecord(
            logger.name, logging.ERROR, __file__, 1, "failed %s", ("here",), sys.exc_info()
        )
    entry = json.loads(JsonFormatter().format(record))
    assert entry["level"] == "ERROR"
    assert entry["logger"] == "modelload.test.json"
    assert entry["message"] == "failed here"
    assert "ValueError: the cause" in entry["exception"]


def test_json_replaces_the_formatter_of_every_root_handler() -> None:
    root = logging.getLogger()
    handler = logging.StreamHandler()
    saved = root.handlers[:]
    root.handlers = [handler]
    try:
        use_log_format("text")
        assert not isinstance(handler.formatter, JsonFormatter)
        use_log_format("json")
        assert isinstance(handler.formatter, JsonFormatter)
    finally:
        root.handlers = saved
