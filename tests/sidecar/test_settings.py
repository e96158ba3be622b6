"""The sidecar's settings: every flag and variable of docs/contracts.md, flags over variables, refusals."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path

import pytest

from modelload.loader.errors import ConfigError
from modelload.loader.sizes import parse_size
from modelload.sidecar.memory import MemorySettings
from modelload.sidecar.peers import PeerSettings
from modelload.sidecar.settings import (
    ENVIRONMENT,
    LoadSettings,
    NotifySettings,
    add_arguments,
    parse_bool,
    parse_settings,
)
from modelload.sidecar.sources import S3Settings, display_url

SOURCE = ["--source", "s3://models/llama.tensors"]


def test_defaults_follow_the_contract() -> None:
    settings = parse_settings(SOURCE, environ={})
    assert settings.engine.source == "s3://models/llama.tensors"
    assert settings.engine.segment == Path("/run/modelload/model.seg")
    assert settings.engine.format == "auto"
    assert settings.engine.readers == 8
    assert settings.engine.chunk_size == 32 << 20
    assert settings.engine.verify is True
    assert settings.engine.key_file is None and settings.engine.password_file is None
    assert settings.engine.priority == ()
    assert (settings.api.host, settings.api.port) == ("0.0.0.0", 8479)
    assert settings.notify.endpoint == "ipc:///run/modelload/model.seg.notify.sock"
    assert settings.sources.s3.endpoint_url is None  # botocore's chain decides
    assert settings.sources.s3.region is None
    assert settings.sources.s3.addressing == "auto"
    assert settings.sources.s3.unsigned is False
    assert settings.log_level == "info"


EVERY_FLAG = [
    "--source", "https://models.example/llama.safetensors",
    "--segment", "/dev/shm/x/model.seg",
    "--format", "safetensors",
    "--readers", "16",
    "--chunk-size", "64MiB",
    "--no-verify",
    "--key-file", "/var/run/secrets/modelload/key/key",
    "--priority", "embed, layers.0.,lm_head",
    "--port", "9000",
    "--host", "127.0.0.1",
    "--notify", "tcp://127.0.0.1:5555",
    "--s3-endpoint", "http://minio:9000",
    "--s3-region", "eu-west-3",
    "--s3-addressing", "path",
    "--s3-unsigned",
    "--log-level", "debug",
]  # fmt: skip

EVERY_VARIABLE = {
    "MODELLOAD_SOURCE": "https://models.example/llama.safetensors",
    "MODELLOAD_SEGMENT": "/dev/shm/x/model.seg",
    "MODELLOAD_FORMAT": "safetensors",
    "MODELLOAD_READERS": "16",
    "MODELLOAD_CHUNK_SIZE": "64MiB",
    "MODELLOAD_VERIFY": "false",
    "MODELLOAD_KEY_FILE": "/var/run/secrets/modelload/key/key",
    "MODELLOAD_PRIORITY": "embed, layers.0.,lm_head",
    "MODELLOAD_PORT": "9000",
    "MODELLOAD_HOST": "127.0.0.1",
    "MODELLOAD_NOTIFY": "tcp://127.0.0.1:5555",
    "MODELLOAD_S3_ENDPOINT": "http://minio:9000",
    "MODELLOAD_S3_REGION": "eu-west-3",
    "MODELLOAD_S3_ADDRESSING": "path",
    "MODELLOAD_S3_UNSIGNED": "yes",
    "MODELLOAD_LOG_LEVEL": "debug",
}


def _assert_every_value_taken(settings: object) -> None:
    s = settings
    assert s.engine.source == "https://models.example/llama.safetensors"  # type: ignore[attr-defined]
    assert s.engine.segment == Path("/dev/shm/x/model.seg")  # type: ignore[attr-defined]
    assert s.engine.format == "safetensors"  # type: ignore[attr-defined]
    assert s.engine.readers == 16  # type: ignore[attr-defined]
    assert s.engine.chunk_size == 64 << 20  # type: ignore[attr-defined]
    assert s.engine.verify is False  # type: ignore[attr-defined]
    assert s.engine.key_file == Path("/var/run/secrets/modelload/key/key")  # type: ignore[attr-defined]
    assert s.engine.priority == ("embed", "layers.0.", "lm_head")  # type: ignore[attr-defined]
    assert (s.api.host, s.api.port) == ("127.0.0.1", 9000)  # type: ignore[attr-defined]
    assert s.notify.endpoint == "tcp://127.0.0.1:5555"  # type: ignore[attr-defined]
    assert s.sources.s3.endpoint_url == "http://minio:9000"  # type: ignore[attr-defined]
    assert s.sources.s3.region == "eu-west-3"  # type: ignore[attr-defined]
    assert s.sources.s3.addressing == "path"  # type: ignore[attr-defined]
    assert s.sources.s3.unsigned is True  # type: ignore[attr-defined]
    assert s.log_level == "debug"  # type: ignore[attr-defined]


def test_every_flag_is_parsed() -> None:
    _assert_every_value_taken(parse_settings(EVERY_FLAG, environ={}))


def test_every_flag_has_a_variable_that_sets_the_same_value() -> None:
    _assert_every_value_taken(parse_settings([], environ=EVERY_VARIABLE))
    assert set(EVERY_VARIABLE) <= set(ENVIRONMENT)


def test_a_flag_wins_over_its_variable() -> None:
    environ = {"MODELLOAD_READERS": "4", "MODELLOAD_VERIFY": "false", "MODELLOAD_S3_UNSIGNED": "true"}
    settings = parse_settings([*SOURCE, "--readers", "32", "--verify", "--no-s3-unsigned"], environ=environ)
    assert settings.engine.readers == 32
    assert settings.engine.verify is True
    assert settings.sources.s3.unsigned is False


def test_a_variable_applies_when_its_flag_is_absent_and_an_empty_one_is_unset() -> None:
    settings = parse_settings(SOURCE, environ={"MODELLOAD_READERS": "4", "MODELLOAD_PORT": ""})
    assert settings.engine.readers == 4
    assert settings.api.port == 8479


def test_settings_come_from_parsed_arguments_of_the_command_line_too() -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args([*SOURCE, "--chunk-size", "1GiB"])
    assert parse_settings(args, environ={"MODELLOAD_FORMAT": "tensorizer"}).engine.chunk_size == 1 << 30
    assert parse_settings(args, environ={"MODELLOAD_FORMAT": "tensorizer"}).engine.format == "tensorizer"


def test_the_notify_endpoint_defaults_to_one_per_segment_and_can_be_turned_off() -> None:
    settings = parse_settings([*SOURCE, "--segment", "/dev/shm/m/model.seg"], environ={})
    assert settings.notify.endpoint == "ipc:///dev/shm/m/model.seg.notify.sock"
    assert parse_settings([*SOURCE, "--notify", "none"], environ={}).notify.endpoint is None


def test_a_relative_segment_path_is_made_absolute(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    settings = parse_settings([*SOURCE, "--segment", "model.seg"], environ={})
    assert settings.engine.segment == tmp_path / "model.seg"
    assert settings.notify.endpoint == f"ipc://{tmp_path}/model.seg.notify.sock"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("33554432", 32 << 20),
        ("32MiB", 32 << 20),
        ("32mib", 32 << 20),
        ("32Mi", 32 << 20),
        ("1GiB", 1 << 30),
        (" 2 GiB ", 2 << 30),
        ("64KiB", 64 << 10),
        ("500MB", 500_000_000),
        ("4096B", 4096),
    ],
)
def test_sizes_accept_bytes_and_units(text: str, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "MiB", "32 MiBs", "-1", "1.5GiB", "32XB", "0x10"])
def test_a_malformed_size_is_refused_with_what_is_expected(text: str) -> None:
    with pytest.raises(ConfigError, match=r"--chunk-size: expected a size such as 32MiB"):
        parse_size(text, setting="--chunk-size")


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        *[("true", True), ("1", True), ("yes", True), ("YES", True), ("on", True)],
        *[("false", False), ("0", False), ("no", False), ("Off", False)],
    ],
)
def test_booleans_accept_the_usual_spellings(text: str, expected: bool) -> None:
    assert parse_bool(text) is expected


@pytest.mark.parametrize(
    ("argv", "environ", "message"),
    [
        ([], {}, r"no model source: pass --source URI or set MODELLOAD_SOURCE"),
        ([*SOURCE, "--readers", "0"], {}, r"--readers: expected a number from 1 to 256, got 0"),
        ([*SOURCE, "--readers", "257"], {}, r"--readers: expected a number from 1 to 256, got 257"),
        (SOURCE, {"MODELLOAD_READERS": "many"}, r"MODELLOAD_READERS: expected a whole number, got 'many'"),
        ([*SOURCE, "--chunk-size", "512KiB"], {}, r"--chunk-size: expected a size from 1MiB to 1GiB"),
        (
            SOURCE,
            {"MODELLOAD_CHUNK_SIZE": "2GiB"},
            r"MODELLOAD_CHUNK_SIZE: expected a size from 1MiB to 1GiB",
        ),
        (SOURCE, {"MODELLOAD_CHUNK_SIZE": "big"}, r"MODELLOAD_CHUNK_SIZE: expected a size such as 32MiB"),
        (SOURCE, {"MODELLOAD_VERIFY": "maybe"}, r"MODELLOAD_VERIFY: expected true or false"),
        (SOURCE, {"MODELLOAD_S3_UNSIGNED": "2"}, r"MODELLOAD_S3_UNSIGNED: expected true or false"),
        ([*SOURCE, "--format", "gguf"], {}, r"--format: expected one of auto, tensorizer, safetensors"),
        (SOURCE, {"MODELLOAD_FORMAT": "pickle"}, r"MODELLOAD_FORMAT: expected one of auto"),
        ([*SOURCE, "--s3-addressing", "dns"], {}, r"--s3-addressing: expected one of auto, path, virtual"),
        ([*SOURCE, "--s3-endpoint", "minio:9000"], {}, r"--s3-endpoint: expected an http:// or https:// URL"),
        ([*SOURCE, "--port", "70000"], {}, r"--port: expected a number from 0 to 65535, got 70000"),
        (SOURCE, {"MODELLOAD_PORT": "http"}, r"MODELLOAD_PORT: expected a whole number"),
        (
            [*SOURCE, "--notify", "/run/notify.sock"],
            {},
            r"--notify: expected ipc://PATH, tcp://HOST:PORT or none",
        ),
        ([*SOURCE, "--log-level", "loud"], {}, r"--log-level: expected one of debug, info, warning, error"),
        (
            [*SOURCE, "--key-file", "k"],
            {"MODELLOAD_PASSWORD_FILE": "p"},
            r"both a key file \(--key-file/MODELLOAD_KEY_FILE\) and a password file",
        ),
        ([*SOURCE, "--slots", "tight"], {}, r"--slots: expected one of auto, packed, paged"),
        (
            [*SOURCE, "--slots", "packed", "--memory-mode", "ring", "--ring-size", "1GiB"],
            {},
            r"--slots packed needs --memory-mode full: memory mode ring",
        ),
        ([*SOURCE, "--readers"], {}, r"--readers: expected one argument"),
        ([*SOURCE, "--reader", "4", "extra"], {}, r"unknown arguments: --reader 4 extra"),
    ],
)
def test_a_bad_value_is_refused_naming_its_flag_or_variable(
    argv: list[str], environ: dict[str, str], message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_settings(argv, environ=environ)


@pytest.mark.parametrize(
    ("argv", "environ", "packed"),
    [
        (SOURCE, {}, None),  # auto: the layout decides by the padding pages would add
        ([*SOURCE, "--slots", "packed"], {}, True),
        (SOURCE, {"MODELLOAD_SLOTS": "paged"}, False),
        ([*SOURCE, "--memory-mode", "release"], {}, False),  # a tensor's pages go back: never packed
    ],
)
def test_slots_reach_the_layout_as_packed_paged_or_its_choice(
    argv: list[str], environ: dict[str, str], packed: bool | None
) -> None:
    assert parse_settings(argv, environ=environ).engine.packed is packed


def test_settings_built_in_code_are_checked_too() -> None:
    with pytest.raises(ConfigError, match="readers"):
        LoadSettings(source="s3://b/k", readers=0)
    with pytest.raises(ConfigError, match="chunk size"):
        LoadSettings(source="s3://b/k", chunk_size=1)
    with pytest.raises(ConfigError, match="notify endpoint"):
        NotifySettings(endpoint="udp://x")


def test_reprs_hide_credentials_and_signatures_of_the_source() -> None:
    uri = "https://alice:hunter2@models.example:8443/llama.safetensors?X-Amz-Signature=deadbeef&X-Amz-Credential=AKIA"
    settings = parse_settings(["--source", uri, "--password-file", "/secrets/pw"], environ={})
    text = repr(settings)
    for secret in ("hunter2", "alice", "deadbeef", "AKIA"):
        assert secret not in text
    assert "https://models.example:8443/llama.safetensors?…" in text
    assert "/secrets/pw" in text  # a path is fine; the password itself is never read here
    assert settings.engine.source == uri  # the engine still gets the real URI


@pytest.mark.parametrize(
    ("uri", "shown"),
    [
        ("s3://bucket/key", "s3://bucket/key"),
        ("/models/llama.safetensors", "/models/llama.safetensors"),
        ("http://u:p@[::1]:8080/m?sig=1", "http://[::1]:8080/m?…"),
    ],
)
def test_sources_are_displayed_without_user_info_or_query(uri: str, shown: str) -> None:
    assert display_url(uri) == shown


def test_s3_endpoint_and_region_come_from_the_aws_variables_unless_overridden(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from modelload.sidecar.sources import open_source

    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", "http://s3-from-aws-env:9000")  # botocore reads it itself
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-west-2")  # botocore reads it itself
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    plain = parse_settings(["--source", "s3://models/m.safetensors"], environ={})
    assert plain.sources.s3.endpoint_url is None  # not duplicated here
    with open_source(plain.engine.source, plain.sources) as source:  # no request is made here
        assert source.location.origin.netloc == "s3-from-aws-env:9000"  # type: ignore[attr-defined]
        assert source.region == "us-west-2"  # type: ignore[attr-defined]
    # AWS_REGION (the contract's, EKS's) is read at the edge: botocore does not know it, and it wins over
    # AWS_DEFAULT_REGION as in the AWS CLI v2.
    with_region = parse_settings(
        ["--source", "s3://models/m.safetensors"], environ={"AWS_REGION": "ap-south-2"}
    )
    with open_source(with_region.engine.source, with_region.sources) as source:
        assert source.region == "ap-south-2"  # type: ignore[attr-defined]
    environ = {
        "MODELLOAD_S3_ENDPOINT": "http://minio:9000",
        "MODELLOAD_S3_REGION": "eu-west-3",
        "AWS_REGION": "x",
    }
    overridden = parse_settings(["--source", "s3://models/m.safetensors"], environ=environ)
    with open_source(overridden.engine.source, overridden.sources) as source:
        assert source.location.origin.netloc == "minio:9000"  # type: ignore[attr-defined]
        assert source.region == "eu-west-3"  # type: ignore[attr-defined]


def test_the_help_gives_each_flag_the_default_its_field_declares() -> None:
    from modelload.loader import options
    from modelload.sidecar.settings import OPTIONS, SidecarSettings

    shown = {option.flag: options.default_shown(option, SidecarSettings) for option in OPTIONS}
    assert shown["--readers"] == "8" and shown["--chunk-size"] == "32MiB" and shown["--verify"] == "on"
    for option in OPTIONS:
        parser = argparse.ArgumentParser()
        options.add_arguments(parser, [option], settings=SidecarSettings)
        text = " ".join(parser.format_help().split("options:", 1)[1].split())
        if shown[option.flag] is not None:
            assert f"default {shown[option.flag]})" in text, option.flag


@pytest.mark.parametrize(
    ("flag", "value", "built_in_code"),
    [
        ("--consumers", "65", lambda: MemorySettings(consumers=65)),
        ("--readers", "300", lambda: LoadSettings(source="s3://b/k", readers=300)),
        ("--peer-uploads", "0", lambda: PeerSettings(max_uploads=0)),
        ("--s3-addressing", "dns", lambda: S3Settings(addressing="dns")),  # type: ignore[arg-type]
        ("--memory-wait-timeout", "0", lambda: MemorySettings(wait_timeout=0)),
    ],
)
def test_a_flag_and_code_are_refused_by_the_one_rule_in_the_same_words(
    flag: str, value: str, built_in_code: Callable[[], object]
) -> None:
    with pytest.raises(ConfigError) as from_flag:
        parse_settings([*SOURCE, flag, value], environ={})
    with pytest.raises(ConfigError) as from_code:
        built_in_code()
    assert from_flag.value.setting == flag
    assert from_flag.value.detail == from_code.value.detail


def test_the_hub_token_and_endpoint_come_from_the_flags_else_the_hubs_own_variables(tmp_path: Path) -> None:
    hub_env = {"HF_TOKEN": "hf_from-env-EXAMPLE", "HF_ENDPOINT": "https://mirror.example"}
    settings = parse_settings(["--source", "hf://org/model"], environ=hub_env)
    assert (settings.sources.hub.token, settings.sources.hub.endpoint) == (
        hub_env["HF_TOKEN"],
        hub_env["HF_ENDPOINT"],
    )
    token = tmp_path / "token"
    token.write_text("hf_from-file-EXAMPLE\n")
    flags = [
        "--source",
        "hf://org/model",
        "--hf-token-file",
        str(token),
        "--hf-endpoint",
        "http://hub.internal",
    ]
    settings = parse_settings(flags, environ=hub_env)
    assert (settings.sources.hub.token, settings.sources.hub.endpoint) == (
        "hf_from-file-EXAMPLE",
        "http://hub.internal",
    )
    assert "hf_from-file-EXAMPLE" not in repr(settings)
    with pytest.raises(ConfigError, match="--hf-endpoint"):
        parse_settings(["--source", "hf://org/model", "--hf-endpoint", "hub.internal"], environ={})


def test_registry_credentials_and_plain_http_registries_are_read_at_start(tmp_path: Path) -> None:
    config = tmp_path / "config.json"
    config.write_text('{"auths": {"registry.internal:5000": {"auth": "dXNlcjpwdw=="}}}')
    env = {
        "MODELLOAD_REGISTRY_AUTH_FILE": str(config),
        "MODELLOAD_REGISTRY_PLAIN_HTTP": "registry.internal:5000",
    }
    settings = parse_settings(["--source", "oci://registry.internal:5000/m:v1"], environ=env)
    assert settings.sources.registry.auths == {"registry.internal:5000": {"auth": "dXNlcjpwdw=="}}
    assert settings.sources.registry.uses_plain_http("registry.internal:5000")
    assert "dXNlcjpwdw" not in repr(settings)
    config.write_text("not json")
    with pytest.raises(ConfigError, match=r"MODELLOAD_REGISTRY_AUTH_FILE.*not JSON"):
        parse_settings(["--source", "oci://registry.internal:5000/m:v1"], environ=env)
