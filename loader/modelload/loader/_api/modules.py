"""Putting a model's tensors into a torch module: names matched, ties kept, nothing left on ``meta``.

torch's ``load_state_dict(assign=True)`` alone fails real models built on ``meta`` in three ways, which this
module answers:

- Non-persistent buffers are not in ``state_dict()``. A file that holds them (tensorizer's ``write_module``
  stores every buffer) is refused for "unexpected keys"; here they are assigned, and stay non-persistent.
- Assigning breaks ties: each name gets a Parameter of its own, and a file that stores a tied weight under
  one name (as ``save_pretrained`` does) is "missing" the other. Here a tie group is filled from whichever of
  its names the file holds, fetched once, and every name ends on the same Parameter. A file that holds two
  names of one group with different values is refused: the module would silently drop one of them.
- Whatever the file lacks stays on ``meta``: the forward pass crashes (rotary ``inv_freq``) or computes NaN
  (BERT's ``position_ids``). Here that is an error naming each tensor, unless the caller keeps them or
  re-creates them.

The plan is made from the manifest (names and shapes) before any tensor is waited for or assigned, so every
refusal leaves the module as it was.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, TypeAlias

from modelload.loader.errors import ConfigError, LeftOnMetaError, ModuleLoadError, ModuleMismatchError

if TYPE_CHECKING:
    import torch

__all__ = ["Leftover", "Place", "Plan", "assign", "check_twins", "plan"]

Leftover: TypeAlias = "Literal['raise', 'keep'] | Callable[[str, torch.Tensor], torch.Tensor]"
"""What to do with tensors that would stay on ``meta``: raise (the default), keep them there, or re-create
each with ``fn(name, meta_tensor) -> tensor``."""

_MESSAGE_NAMES = 20


@dataclass(frozen=True)
class Place:
    """One tensor attribute of the module: ``owner.<attr>``, known as ``name`` from the root."""

    name: str
    owner: Any
    attr: str
    is_parameter: bool


@dataclass
class Plan:
    """What a load will do, decided from names and shapes alone."""

    sources: dict[str, list[Place]] = field(default_factory=dict)
    """File name -> every place its tensor fills (the whole tie group; non-persistent buffers included)."""
    twins: list[tuple[str, str]] = field(default_factory=list)
    """Pairs of file names that fill one tie group: their bytes must be equal."""
    missing: tuple[str, ...] = ()
    unexpected: tuple[str, ...] = ()
    leftover: list[list[Place]] = field(default_factory=list)
    """Tie groups that no file tensor fills and that are on ``meta``."""


def _not_a_module(given: object) -> str:
    """What was passed to ``load_into_module`` instead of a module, and what to pass."""
    if isinstance(given, type):
        return (
            f"the class {given.__name__}, not a module built from it: build it first (with "
            f"torch.device('meta'): net = {given.__name__}(...)) and pass net"
        )
    if isinstance(given, Mapping):
        return (
            f"a {type(given).__name__}: a state dict is what model.state_dict() returns; pass the module the "
            "tensors go into"
        )
    return repr(given) if given is None else f"a {type(given).__name__}"


def plan(
    module: torch.nn.Module,
    shapes: Mapping[str, tuple[int, ...]],
    *,
    strict: bool,
    leftover: Leftover,
) -> Plan:
    """Match the file's names (with their shapes) to ``module``; raise what ``strict`` and ``leftover``
    refuse."""
    import torch

    if not isinstance(module, torch.nn.Module):
        raise ModuleLoadError(f"load_into_module takes a torch.nn.Module, got {_not_a_module(module)}")
    if leftover not in ("raise", "keep") and not callable(leftover):
        raise ConfigError(
            f"leftover={leftover!r}: give 'raise' (the default), 'keep', or a function "
            "fn(name, meta_tensor) -> tensor that re-creates each tensor left on meta"
        )
    groups = _tie_groups(module)
    group_of = {place.name: index for index, group in enumerate(groups) for place in group}
    keys = list(module.state_dict(keep_vars=True))
    result = Plan()
    filled: dict[int, str] = {}
    unexpected = []
    mismatched = []
    for file_name, shape in shapes.items():
        key = _module_key(file_name, group_of)
        index = group_of.get(key)
        if index is None:
            unexpected.append(file_name)
            continue
        expected = tuple(_tensor(groups[index][0]).shape)
        if tuple(shape) != expected:
            mismatched.append(
                f"size mismatch for {key}: the model's tensor {file_name!r} has shape {tuple(shape)}, the "
                f"module's {expected}"
            )
        elif index in filled:
            result.twins.append((filled[index], file_name))
        else:
            filled[index] = file_name
            result.sources[file_name] = groups[index]
    if mismatched:
        raise ModuleMismatchError(
            f"cannot load into {type(module).__name__}: " + "; ".join(mismatched) + ". Nothing was assigned: "
            "build the module from the model's own config"
        )
    covered = {place.name for index in filled for place in groups[index]}
    result.missing = tuple(key for key in keys if key not in covered)
    result.unexpected = tuple(unexpected)
    if strict and (result.missing or result.unexpected):
        raise ModuleMismatchError(
            _strict_message(module, result.missing, result.unexpected),
            missing_keys=result.missing,
            unexpected_keys=result.unexpected,
        )
    result.leftover = [g for i, g in enumerate(groups) if i not in filled and _tensor(g[0]).is_meta]
    if leftover == "raise" and result.leftover:
        names = tuple(place.name for group in result.leftover for place in group)
        raise LeftOnMetaError(
            f"{_listed(names)} of {type(module).__name__} would stay on the meta device after the load, "
            "and a forward pass would crash or compute garbage: the model does not hold them (buffers "
            "computed in __init__ are lost when a module is built on meta). Nothing was assigned. Store them "
            "in the file, pass leftover=fn(name, meta_tensor) to re-create each, or leftover='keep' to keep "
            "them on meta",
            names=names,
        )
    return result


def assign(
    module: torch.nn.Module,
    the_plan: Plan,
    tensors: Mapping[str, torch.Tensor],
    *,
    leftover: Leftover,
) -> Any:
    """Assign ``tensors`` (by file name) where ``the_plan`` says; return torch's ``(missing, unexpected)``."""
    import torch

    recreated = []
    if callable(leftover):
        for group in the_plan.leftover:
            meta = _tensor(group[0])
            made = leftover(group[0].name, meta)
            if not isinstance(made, torch.Tensor) or made.is_meta or tuple(made.shape) != tuple(meta.shape):
                got = (
                    f"shape {tuple(made.shape)} on {made.device}" if isinstance(made, torch.Tensor) else made
                )
                raise ModuleLoadError(
                    f"leftover re-created {group[0].name!r} as {got!r}; the module needs a tensor of shape "
                    f"{tuple(meta.shape)} off the meta device. Nothing was assigned"
                )
            recreated.append((group, made))
    persistent = set(module.state_dict(keep_vars=True))
    state: dict[str, torch.Tensor] = {}
    extra: list[tuple[Place, torch.Tensor]] = []
    for file_name, group in the_plan.sources.items():
        for place in group:
            if place.name in persistent:
                state[place.name] = tensors[file_name]
            else:
                extra.append((place, tensors[file_name]))
    with torch.no_grad():
        module.load_state_dict(state, strict=False, assign=True)
        for place, tensor in extra:
            place.owner._buffers[place.attr] = tensor
        for group, made in recreated:
            _put(group[0], made)
        for group in [*the_plan.sources.values(), *(g for g, _ in recreated)]:
            _retie(group)
    return torch.nn.modules.module._IncompatibleKeys(list(the_plan.missing), list(the_plan.unexpected))


