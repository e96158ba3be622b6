"""Dataclasses that are also OpenAPI schemas: one declaration gives the typed object, its parser and its CRD.

The ModelLoad resource is declared once, as frozen dataclasses whose fields carry their validation rules in
:func:`prop`. Three things are derived from that single declaration:

* :func:`openapi` renders the structural ``openAPIV3Schema`` a CustomResourceDefinition needs (types,
  descriptions, defaults, patterns, enums, bounds, ``x-kubernetes-int-or-string`` for quantities);
* :func:`parse` turns a resource's ``spec`` mapping into the dataclass, applying the same defaults and
  checking the same rules, so the operator never trusts that an API server validated the object (the KMock
  emulator and objects stored under an earlier schema do not);
* :func:`dump` turns a dataclass back into a JSON-ready mapping (used for ``status``).

Supported field types, deliberately few: ``str``, ``int``, ``float``, ``bool``, :data:`Quantity`, nested
dataclasses, ``list[T]``, ``dict[str, T]`` and ``T | None``. Python names are snake_case; JSON names are the
camelCase form unless :func:`prop` names one. This is not a general serialization library: it knows exactly
what a CRD schema can express and refuses the rest at import time.
"""

from __future__ import annotations

import dataclasses
import re
import types
from collections.abc import Mapping
from typing import Any, NewType, TypeVar, Union, get_args, get_origin, get_type_hints

from modelload.loader.errors import ConfigError

__all__ = ["Quantity", "dump", "openapi", "parse", "prop"]

Quantity = NewType("Quantity", str)
"""A Kubernetes resource quantity (``512Mi``, ``2``, ``500m``); integers are accepted and kept as text."""

QUANTITY_PATTERN = (
    r"^(\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))"
    r"(([KMGTPE]i)|[numkMGTPE]|([eE](\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$"
)
"""The pattern Kubernetes publishes for ``resource.Quantity`` in its OpenAPI documents."""

_META_KEY = "modelload.schema"
_T = TypeVar("_T")


@dataclasses.dataclass(frozen=True)
class Rules:
    """What a field promises beyond its type; rendered into the schema and checked by :func:`parse`."""

    doc: str
    name: str | None = None
    pattern: str | None = None
    enum: tuple[str, ...] | None = None
    minimum: float | None = None
    maximum: float | None = None
    max_length: int | None = None
    max_items: int | None = None
    format: str | None = None
    item_pattern: str | None = None
    item_max_length: int | None = None
    hint: str | None = None
    """What a valid value looks like, for people; replaces the regular expression in errors."""
    cel: tuple[tuple[str, str], ...] = ()
    """``(rule, message)`` pairs for ``x-kubernetes-validations`` (checked by the API server only)."""
    error: type[ConfigError] = ConfigError
    """The branch of ConfigError a bad value of this field raises (its condition reason)."""


