"""The ``modelload`` command: one entry point, subcommands registered by each part of the distribution.

Each part (loader, sidecar, operator) lists its subcommands in the ``modelload.commands`` entry-point group,
as ``name = "module:register"``. The loader's CLI never imports the sidecar or the operator: it loads each
entry point, and a part whose extra is not installed still shows its command, which then says which extra
to install. ``register(subparsers)`` adds a parser whose ``func(args)`` runs the command and returns an exit
status; heavy imports belong inside ``func``.
"""

from __future__ import annotations

import argparse
import difflib
import logging
import sys
from collections.abc import Sequence
from importlib.metadata import PackageNotFoundError, entry_points, version

from modelload.loader.errors import ModelloadError

__all__ = ["build_parser", "main"]

_EXTRAS = {"sidecar": "sidecar", "monitor": "sidecar", "push": "sidecar", "operator": "operator"}


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The parser with every subcommand, or with ``only`` that one (importing one part, not all three)."""
    parser = argparse.ArgumentParser(
        prog="modelload",
        description="Stream model weights into shared memory and attach to them.",
    )
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more logging (-vv for debug)")
    parser.add_argument("--version", action="version", version=f"modelload {_version()}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    entries = sorted(entry_points(group="modelload.commands"), key=lambda e: e.name)
    if only is not None and any(e.name == only for e in entries):
        entries = [e for e in entries if e.name == only]
    for entry in entries:
        try:
            register = entry.load()
        except ImportError as exc:
            _register_missing(subparsers, entry.name, exc)
            continue
        register(subparsers)
    return parser


def _version() -> str:
    try:
        return version("modelload")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown (not installed)"


def _register_missing(subparsers: argparse._SubParsersAction, name: str, exc: ImportError) -> None:
    extra = _EXTRAS.get(name, "dev")
    if (exc.name or "").startswith("modelload"):
        reason = f"this build of modelload lacks {exc.name}; reinstall modelload"
    else:
        reason = f"it needs the '{extra}' extra (missing {exc.name or exc}): pip install 'modelload[{extra}]'"
    parser = subparsers.add_parser(name, help="(unavailable)", add_help=False)

    def unavailable(_: argparse.Namespace) -> int:
        print(f"modelload {name} is unavailable: {reason}", file=sys.stderr)
        return 2

    parser.set_defaults(func=unavailable, unavailable=True)


def _refuse_unknown(parser: argparse.ArgumentParser, command: str, unknown: list[str]) -> None:
    """Exit with the command's own usage (not the top level's, which reads as a wrong command), and the
    command's option closest to the first unknown one."""
    subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    sub: argparse.ArgumentParser = subparsers.choices.get(command, parser)
    message = f"unrecognized arguments: {' '.join(unknown)}"
    typed = next((word.partition("=")[0] for word in unknown if word.startswith("--")), None)
    if typed is not None:
        close = difflib.get_close_matches(typed, sub._option_string_actions, n=1)
        message += f" (did you mean {close[0]}?)" if close else ""
    sub.error(message)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status: 2 for a usage error (argparse) or a bad setting (a
    ConfigError: a malformed URI, a missing key file, a flag the registry needs), 1 when a command fails
    otherwise (the error's ``exit_status``). The service commands (sidecar, operator) end on their own
    errors the same way before it comes to that."""
    arguments = list(sys.argv[1:] if argv is None else argv)
    command = next((a for a in arguments if not a.startswith("-")), None)
    parser = build_parser(command)
    args, unknown = parser.parse_known_args(arguments)
    if unknown and not getattr(args, "unavailable", False):
        _refuse_unknown(parser, args.command, unknown)
    level = logging.WARNING - 10 * min(args.verbose, 2)
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        status = args.func(args)
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # the reader of our output went away (``modelload inspect --json | head``)
        sys.stderr.close()
        return 141
    except ModelloadError as exc:
        print(f"modelload {args.command}: {exc}", file=sys.stderr)
        return exc.exit_status
    return int(status or 0)


if __name__ == "__main__":
    sys.exit(main())
