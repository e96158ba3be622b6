"""The contract and format docs say what the code does: their marked tables and example are checked here.

``docs/contracts.md`` marks the tables that restate a piece of code (``<!-- table: NAME -->`` ...
``<!-- end table: NAME -->``); ``docs/tensorizer-format.md`` marks a hex dump of a file our writer makes.
Each test rebuilds the facts from the code and compares, so a flag, a variable, a ``/status`` field, a
metric or a byte of the format that changes without its doc fails here, naming what differs.
"""

from __future__ import annotations

import hashlib
import io
import re
import zlib
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from modelload.loader.formats.tensorizer import TensorizerWriter, read_index
from tests.support.subscriptions import until_heard

ROOT = Path(__file__).resolve().parents[1]
CONTRACTS = ROOT / "docs" / "contracts.md"
FORMAT = ROOT / "docs" / "tensorizer-format.md"


def marked(path: Path, kind: str, name: str) -> str:
    """The text between ``<!-- KIND: NAME ... -->`` and ``<!-- end KIND: NAME -->`` in ``path``."""
    text = path.read_text(encoding="utf-8")
    match = re.search(
        rf"<!-- {kind}: {re.escape(name)}\b[^>]*-->(.*?)<!-- end {kind}: {re.escape(name)} -->", text, re.S
    )
    assert match is not None, f"{path.name} has no {kind} marked {name!r}"
    return match.group(1)


def table_rows(name: str) -> list[list[str]]:
    """The body rows of a marked table in contracts.md, each a list of its cells (header and rule dropped)."""
    lines = [line.strip() for line in marked(CONTRACTS, "table", name).splitlines()]
    rows = [line for line in lines if line.startswith("|")]
    assert len(rows) > 2, f"table {name!r} has no rows"
    return [[cell.strip() for cell in row.strip("|").split("|")] for row in rows[2:]]


def first_code(cell: str) -> str:
    """The first `backticked` word of a cell."""
    match = re.search(r"`([^`]+)`", cell)
    assert match is not None, f"no `name` in the cell {cell!r}"
    return match.group(1)


# --- the sidecar's flags -----------------------------------------------------------------------------------


def test_the_flag_table_lists_every_sidecar_option_in_order() -> None:
    settings = pytest.importorskip("modelload.sidecar.settings")
    documented = [(first_code(row[0]), first_code(row[1])) for row in table_rows("sidecar-flags")]
    in_code = [(option.flag, option.env) for option in settings.OPTIONS]
    assert documented == in_code


def test_the_flag_table_names_the_negative_form_of_every_boolean_flag() -> None:
    settings = pytest.importorskip("modelload.sidecar.settings")
    cells = {first_code(row[0]): row[0] for row in table_rows("sidecar-flags")}
    for option in settings.OPTIONS:
        if option.boolean:
            negative = "--no-" + option.flag.removeprefix("--")
            assert f"`{negative}`" in cells[option.flag], f"{option.flag}: {negative} is not documented"


def test_the_flag_table_gives_the_default_each_setting_declares() -> None:
    settings = pytest.importorskip("modelload.sidecar.settings")
    from modelload.loader.options import default_shown

    defaults = {first_code(row[0]): row[2] for row in table_rows("sidecar-flags")}
    checked = 0
    for option in settings.OPTIONS:
        shown = default_shown(option, settings.SidecarSettings)
        if shown is None:  # required, none, or a default that other settings decide: said in words
            continue
        documented = defaults[option.flag].replace("`", "")
        assert documented == shown, f"{option.flag}: the doc says {documented}, the field {shown}"
        checked += 1
    assert checked >= 15, "the defaults of most flags are values the table gives"


# --- pod wiring ---------------------------------------------------------------------------------------------


def _env_of(spec: dict[str, Any]) -> dict[str, dict[str, Any]]:
    from modelload.operator.resource import ResolvedModel
    from modelload.operator.schema import parse_spec
    from modelload.operator.sidecar_env import sidecar_env

    model = ResolvedModel(name="m", namespace="ns", spec=parse_spec(spec), bytes=1 << 30, tensors=100)
    return {item["name"]: item for item in sidecar_env(model, port=8479)}


