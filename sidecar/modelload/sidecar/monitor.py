"""``modelload monitor``: watch a sidecar's load from a shell, as a progress bar or as JSON lines.

It polls the sidecar's ``GET /status`` (``--url``, default ``MODELLOAD_STATUS_URL`` as the operator sets it
in the app's containers, else ``http://127.0.0.1:8479``) and draws one line: phase, bar, bytes, throughput,
ETA, tensors, retries. On a terminal the line is redrawn in place; in a log (``kubectl exec ... monitor``
piped, CI) a line is printed at most every few seconds. It ends when the load ends.

Exit status, for scripts (``modelload monitor && start-server``)::

    0  the load is complete
    1  the load failed or was stopped (the reason is printed)
    2  a bad flag
    3  the sidecar cannot be reached, or what answered is not a modelload sidecar
    4  with --once: the load is still running

Only the standard library talks HTTP here (``urllib.request``): the monitor runs in app images that
install the loader alone.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import urllib.error
import urllib.request
from typing import Any, TextIO

from modelload.loader.errors import SidecarUnavailableError
from modelload.loader.sizes import format_bytes
from modelload.loader.wiring import STATUS_URL, STATUS_URL_ENV

__all__ = ["EXIT_FAILED", "EXIT_LOADING", "EXIT_UNREACHABLE", "fetch_status", "register", "render", "watch"]

EXIT_FAILED = 1
EXIT_UNREACHABLE = 3
EXIT_LOADING = 4
LOG_INTERVAL = 5.0
"""Seconds between lines when the output is not a terminal."""


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``modelload monitor`` to the main CLI (through the ``modelload.commands`` entry point)."""
    parser = subparsers.add_parser(
        "monitor",
        help="watch a sidecar's load: progress bar, throughput, ETA",
        description=(
            "Poll a modelload sidecar's /status and draw its load until it ends. It reads the sidecar's "
            "HTTP API, not a segment file: `modelload inspect SEGMENT` shows a segment's state."
        ),
        epilog="exit status: 0 complete, 1 failed or stopped, 3 unreachable, 4 still loading (--once)",
    )
    parser.add_argument(
        "--url",
        default=None,
        help=f"the sidecar's status API (default ${STATUS_URL_ENV}, else {STATUS_URL})",
    )
    parser.add_argument("--interval", type=float, default=1.0, metavar="S", help="seconds between polls (1)")
    parser.add_argument(
        "--timeout",
        type=float,
        default=10.0,
        metavar="S",
        help="give up when the sidecar has not answered for S seconds (10)",
    )
    parser.add_argument("--once", action="store_true", help="print the status once and exit")
    parser.add_argument("--json", action="store_true", help="print each status as one JSON line")
    parser.set_defaults(func=_command)


def _command(args: argparse.Namespace) -> int:
    url = args.url or os.environ.get(STATUS_URL_ENV) or STATUS_URL
    if args.interval <= 0 or args.timeout <= 0:
        print("modelload monitor: --interval and --timeout must be positive", file=sys.stderr)
        return 2
    return watch(url, interval=args.interval, timeout=args.timeout, once=args.once, as_json=args.json)


# --- polling -----------------------------------------------------------------------------------------------


def fetch_status(url: str, *, timeout: float = 5.0) -> dict[str, Any]:
    """``GET {url}/status`` as a dict; SidecarUnavailableError saying what went wrong and what to check."""
    target = url.rstrip("/") + "/status"
    if not target.startswith(("http://", "https://")):
        raise SidecarUnavailableError(f"{url!r} is not an http:// URL: pass --url http://HOST:PORT")
    try:
        with urllib.request.urlopen(target, timeout=timeout) as response:  # noqa: S310 - checked above
            body = response.read(1 << 20)
    except urllib.error.HTTPError as exc:
        raise SidecarUnavailableError(
            f"{target} answered HTTP {exc.code}: is --url the sidecar's status API?"
        ) from None
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        raise SidecarUnavailableError(
            f"cannot reach the sidecar at {url} ({reason}): is it running, and are --url or ${STATUS_URL_ENV}"
            " right?"
        ) from None
    try:
        document = json.loads(body)
    except ValueError:
        document = None
    if not isinstance(document, dict) or not isinstance(document.get("phase", document.get("state")), str):
        raise SidecarUnavailableError(f"{target} did not answer with a modelload status: is --url right?")
    return document


