"""The examples in the safetensors and detection modules' docstrings run, and print what they claim."""

from __future__ import annotations

import doctest
from types import ModuleType

import pytest

from modelload.loader.formats import _detect
from modelload.loader.formats.safetensors import _file, _header, _writer


@pytest.mark.parametrize("module", [_header, _writer, _file, _detect], ids=lambda m: m.__name__)
def test_docstring_examples_hold(module: ModuleType) -> None:
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0, "the module documents at least one example"
    assert result.failed == 0