def _everything_the_webhook_sets() -> tuple[dict[str, dict[str, Any]], dict[str, str]]:
    """Every variable the sidecar can get (over specs that use every field) and those of a target."""
    pytest.importorskip("modelload.operator.injection")
    from modelload.operator.sidecar_env import target_env

    sidecar: dict[str, dict[str, Any]] = {}
    for spec in (
        {
            "source": "s3://models/llama/",
            "priority": ["embed"],
            "files": ["a.safetensors"],
            "credentialsSecretRef": {"name": "creds"},
            "decryptionKeySecretRef": {"name": "key"},
            "s3": {"endpoint": "http://minio:9000", "region": "eu-west-1", "addressing": "path"},
        },
        {"source": "s3://models/m.tensors", "passwordSecretRef": {"name": "pw"}, "s3": {"unsigned": True}},
        {"source": "https://models.example.com/m.tensors", "headersSecretRef": {"name": "token"}},
        {
            "source": "hf://org/model",
            "hub": {"endpoint": "https://mirror.internal", "tokenSecretRef": {"name": "hf"}},
        },
        {
            "source": "oci://registry.internal:5000/models/m:v1",
            "registry": {"credentialsSecretRef": {"name": "pull"}, "plainHttp": True},
        },
        {
            "source": "s3://models/m.tensors",
            "memory": {
                "mode": "ring",
                "ringSize": "256Mi",
                "waitTimeoutSeconds": 60,
                "hugePages": "2Mi",
                "slots": "paged",
            },
        },
        {
            "source": "gs://models/m.tensors",
            "credentialsSecretRef": {"name": "gcs"},
            "gcs": {"endpoint": "http://gcs:4443"},
        },
        {
            "source": "az://acct01/models/m.tensors",
            "credentialsSecretRef": {"name": "az"},
            "azure": {"endpoint": "http://azurite:10000/acct01"},
        },
    ):
        sidecar.update(_env_of(spec))
    targets = {item["name"]: item["value"] for item in target_env()}
    return sidecar, targets


def test_the_wiring_table_lists_every_variable_the_webhook_sets_and_where() -> None:
    sidecar, targets = _everything_the_webhook_sets()
    documented = {first_code(row[0]): row[1] for row in table_rows("pod-wiring")}
    assert sorted(documented) == sorted(set(sidecar) | set(targets))
    for name, where in documented.items():
        assert ("sidecar" in where) == (name in sidecar), f"{name}: is it set in the sidecar? ({where!r})"
        assert ("targets" in where) == (name in targets), f"{name}: is it set in targets? ({where!r})"


def test_the_wiring_table_gives_the_fixed_values_the_webhook_writes() -> None:
    sidecar, targets = _everything_the_webhook_sets()
    values = {first_code(row[0]): row[2] for row in table_rows("pod-wiring")}
    constant = (
        "MODELLOAD_SEGMENT",
        "MODELLOAD_NOTIFY",
        "MODELLOAD_MODEL_DIR",
        "MODELLOAD_PORT",
        "MODELLOAD_HOST",
    )
    fixed = {name: sidecar[name]["value"] for name in constant} | targets
    for name, value in fixed.items():
        assert f"`{value}`" in values[name], f"{name}: the doc says {values[name]!r}, the webhook {value!r}"
    for name, item in sidecar.items():
        if "valueFrom" in item:
            assert "secretKeyRef" in values[name], f"{name} comes from a Secret"


def test_every_sidecar_variable_of_the_wiring_table_is_one_the_sidecar_reads() -> None:
    settings = pytest.importorskip("modelload.sidecar.settings")
    sidecar, _ = _everything_the_webhook_sets()
    unknown = {n for n in sidecar if n.startswith("MODELLOAD_")} - set(settings.ENVIRONMENT)
    assert not unknown, f"the webhook sets variables the sidecar does not read: {sorted(unknown)}"


def test_the_paths_ports_and_variables_of_the_pod_are_those_of_the_wiring_module() -> None:
    from modelload.loader import wiring

    text = CONTRACTS.read_text(encoding="utf-8")
    for constant in wiring.__all__:
        value = getattr(wiring, constant)
        if callable(value):
            continue
        assert f"`{value}`" in text, f"contracts.md does not give {constant} = {value!r}"
    assert "`loader/modelload/loader/wiring.py`" in text, (
        "contracts.md names the wiring module as the source of truth"
    )


def test_the_paths_and_names_of_the_pod_are_those_of_the_webhook() -> None:
    injection = pytest.importorskip("modelload.operator.injection")
    text = CONTRACTS.read_text(encoding="utf-8")
    for constant in (
        "KEY_DIR",
        "PASSWORD_DIR",
        "HEADERS_DIR",
        "VOLUME_NAME",
        "KEY_VOLUME",
        "PASSWORD_VOLUME",
        "HEADERS_VOLUME",
        "HUGE_PAGES_VOLUME",
        "SIDECAR_NAME",
        "CONTAINERS_ANNOTATION",
        "INJECTED_ANNOTATION",
        "MODE_ANNOTATION",
    ):
        value = getattr(injection, constant)
        assert f"`{value}`" in text, f"contracts.md does not give {constant} = {value!r}"
    from modelload.operator.pods import GENERATION_ANNOTATION
    from modelload.operator.schema import MODEL_LABEL

    assert f"`{GENERATION_ANNOTATION}`" in text, "contracts.md does not give the generation annotation"
    assert f"`{MODEL_LABEL}`" in text, f"contracts.md does not give the pod label {MODEL_LABEL!r}"


# --- the status API -----------------------------------------------------------------------------------------