def watch(
    url: str,
    *,
    interval: float = 1.0,
    timeout: float = 10.0,
    once: bool = False,
    as_json: bool = False,
    out: TextIO | None = None,
) -> int:
    """Poll until the load ends (or once); returns the exit status listed in the module docstring."""
    stream = out or sys.stdout
    tty = stream.isatty() and not as_json
    last_answer = time.monotonic()
    last_line = float("-inf")
    while True:
        try:
            status = fetch_status(url, timeout=min(timeout, 5.0))
        except SidecarUnavailableError as exc:
            if once or time.monotonic() - last_answer >= timeout:
                if tty:
                    stream.write("\n")
                print(f"modelload monitor: {exc}", file=sys.stderr)
                return EXIT_UNREACHABLE
            time.sleep(interval)
            continue
        last_answer = time.monotonic()
        phase = _phase(status)
        final = phase in ("complete", "failed", "stopped") or once
        if as_json:
            stream.write(json.dumps(status, sort_keys=True) + "\n")
        elif tty:
            stream.write("\r\x1b[2K" + render(status) + ("\n" if final else ""))
        elif final or last_answer - last_line >= LOG_INTERVAL:
            last_line = last_answer
            stream.write(render(status) + "\n")
        stream.flush()
        if phase == "complete":
            return 0
        if phase in ("failed", "stopped"):
            if not as_json:
                print(f"modelload monitor: the load {phase}: {status.get('error')}", file=sys.stderr)
            return EXIT_FAILED
        if once:
            return EXIT_LOADING
        time.sleep(interval)


# --- drawing -----------------------------------------------------------------------------------------------


def _phase(status: dict[str, Any]) -> str:
    return str(status.get("phase") or status.get("state"))


def _number(status: dict[str, Any], key: str) -> float:
    value = status.get(key)
    return float(value) if isinstance(value, int | float) else 0.0


def render(status: dict[str, Any], *, width: int = 24) -> str:
    """One line for a ``/status`` document.

    >>> render({"phase": "loading", "bytes_total": 4096, "bytes_done": 1024, "throughput_bytes_per_s": 512,
    ...         "eta_s": 6, "tensors_total": 4, "tensors_ready": 1, "retries": 0})
    'loading  [######..................]  25.0% 1.0 KiB/4.0 KiB 512 B/s ETA 6 s, 1/4 tensors, 0 retries'
    """
    phase = _phase(status)
    done, total = _number(status, "bytes_done"), _number(status, "bytes_total")
    rate = _number(status, "throughput_bytes_per_s")
    tensors = f"{int(_number(status, 'tensors_ready'))}/{int(_number(status, 'tensors_total'))} tensors"
    retries = f"{int(_number(status, 'retries'))} retries"
    if phase == "complete":
        elapsed = _number(status, "elapsed_s")
        speed = f"{format_bytes(rate)}/s"
        return f"complete: {format_bytes(total)} in {elapsed:.1f} s ({speed}), {tensors}, {retries}"
    if phase in ("failed", "stopped"):
        return f"{phase}: {status.get('error')} ({format_bytes(done)}/{format_bytes(total)}, {tensors})"
    if phase == "retrying":
        upcoming = status.get("next_attempt_at")
        wait = f" in {max(upcoming - time.time(), 0):.0f} s" if isinstance(upcoming, int | float) else ""
        attempt = int(_number(status, "attempt") or 1)
        return f"retrying: attempt {attempt} failed ({status.get('error')}); the whole load again{wait}"
    if phase == "starting" or not total:
        errors = status.get("errors")
        kinds = ", ".join(f"{k} {n}" for k, n in errors.items()) if isinstance(errors, dict) else ""
        retried = f", {retries}{f' ({kinds})' if kinds else ''}" if _number(status, "retries") else ""
        return f"{phase}: waiting for the model's index{retried}"
    share = min(done / total, 1.0)
    filled = int(width * share)
    bar = "#" * filled + "." * (width - filled)
    eta = status.get("eta_s")
    eta_text = f"ETA {eta:.0f} s" if isinstance(eta, int | float) else "ETA ?"
    return (
        f"{phase:8} [{bar}] {share:6.1%} {format_bytes(done)}/{format_bytes(total)} "
        f"{format_bytes(rate)}/s {eta_text}, {tensors}, {retries}"
    )