def prop(
    *,
    doc: str,
    default: Any = dataclasses.MISSING,
    name: str | None = None,
    pattern: str | None = None,
    enum: tuple[str, ...] | None = None,
    minimum: float | None = None,
    maximum: float | None = None,
    max_length: int | None = None,
    max_items: int | None = None,
    format: str | None = None,  # noqa: A002 - the OpenAPI keyword
    item_pattern: str | None = None,
    item_max_length: int | None = None,
    hint: str | None = None,
    cel: tuple[tuple[str, str], ...] = (),
    error: type[ConfigError] = ConfigError,
) -> Any:
    """A dataclass field with its documentation and validation rules.

    A ``list`` or ``dict`` default is copied per instance. ``default=None`` marks an optional field that the
    schema leaves without a default.
    """
    rules = Rules(
        doc=doc,
        name=name,
        pattern=pattern,
        enum=enum,
        minimum=minimum,
        maximum=maximum,
        max_length=max_length,
        max_items=max_items,
        format=format,
        item_pattern=item_pattern,
        item_max_length=item_max_length,
        hint=hint,
        cel=cel,
        error=error,
    )
    metadata = {_META_KEY: rules}
    if isinstance(default, (list, dict)):
        frozen = default
        return dataclasses.field(default_factory=lambda: type(frozen)(frozen), metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


# --- introspection -----------------------------------------------------------------------------------------


def _camel(name: str) -> str:
    head, *rest = name.split("_")
    return head + "".join(part[:1].upper() + part[1:] for part in rest)


@dataclasses.dataclass(frozen=True)
class _Field:
    attr: str
    json: str
    hint: Any
    rules: Rules
    default: Any  # dataclasses.MISSING when required


def _fields(cls: type) -> list[_Field]:
    hints = get_type_hints(cls)
    out: list[_Field] = []
    for f in dataclasses.fields(cls):
        rules = f.metadata.get(_META_KEY)
        if not isinstance(rules, Rules):
            raise TypeError(f"{cls.__name__}.{f.name} is not declared with prop()")
        if f.default is not dataclasses.MISSING:
            default = f.default
        elif f.default_factory is not dataclasses.MISSING:
            default = f.default_factory()
        else:
            default = dataclasses.MISSING
        out.append(_Field(f.name, rules.name or _camel(f.name), hints[f.name], rules, default))
    return out


def _unwrap_optional(hint: Any) -> tuple[Any, bool]:
    origin = get_origin(hint)
    if origin in (Union, types.UnionType):
        args = [a for a in get_args(hint) if a is not type(None)]
        if len(args) != 1:
            raise TypeError(f"unions other than T | None are not supported: {hint}")
        return args[0], True
    return hint, False


# --- schema ------------------------------------------------------------------------------------------------


def openapi(cls: type, *, doc: str | None = None) -> dict[str, Any]:
    """The structural OpenAPI v3 schema of a dataclass declared with :func:`prop` fields."""
    props: dict[str, Any] = {}
    required: list[str] = []
    for f in _fields(cls):
        hint, optional = _unwrap_optional(f.hint)
        schema = _schema_of(hint)
        _apply_rules(schema, f.rules)
        if f.default is dataclasses.MISSING:
            if not optional:
                required.append(f.json)
        elif f.default is not None:
            schema["default"] = dump(f.default) if dataclasses.is_dataclass(f.default) else f.default
        props[f.json] = schema
    out: dict[str, Any] = {"type": "object"}
    description = doc or (cls.__doc__ or "").strip()
    if description:
        out["description"] = _first_paragraph(description)
    out["properties"] = props
    if required:
        out["required"] = required
    return out


def _first_paragraph(text: str) -> str:
    return " ".join(text.split("\n\n", maxsplit=1)[0].split())


def _schema_of(hint: Any) -> dict[str, Any]:
    if hint is Quantity:
        return {
            "anyOf": [{"type": "integer"}, {"type": "string"}],
            "pattern": QUANTITY_PATTERN,
            "x-kubernetes-int-or-string": True,
        }
    if hint is bool:
        return {"type": "boolean"}
    if hint is int:
        return {"type": "integer"}
    if hint is float:
        return {"type": "number"}
    if hint is str:
        return {"type": "string"}
    if dataclasses.is_dataclass(hint) and isinstance(hint, type):
        return openapi(hint)
    origin = get_origin(hint)
    if origin is list:
        (item,) = get_args(hint)
        return {"type": "array", "items": _schema_of(item)}
    if origin is dict:
        key, value = get_args(hint)
        if key is not str:
            raise TypeError(f"map keys must be str: {hint}")
        return {"type": "object", "additionalProperties": _schema_of(value)}
    raise TypeError(f"unsupported field type for a CRD schema: {hint!r}")


def _apply_rules(schema: dict[str, Any], rules: Rules) -> None:
    schema["description"] = _first_paragraph(rules.doc)
    for key, value in (
        ("pattern", rules.pattern),
        ("minimum", rules.minimum),
        ("maximum", rules.maximum),
        ("maxLength", rules.max_length),
        ("maxItems", rules.max_items),
        ("format", rules.format),
    ):
        if value is not None:
            schema[key] = value
    if rules.enum is not None:
        schema["enum"] = list(rules.enum)
    if rules.item_pattern is not None or rules.item_max_length is not None:
        items = schema.get("items")
        if not isinstance(items, dict) or items.get("type") != "string":
            raise TypeError("item rules apply to lists of strings only")
        if rules.item_pattern is not None:
            items["pattern"] = rules.item_pattern
        if rules.item_max_length is not None:
            items["maxLength"] = rules.item_max_length
    if rules.cel:
        schema["x-kubernetes-validations"] = [{"rule": rule, "message": msg} for rule, msg in rules.cel]


# --- parsing -----------------------------------------------------------------------------------------------


def parse(cls: type[_T], data: Any, *, path: str = "spec") -> _T:
    """Build ``cls`` from a JSON-like mapping, applying defaults and checking every rule.

    Raises :class:`ConfigError` naming the field path (``spec.s3.addressing``) and what is wrong. Unknown
    fields are refused: an API server prunes them, so one that arrives here is a typo worth reporting.
    """
    if not isinstance(data, Mapping):
        raise ConfigError(f"{path}: expected an object, got {type(data).__name__}")
    fields = _fields(cls)
    known = {f.json for f in fields}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ConfigError(f"{path}: unknown field(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
    kwargs: dict[str, Any] = {}
    for f in fields:
        where = f"{path}.{f.json}"
        hint, optional = _unwrap_optional(f.hint)
        if f.json not in data or data[f.json] is None:
            if f.default is not dataclasses.MISSING:
                kwargs[f.attr] = f.default
            elif optional:
                kwargs[f.attr] = None
            else:
                raise f.rules.error(f"{where} is required")
            continue
        try:
            value = _parse_value(hint, data[f.json], where)
            _check_rules(value, f.rules, where)
        except ConfigError as exc:
            if type(exc) is f.rules.error or type(exc) is not ConfigError:
                raise
            raise f.rules.error(str(exc)) from None
        kwargs[f.attr] = value
    return cls(**kwargs)


def _parse_value(hint: Any, value: Any, where: str) -> Any:
    if hint is Quantity:
        if isinstance(value, bool) or not isinstance(value, (int, str)):
            raise ConfigError(f"{where}: expected a quantity such as 512Mi, got {value!r}")
        text = str(value)
        if not re.fullmatch(QUANTITY_PATTERN, text):
            raise ConfigError(f"{where}: {text!r} is not a Kubernetes quantity (e.g. 512Mi, 2Gi, 500m)")
        return Quantity(text)
    if hint is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{where}: expected true or false, got {value!r}")
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{where}: expected an integer, got {value!r}")
        return value
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{where}: expected a number, got {value!r}")
        return float(value)
    if hint is str:
        if not isinstance(value, str):
            raise ConfigError(f"{where}: expected a string, got {value!r}")
        return value
    if dataclasses.is_dataclass(hint) and isinstance(hint, type):
        return parse(hint, value, path=where)
    origin = get_origin(hint)
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"{where}: expected a list, got {type(value).__name__}")
        (item,) = get_args(hint)
        return [_parse_value(item, v, f"{where}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, Mapping):
            raise ConfigError(f"{where}: expected an object, got {type(value).__name__}")
        _, item = get_args(hint)
        return {str(k): _parse_value(item, v, f"{where}.{k}") for k, v in value.items()}
    raise TypeError(f"unsupported field type: {hint!r}")  # pragma: no cover - refused by openapi() too


def _check_rules(value: Any, rules: Rules, where: str) -> None:
    if rules.enum is not None and value not in rules.enum:
        raise ConfigError(f"{where}: {value!r} is not one of {', '.join(rules.enum)}")
    if rules.pattern is not None and isinstance(value, str) and not re.search(rules.pattern, value):
        raise ConfigError(
            f"{where}: {value!r} is not valid: {rules.hint or 'it must match ' + rules.pattern}"
        )
    if rules.max_length is not None and isinstance(value, str) and len(value) > rules.max_length:
        raise ConfigError(f"{where}: longer than {rules.max_length} characters")
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if rules.minimum is not None and value < rules.minimum:
            raise ConfigError(f"{where}: {value} is below the minimum {rules.minimum:g}")
        if rules.maximum is not None and value > rules.maximum:
            raise ConfigError(f"{where}: {value} is above the maximum {rules.maximum:g}")
    if isinstance(value, list):
        if rules.max_items is not None and len(value) > rules.max_items:
            raise ConfigError(f"{where}: more than {rules.max_items} items")
        for i, item in enumerate(value):
            if rules.item_pattern is not None and not re.search(rules.item_pattern, item):
                expected = rules.hint or f"it must match {rules.item_pattern}"
                raise ConfigError(f"{where}[{i}]: {item!r} is not valid: {expected}")
            if rules.item_max_length is not None and len(item) > rules.item_max_length:
                raise ConfigError(f"{where}[{i}]: longer than {rules.item_max_length} characters")


# --- dumping -----------------------------------------------------------------------------------------------


def dump(obj: Any) -> Any:
    """A JSON-ready form of a dataclass built from :func:`prop` fields; ``None`` fields are left out."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        out: dict[str, Any] = {}
        for f in _fields(type(obj)):
            value = getattr(obj, f.attr)
            if value is not None:
                out[f.json] = dump(value)
        return out
    if isinstance(obj, list):
        return [dump(v) for v in obj]
    if isinstance(obj, dict):
        return {k: dump(v) for k, v in obj.items()}
    return obj
