"""The operator process: kopf's handlers and the pod webhook's HTTPS server in one event loop.

Start-up, in order:

1. connect to the API server (the pod's service account, or ``$KUBECONFIG``);
2. decide the sidecar mode: ``native`` (an init container with ``restartPolicy: Always``) when the setting
   says so, or in ``auto`` mode when the API server reports 1.29 or later (SidecarContainers is beta and on
   by default from 1.29, GA in 1.33); ``regular`` otherwise, and when the version cannot be read;
3. TLS: read or create the CA and certificate and patch the CA into the webhook configuration, then keep
   both renewed while running (self-signed), or load cert-manager's files and watch them for renewals;
4. serve the webhook, then run kopf until SIGTERM/SIGINT (or ``stop``).

The webhook reports ready (``/readyz``) once kopf's own start-up is done, so the Service sends admissions
only to replicas that can also see ModelLoads.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Collection, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from modelload.operator.kube import Kube, KubeError, KubeNotFoundError, load_configuration
from modelload.operator.metrics import serve as serve_metrics
from modelload.operator.settings import OperatorSettings
from modelload.operator.tls import (
    TlsFiles,
    ensure_self_signed,
    keep_renewed,
    patch_ca_bundle,
    server_context,
    watch_and_reload,
)
from modelload.operator.webhook import PodWebhook, kube_lookup, serve

__all__ = ["NATIVE_SIDECARS_SINCE", "RunningOperator", "native_sidecars", "run", "running"]

logger = logging.getLogger(__name__)

NATIVE_SIDECARS_SINCE = (1, 29)


VERSION_ATTEMPTS = 5


async def native_sidecars(kube: Kube, mode: str, *, first_delay: float = 1.0) -> bool:
    """Whether to inject a native sidecar, per the setting or the API server's version. The version is
    asked :data:`VERSION_ATTEMPTS` times (waiting ``first_delay`` seconds, doubling, between them) before
    falling back to regular containers: the answer holds for the process's life, and one failed call at
    start-up (an API server restarting) would otherwise give every pod a regular sidecar until the next
    restart, and refuse every Job's pod."""
    if mode != "auto":
        return mode == "native"
    for attempt in range(VERSION_ATTEMPTS):
        try:
            version = await kube.server_version()
            break
        except KubeError as exc:
            if attempt + 1 == VERSION_ATTEMPTS:
                logger.warning("cannot read the API server's version (%s): injecting regular containers", exc)
                return False
            logger.info("cannot read the API server's version yet (%s): asking again", exc)
            await asyncio.sleep(first_delay * 2**attempt)
    native = version >= NATIVE_SIDECARS_SINCE
    logger.info(
        "API server %d.%d: injecting %s",
        *version,
        "native sidecars" if native else "regular sidecar containers",
    )
    return native


@dataclass
class RunningOperator:
    webhook_port: int
    ca_pem: bytes | None
    native: bool
    task: asyncio.Task[None]
    stop: asyncio.Event

    async def wait(self) -> None:
        await self.task


async def _tls(kube: Kube, settings: OperatorSettings) -> tuple[Any, TlsFiles, bytes | None]:
    webhook = settings.webhook
    if webhook.tls == "files":
        files = TlsFiles(cert=webhook.cert_dir / "tls.crt", key=webhook.cert_dir / "tls.key")
        ca_file = webhook.cert_dir / "ca.crt"
        return server_context(files), files, (ca_file.read_bytes() if ca_file.is_file() else None)
    bundle, files = await ensure_self_signed(kube, namespace=settings.namespace, webhook=webhook)
    try:
        await patch_ca_bundle(
            kube,
            configuration=webhook.configuration,
            namespace=settings.namespace,
            service=webhook.service,
            ca_pem=bundle.trust_pem(),
        )
    except KubeNotFoundError:
        logger.warning(
            "MutatingWebhookConfiguration %r not found: install the chart, or set --webhook-configuration",
            webhook.configuration,
        )
    return server_context(files), files, bundle.ca_pem


