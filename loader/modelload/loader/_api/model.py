"""A model attached from a segment: tensors by name, as they arrive, as numpy arrays or torch tensors.

Every tensor handed out is a view of the segment: nothing is copied on the host. Arrays of tensors that are
not ready yet are never handed out: each accessor waits for its tensor first (or raises, with
``wait=False``). Views are copy-on-write: changing one in place is private to this process. In memory mode
ring they are read-only instead (numpy arrays say so; a write to a torch tensor faults): the sidecar reuses
a ring's bytes for newer tensors, which a private copy of a page would hide from this process.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import numpy as np
import numpy.typing as npt

from modelload.loader._api import gpu_copy, modules
from modelload.loader._api import torch as torch_api
from modelload.loader._api.notify import Subscriber
from modelload.loader.dtypes import by_name
from modelload.loader.errors import ConfigError, LoadTimeoutError, ModelClosedError, ModuleLoadError
from modelload.loader.segment import (
    MODEL_DIR_KEY,
    MemoryMode,
    SegmentReader,
    Slot,
    TensorState,
    WriterState,
)
from modelload.loader.segment.collector import paused_collector
from modelload.loader.segment.consumers import Registration

if TYPE_CHECKING:
    import torch

__all__ = ["DEFAULT", "Model", "Progress"]


class _Default:
    """The type of :data:`DEFAULT`: "use the model's own timeout", as opposed to None (wait forever)."""

    def __repr__(self) -> str:
        return "DEFAULT"


DEFAULT = _Default()


class Progress:
    """A snapshot of a load: tensors and bytes ready out of the total, and the writer's state."""

    __slots__ = ("bytes_ready", "bytes_total", "state", "tensors_ready", "tensors_total")

    def __init__(self, reader: SegmentReader) -> None:
        mask = reader.ready_mask()
        self.state = reader.writer_state.name.lower()
        self.tensors_ready = int(mask.sum())
        self.tensors_total = len(reader.slots)
        self.bytes_total = int(reader.nbytes.sum())
        self.bytes_ready = int(reader.nbytes[mask].sum())

    def __repr__(self) -> str:
        return (
            f"<Progress {self.state}: {self.tensors_ready}/{self.tensors_total} tensors, "
            f"{self.bytes_ready}/{self.bytes_total} bytes>"
        )


