"""Settings declared once: a dataclass field holds the default and the rule; the flag, its variable, code and
``--help`` all read them from there (``modelload.loader.options`` and ``modelload.loader.rules``)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field

import pytest

from modelload.loader.errors import ConfigError
from modelload.loader.options import Given, Option, add_arguments, default_shown, parse_int, parse_word
from modelload.loader.rules import Between, OneOf, Positive, Prefixed, check_fields, rule
from modelload.loader.sizes import format_size, parse_size


@dataclass(frozen=True)
class Inner:
    chunk: int = field(
        default=32 << 20, metadata=rule(Between(4096, 1 << 30, what="a chunk", show=format_size))
    )
    mode: str = field(default="full", metadata=rule(OneOf(("full", "ring"))))
    timeout: float | None = field(default=None, metadata=rule(Positive("a positive number of seconds")))

    def __post_init__(self) -> None:
        check_fields(self)


@dataclass(frozen=True)
class Outer:
    name: str
    inner: Inner = field(default_factory=Inner)
    readers: int = field(default=8, metadata=rule(Between(1, 256)))
    url: str | None = field(default=None, metadata=rule(Prefixed(("http://",), "an http:// URL")))

    def __post_init__(self) -> None:
        check_fields(self)


OPTIONS = (
    Option("name", "--name", "T_NAME", "a name"),
    Option("readers", "--readers", "T_READERS", "readers", parse=parse_int),
    Option("url", "--url", "T_URL", "a URL", unset="the system's"),
    Option(
        "inner.chunk", "--chunk", "T_CHUNK", "bytes per read", parse=parse_size,
        rule=Between(1 << 20, 1 << 30, what="a size", show=format_size),
    ),
    Option("inner.mode", "--mode", "T_MODE", "the mode", parse=parse_word),
)  # fmt: skip


def build(flags: dict[str, object], environ: dict[str, str]) -> Outer:
    given = Given(OPTIONS, flags, environ)
    return given.build(Outer, inner=given.build(Inner, "inner"), defaults={"name": "x"})


def test_a_field_checks_the_value_of_a_flag_and_names_the_flag() -> None:
    with pytest.raises(ConfigError, match=r"^--readers: expected a number from 1 to 256, got 0$"):
        build({"readers": "0"}, {})
    with pytest.raises(ConfigError, match=r"^T_READERS: expected a number from 1 to 256, got 300$"):
        build({}, {"T_READERS": "300"})


def test_the_same_rule_refuses_the_value_in_code_naming_the_field() -> None:
    with pytest.raises(ConfigError, match=r"^readers: expected a number from 1 to 256, got 0$"):
        Outer(name="x", readers=0)
    with pytest.raises(ConfigError, match=r"^mode: expected one of full, ring, got 'half'$"):
        Inner(mode="half")
    with pytest.raises(ConfigError, match=r"^timeout: expected a positive number of seconds, got 0$"):
        Inner(timeout=0)
    with pytest.raises(ConfigError, match=r"^url: expected an http:// URL, got 'ftp://h'$"):
        Outer(name="x", url="ftp://h")
    assert Inner(timeout=None).timeout is None  # an unset optional setting has nothing to obey


def test_a_nested_field_names_its_own_flag_or_variable() -> None:
    with pytest.raises(ConfigError, match=r"^T_MODE: expected one of full, ring, got 'half'$"):
        build({}, {"T_MODE": "HALF"})
    assert build({"inner.mode": "RING"}, {}).inner.mode == "ring"


def test_an_option_rule_is_checked_on_top_of_the_field_rule_for_flags_only() -> None:
    with pytest.raises(ConfigError, match=r"^--chunk: expected a size from 1MiB to 1GiB, got 64KiB$"):
        build({"inner.chunk": "64KiB"}, {})
    assert Inner(chunk=64 << 10).chunk == 64 << 10  # code may go lower
    with pytest.raises(ConfigError, match=r"^chunk: expected a chunk from 4KiB to 1GiB, got 1B$"):
        Inner(chunk=1)


def test_a_flag_wins_over_its_variable_and_unset_values_keep_the_field_default() -> None:
    settings = build({"readers": "16"}, {"T_READERS": "4", "T_CHUNK": ""})
    assert settings.readers == 16
    assert settings.inner.chunk == 32 << 20


def test_a_value_made_by_the_caller_is_not_blamed_on_a_flag() -> None:
    given = Given(OPTIONS, {"readers": "4"}, {})
    with pytest.raises(ConfigError, match=r"^readers: expected a number from 1 to 256, got 0$"):
        given.build(Outer, defaults={"name": "x"}, readers=0)


def test_the_help_takes_the_range_and_the_default_from_the_field() -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser, OPTIONS, settings=Outer)
    text = " ".join(parser.format_help().split())
    assert "--readers READERS readers (1 to 256; default 8) [env T_READERS]" in text
    assert "--chunk CHUNK bytes per read (1MiB to 1GiB; default 32MiB) [env T_CHUNK]" in text
    assert "--mode {full,ring} the mode (default full) [env T_MODE]" in text
    assert "--url URL a URL (default: the system's) [env T_URL]" in text
    assert "--name NAME a name (required) [env T_NAME]" in text
    assert [default_shown(option, Outer) for option in OPTIONS] == [None, "8", None, "32MiB", "full"]


def test_an_option_that_names_no_field_is_a_mistake_of_the_table() -> None:
    with pytest.raises(LookupError, match=r"no field 'inner\.chunks'"):
        default_shown(Option("inner.chunks", "--chunks", "T_CHUNKS", "typo"), Outer)
