"""The ``modelload`` entry point: subcommands from entry points, loaded only when named."""

from __future__ import annotations

import subprocess
import sys

import pytest

from modelload.loader.cli import main as cli


def test_every_registered_command_is_listed(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as caught:
        cli.main(["--help"])
    assert caught.value.code == 0
    listed = capsys.readouterr().out
    for command in ("inspect", "serialize", "stage", "sidecar", "monitor", "operator"):
        assert command in listed


def test_an_unknown_command_is_a_usage_error_naming_the_known_ones(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as caught:
        cli.main(["bogus"])
    assert caught.value.code == 2
    assert "choose from" in capsys.readouterr().err


def test_running_one_command_imports_no_other_part() -> None:
    code = (
        "import sys; from modelload.loader.cli.main import main\n"
        "try:\n    main(['stage', '--help'])\nexcept SystemExit:\n    pass\n"
        "parts = ('modelload.sidecar', 'modelload.operator', 'kopf')\n"
        "print(sorted(m for m in sys.modules if m.startswith(parts)))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip().splitlines()[-1] == "[]"


def test_a_command_whose_module_is_missing_says_so(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    class Missing:
        name = "sidecar"

        def load(self) -> None:
            raise ModuleNotFoundError("No module named 'fastapi'", name="fastapi")

    monkeypatch.setattr(cli, "entry_points", lambda group: [Missing()])
    assert cli.main(["sidecar", "--source", "x"]) == 2
    assert "pip install 'modelload[sidecar]'" in capsys.readouterr().err


def test_a_closed_pipe_ends_quietly(monkeypatch: pytest.MonkeyPatch) -> None:
    class Writes:
        name = "inspect"

        def load(self) -> object:
            def register(subparsers: object) -> None:
                parser = subparsers.add_parser("inspect")  # type: ignore[attr-defined]
                parser.set_defaults(func=lambda _: (_ for _ in ()).throw(BrokenPipeError()))

            return register

    monkeypatch.setattr(cli, "entry_points", lambda group: [Writes()])
    monkeypatch.setattr(sys, "stderr", open("/dev/null", "w"))  # noqa: SIM115 - main closes it
    assert cli.main(["inspect"]) == 141


def test_a_mistyped_option_is_refused_by_its_command_with_the_option_it_resembles(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # before the fix: the top-level usage ("usage: modelload [-h] [-v] [--version] COMMAND ...") and
    # "modelload: error: unrecognized arguments: --treads 2", as if the command were wrong
    with pytest.raises(SystemExit) as exit_:
        cli.main(["stage", "model.tensors", "/dev/shm/m.seg", "--treads", "2"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2
    assert "usage: modelload stage" in err
    assert "modelload stage: error: unrecognized arguments: --treads 2 (did you mean --threads?)" in err
