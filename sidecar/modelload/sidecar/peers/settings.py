"""Peer settings: which sidecars of the same model to take chunks from, and how this one serves them."""

from __future__ import annotations

from dataclasses import dataclass, field

from modelload.loader import wiring
from modelload.loader.errors import ConfigError

__all__ = ["DEFAULT_PEER_PORT", "PeerSettings"]

DEFAULT_PEER_PORT = wiring.PEER_PORT


@dataclass(frozen=True)
class PeerSettings:
    """Sidecars of the same model as each other's sources (docs/peers.md). Off unless peers are named.

    ``urls``: peers' base URLs (``http://10.0.0.7:8480``), from ``--peers``. ``dns``: a name whose addresses
    are the peers (a headless Service with ``publishNotReadyAddresses``), re-resolved while loading, each
    address with ``port``. ``port``: where this sidecar serves its peers. ``token``: the shared secret peers
    present and ask for (read from ``--peer-token-file``; ``repr`` hides it). ``max_uploads``: uploads served
    at once before answering 429. ``stall_timeout``: seconds a peer may send nothing (or an owner make no
    progress) before its chunks move elsewhere. ``settle``: seconds to wait at the start of a load for every
    peer address to answer, so that sidecars started together agree on who reads what from the origin.
    """

    urls: tuple[str, ...] = ()
    dns: str | None = None
    port: int = DEFAULT_PEER_PORT
    token: str = field(default="", repr=False)
    max_uploads: int = 8
    stall_timeout: float = 10.0
    settle: float = 5.0

    @property
    def enabled(self) -> bool:
        return bool(self.urls or self.dns)

    def __post_init__(self) -> None:
        if self.enabled and not self.token:
            raise ConfigError(
                "peers are named (--peers/--peer-dns) but no token is: pass --peer-token-file or set"
                " MODELLOAD_PEER_TOKEN_FILE (the ModelLoad's peer Secret)"
            )
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"the peer port must be between 0 and 65535, got {self.port}")
        if not 1 <= self.max_uploads <= 256:
            raise ConfigError(f"peer uploads must be between 1 and 256, got {self.max_uploads}")
