"""``modelload operator``: run the operator (kopf handlers and the pod webhook) in the foreground.

Registered through the ``modelload.commands`` entry point. Every flag also reads a ``MODELLOAD_OPERATOR_*``
variable (the chart sets those); a flag wins. kopf, aiohttp and the Kubernetes client are imported only
when the command runs, so ``modelload --help`` stays fast and works without the operator extra.
"""

from __future__ import annotations

import argparse
import logging
import os

from modelload.loader._logjson import use_log_format
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
    import asyncio

    from modelload.operator.app import run

    settings = from_args(args, os.environ)
    logging.getLogger().setLevel(settings.log_level)
    use_log_format(settings.log_format)
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)
    asyncio.run(run(settings))
    return 0
