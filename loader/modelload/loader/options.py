"""Settings read at the edge: each one a flag and a ``MODELLOAD_*`` variable, parsed once into a typed value.

The sidecar and the operator describe their settings as tables of :class:`Option` (a flag, a variable, a help
line), add them to their parser with :func:`add_arguments`, and read each value through :class:`Lookup`: the
flag when it was given, else its variable, else the default (an empty variable counts as unset: a blank Helm
value). Values stay strings until then, so a flag and a variable get the same parser and the same message.
A parser takes the text and returns the value, or raises a :class:`ConfigError` saying what is expected;
the lookup names the flag or variable the text came from (``ConfigError.setting``).

The parsers below are the grammars both components share; :func:`~modelload.loader.sizes.parse_size` is
the size one. Standard library only: the loader, the sidecar and the operator all import this module.

>>> options = (Option("readers", "--readers", "MODELLOAD_READERS", "parallel range readers"),)
>>> get = Lookup(options, {"readers": None}, {"MODELLOAD_READERS": "16"}).get
>>> get("readers", parse_int(1, 256), 8)
16
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar, cast

from modelload.loader.errors import ConfigError

__all__ = [
    "Lookup",
    "Option",
    "add_arguments",
    "parse_bool",
    "parse_choice",
    "parse_int",
    "parse_list",
    "parse_seconds",
    "parse_text",
]

T = TypeVar("T")


@dataclass(frozen=True)
class Option:
    """One setting: where its value lands (``dest``), its flag, its variable, and its ``--help`` line."""

    dest: str
    flag: str
    env: str
    help: str
    metavar: str | None = None
    """What ``--help`` shows for the value; the choices when there are some, else the flag in capitals."""
    choices: tuple[str, ...] = ()
    """Shown in ``--help`` only: the parser checks them, so a flag and a variable read alike."""
    boolean: bool = False
    """A ``--flag``/``--no-flag`` pair; its variable reads true/false (:func:`parse_bool`)."""
    parse: Callable[[str], Any] | None = field(default=None, compare=False)
    """The value's parser, for a table that keeps it beside the option (the operator's)."""


def add_arguments(parser: argparse.ArgumentParser, options: Sequence[Option]) -> None:
    """Add a flag per option; one left out stays ``None``, so :class:`Lookup` falls back to its variable."""
    for option in options:
        text = f"{option.help} [env {option.env}]"
        if option.boolean:
            parser.add_argument(
                option.flag, dest=option.dest, action=argparse.BooleanOptionalAction, help=text
            )
            continue
        if option.choices:
            metavar = "{" + ",".join(option.choices) + "}"
        else:
            metavar = option.metavar or option.flag[2:].upper().replace("-", "_")
        parser.add_argument(option.flag, dest=option.dest, default=None, metavar=metavar, help=text)


class Lookup:
    """Where each value comes from: the flag when given, else its variable, else the default."""

    def __init__(
        self, options: Sequence[Option], flags: Mapping[str, object], environ: Mapping[str, str]
    ) -> None:
        self._options = {option.dest: option for option in options}
        self._flags = flags
        self._environ = environ

    def get(self, dest: str, parse: Callable[[str], T], default: T) -> T:
        """The value of ``dest``, parsed; a ConfigError of ``parse`` gets the flag or variable's name."""
        option = self._options[dest]
        value = self._flags.get(dest)
        if isinstance(value, bool):  # --verify / --no-verify arrive parsed
            return cast("T", value)
        if value is not None:
            text, name = str(value), option.flag
        else:
            text, name = self._environ.get(option.env, ""), option.env
            if not text.strip():  # an empty variable is an unset one (a blank Helm value)
                return default
        try:
            return parse(text)
        except ConfigError as exc:
            if exc.setting is not None:
                raise
            raise ConfigError(str(exc), setting=name) from None

    def origin(self, dest: str) -> str:
        """The name the value of ``dest`` comes from: its flag when given, else its variable."""
        option = self._options[dest]
        return option.flag if self._flags.get(dest) is not None else option.env


# --- grammars ----------------------------------------------------------------------------------------------

_TRUE = ("true", "1", "yes", "on")
_FALSE = ("false", "0", "no", "off")


def parse_text(text: str) -> str:
    return text.strip()


def parse_bool(text: str) -> bool:
    """``true``/``false``, ``1``/``0``, ``yes``/``no``, ``on``/``off``, in any case."""
    value = text.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ConfigError(f"expected true or false (also 1/0, yes/no), got {text!r}")


def parse_int(low: int, high: int) -> Callable[[str], int]:
    """A parser of whole numbers from ``low`` to ``high``."""

    def parse(text: str) -> int:
        try:
            value = int(text.strip())
        except ValueError:
            raise ConfigError(f"expected a whole number, got {text!r}") from None
        if not low <= value <= high:
            raise ConfigError(f"expected a number from {low} to {high}, got {value}")
        return value

    return parse


def parse_seconds(text: str) -> float:
    """A positive number of seconds (``300``, ``0.5``)."""
    try:
        value = float(text.strip())
    except ValueError:
        raise ConfigError(f"expected seconds, such as 300, got {text!r}") from None
    if not value > 0:
        raise ConfigError(f"expected a positive number of seconds, got {text!r}")
    return value


def parse_list(text: str) -> tuple[str, ...]:
    """Comma-separated words, blanks dropped: ``"a, b,"`` → ``("a", "b")``."""
    return tuple(part.strip() for part in text.split(",") if part.strip())


def parse_choice(choices: Sequence[str]) -> Callable[[str], str]:
    """A parser of one of ``choices``, in any case (given in lower case)."""

    def parse(text: str) -> str:
        value = text.strip().lower()
        if value not in choices:
            raise ConfigError(f"expected one of {', '.join(choices)}, got {text!r}")
        return value

    return parse
