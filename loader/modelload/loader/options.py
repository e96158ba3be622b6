"""Settings read at the edge: each one a flag and a ``MODELLOAD_*`` variable, parsed once into a typed value.

The sidecar and the operator describe their settings as tables of :class:`Option` (a flag, a variable, a help
line, a parser) whose ``dest`` is the dataclass field the value lands in (``engine.readers``). The field holds
everything else about the setting, once: its default, its docs, and the rule its value must follow
(:mod:`~modelload.loader.rules`). :func:`add_arguments` writes the ``--help`` line from the option and that
field (the range and the default are the field's, never retyped); :class:`Given` reads each value (the flag
when it was given, else its variable; an empty variable counts as unset: a blank Helm value) and builds the
settings dataclasses from them, so a value from a flag and one from code meet the same check. Values stay
strings until then, so a flag and a variable get the same parser and the same message. A parser takes the
text and returns the value, or raises a :class:`ConfigError` saying what is expected; the message names the
flag or variable the text came from (``ConfigError.setting``), whether the parser or the field refused it.

The parsers below are the grammars both components share; :func:`~modelload.loader.sizes.parse_size` is
the size one. Standard library only: the loader, the sidecar and the operator all import this module.

>>> from dataclasses import dataclass, field
>>> from modelload.loader.rules import Between, check_fields, rule
>>> @dataclass(frozen=True)
... class Pool:
...     readers: int = field(default=8, metadata=rule(Between(1, 256)))
...     def __post_init__(self) -> None:
...         check_fields(self)
>>> options = (Option("readers", "--readers", "MODELLOAD_READERS", "range readers", parse=parse_int),)
>>> Given(options, {"readers": None}, {"MODELLOAD_READERS": "16"}).build(Pool)
Pool(readers=16)
>>> Given(options, {"readers": "0"}, {}).build(Pool)
Traceback (most recent call last):
...
modelload.loader.errors.ConfigError: --readers: expected a number from 1 to 256, got 0
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import typing
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar, cast

from modelload.loader.errors import ConfigError
from modelload.loader.rules import OneOf, Rule, field_rule, plain

__all__ = [
    "Given",
    "Lookup",
    "Option",
    "add_arguments",
    "default_shown",
    "parse_bool",
    "parse_int",
    "parse_list",
    "parse_seconds",
    "parse_text",
    "parse_word",
]

T = TypeVar("T")


@dataclass(frozen=True)
class Option:
    """One setting as a person gives it: the field its value lands in (``dest``), its flag, its variable,
    its ``--help`` line and its parser."""

    dest: str
    flag: str
    env: str
    help: str
    metavar: str | None = None
    """What ``--help`` shows for the value; the choices when the field has some, else the flag in capitals."""
    boolean: bool = False
    """A ``--flag``/``--no-flag`` pair; its variable reads true/false (:func:`parse_bool`)."""
    parse: Callable[[str], Any] | None = field(default=None, compare=False)
    """The value's grammar: text in, a typed value (or a ConfigError) out; the field's rule checks it."""
    rule: Rule | None = field(default=None, compare=False)
    """A rule the flag and variable add to the field's own, for values a person should not pick though code
    may (chunks under 1 MiB); ``--help`` shows it instead of the field's."""
    show: Callable[[Any], str] | None = field(default=None, compare=False)
    """How ``--help`` writes the default, where the rule's own way does not suit (a quantity, ``512Mi``)."""
    unset: str | None = None
    """What ``--help`` says happens when the setting is not given, where the field's default cannot say it
    (``model/ beside the segment``; a default that other settings decide)."""


def add_arguments(
    parser: argparse.ArgumentParser, options: Sequence[Option], *, settings: type | None = None
) -> None:
    """Add a flag per option; one left out stays ``None``, so :class:`Lookup` falls back to its variable.

    With ``settings`` (the root dataclass the options' ``dest`` paths start from), each help line ends with
    the field's range and default: ``parallel range readers (1 to 256; default 8)``.
    """
    for option in options:
        text = f"{_help(option, settings)} [env {option.env}]"
        if option.boolean:
            parser.add_argument(
                option.flag, dest=option.dest, action=argparse.BooleanOptionalAction, help=text
            )
            continue
        checked = option.rule or (None if settings is None else field_rule(_declared(settings, option.dest)))
        if isinstance(checked, OneOf):
            metavar = "{" + ",".join(checked.choices) + "}"
        else:
            metavar = option.metavar or option.flag[2:].upper().replace("-", "_")
        parser.add_argument(option.flag, dest=option.dest, default=None, metavar=metavar, help=text)


