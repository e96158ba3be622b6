"""``modelload operator``: run the operator (kopf handlers and the pod webhook) in the foreground.

Registered through the ``modelload.commands`` entry point. Every flag also reads a ``MODELLOAD_OPERATOR_*``
variable (the chart sets those); a flag wins. kopf, aiohttp and the Kubernetes client are imported only
when the command runs, so ``modelload --help`` stays fast and works without the operator extra.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from modelload.loader._logjson import use_log_format
from modelload.loader.errors import ModelloadError
from modelload.operator.settings import add_arguments, from_args

__all__ = ["register"]


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "operator",
        help="run the ModelLoad operator and its pod webhook",
        description="Run the ModelLoad operator: resolve ModelLoads, inject the loader sidecar into pods "
        "that ask for a model, and report their loads.",
    )
    add_arguments(parser)
    parser.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    """Run until stopped. Start-up mistakes are one line on stderr and the error's ``exit_status``, not a
    traceback: they are fixed outside the process. A bad flag or variable exits 2 (as the sidecar's do); no
    Kubernetes configuration, an API server out of reach or a refused call, 1."""
    try:
        _serve(args)
    except ModelloadError as exc:
        print(f"modelload operator: {exc}", file=sys.stderr)
        return exc.exit_status
    return 0


def _serve(args: argparse.Namespace) -> None:
    import asyncio

    from kubernetes.config import ConfigException

    from modelload.operator.app import run
    from modelload.operator.kube import KubeError, KubeUnavailableError

    settings = from_args(args, os.environ)
    logging.getLogger().setLevel(settings.log_level)
    use_log_format(settings.log_format)
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)
    try:
        asyncio.run(run(settings))
    except ConfigException as exc:  # nothing says where the API server is: no call can be made (exit 1)
        raise KubeError(
            f"no Kubernetes configuration ({exc}): run in a cluster (the pod's service account), or point"
            " KUBECONFIG (default ~/.kube/config) at a kubeconfig with a current context"
        ) from None
    except KubeUnavailableError as exc:
        raise KubeUnavailableError(
            f"cannot reach the Kubernetes API server ({exc}); check the server address of the current"
            " kubeconfig context and the network, then start again"
        ) from exc
    except KubeError as exc:
        raise KubeError(f"the Kubernetes API refused a start-up call: {exc}") from exc
