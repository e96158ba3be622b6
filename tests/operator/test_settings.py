"""Operator settings come from flags, then MODELLOAD_OPERATOR_* variables, then documented defaults."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from modelload.loader.errors import ConfigError
from modelload.operator.cli import register
from modelload.operator.settings import OPTIONS, OperatorSettings, from_args


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="modelload")
    register(parser.add_subparsers(dest="command"))
    return parser.parse_args(["operator", *argv])


def test_the_defaults_need_no_flag_and_no_variable() -> None:
    settings = from_args(parse([]), {})
    assert settings == OperatorSettings()
    assert settings.sidecar.mode == "auto"
    assert settings.webhook.port == 9443
    assert settings.webhook.tls == "self-signed"


def test_the_registered_command_runs_the_operator() -> None:
    args = parse(["--sidecar-mode", "native"])
    assert args.command == "operator"
    assert callable(args.func)
    assert args.func.__module__ == "modelload.operator.cli"


def test_variables_configure_every_group_and_flags_win() -> None:
    environ = {
        "MODELLOAD_OPERATOR_NAMESPACE": "ml-system",
        "MODELLOAD_OPERATOR_WATCH_NAMESPACES": "serving, research ,",
        "MODELLOAD_OPERATOR_WEBHOOK_PORT": "8443",
        "MODELLOAD_OPERATOR_WEBHOOK_TLS": "files",
        "MODELLOAD_OPERATOR_CERT_DIR": "/etc/modelload/tls",
        "MODELLOAD_OPERATOR_SIDECAR_IMAGE": "mirror/sidecar:2",
        "MODELLOAD_OPERATOR_SIDECAR_WORKING_SET": "1Gi",
        "MODELLOAD_OPERATOR_RETRY_FIRST_DELAY": "2",
    }
    settings = from_args(parse(["--sidecar-image", "flag/sidecar:3"]), environ)
    assert settings.namespace == "ml-system"
    assert settings.watch_namespaces == ("serving", "research")
    assert settings.webhook.port == 8443
    assert settings.webhook.tls == "files"
    assert settings.webhook.cert_dir == Path("/etc/modelload/tls")
    assert settings.sidecar.image == "flag/sidecar:3"
    assert settings.sidecar.sizing.working_set_bytes == 1 << 30
    assert settings.retry.first_delay == 2.0


@pytest.mark.parametrize(
    ("name", "value", "message"),
    [
        ("MODELLOAD_OPERATOR_WEBHOOK_PORT", "99999", "MODELLOAD_OPERATOR_WEBHOOK_PORT: 99999 is not a port"),
        ("MODELLOAD_OPERATOR_SIDECAR_MODE", "sidecar", "not one of auto, native, regular"),
        ("MODELLOAD_OPERATOR_SIDECAR_WORKING_SET", "lots", "not a Kubernetes quantity"),
        ("MODELLOAD_OPERATOR_RETRY_MAX_DELAY", "0.1", "below the first delay"),
    ],
)
def test_a_bad_value_names_its_variable(name: str, value: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        from_args(None, {name: value})


def test_every_option_has_a_flag_and_a_prefixed_variable() -> None:
    for option in OPTIONS:
        assert option.flag.startswith("--")
        assert option.env.startswith("MODELLOAD_OPERATOR_")
    assert len({o.env for o in OPTIONS}) == len(OPTIONS)


def test_a_bad_flag_stops_the_command_with_status_2_and_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    from modelload.loader.cli.main import main

    assert main(["operator", "--webhook-port", "99999"]) == 2
    err = capsys.readouterr().err
    assert err == "modelload operator: --webhook-port: 99999 is not a port number (1-65535)\n"