def default_shown(option: Option, settings: type) -> str | None:
    """The default of ``option``'s field as a person writes it (``8``, ``32MiB``, ``on``), or None when the
    field has no default value (required, or nothing: ``None``, empty) or the option says in words what
    happens when it is not given (``unset``)."""
    declared = _declared(settings, option.dest)
    if option.unset is not None:
        return None
    if declared.default is not dataclasses.MISSING:
        value = declared.default
    elif declared.default_factory is not dataclasses.MISSING:
        value = declared.default_factory()
    else:
        return None
    if value is None or value in ((), ""):
        return None
    if isinstance(value, bool):
        return "on" if value else "off"
    checked = option.rule or field_rule(declared)
    show = option.show or (checked.show if checked is not None else plain)
    return show(value)


def _declared(settings: type, dest: str) -> dataclasses.Field[Any]:
    """The dataclass field that ``dest`` (``engine.memory.mode``) names, from the root class ``settings``."""
    owner = settings
    *path, name = dest.split(".")
    for part in path:
        owner = typing.get_type_hints(owner)[part]
    for declared in dataclasses.fields(owner):
        if declared.name == name:
            return declared
    raise LookupError(f"{settings.__name__} has no field {dest!r} for an option")


def _help(option: Option, settings: type | None) -> str:
    """The option's help, then the range of its rule and its default as its field declares them:
    ``parallel range readers (1 to 256; default 8)``."""
    if settings is None:
        return option.help
    declared = _declared(settings, option.dest)
    checked = option.rule or field_rule(declared)
    span = None if checked is None else checked.describe()
    notes = [] if span is None else [span]
    shown = default_shown(option, settings)
    if option.unset is not None:
        notes.append(f"default: {option.unset}")
    elif shown is not None:
        notes.append(f"default {shown}")
    elif declared.default is dataclasses.MISSING and declared.default_factory is dataclasses.MISSING:
        notes.append("required")
    return f"{option.help} ({'; '.join(notes)})" if notes else option.help


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


_UNSET: Any = object()


class Given:
    """The values a table of options is given, by ``dest``: each parsed by its option's parser and checked
    by its option's own rule; :meth:`build` makes the settings dataclasses of them."""

    def __init__(
        self, options: Sequence[Option], flags: Mapping[str, object], environ: Mapping[str, str]
    ) -> None:
        self._lookup = Lookup(options, flags, environ)
        self.values: dict[str, Any] = {}
        for option in options:
            value = self._lookup.get(option.dest, _parser(option), _UNSET)
            if value is not _UNSET:
                self.values[option.dest] = value

    def get(self, dest: str, default: Any = None) -> Any:
        """The value given for ``dest``, or ``default`` when neither its flag nor its variable is."""
        return self.values.get(dest, default)

    def origin(self, dest: str) -> str:
        """The flag or variable the value of ``dest`` came from."""
        return self._lookup.origin(dest)

    def build(
        self, cls: type[T], prefix: str = "", /, *, defaults: Mapping[str, Any] | None = None, **values: Any
    ) -> T:
        """``cls`` from the values given under ``prefix`` (``engine.memory``), over ``defaults`` (that other
        settings decide), under ``values`` (made from what was given, such as a file read).

        The fields check themselves (:func:`~modelload.loader.rules.check_fields`); a ConfigError about a
        field whose value was given is re-raised naming its flag or variable instead of the field.
        """
        given = {
            dest.rpartition(".")[2]: value
            for dest, value in self.values.items()
            if dest.rpartition(".")[0] == prefix
        }
        try:
            return cast("Callable[..., T]", cls)(**{**(defaults or {}), **given, **values})
        except ConfigError as exc:
            if exc.setting is None or exc.setting not in given or exc.setting in values:
                raise
            dest = f"{prefix}.{exc.setting}" if prefix else exc.setting
            raise ConfigError(exc.detail, setting=self._lookup.origin(dest)) from None


def _parser(option: Option) -> Callable[[str], Any]:
    """The option's parser, followed by the option's own rule."""
    parse = option.parse or parse_text
    extra = option.rule
    if extra is None:
        return parse

    def parse_and_check(text: str) -> Any:
        value = parse(text)
        problem = extra.problem(value)
        if problem is not None:
            raise ConfigError(problem)
        return value

    return parse_and_check


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


def parse_int(text: str) -> int:
    """A whole number (``8``, `` 16 ``); the field's rule says which ones."""
    try:
        return int(text.strip())
    except ValueError:
        raise ConfigError(f"expected a whole number, got {text!r}") from None


def parse_seconds(text: str) -> float:
    """A number of seconds (``300``, ``0.5``); the field's rule says which ones."""
    try:
        value = float(text.strip())
    except ValueError:
        raise ConfigError(f"expected seconds, such as 300, got {text!r}") from None
    if not math.isfinite(value):
        raise ConfigError(f"expected a finite number of seconds, got {text!r}")
    return value


def parse_list(text: str) -> tuple[str, ...]:
    """Comma-separated words, blanks dropped: ``"a, b,"`` → ``("a", "b")``."""
    return tuple(part.strip() for part in text.split(",") if part.strip())


def parse_word(text: str) -> str:
    """A word in any case, in lower case: the field's :class:`~modelload.loader.rules.OneOf` checks it."""
    return text.strip().lower()
