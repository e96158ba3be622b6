"""The rule a setting's value must follow, declared once, on its dataclass field.

A settings dataclass says what a valid value is where it says the default: ``field(default=8,
metadata=rule(Between(1, 256)))``, and its ``__post_init__`` calls :func:`check_fields`. The same rule object
then serves everyone who needs it: settings built in code are checked by it, a value from a flag or a variable
is checked by it when the settings are built (:class:`~modelload.loader.options.Given` names the flag or
variable in the message), and ``--help`` writes its range from it (:meth:`Rule.describe`) and the default in
its units (:meth:`Rule.show`). A fix to a bound lands in all four at once.

A rule checks one value; a rule over several fields (a ring size exactly when the mode is ring) stays in the
dataclass's ``__post_init__``. ``None`` is never checked: an optional setting left unset has nothing to obey.
Standard library only, like :mod:`~modelload.loader.options`.

>>> from dataclasses import dataclass, field
>>> @dataclass(frozen=True)
... class Pool:
...     size: int = field(default=8, metadata=rule(Between(1, 256)))
...     def __post_init__(self) -> None:
...         check_fields(self)
>>> Pool(size=0)
Traceback (most recent call last):
...
modelload.loader.errors.ConfigError: size: expected a number from 1 to 256, got 0
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from modelload.loader.errors import ConfigError

__all__ = [
    "HTTP_URL",
    "Between",
    "OneOf",
    "Positive",
    "Prefixed",
    "Rule",
    "check_fields",
    "field_rule",
    "plain",
    "rule",
]

_KEY = "modelload.rule"


class Rule(Protocol):
    """What one setting's value must be."""

    def problem(self, value: Any) -> str | None:
        """What is wrong with ``value`` (``"expected ..., got ..."``), or None when it follows the rule."""
        ...

    def describe(self) -> str | None:
        """The rule in a few words for ``--help`` (``1 to 256``), or None when the help shows it otherwise."""
        ...

    def show(self, value: Any) -> str:
        """``value`` as a person would write it for this setting (a size as ``32MiB``)."""
        ...


def plain(value: Any) -> str:
    """A value as a person writes it: ``10`` for the float ``10.0``."""
    return f"{value:g}" if isinstance(value, float) else str(value)


@dataclass(frozen=True)
class Between:
    """A number from ``low`` to ``high``, both included; no upper bound when ``high`` is None.

    ``what`` names the value in the message (``a size``); ``show`` writes a bound or a value in the
    setting's units (:func:`~modelload.loader.sizes.format_size` for sizes).
    """

    low: float
    high: float | None = None
    what: str = "a number"
    show: Callable[[Any], str] = plain

    def problem(self, value: Any) -> str | None:
        if self.high is None:
            if value >= self.low:
                return None
            return f"{self.what} must be at least {self.show(self.low)}, got {self.show(value)}"
        if self.low <= value <= self.high:
            return None
        return f"expected {self.what} from {self.describe()}, got {self.show(value)}"

    def describe(self) -> str:
        if self.high is None:
            return f"at least {self.show(self.low)}"
        return f"{self.show(self.low)} to {self.show(self.high)}"


class _Unranged:
    """What a rule without a range shows: no range in ``--help``, and values as they are written."""

    def describe(self) -> str | None:
        return None

    def show(self, value: Any) -> str:
        return plain(value)


@dataclass(frozen=True)
class Positive(_Unranged):
    """A finite number above zero (a timeout); ``what`` names it in the message."""

    what: str = "a positive number"

    def problem(self, value: Any) -> str | None:
        if value > 0 and math.isfinite(value):
            return None
        return f"expected {self.what}, got {plain(value)}"


@dataclass(frozen=True)
class OneOf(_Unranged):
    """One of ``choices`` (``--help`` lists them as the flag's value, so :meth:`describe` adds nothing)."""

    choices: tuple[str, ...]

    def problem(self, value: Any) -> str | None:
        if value in self.choices:
            return None
        return f"expected one of {', '.join(self.choices)}, got {value!r}"


@dataclass(frozen=True)
class Prefixed(_Unranged):
    """Text that starts with one of ``prefixes`` (a URL's scheme); ``expected`` says so to a person."""

    prefixes: tuple[str, ...]
    expected: str

    def problem(self, value: Any) -> str | None:
        if str(value).startswith(self.prefixes):
            return None
        return f"expected {self.expected}, got {value!r}"


HTTP_URL = Prefixed(("http://", "https://"), "an http:// or https:// URL")
"""A URL of a plain or TLS HTTP server (an S3 endpoint, a peer)."""


def rule(checked: Rule) -> Mapping[str, Rule]:
    """The ``metadata`` of a field whose values must follow ``checked``."""
    return {_KEY: checked}


def field_rule(declared: dataclasses.Field[Any]) -> Rule | None:
    """The rule a field was declared with, if any."""
    found: Rule | None = declared.metadata.get(_KEY)
    return found


def check_fields(settings: Any) -> None:
    """Check every field of the dataclass instance ``settings`` against the rule it was declared with.

    Raises the ConfigError of the first field that breaks its rule, its ``setting`` the field's name (which
    :class:`~modelload.loader.options.Given` replaces with the flag or variable the value came from).
    """
    for declared in dataclasses.fields(settings):
        checked = field_rule(declared)
        if checked is None:
            continue
        value = getattr(settings, declared.name)
        problem = None if value is None else checked.problem(value)
        if problem is not None:
            raise ConfigError(problem, setting=declared.name)
