"""transformers models over the segment: ``from_pretrained`` whose weights are the tensors already in memory.

The model directory beside the segment (config, generation config, tokenizer) gives the config, and for an
``AutoModel*`` class the model class; the weights are the segment's tensors, handed to transformers' own
``from_pretrained(None, config=..., state_dict=...)``. Going through transformers rather than around it means
its finishing steps run: weights renamed or converted for the class, non-persistent buffers (rotary
``inv_freq``, BERT's ``position_ids``) re-initialised on the model's device, tied weights tied, the
generation config read, the model put in eval mode.

On the CPU nothing is copied: transformers assigns each tensor it receives when the dtype already matches,
so the parameters are views of the segment (copy-on-write: private to this process if written to). With a
CUDA ``device`` the tensors are copied as each becomes ready, through pinned memory (the loader's own path),
and transformers receives them on the device, placed there by its ``device_map`` (which needs accelerate).

This module imports transformers, an optional extra (``pip install 'modelload[transformers]'``); nothing
else in ``modelload.loader`` imports it, so ``attach()`` never pulls it in.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from modelload.loader._api.attach import attach
from modelload.loader._api.model import Model
from modelload.loader.errors import ConfigError

if TYPE_CHECKING:
    import torch

__all__ = ["from_pretrained"]

_OURS = ("state_dict", "device_map", "pretrained_model_name_or_path")


def from_pretrained(
    auto_class_or_model_class: Any,
    *,
    segment: str | os.PathLike[str] | Model | None = None,
    dtype: torch.dtype | None = None,
    device: str | torch.device | None = None,
    **kwargs: Any,
) -> Any:
    """A transformers model built from the attached model's directory, with the segment's tensors as weights.

    >>> from transformers import AutoModelForCausalLM                         # doctest: +SKIP
    >>> from modelload.loader.transformers import from_pretrained            # doctest: +SKIP
    >>> net = from_pretrained(AutoModelForCausalLM)                          # doctest: +SKIP
    >>> net = from_pretrained(AutoModelForCausalLM, device="cuda")           # doctest: +SKIP

    ``auto_class_or_model_class`` is an ``AutoModel*`` class (the model class is chosen from the config) or a
    model class such as ``LlamaForCausalLM``. ``segment`` is a segment path or an attached
    :class:`~modelload.loader.Model` (default: ``attach()``, the segment named by ``MODELLOAD_SEGMENT``).

    The weights keep the dtype they have in the segment; ``dtype`` casts them (a copy of each). ``device``
    None or ``"cpu"`` keeps them in the segment, without a copy; a CUDA device copies them there through
    pinned memory as they arrive. Other keyword arguments go to transformers' ``from_pretrained``
    (``attn_implementation=...``, ``config=`` to replace the directory's config, ...).
    """
    import transformers

    if isinstance(segment, Model):
        return _build(transformers, auto_class_or_model_class, segment, dtype, device, kwargs)
    # Detached once built: the model's tensors keep their part of the mapping, and nothing waits any more.
    with attach(segment) as model:
        return _build(transformers, auto_class_or_model_class, model, dtype, device, kwargs)


def _build(
    transformers: Any,
    auto_class_or_model_class: Any,
    model: Model,
    dtype: torch.dtype | None,
    device: str | torch.device | None,
    kwargs: dict[str, Any],
) -> Any:
    model_dir = _model_dir(model)
    clashes = sorted(set(kwargs) & set(_OURS))
    if clashes:
        raise ConfigError(
            f"from_pretrained got {', '.join(clashes)}: modelload gives the weights and their device itself; "
            "pass device= (and dtype=) instead"
        )
    trust_remote_code = kwargs.get("trust_remote_code")
    config = kwargs.pop("config", None)
    if config is None:
        config = transformers.AutoConfig.from_pretrained(
            model_dir, local_files_only=True, trust_remote_code=trust_remote_code
        )
    model_class = _model_class(auto_class_or_model_class, config)
    if "generation_config" not in kwargs and (model_dir / "generation_config.json").is_file():
        kwargs["generation_config"] = transformers.GenerationConfig.from_pretrained(
            model_dir, local_files_only=True
        )
    placement: dict[str, Any] = {}
    if device is not None:
        if not transformers.utils.is_accelerate_available():
            raise ConfigError(
                f"device={str(device)!r} places the model through transformers' device_map, which needs "
                "accelerate: pip install 'modelload[transformers]' (or leave device out for the CPU)"
            )
        placement["device_map"] = {"": device}
    on_gpu = device is not None and str(device).split(":")[0] != "cpu"
    state = model.state_dict(device=device if on_gpu else None)
    chosen = dtype if dtype is not None else _files_dtype(state)
    with _no_allocator_warmup(on_gpu):
        return model_class.from_pretrained(
            None, config=config, state_dict=state, dtype=chosen, **placement, **kwargs
        )


def _model_dir(model: Model) -> Path:
    model_dir = model.model_dir
    if model_dir is None:
        raise ConfigError(
            f"the segment {model.path} has no model directory (it was loaded from a single weight file), so "
            "there is no config to build a transformers model from: load the model's directory (config.json "
            "beside the weights) with the sidecar or `modelload stage DIR SEGMENT`"
        )
    if not (model_dir / "config.json").is_file():
        raise ConfigError(
            f"the model directory {model_dir} holds no config.json: a transformers model needs one. Load the "
            "whole Hugging Face model directory, not only its weights"
        )
    return model_dir


def _model_class(cls: Any, config: Any) -> Any:
    """The class to build: ``cls`` itself, or for an ``AutoModel*`` class the one its mapping names for the
    config (as transformers' own auto classes choose it)."""
    mapping = getattr(cls, "_model_mapping", None)
    if mapping is None:
        if not hasattr(cls, "from_pretrained") or not hasattr(cls, "config_class"):
            raise ConfigError(
                f"{cls!r} is neither a transformers model class nor an AutoModel class: pass the model class "
                "(AutoModelForCausalLM, BertModel, ...); its config and weights come from the segment, not a "
                "model id or path"
            )
        return cls
    from transformers.models.auto.auto_factory import _get_model_class

    if type(config) not in mapping:
        raise ConfigError(
            f"{cls.__name__} has no model for a {type(config).__name__} (model_type {config.model_type!r}): "
            "choose the AutoModel class that fits the model, or its model class"
        )
    return _get_model_class(config, mapping)


def _files_dtype(state: dict[str, torch.Tensor]) -> torch.dtype | None:
    """The dtype the weights have, as transformers reads it from a state dict: the first floating one."""
    for tensor in state.values():
        if tensor.is_floating_point():
            return tensor.dtype
    return None


@contextlib.contextmanager
def _no_allocator_warmup(on_gpu: bool) -> Iterator[None]:
    """On a GPU, skip transformers' caching-allocator warm-up.

    The warm-up reserves one block the size of the model on the device, to be filled by the copies it is
    about to make. Here the weights are on the device already, so that block would be a second model's worth
    of GPU memory. The hook is a private name of transformers: where it is missing, there is nothing to skip.
    """
    from transformers import modeling_utils

    original = getattr(modeling_utils, "caching_allocator_warmup", None)
    if not on_gpu or original is None:
        yield
        return
    modeling_utils.caching_allocator_warmup = lambda *args, **kwargs: None
    try:
        yield
    finally:
        modeling_utils.caching_allocator_warmup = original
