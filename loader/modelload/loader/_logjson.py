"""One JSON object per log line, for the sidecar's and the operator's ``--log-format json``.

Log pipelines (Loki, Elasticsearch, Cloud Logging) parse a JSON line into fields without a regular
expression per component. The record's message is the same text the human format shows, so nothing that
is kept out of the text logs (credentials, signatures, query strings) can reach the JSON ones.

Fields: ``time`` (RFC 3339, UTC, milliseconds), ``level``, ``logger``, ``message``, and ``exception`` (the
formatted traceback) when the record carries one. Standard library only: the loader stays light.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import Literal

from modelload.loader.errors import ConfigError

__all__ = ["LOG_FORMATS", "JsonFormatter", "LogFormat", "parse_log_format", "use_log_format"]

LogFormat = Literal["text", "json"]
LOG_FORMATS: tuple[LogFormat, ...] = ("text", "json")


def parse_log_format(text: str) -> LogFormat:
    """``text`` or ``json``, in any case: the value of the sidecar's and the operator's ``--log-format``."""
    value = text.strip().lower()
    if value not in LOG_FORMATS:
        raise ConfigError(f"{value!r} is not one of {', '.join(LOG_FORMATS)}")
    return value


class JsonFormatter(logging.Formatter):
    """Formats a record as one line of JSON (see the module docstring for the fields)."""

    def format(self, record: logging.LogRecord) -> str:
        seconds = time.gmtime(record.created)
        millis = int(record.msecs)
        entry: dict[str, object] = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", seconds) + f".{millis:03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, ensure_ascii=False, default=str)


def use_log_format(fmt: LogFormat) -> None:
    """Switch the root logger's handlers to ``fmt`` (adding a stderr handler when there is none).

    ``text`` leaves the handlers as they are; ``json`` gives each a :class:`JsonFormatter`.
    """
    if fmt == "text":
        return
    root = logging.getLogger()
    if not root.handlers:
        root.addHandler(logging.StreamHandler(sys.stderr))
    for handler in root.handlers:
        handler.setFormatter(JsonFormatter())