def test_the_status_table_lists_every_field_in_order() -> None:
    progress = pytest.importorskip("modelload.sidecar.progress")
    fields = list(progress.LoadStatus(phase="starting", source="", segment="").as_dict())
    assert [first_code(row[0]) for row in table_rows("status-fields")] == fields


def test_the_metrics_table_lists_every_family_the_sidecar_exports() -> None:
    metrics = pytest.importorskip("modelload.sidecar.metrics")
    from prometheus_client import generate_latest

    observer = metrics.MetricsObserver()
    observer.retried(kind="timeout", message="a test")  # labelled families show only once they have a child
    exposition = generate_latest(observer.registry).decode()
    exported = [
        name
        for name in re.findall(r"^# TYPE (\S+) ", exposition, re.M)
        if not name.endswith("_created")  # prometheus_client's timestamps, mentioned under the table
    ]
    assert [first_code(row[0]) for row in table_rows("metrics")] == exported


# --- notifications ------------------------------------------------------------------------------------------


def test_the_notifications_are_the_frames_the_doc_lists(tmp_path: Path) -> None:
    zmq = pytest.importorskip("zmq")
    notify = pytest.importorskip("modelload.sidecar.notify")
    section = CONTRACTS.read_text(encoding="utf-8").split("## Notifications", 1)[1].split("\n## ", 1)[0]
    topics = re.findall(r"^\| `(\w+)` \|", section, re.M)
    assert topics == ["ready", "done", "failed"]

    endpoint = f"ipc://{tmp_path}/notify.sock"
    context = zmq.Context()
    with notify.Notifier(endpoint) as notifier:
        sub = context.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.setsockopt(zmq.LINGER, 0)
        sub.connect(endpoint)
        try:
            heard: list[list[bytes]] = []

            def listen(seconds: float) -> bool:
                if sub.poll(int(seconds * 1000)):
                    heard.append(sub.recv_multipart())
                return bool(heard)

            until_heard(lambda: notifier.tensor_ready(index=7, name="w", nbytes=4), listen)
            assert heard[0] == [b"ready", (7).to_bytes(4, "little")]
            notifier.load_finished(seconds=1.0, nbytes=4)
            notifier.load_failed(kind="format", reason="a" + "é" * 3000)
            received: list[list[bytes]] = []
            while len(received) < 2 and sub.poll(5000):
                frames = sub.recv_multipart()
                if frames[0] != b"ready":  # more ready messages sent while the subscription settled
                    received.append(frames)
        finally:
            sub.close()
            context.term()
    assert received[0] == [b"done", b""]
    assert received[1][0] == b"failed"
    assert len(received[1][1]) <= 4096
    assert received[1][1].decode("utf-8") == "a" + "é" * 2047  # cut before the character 4096 splits


# --- the tensorizer format's worked example -----------------------------------------------------------------


def _hexdump_bytes() -> bytes:
    block = marked(FORMAT, "hexdump", "worked-example")
    data = bytearray()
    for line in block.splitlines():
        match = re.match(r"^([0-9a-f]{4})  ((?:[0-9a-f]{2} ?)+)$", line.strip())
        if match:
            assert int(match.group(1), 16) == len(data), f"the hex dump skips to {match.group(1)}"
            data += bytes.fromhex(match.group(2))
    assert data, "the hex dump is empty"
    return bytes(data)


def test_the_worked_example_is_what_the_writer_writes() -> None:
    buf = io.BytesIO()
    writer = TensorizerWriter(buf, metadata_size=0)
    writer.write_state_dict({"w": np.array([1.0, 2.0], dtype="<f2")})
    writer.close()
    assert _hexdump_bytes() == buf.getvalue()


def test_the_worked_example_reads_as_its_table_says() -> None:
    data = _hexdump_bytes()
    index = read_index(data, size=len(data))
    (entry,) = index.tensors
    assert (index.version, index.index_length) == (1, 73 + 37)
    assert (entry.name, entry.kind, entry.dtype.name, entry.shape) == ("w", "state_dict", "float16", (2,))
    assert (entry.record_offset, entry.data_offset, entry.data_length) == (110, 184, 4)
    assert int.from_bytes(data[110:118], "little") == 74
    assert data[188:] == bytes(8)


def test_the_hashes_cover_the_header_with_zeroed_values_then_the_data() -> None:
    data = _hexdump_bytes()
    header = bytearray(data[110:184])
    crc_at, sha_at = 138 - 110, 144 - 110
    stored_crc, stored_sha = bytes(header[crc_at : crc_at + 4]), bytes(header[sha_at : sha_at + 32])
    header[crc_at : crc_at + 4] = bytes(4)
    header[sha_at : sha_at + 32] = bytes(32)
    covered = bytes(header) + data[184:188]
    assert zlib.crc32(covered).to_bytes(4, "little") == stored_crc
    assert hashlib.sha256(covered).digest() == stored_sha
