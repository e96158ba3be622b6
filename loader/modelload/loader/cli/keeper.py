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
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING

from modelload.loader.errors import ConfigError, HandoffError, LoadFailedError, ModelloadError
from modelload.loader.sizes import parse_size
from modelload.loader.wiring import KEEPER_ENV, KEEPER_SOCKET, SEGMENT_ENV, SEGMENT_PATH

if TYPE_CHECKING:
    from modelload.loader.handoff.keeper import Keeper

__all__ = ["KeeperSettings", "register", "run"]

log = logging.getLogger("modelload.keeper")


@dataclass(frozen=True)
class KeeperSettings:
    segment: Path
    """The segment to copy from (``--segment``, ``MODELLOAD_SEGMENT``, default the pod's)."""
    socket: Path
    """Where to listen (``--socket``, ``MODELLOAD_KEEPER``, default ``/run/modelload/keeper.sock``)."""
    device: str
    """The CUDA device to hold the weights on (``--device``, default ``cuda``: this container's first)."""
    block_size: int
    """Bytes per exported allocation (``--block-size``, default 1 GiB)."""
    timeout: float | None
    """Seconds to wait for the segment to appear (``--timeout``, default 600; 0 waits without limit)."""

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> KeeperSettings:
        block_size = parse_size(args.block_size, setting="--block-size")
        if block_size < 1 << 20:
            raise ConfigError(f"{args.block_size!r} is under 1 MiB", setting="--block-size")
        if args.timeout < 0:
            raise ConfigError(f"{args.timeout:g} is negative", setting="--timeout")
        return cls(
            segment=Path(args.segment or os.environ.get(SEGMENT_ENV) or SEGMENT_PATH),
            socket=_socket_path(args.socket),
            device=args.device,
            block_size=block_size,
            timeout=args.timeout or None,
        )


def _socket_path(flag: str | None) -> Path:
    return Path(flag or os.environ.get(KEEPER_ENV) or KEEPER_SOCKET)


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
    parser.add_argument(
        "--segment", metavar="PATH", help=f"the segment (default ${SEGMENT_ENV}, {SEGMENT_PATH})"
    )
    parser.add_argument(
        "--socket", metavar="PATH", help=f"where to listen (default ${KEEPER_ENV}, {KEEPER_SOCKET})"
    )
    parser.add_argument(
        "--device", default="cuda", help="the CUDA device to hold the weights on (default cuda)"
    )
    parser.add_argument(
        "--block-size", default="1GiB", metavar="SIZE", help="bytes per exported allocation (default 1GiB)"
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=600.0,
        metavar="SEC",
        help="seconds to wait for the segment to appear (default 600; 0: no limit)",
    )
    parser.add_argument("--status", action="store_true", help="print a running keeper's state and exit")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Serve until SIGTERM; a configuration or device error at start ends it with the error's exit status
    (2 for configuration), as the sidecar does."""
    if args.status:
        return _status(_socket_path(args.socket))
    try:
        settings = KeeperSettings.from_args(args)
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