class Model:
    """A model attached from a shared-memory segment. Get one from :func:`modelload.loader.attach`.

    >>> model = attach()                                    # doctest: +SKIP
    >>> model.names[:2]                                     # doctest: +SKIP
    ('model.embed_tokens.weight', 'model.layers.0.input_layernorm.weight')
    >>> model.numpy("lm_head.weight").shape                 # doctest: +SKIP
    (32000, 2048)
    >>> with torch.device("meta"):                          # doctest: +SKIP
    ...     net = MyModel(config)
    >>> model.load_into_module(net, device="cuda")          # doctest: +SKIP
    """

    def __init__(
        self,
        reader: SegmentReader,
        subscriber: Subscriber | None,
        *,
        timeout: float | None,
        registration: Registration | None = None,
    ) -> None:
        self._reader = reader
        self._subscriber = subscriber
        self._registration = registration
        self._views_of_data: torch_api.Views | None = None
        self.timeout = timeout
        """Default seconds to wait for tensors (None waits as long as the writer lives)."""

    # --- what is in it --------------------------------------------------------------------------------------

    @property
    def names(self) -> tuple[str, ...]:
        """Every tensor's name, in the segment's order (the file's order)."""
        return tuple(s.name for s in self._reader.slots)

    @property
    def metadata(self) -> Mapping[str, str]:
        """What the writer recorded: ``format``, ``source`` (without credentials), ``source_etag``, ..."""
        return self._reader.metadata

    @property
    def path(self) -> str:
        return str(self._reader.path)

    @property
    def model_dir(self) -> Path | None:
        """The model directory beside the segment (config, generation config, tokenizer: every small file of
        the model), as the writer recorded it; None for a segment loaded from a single weight file.

        Engines take it as their model path: ``AutoConfig.from_pretrained(model.model_dir)``.
        """
        recorded = self._reader.metadata.get(MODEL_DIR_KEY)
        return Path(recorded) if recorded else None

    @property
    def nbytes(self) -> int:
        return int(self._reader.nbytes.sum())

    def progress(self) -> Progress:
        return Progress(self._reader)

    @property
    def complete(self) -> bool:
        return self._reader.writer_state == WriterState.COMPLETE

    def __len__(self) -> int:
        return len(self._reader.slots)

    def __contains__(self, name: object) -> bool:
        return name in self._reader.by_name

    def __iter__(self) -> Iterator[str]:
        return iter(self.names)

    def __getitem__(self, name: str) -> npt.NDArray[Any]:
        return self.numpy(name)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._slot(name).shape

    def dtype(self, name: str) -> str:
        """The tensor's canonical dtype name (torch's, without ``torch.``)."""
        return self._slot(name).dtype.name

    # --- waiting --------------------------------------------------------------------------------------------

    def is_ready(self, name: str) -> bool:
        return self._reader.is_ready(self._slot(name).index)

    def wait(
        self,
        names: Iterable[str] | None = None,
        *,
        prefix: str | None = None,
        timeout: float | _Default | None = DEFAULT,
    ) -> None:
        """Block until the named tensors (those starting with ``prefix``; all when neither) are ready.

        Raises :class:`~modelload.loader.errors.LoadTimeoutError` or
        :class:`~modelload.loader.errors.LoadFailedError` (with the sidecar's reason).
        """
        self._reader.wait(self._indices(names, prefix), timeout=self._timeout(timeout), waiter=self._waiter)

    def iter_ready(
        self,
        names: Iterable[str] | None = None,
        *,
        timeout: float | _Default | None = DEFAULT,
    ) -> Iterator[str]:
        """Yield tensor names in the order they become ready (those ready already first, in segment order).

        ``timeout`` bounds the whole iteration.
        """
        slots = self._reader.slots
        for batch in self._ready_batches(self._indices(names, None), timeout):
            for index in batch.tolist():
                yield slots[index].name

    def _ready_batches(
        self, indices: list[int], timeout: float | _Default | None
    ) -> Iterator[npt.NDArray[np.intp]]:
        """``indices`` in batches as they become ready (each in segment order); ``timeout`` bounds all."""
        pending = np.asarray(indices, dtype=np.intp)
        limit = self._timeout(timeout)
        deadline = None if limit is None else time.monotonic() + limit
        while len(pending):
            remaining = None if deadline is None else max(deadline - time.monotonic(), 0.0)
            ready, pending = self._reader.wait_split(pending, timeout=remaining, waiter=self._waiter)
            yield ready

    # --- consumption (memory modes release and ring) -----------------------------------------------------

    @property
    def memory_mode(self) -> str:
        """``full``, ``release`` or ``ring``: what the sidecar does with tensors every consumer has copied."""
        return self._reader.memory_mode.name.lower()

    def consumed(self, names: Iterable[str] | str) -> None:
        """Tell the sidecar this process is done with tensors ``names``: it has copied them and holds no view.

        In memory modes release and ring the sidecar gives a tensor's pages back once every registered
        consumer has consumed it; views of it must not be used afterwards. ``state_dict(device="cuda")`` and
        ``load_into_module(..., device="cuda")`` call this for you as each copy completes; call it yourself
        when you copy tensors another way. In memory mode full it does nothing. A process that did not
        register (``attach(register=False)``) records nothing, but still learns whether its copy was whole.

        >>> for name in model.iter_ready():                     # doctest: +SKIP
        ...     weights[name] = model.tensor(name).to("cuda")
        ...     model.consumed(name)

        Raises :class:`~modelload.loader.errors.TensorReleasedError` when a tensor was released before this
        process consumed it (it did not register, or its registration expired): its copy may be torn.
        """
        if isinstance(names, str):
            names = [names]
        indices = [self._slot(name).index for name in names]
        registration = self._registration
        for index in self._reader.released_among(indices):
            # Released before this call: only this process's own earlier mark may vouch for a whole copy
            # (its memory of it, never the consumer table, which any container can write).
            if not (registration is not None and registration.vouched(index)):
                raise self._reader.released(index)
        if registration is not None:
            registration.mark(indices)

    # --- tensors --------------------------------------------------------------------------------------------

    def numpy(self, name: str, *, wait: bool = True) -> npt.NDArray[Any]:
        """Tensor ``name`` as a numpy array over the segment.

        Types numpy lacks (bfloat16, float8, ...) come as unsigned integers of the same width.
        """
        slot = self._ready_slot(name, wait)
        return np.frombuffer(self._reader.view(slot.index), dtype=slot.dtype.numpy).reshape(slot.shape)

    def tensor(self, name: str, *, wait: bool = True) -> torch.Tensor:
        """Tensor ``name`` as a torch tensor over the segment, with its real dtype (bfloat16, float8, ...)."""
        slot = self._ready_slot(name, wait)
        views = self._tensor_views()
        with views.quiet():
            return views(self._reader.start(slot), slot.dtype, slot.shape, slot.nbytes)

    def state_dict(
        self,
        *,
        device: str | torch.device | None = None,
        names: Iterable[str] | None = None,
        timeout: float | _Default | None = DEFAULT,
    ) -> dict[str, torch.Tensor]:
        """Every tensor (or ``names``) as torch tensors, waiting for each as needed.

        With no ``device`` (or ``"cpu"``) the tensors are zero-copy views of the segment. With a CUDA
        device, each tensor is copied as soon as it is ready, through pinned memory, so the copies overlap
        the rest of the load, and marked consumed once copied (see :meth:`consumed`); in memory mode full,
        small neighbours are copied together in runs (a run waits for the tensor after it), each into
        device memory of its own.

        The whole model (no ``names``) is returned only once the load is finished (:meth:`wait_complete`):
        tensors are published as they land, before their file's end-of-load proof, and a load refused then
        raises :class:`~modelload.loader.errors.LoadFailedError` here rather than leave the app running on
        those weights. ``timeout`` bounds the wait for the tensors and, again, the wait for that end.
        """
        wanted = list(self.names if names is None else [names] if isinstance(names, str) else names)
        indices = self._indices(wanted, None)
        if device is None or _is_cpu(device):
            self._check_ring_holds(indices)
            result = dict(self._views(self._ready_batches(indices, timeout)))
        else:
            on_done = self.consumed if self._registration is not None else None
            region = self._pinnable(wanted)
            result = dict(
                gpu_copy.copy_all(
                    self._views(self._ready_batches(indices, timeout)),
                    device,
                    on_done=on_done,
                    region=region,
                    pin_in_place=self._pins_in_place(),
                    data=self._runs_over(),
                )
            )
            if on_done is None and self._reader.memory_mode != MemoryMode.FULL:
                # Not a consumer: nothing waited for these copies, so check now that none was torn by a
                # release under it (SPEC.md, consumer table rule 5); consumed() only checks here.
                self.consumed(wanted)
        if names is None:
            self.wait_complete(timeout=timeout)
        return {name: result[name] for name in wanted}

    def wait_complete(self, *, timeout: float | _Default | None = DEFAULT) -> None:
        """Block until the sidecar has finished the load: every tensor landed and every weight file proven
        (its store's checksum, the digest its origin publishes, or the end-of-load samples; see the
        sidecar's docs). Returns at once on a finished segment. Raises
        :class:`~modelload.loader.errors.LoadFailedError` with the sidecar's reason when the load failed
        (a file that did not match its proof included), or
        :class:`~modelload.loader.errors.LoadTimeoutError`.

        :meth:`state_dict` of the whole model, :meth:`load_into_module` and the transformers and vLLM
        integrations call it before they return; an app that streams tensors one by one (:meth:`iter_ready`,
        :meth:`tensor`) calls it before it serves.
        """
        self._reader.wait_finished(timeout=self._timeout(timeout), waiter=self._waiter)

    def _views(self, batches: Iterable[npt.NDArray[np.intp]]) -> Iterator[tuple[str, torch.Tensor]]:
        """``(name, zero-copy torch tensor)`` of each index in ``batches`` (indices known READY)."""
        reader = self._reader
        slots = reader.slots
        views = self._tensor_views()
        for batch in batches:  # the collector paused per batch, never across a wait for the next one
            with views.quiet(), paused_collector():
                made = [
                    (slot.name, views(reader.start(slot), slot.dtype, slot.shape, slot.nbytes))
                    for slot in map(slots.__getitem__, batch.tolist())
                ]
            yield from made

    def _runs_over(self) -> torch.Tensor | None:
        """The data mapping as flat bytes, over which small neighbouring tensors are copied to a device in
        runs (:func:`~modelload.loader._api.gpu_copy.runs`): in memory mode full, where no landing waits for
        a copy; elsewhere (a release or a ring gives pages back as each tensor is consumed) None."""
        data = self._reader.data()
        if self._reader.memory_mode != MemoryMode.FULL or not len(data):
            return None
        return torch_api.as_tensor(data, by_name("uint8"), (len(data),))

    def _pins_in_place(self) -> bool:
        """Whether a copy to a GPU pins the segment's own pages, or goes through pinned staging buffers.

        Pinning costs per page: on an H100, pinning a 4.26 GiB model's 4 KiB pages took 2.37 s, where the
        copy itself took 0.085 s, and copying the same model through two 64 MiB staging buffers ran at
        19.8 GiB/s (docs/gpu.md). So pages are pinned in place where they are few (a segment on huge pages:
        512 times fewer) or pinned once and reused (a ring, lap after lap); a model on 4 KiB pages in memory
        mode full or release is copied through the staging buffers.
        """
        return self._reader.volume.huge or self._reader.memory_mode == MemoryMode.RING

    def _pinnable(self, wanted: list[str]) -> gpu_copy.Region | None:
        """What a copy of tensors ``wanted`` to a GPU may pin once rather than tensor by tensor (pinning costs
        per page, and a copy must read from inside one registration):

        - a segment on hugetlbfs, whole, in every memory mode: its pages are allocated before the first
          tensor lands and mapped shared, so pinning pages whose tensors still land is harmless, and whole
          huge pages are 512 times fewer to pin. In memory mode release the pages of tensors released during
          the copy go back to the pool when the copy ends rather than one by one (the volume holds the whole
          model there anyway);
        - elsewhere a ring (its pages are reused lap after lap and stay while the load runs), or a complete
          full-mode segment's data when the copy takes at least half of it. Not in memory mode release,
          where a pinned page could not go back to the volume when its tensor is released, nor while a
          full-mode load still lands: each tensor is pinned once it is ready.
        """
        reader = self._reader
        data = reader.data()
        mode = reader.memory_mode
        if not len(data):
            return None
        if not reader.volume.mapping_only:
            if mode == MemoryMode.RELEASE:
                return None
            if mode == MemoryMode.FULL and (
                reader.writer_state != WriterState.COMPLETE
                or 2 * sum(self._slot(name).nbytes for name in wanted) < len(data)
            ):
                return None
        ring = reader.header.ring_size if mode == MemoryMode.RING else 0
        return gpu_copy.Region(torch_api.as_tensor(data, by_name("uint8"), (len(data),)), ring)

    def load_into_module(
        self,
        module: torch.nn.Module,
        *,
        device: str | torch.device | None = None,
        dtype: torch.dtype | None = None,
        strict: bool = True,
        leftover: modules.Leftover = "raise",
        timeout: float | _Default | None = DEFAULT,
    ) -> Any:
        """Put the segment's tensors into ``module``'s parameters and buffers, by name.

        The module may live on the ``meta`` device: its tensors are replaced, not copied into (so a model is
        built without allocating its weights twice; on the CPU they are views of the segment). Tied
        parameters stay tied, filled from whichever of their names the model holds. Non-persistent buffers
        the model holds (tensorizer's ``write_module`` stores them) are assigned too. Names written by
        tensorizer for the root module (``".weight"``) match ``"weight"``.

        Each tensor keeps the model's dtype (not the module's); ``dtype`` casts the floating-point ones
        (integer buffers such as position ids are never cast).

        Anything that would stay on ``meta`` (a buffer computed in ``__init__``, a weight the model lacks
        with ``strict=False``) raises :class:`~modelload.loader.errors.LeftOnMetaError` naming it, unless
        ``leftover`` is ``"keep"`` or a function ``fn(name, meta_tensor) -> tensor`` that re-creates each.
        With ``strict``, names that differ raise :class:`~modelload.loader.errors.ModuleMismatchError`
        (shapes always do). Every refusal comes before anything is assigned. Returns torch's
        ``(missing_keys, unexpected_keys)``. In memory modes release and ring, a registered consumer marks
        the unexpected tensors consumed (it will not copy them), so the sidecar does not keep them for it.
        """
        import torch

        if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
            raise ModuleLoadError(
                f"dtype={dtype!r}: a cast is to a floating-point torch dtype, such as torch.bfloat16"
            )
        shapes = {name: self._slot(name).shape for name in self.names}
        plan = modules.plan(module, shapes, strict=strict, leftover=leftover)
        names = list(plan.sources)
        seconds = [second for _, second in plan.twins]
        streamed = self._reader.memory_mode != MemoryMode.FULL and not (device is None or _is_cpu(device))
        if plan.twins and not streamed:
            self.wait([name for pair in plan.twins for name in pair], timeout=timeout)
            modules.check_twins(plan, lambda name: self.tensor(name, wait=False))
        elif plan.twins:
            # Memory modes release and ring: the sidecar may need the first twin's bytes back before the
            # second lands (a ring smaller than the span between them), so waiting for both before copying
            # anything would never end. Copy the second twins too (and so consume them), compare the copies.
            names += [name for name in seconds if name not in plan.sources]
        if plan.unexpected and self._registration is not None:
            # Tensors the module does not take (strict=False) are never copied: consume them now, or the
            # sidecar would keep them, and a ring would wait for their bytes, as long as this process lives.
            self._registration.mark([self._slot(name).index for name in plan.unexpected], copied=False)
        tensors = self.state_dict(device=device, names=names, timeout=timeout)
        if plan.twins and streamed:
            modules.check_twins(plan, tensors.__getitem__)
            for name in seconds:
                if name not in plan.sources:
                    tensors.pop(name, None)
        self.wait_complete(timeout=timeout)  # nothing is assigned from a load that is then refused
        if dtype is not None:
            tensors = {n: t.to(dtype) if t.is_floating_point() else t for n, t in tensors.items()}
        return modules.assign(module, plan, tensors, leftover=leftover)

    # --- internals --------------------------------------------------------------------------------------

    def _check_ring_holds(self, indices: list[int]) -> None:
        """Refuse, before waiting, to hold tensors on the CPU that a ring cannot hold at once: the sidecar
        reuses the ring's room only as consumers copy tensors out, so views of more than the ring would
        wait for room this very call holds, without end (or until a timeout that would not say why)."""
        reader = self._reader
        if reader.memory_mode != MemoryMode.RING:
            return
        wanted = int(reader.nbytes[np.asarray(indices, dtype=np.intp)].sum()) if indices else 0
        ring = reader.header.ring_size
        if wanted > ring:
            raise ConfigError(
                f"{self.path} is a ring of {ring} bytes (memory mode ring) and these tensors take {wanted}: "
                "holding them all on the CPU would wait for room only their consumers free. Copy them to a "
                "device (state_dict(device='cuda')), take them one by one with iter_ready() and consumed(), "
                "or run the sidecar in memory mode full (ModelLoad spec.memory.mode: full)"
            )

    def _slot(self, name: str) -> Slot:
        try:
            return self._reader.slots[self._reader.by_name[name]]
        except KeyError:
            raise KeyError(f"no tensor named {name!r} in {self.path}") from None

    def _tensor_views(self) -> torch_api.Views:
        if self._views_of_data is None:
            self._views_of_data = torch_api.Views(self._reader.shared_data())
        return self._views_of_data

    def _ready_slot(self, name: str, wait: bool) -> Slot:
        slot = self._slot(name)
        if wait:
            self._reader.wait([slot.index], timeout=self.timeout, waiter=self._waiter)
        elif not self._reader.is_ready(slot.index):
            self._reader.check()
            if self._reader.state(slot.index) == TensorState.RELEASED:
                raise self._reader.released(slot.index)
            raise LoadTimeoutError(f"tensor {name!r} is not ready yet", pending=(name,))
        else:
            self._reader.check_handout()  # (waiting checks it as it finds the tensor ready)
        return slot

    def _indices(self, names: Iterable[str] | None, prefix: str | None) -> list[int]:
        slots = self._reader.slots
        if isinstance(names, str):
            names = [names]
        chosen = list(range(len(slots))) if names is None else [self._slot(n).index for n in names]
        if prefix is not None:
            chosen = [i for i in chosen if slots[i].name.startswith(prefix)]
            if not chosen:
                raise KeyError(f"no tensor name starts with {prefix!r} in {self.path}")
        return chosen

    def _timeout(self, timeout: float | _Default | None) -> float | None:
        return self.timeout if isinstance(timeout, _Default) else timeout

    @property
    def _waiter(self) -> Any:
        return self._subscriber.wait if self._subscriber is not None else None

    # --- closing ----------------------------------------------------------------------------------------

    def close(self) -> None:
        """Detach. Tensors already handed out stay valid (in memory modes release and ring, until they are
        consumed); they keep their part of the mapping alive. A registered consumer leaves the table. Any
        use of the model afterwards raises :class:`~modelload.loader.errors.ModelClosedError`; closing
        again does nothing."""
        if isinstance(self._reader, _Closed):
            return
        if self._registration is not None:
            self._registration.leave()
            self._registration = None
        if self._subscriber is not None:
            self._subscriber.close()
            self._subscriber = None
        self._views_of_data = None
        self._reader.close()
        self._reader = cast(SegmentReader, _Closed(self._reader.path))

    def __enter__(self) -> Model:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        if isinstance(self._reader, _Closed):
            return f"<Model {self.path}: closed>"
        progress = self.progress()
        return f"<Model {self.path}: {len(self)} tensors, {progress.tensors_ready} ready, {progress.state}>"


class _Closed:
    """What a closed :class:`Model` reads through: every attribute but the path is an error saying so (the
    reader's mappings are gone: an IndexError, or mmap's "closed", from deep inside said nothing)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __getattr__(self, name: str) -> Any:
        raise ModelClosedError(f"the model of {self.path} was closed; attach() again to read it")


def _is_cpu(device: Any) -> bool:
    return str(device).split(":")[0] == "cpu"