def check_twins(the_plan: Plan, host: Callable[[str], torch.Tensor]) -> None:
    """Refuse a file that stores two names of one tie group with different bytes."""
    import torch

    for first, second in the_plan.twins:
        a, b = host(first), host(second)
        if a.dtype != b.dtype or not torch.equal(
            a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)
        ):
            raise ModuleMismatchError(
                f"the model stores {first!r} and {second!r} with different values, but the module ties them "
                "(one Parameter under both names): loading would drop one. Nothing was assigned. Build the "
                "module untied (for transformers: tie_word_embeddings=False in the config)"
            )


def _tie_groups(module: torch.nn.Module) -> list[list[Place]]:
    """Every tensor attribute of the module, grouped by the tensor object they hold (a group of one when
    nothing is tied), in registration order."""
    groups: dict[int, list[Place]] = {}
    for prefix, owner in module.named_modules(remove_duplicate=False):
        dot = f"{prefix}." if prefix else ""
        for attr, tensor in owner._parameters.items():
            if tensor is not None:
                groups.setdefault(id(tensor), []).append(Place(dot + attr, owner, attr, True))
        for attr, tensor in owner._buffers.items():
            if tensor is not None:
                groups.setdefault(id(tensor), []).append(Place(dot + attr, owner, attr, False))
    return list(groups.values())


def _tensor(place: Place) -> torch.Tensor:
    tensor: torch.Tensor = getattr(place.owner, place.attr)
    return tensor


def _put(place: Place, tensor: torch.Tensor) -> None:
    import torch

    if place.is_parameter:
        old = place.owner._parameters[place.attr]
        place.owner._parameters[place.attr] = torch.nn.Parameter(tensor, requires_grad=old.requires_grad)
    else:
        place.owner._buffers[place.attr] = tensor


def _retie(group: list[Place]) -> None:
    """Make every place of a tie group hold the first place's tensor object, as the module had it."""
    canonical = _tensor(group[0])
    for place in group[1:]:
        table = place.owner._parameters if place.is_parameter else place.owner._buffers
        table[place.attr] = canonical


def _module_key(name: str, known: Mapping[str, Any]) -> str:
    """Map a file's tensor name to the module's: tensorizer names root parameters ``".weight"``."""
    if name.startswith(".") and name not in known and name[1:] in known:
        return name[1:]
    return name


def _strict_message(module: Any, missing: tuple[str, ...], unexpected: tuple[str, ...]) -> str:
    parts = []
    if missing:
        parts.append(f"missing key(s): {_listed(missing)}")
    if unexpected:
        parts.append(f"unexpected key(s): {_listed(unexpected)}")
    return (
        f"error(s) loading into {type(module).__name__}: {'; '.join(parts)}. Nothing was assigned. Check "
        "that the module matches the model, or pass strict=False to skip the names that differ"
    )


def _listed(names: tuple[str, ...] | list[str]) -> str:
    shown = ", ".join(repr(n) for n in names[:_MESSAGE_NAMES])
    more = len(names) - _MESSAGE_NAMES
    return shown + (f" and {more} more" if more > 0 else "")