@contextlib.asynccontextmanager
async def running(
    settings: OperatorSettings,
    *,
    configuration: Any = None,
    login: Any = None,
    liveness: bool = True,
) -> AsyncIterator[RunningOperator]:
    """Run the operator for the duration of the block.

    Tests pass an emulated API server's client ``configuration`` and kopf ``login`` handler.
    """
    from modelload.operator.handlers import build_registry

    kube = Kube(configuration if configuration is not None else load_configuration())
    stop = asyncio.Event()
    ready = asyncio.Event()
    exposure = contextlib.ExitStack()  # the metrics server, when one is asked for
    try:
        native = await native_sidecars(kube, settings.sidecar.mode)
        context, files, ca_pem = await _tls(kube, settings)
        if settings.webhook.tls == "files":
            renewal = watch_and_reload(context, files)
        else:
            renewal = keep_renewed(
                kube, namespace=settings.namespace, webhook=settings.webhook, context=context, files=files
            )
        reloader = asyncio.create_task(renewal, name="modelload-tls-renewal")
        if settings.metrics_port:
            exposure.enter_context(serve_metrics(port=settings.metrics_port))
        webhook = PodWebhook(lookup=kube_lookup(kube), sidecar=settings.sidecar, native=native)
        registry = build_registry(settings=settings, kube=kube, login=login)
        hook = settings.webhook
        async with serve(
            webhook, host=hook.host, port=hook.port, path=hook.path, ssl_context=context, ready=ready.is_set
        ) as port:
            task = asyncio.create_task(
                _kopf(
                    registry=registry,
                    standalone=True,
                    clusterwide=not settings.watch_namespaces,
                    namespaces=settings.watch_namespaces,
                    stop_flag=stop,
                    ready_flag=ready,
                    liveness_endpoint=f"http://0.0.0.0:{settings.liveness_port}/healthz"
                    if liveness
                    else None,
                ),
                name="modelload-kopf",
            )
            await _started(task, ready)
            try:
                yield RunningOperator(webhook_port=port, ca_pem=ca_pem, native=native, task=task, stop=stop)
            finally:
                stop.set()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
                reloader.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await reloader
    finally:
        exposure.close()
        await kube.close()


class _ForeignTasks(Collection["asyncio.Task[Any]"]):
    """The tasks kopf must leave alone: those whose coroutine is not kopf's own code."""

    def __init__(self, kopf_dir: str) -> None:
        self._kopf_dir = kopf_dir

    def __contains__(self, item: object) -> bool:
        if isinstance(item, asyncio.Task) and item.get_name() == "stop-flag waiter":
            return True  # it waits on the caller's stop flag, which the caller sets once kopf has returned
        coro = item.get_coro() if isinstance(item, asyncio.Task) else None
        code = getattr(coro, "cr_code", None)
        return not (code is not None and code.co_filename.startswith(self._kopf_dir))

    def __iter__(self) -> Iterator[asyncio.Task[Any]]:
        return iter(())

    def __len__(self) -> int:
        return 0


async def _kopf(**options: Any) -> None:
    """``kopf.operator`` with its hung-task sweep limited to kopf's own tasks.

    kopf assumes that every task created after it started is its own, and at exit waits five seconds for
    them, then cancels them. Here the loop is shared (the webhook's connections, an embedding test), so the
    sweep only touches tasks running kopf's code; the others are left to their owners.
    """
    import kopf

    kopf_dir = str(Path(kopf.__file__).parent)
    tasks = await kopf.spawn_tasks(**options)
    await kopf.run_tasks(tasks, ignored=_ForeignTasks(kopf_dir))


async def _started(task: asyncio.Task[None], ready: asyncio.Event) -> None:
    """Wait until kopf has started (indices filled, watches open), or raise why it could not."""
    waiter = asyncio.create_task(ready.wait())
    done, _ = await asyncio.wait({task, waiter}, return_when=asyncio.FIRST_COMPLETED)
    if task in done:
        waiter.cancel()
        task.result()  # raises kopf's start-up error
        raise RuntimeError("kopf stopped during start-up")


async def run(settings: OperatorSettings) -> None:
    """Run until kopf stops (SIGTERM/SIGINT)."""
    async with running(settings) as operator:
        await operator.wait()
