"""Sidecars of one model as each other's sources (docs/peers.md).

``hook`` (:class:`~modelload.sidecar.peers.hook.Peers`) is one sidecar's side, as the engine and the process
see it; ``fetch`` takes chunks from other peers; ``ranges`` decides who reads what from the origin; ``server``
serves what this sidecar holds; ``settings`` holds :class:`PeerSettings`. Only the settings are imported here,
so reading the settings never starts the peer machinery.
"""

from modelload.sidecar.peers.settings import DEFAULT_PEER_PORT, PeerSettings

__all__ = ["DEFAULT_PEER_PORT", "PeerSettings"]
