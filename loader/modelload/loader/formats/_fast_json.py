"""orjson's parser where it is installed (the sidecar's extra), for the few big JSON documents of a load.

A mixture of experts' headers and ``model.safetensors.index.json`` list 100,000 tensors; the json module
parses those in about 0.1 s a load, orjson in a few times less. orjson is strict RFC 8259 (no ``NaN``, no
lone surrogate, UTF-8 only, nesting to 1024) and keeps the last of repeated keys, as the json module does;
it reads an integer past 2**64 - 1 as a float where the json module keeps it exact. So a caller uses it
where the document passes every check, and on anything wrong parses again with the json module, whose
reading its error messages quote. Inference images that only attach need not install it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["fast_loads"]

fast_loads: Callable[[str | bytes], Any] | None
try:
    from orjson import loads as fast_loads
except ImportError:  # pragma: no cover - depends on the environment
    fast_loads = None
