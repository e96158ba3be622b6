"""The error tree carries its own classification: metric labels, condition reasons and exit statuses are
attributes of the classes, which the sidecar, the operator and the CLIs read."""

from __future__ import annotations

import re

import pytest

from modelload.loader import errors
from modelload.loader.errors import (
    ConfigError,
    HashMismatchError,
    LoadFailedError,
    ModelloadError,
    RangeNotSupportedError,
    SegmentSpaceError,
    SourceChangedError,
    SourceNotFoundError,
    SourceUriError,
    TransientSourceError,
    WrongKeyError,
)

CLASSES = [getattr(errors, name) for name in errors.__all__]


def test_the_docstring_draws_every_class_of_the_tree() -> None:
    drawn = set(re.findall(r"[├└]── (\w+)", errors.__doc__ or ""))
    assert drawn | {"ModelloadError"} == {cls.__name__ for cls in CLASSES}


@pytest.mark.parametrize("cls", CLASSES, ids=lambda cls: cls.__name__)
def test_every_class_has_a_label_a_condition_and_an_exit_status(cls: type[ModelloadError]) -> None:
    assert issubclass(cls, ModelloadError)
    assert re.fullmatch(r"[a-z_]+", cls.kind)
    assert re.fullmatch(r"[A-Z][A-Za-z]+", cls.condition)
    assert cls.exit_status in (1, 2)


@pytest.mark.parametrize(
    ("error", "kind", "condition", "transient"),
    [
        (ConfigError("x"), "config", "BadSpec", False),
        (SourceUriError("x"), "config", "BadSource", False),
        (SourceNotFoundError("x"), "not_found", "SourceNotFound", False),
        (RangeNotSupportedError("x"), "range_unsupported", "BadSource", False),
        (SourceChangedError("x"), "changed", "SourceUnreadable", True),
        (TransientSourceError("x", retry_after=3), "transient", "SourceUnreadable", True),
        (HashMismatchError("x"), "hash_mismatch", "BadModel", False),
        (WrongKeyError("x"), "encryption", "Error", False),
        (SegmentSpaceError("x"), "no_space", "Error", False),
        (LoadFailedError("the source vanished"), "segment", "Error", False),
        (ModelloadError("x"), "internal", "Error", False),
    ],
)
def test_a_branch_is_classified_by_what_the_caller_does_next(
    error: ModelloadError, kind: str, condition: str, transient: bool
) -> None:
    assert (error.kind, error.condition, error.transient) == (kind, condition, transient)


def test_a_config_error_names_its_setting_first() -> None:
    error = ConfigError("expected a whole number, got 'x'", setting="--readers")
    assert error.setting == "--readers"
    assert str(error) == "--readers: expected a whole number, got 'x'"
    assert ConfigError("no source").setting is None
    assert (ConfigError.exit_status, ModelloadError.exit_status) == (2, 1)
    assert LoadFailedError("why").reason == "why", "the writer's reason stays an attribute of its own"
