"""``modelload keeper``: hold the model on the GPU and lend it to the app's processes (the CUDA hand-off).

Run in a container of the pod that sees the app's GPU (docs/handoff.md): it attaches to the segment,
copies every tensor to exportable GPU memory as it arrives, and serves the app's ``connect()`` calls on a
Unix socket until it is stopped. ``--status`` asks a running keeper for its state instead (a probe: exit 0
once the weights are on the GPU).

This is the service's edge: its settings come from flags and from the pod's variables here, once.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING

from modelload.loader import options
from modelload.loader.errors import HandoffError, LoadFailedError, ModelloadError
from modelload.loader.options import Given, Option, parse_seconds
from modelload.loader.rules import Between, Positive, Prefixed, check_fields, rule
from modelload.loader.sizes import format_size, parse_size
from modelload.loader.wiring import KEEPER_ENV, KEEPER_SOCKET, SEGMENT_ENV, SEGMENT_PATH

if TYPE_CHECKING:
    from modelload.loader.handoff.keeper import Keeper

__all__ = ["OPTIONS", "KeeperSettings", "parse_settings", "register", "run"]

log = logging.getLogger("modelload.keeper")


@dataclass(frozen=True)
class KeeperSettings:
    """What ``modelload keeper`` is told, each setting a flag and a variable (:data:`OPTIONS`)."""

    segment: str = SEGMENT_PATH
    """The segment to copy from: the pod's, where the sidecar writes it."""
    socket: str = KEEPER_SOCKET
    """Where to listen; the app's ``connect()`` reads the same variable."""
    device: str = field(default="cuda", metadata=rule(Prefixed(("cuda",), "a CUDA device: cuda or cuda:N")))
    """The CUDA device to hold the weights on, in this container's numbering (``cuda``: its first)."""
    block_size: int = field(
        default=1 << 30, metadata=rule(Between(1 << 20, what="a block size", show=format_size))
    )
    """Bytes per exported allocation: a few per GiB keep the descriptors few and the mapping quick."""
    timeout: float = field(default=600.0, metadata=rule(Positive("a positive number of seconds")))
    """Seconds to wait for the segment to appear, as ``attach()`` waits."""

    def __post_init__(self) -> None:
        check_fields(self)


OPTIONS = (
    Option("segment", "--segment", SEGMENT_ENV, "the segment to copy the model from", "PATH"),
    Option("socket", "--socket", KEEPER_ENV, "where to listen for the app's processes", "PATH"),
    Option("device", "--device", "MODELLOAD_KEEPER_DEVICE", "the CUDA device to hold the weights on"),
    Option(
        "block_size", "--block-size", "MODELLOAD_KEEPER_BLOCK_SIZE", "bytes per exported GPU allocation",
        "SIZE", parse=parse_size,
    ),
    Option(
        "timeout", "--timeout", "MODELLOAD_KEEPER_TIMEOUT", "seconds to wait for the segment to appear",
        "SEC", parse=parse_seconds,
    ),
)  # fmt: skip
"""The keeper's flags and variables, each landing in the :class:`KeeperSettings` field its ``dest`` names."""


def parse_settings(flags: argparse.Namespace, environ: Mapping[str, str]) -> KeeperSettings:
    """The settings from the flags given and ``environ``; a ConfigError names the flag or variable."""
    return Given(OPTIONS, vars(flags), environ).build(KeeperSettings)


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "keeper",
        help="hold the model on the GPU and lend it to the app's processes (the CUDA hand-off)",
        description=(
            "Copy the segment's tensors into GPU memory that other processes can map, and lend it to them "
            "over a Unix socket: an app process that restarts maps the weights again without a copy. "
            "Needs torch with CUDA and the same GPU as the app's container (docs/handoff.md). "
            "With --status, print a running keeper's state and exit 0 once its weights are on the GPU."
        ),
    )
    options.add_arguments(parser, OPTIONS, settings=KeeperSettings)
    parser.add_argument("--status", action="store_true", help="print a running keeper's state and exit")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Serve until SIGTERM; a configuration or device error at start ends it with the error's exit status
    (2 for configuration), as the sidecar does."""
    try:
        settings = parse_settings(args, os.environ)
        if args.status:
            return _status(Path(settings.socket))
        keeper = _start(settings)
    except ModelloadError as exc:
        print(f"modelload keeper: {exc}", file=sys.stderr)
        return exc.exit_status
    stop = threading.Event()

    def on_signal(signum: int, _: FrameType | None) -> None:
        log.info("keeper: %s, stopping", signal.Signals(signum).name)
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    threading.Thread(target=_load, args=(keeper, settings), name="keeper-load", daemon=True).start()
    try:
        stop.wait()
    finally:
        keeper.close()
    return 0


def _start(settings: KeeperSettings) -> Keeper:
    from modelload.loader.handoff.device import CudaMemory
    from modelload.loader.handoff.keeper import Keeper

    keeper = Keeper(CudaMemory(settings.device), socket_path=settings.socket, block_size=settings.block_size)
    keeper.start()
    return keeper


def _load(keeper: Keeper, settings: KeeperSettings) -> None:
    """Attach and copy; any failure is answered to every app from then on, with its reason."""
    from modelload.loader._api.attach import attach

    try:
        with attach(settings.segment, timeout=settings.timeout) as model:
            keeper.load(model)
    except ModelloadError as exc:
        keeper.fail(str(exc))
        log.error("keeper: the load failed: %s", exc)
    except Exception as exc:  # unexpected, but still answered to the apps rather than left unsaid
        keeper.fail(f"{type(exc).__name__}: {exc}")
        log.exception("keeper: the load failed")


def _status(path: Path) -> int:
    from modelload.loader.handoff.client import status

    try:
        state = status(path)
    except (HandoffError, LoadFailedError) as exc:
        print(f"modelload keeper: {exc}", file=sys.stderr)
        return 1
    print(json.dumps({k: v for k, v in state.items() if k != "op"}))
    return 0 if state.get("state") == "ready" else 1
