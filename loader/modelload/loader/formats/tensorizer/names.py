"""Tensor names: plain UTF-8 keys and structured state_dict paths (docs/tensorizer-format.md, "Names and
structured paths").

``write_state_dict`` of nested dicts and lists gives each tensor a path of str keys and int indices. A path
of one str is stored as that string in UTF-8; any other path is stored in JSON-seq form: the byte 0x1E, then
a compact ASCII JSON array (``\\x1e["layers",0,"w"]``). Readers see the path and a flat name, the components
joined with dots (``"layers.0.w"``), which is what a flat state_dict uses.

The same paths must also form a tree tensorizer can rebuild: no path is both a leaf and a prefix of another,
and one layer does not mix str keys with int indices. :class:`PathTree` checks that, for the writer (so it
never writes a file tensorizer refuses) and for the reader (so it refuses what tensorizer refuses).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any, NoReturn

__all__ = ["PathError", "Path", "PathTree", "decode_name", "encode_name", "join_path", "normalize_path"]

Path = tuple[str | int, ...]

_RS = 0x1E


class PathError(ValueError):
    """A name or path that breaks the rules; ``duplicate`` when it only repeats an earlier one.

    Internal: the index reader turns it into HeaderError/DuplicateNameError, the writer into ConfigError.
    """

    def __init__(self, message: str, *, duplicate: bool = False) -> None:
        super().__init__(message)
        self.duplicate = duplicate


def normalize_path(name: str | Sequence[str | int]) -> Path:
    """A name or path as a checked path tuple: non-empty, str components or non-negative int indices."""
    path: Path = (name,) if isinstance(name, str) else tuple(name)
    if not path:
        raise PathError("a tensor path must have at least one component")
    for part in path:
        if isinstance(part, bool) or not isinstance(part, str | int):
            raise PathError(f"path component {part!r} of {path!r} is neither a str key nor an int index")
        if isinstance(part, int) and part < 0:
            raise PathError(f"path component {part} of {path!r} is a negative index")
        if isinstance(part, str) and not _is_text(part):
            raise PathError(
                f"path component {part!r} holds an unpaired UTF-16 surrogate, which is not text (it has no "
                "UTF-8 form and cannot be printed)"
            )
    return path


def _is_text(part: str) -> bool:
    """False for a string holding a lone surrogate: Python strings may (``os.fsdecode``, a JSON ``\\ud800``
    escape), UTF-8 may not, and every later step that encodes or prints the name would crash on it."""
    if part.isascii():
        return True
    try:
        part.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def join_path(path: Path) -> str:
    """The flat name of a path: its components joined with dots."""
    return ".".join(str(part) for part in path)


def encode_name(path: Path) -> bytes:
    """The stored bytes of a checked path: UTF-8 for one str, JSON-seq otherwise."""
    if len(path) == 1 and isinstance(path[0], str):
        return path[0].encode("utf-8")
    return b"\x1e" + json.dumps(list(path), ensure_ascii=True, separators=(",", ":")).encode("ascii")


def _refuse(*_args: object) -> NoReturn:
    raise PathError("a JSON-seq tensor path may hold only strings and non-negative integers")


def decode_name(raw: bytes | memoryview) -> tuple[str, Path | None]:
    """The flat name and, for a JSON-seq name, the structured path; raises :class:`PathError`."""
    data = bytes(raw)
    if not data:
        raise PathError("the tensor name is empty")
    if data[0] != _RS:
        try:
            return data.decode("utf-8"), None
        except UnicodeDecodeError as exc:
            raise PathError(
                f"the tensor name is not valid UTF-8 ({exc.reason} at byte {exc.start})"
            ) from None
    if len(data) < 3 or data[1:2] != b"[" or data[-1:] != b"]":
        raise PathError(f"a JSON-seq tensor name must be 0x1E followed by a JSON array, got {data[:40]!r}")
    if b"\n" in data or b"\r" in data:
        raise PathError("a JSON-seq tensor name must not contain newlines")
    try:
        value: Any = json.loads(data[1:], object_hook=_refuse, parse_float=_refuse, parse_constant=_refuse)
    except RecursionError:
        raise PathError("the JSON-seq tensor name nests too deeply") from None
    except ValueError as exc:
        if isinstance(exc, PathError):
            raise
        raise PathError(f"the JSON-seq tensor name is not valid JSON: {exc}") from None
    if not isinstance(value, list):  # pragma: no cover - guarded by the bracket check above
        raise PathError("a JSON-seq tensor name must be an array")
    path = normalize_path(value)
    return join_path(path), path


class PathTree:
    """The tree of paths seen so far; :meth:`add` refuses what tensorizer cannot rebuild into a structure."""

    __slots__ = ("_root",)

    def __init__(self) -> None:
        self._root: dict[str | int, Any] = {}

    def add(self, path: Path) -> None:
        """Record ``path``; raise :class:`PathError` on a repeat, a leaf/prefix clash, or mixed key types.

        The tree is unchanged when it raises.
        """
        layer = self._root
        for depth, part in enumerate(path):
            if layer:
                existing = next(iter(layer))
                if type(existing) is not type(part):
                    raise PathError(
                        f"path {path!r} uses a {type(part).__name__} at depth {depth} where other tensors "
                        f"use {type(existing).__name__} keys; one layer cannot be both a dict and a list"
                    )
            child = layer.get(part)
            if depth == len(path) - 1:
                if child is True:
                    raise PathError(f"tensor {join_path(path)!r} appears twice", duplicate=True)
                if child is not None:
                    raise PathError(f"path {path!r} is both a tensor and a prefix of other tensors' paths")
            elif child is True:
                raise PathError(f"path {path!r} extends {path[: depth + 1]!r}, which is itself a tensor")
            elif child is None:
                break
            else:
                layer = child
        layer = self._root
        for part in path[:-1]:
            layer = layer.setdefault(part, {})
        layer[path[-1]] = True

    def copy(self) -> PathTree:
        """An independent copy, to try a batch of paths without touching this tree."""

        def clone(layer: dict[str | int, Any]) -> dict[str | int, Any]:
            return {k: (v if v is True else clone(v)) for k, v in layer.items()}

        tree = PathTree()
        tree._root = clone(self._root)
        return tree
