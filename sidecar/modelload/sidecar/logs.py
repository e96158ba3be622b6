"""The sidecar's ``--log-format`` (``MODELLOAD_LOG_FORMAT``): text lines, or one JSON object per line.

Kept apart from the sidecar's settings table so the choice is one flag and one call in the CLI; the
formatter is the loader's (:mod:`modelload.loader._logjson`), shared with the operator.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from typing import cast

from modelload.loader._logjson import LOG_FORMATS, LogFormat, use_log_format
from modelload.loader.errors import ConfigError

__all__ = ["ENV", "add_log_format", "apply_log_format"]

ENV = "MODELLOAD_LOG_FORMAT"


def add_log_format(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--log-format",
        dest="log_format",
        default=None,
        metavar="FORMAT",
        help=f"text (default) or json: one JSON object per line, for a log pipeline [{ENV}]",
    )


def log_format(args: argparse.Namespace, environ: Mapping[str, str]) -> LogFormat:
    """The flag, else the variable, else ``text``; :class:`ConfigError` for anything else."""
    value = getattr(args, "log_format", None)
    where = "--log-format"
    if value is None:
        value, where = environ.get(ENV) or "text", ENV
    value = value.strip().lower()
    if value not in LOG_FORMATS:
        raise ConfigError(f"{where}: {value!r} is not one of {', '.join(LOG_FORMATS)}")
    return cast("LogFormat", value)


def apply_log_format(args: argparse.Namespace, environ: Mapping[str, str]) -> None:
    """Call after the sidecar's logging is configured: switch its handlers to the chosen format."""
    use_log_format(log_format(args, environ))
