"""``modelload sidecar``: the command line of the sidecar, its help, and how its errors end the process.

The command parses the flags and variables into settings (:mod:`modelload.sidecar.settings`), sets up
logging, and hands over to :func:`~modelload.sidecar.process.run_sidecar`, which owns the threads and the
signals (kept apart, as kopf keeps its CLI apart from its reactor). A configuration error, at parsing or
when the process cannot bind its port or notify endpoint, is one line on stderr and the error's
``exit_status`` (2), not a traceback.

Only argparse and the standard library are imported at module level (plus the settings table, which is
stdlib-only): ``modelload --help`` loads every subcommand's ``register``, and FastAPI, uvicorn, pyzmq and
the engine are imported when the command runs.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from modelload.loader.errors import ConfigError
from modelload.sidecar.logs import add_log_format, apply_log_format
from modelload.sidecar.process import run_sidecar
from modelload.sidecar.settings import add_arguments, parse_settings
from modelload.sidecar.sources import check_source_uri, prepare_source

__all__ = ["register"]

DESCRIPTION = """\
Stream a model's weights from S3, Google Cloud Storage, Azure Blob, the Hugging Face Hub, an OCI registry,
HTTP(S) or a file into a shared-memory segment, and serve the load's status until the pod stops.

HTTP endpoints (--host/--port): /healthz (200 while the process runs), /startupz (200 once the manifest is
published: apps can attach), /readyz (200 once every tensor is in, 503 while loading, 500 when the load
failed), /status (JSON progress), /metrics (Prometheus).

The process keeps running after the load, complete or failed: the segment and the API stay up. A failed
load does not exit: liveness stays green while readiness is red (500, with the reason in the body and in
/status), so the pod shows why instead of restarting into the same failure. Every flag has a MODELLOAD_*
variable; a flag given wins over its variable."""

EPILOG = """\
signals: SIGTERM or SIGINT stop the engine (a segment still loading is marked FAILED, never left torn; a
wait before a retry is cut short), then the API; a second signal exits at once.
failures before the manifest: <segment>.failed holds the reason, for apps waiting in attach().
exit status: 0 after a stop if the load had completed, 1 if it had not (failed or still loading), 2 for a
bad flag or variable (a source no backend serves or in a shape its store cannot read, a segment folder that
does not exist, a segment path that is a folder or a file that is no segment), or when the API port or the
notify endpoint cannot be bound (or another sidecar publishes on it)."""


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``modelload sidecar`` to the main CLI (through the ``modelload.commands`` entry point)."""
    parser = subparsers.add_parser(
        "sidecar",
        help="load a model into a shared-memory segment and serve its status",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_arguments(parser)
    add_log_format(parser)
    parser.set_defaults(func=_command)


def _command(args: argparse.Namespace) -> int:
    try:
        settings = parse_settings(args, os.environ)
        # An ftp:// or gs://b source is a bad flag (exit 2), not a load that fails and is served as failed.
        check_source_uri(settings.engine.source)
        # The source's SDK imported now, as the sidecar's own modules are, not inside the load's first step.
        prepare_source(settings.engine.source)
        _configure_logging(settings.log_level, verbose=getattr(args, "verbose", 0))
        apply_log_format(args, os.environ)
        return run_sidecar(settings)
    except ConfigError as exc:
        print(f"modelload sidecar: {exc}", file=sys.stderr)
        return exc.exit_status


_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR}


def _configure_logging(level: str, *, verbose: int) -> None:
    """Let modelload's own records through at ``level`` (or lower with ``-v``), whatever the root's level.

    The main CLI sets the root logger to WARNING unless ``-v`` is given; a sidecar's INFO lines (start,
    manifest, finish) belong in ``kubectl logs`` by default, so the ``modelload`` logger gets its own level.
    """
    wanted = min(_LEVELS[level], logging.WARNING - 10 * min(verbose, 2))
    logging.getLogger("modelload").setLevel(wanted)
    if not logging.getLogger().handlers:
        logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s")
