"""Peer settings: which sidecars of the same model to take chunks from, and how this one serves them."""

from __future__ import annotations

from dataclasses import dataclass, field

from modelload.loader import wiring
from modelload.loader.errors import ConfigError
from modelload.loader.rules import Between, check_fields, rule

__all__ = ["DEFAULT_PEER_PORT", "PeerSettings"]

DEFAULT_PEER_PORT = wiring.PEER_PORT


@dataclass(frozen=True)
class PeerSettings:
    """Sidecars of the same model as each other's sources (docs/peers.md). Off unless peers are named."""

    urls: tuple[str, ...] = ()
    """Peers' base URLs (``http://10.0.0.7:8480``), from ``--peers``. Default none."""

    dns: str | None = None
    """A name whose addresses are the peers (a headless Service with ``publishNotReadyAddresses``),
    re-resolved while loading, each address with ``port``. Default none."""

    port: int = field(default=DEFAULT_PEER_PORT, metadata=rule(Between(0, 65535)))
    """Where this sidecar serves its peers, and the port of every address ``dns`` resolves to. Default 8480
    (``modelload.loader.wiring``): a port of its own, not the status API's, as uploads are long requests."""

    token: str = field(default="", repr=False)
    """The shared secret peers present and ask for (read from ``--peer-token-file``; ``repr`` hides it).
    Required when peers are named."""

    max_uploads: int = field(default=8, metadata=rule(Between(1, 256)))
    """Uploads served at once before answering 429: a busy sidecar sends the asker to another peer or the
    origin at once instead of queueing it. Default 8."""

    stall_timeout: float = field(default=5.0, metadata=rule(Between(1, 3600)))
    """Seconds one peer may keep this load waiting for nothing before it is dropped for the load: a transfer
    without a byte (or under the rate floor), answers of busy (429) and nothing else, an owner that
    completes no tensor while the rest of the fleet does. Default 5: peers share the cluster's fabric, where
    seconds of silence mean a frozen, overloaded or hostile peer."""

    wait_budget: float = field(default=10.0, metadata=rule(Between(1, 3600)))
    """Seconds of waiting that peers which were then dropped may cost one load in total; once spent, the
    load waits on no busy holder and no owner that lags the fleet any more, and asks only peers whose
    tensors already passed its check. Default 10."""

    settle: float = 5.0
    """Seconds to wait at the start of a load for every peer address to answer, so that sidecars started
    together agree on who reads what from the origin."""

    @property
    def enabled(self) -> bool:
        return bool(self.urls or self.dns)

    def __post_init__(self) -> None:
        if self.enabled and not self.token:
            raise ConfigError(
                "peers are named (--peers/--peer-dns) but no token is: pass --peer-token-file or set"
                " MODELLOAD_PEER_TOKEN_FILE (the ModelLoad's peer Secret)"
            )
        check_fields(self)
