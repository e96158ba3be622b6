"""A task that goes over kopf's live indices of ModelLoads and pods every few seconds.

The operator asks pods for two things on a timer (peered models' byte figures, :mod:`.fleet`; why a
sidecar is not ready, :mod:`.load_reasons`), each in a task of its own started with the operator (not a
kopf timer: those add a finalizer to every object). This is their common shape: start once, stop with the
operator, and never let one failed round end the task.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterable, Mapping
from typing import Any

__all__ = ["IndexPoller", "Selector", "answering_entry"]

logger = logging.getLogger(__name__)

Selector = tuple[str, str]
"""(namespace, label value): how pods find their ModelLoad."""


def answering_entry(owners: Iterable[Any]) -> Any:
    """Of the ``modelloads_by_label`` entries of one label value, the ModelLoad that answers (the webhook's
    rule, :func:`.resource.answering`: the oldest, its precedence the entry's fifth item); None if none."""
    return min(owners, key=lambda entry: entry[4], default=None)


class IndexPoller:
    """Calls :meth:`poll` every ``interval`` seconds with kopf's ``modelloads_by_label`` and ``pod_loads``
    indices (handed over at start-up: the poller reads them, kopf keeps them current)."""

    task_name = "modelload-poller"
    what = "a poll of the pods"
    """For the log line of a failed round."""

    def __init__(self, *, interval: float) -> None:
        self._interval = interval
        self._task: asyncio.Task[None] | None = None

    def start(self, *, models: Mapping[Selector, Any], pods: Mapping[Selector, Any]) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(models, pods), name=self.task_name)

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _run(self, models: Mapping[Selector, Any], pods: Mapping[Selector, Any]) -> None:
        while True:
            await asyncio.sleep(self._interval)
            try:
                await self.poll(models, pods)
            except Exception:  # a round must never end the task; the next one may work
                logger.exception("%s failed", self.what)

    async def poll(self, models: Mapping[Selector, Any], pods: Mapping[Selector, Any]) -> None:
        raise NotImplementedError
