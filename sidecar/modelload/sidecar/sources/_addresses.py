"""Which network addresses a source may connect to: the operator's guard against reading the cluster.

The operator reads a model's index from wherever a ModelLoad points, from inside the cluster, with the
operator's own network reach. Without a rule, anyone who can create a ModelLoad could make it fetch from
the cloud's metadata service (169.254.169.254), from the cluster's Services, or from the node's loopback,
and learn from the status what answered. An :class:`AddressPolicy` refuses every address that is not a
public (global) one, unless it lies in a network the installation allows (the chart's
``sourceNetworks``), and it is applied to every connection: the first request, every retry, and every
redirect, since a redirect to another host is a new connection. The host name is resolved once per
connection and the socket connects to the very address that was checked, so a name that resolves to
another address a moment later (DNS rebinding) gains nothing.

The sidecar runs with no policy: it reads from the pod's network, with the pod's own reach, on behalf of
the pod's owner.
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from modelload.loader.errors import ConfigError, SourceUriError

__all__ = ["AddressPolicy", "Network", "parse_networks"]

Network = ipaddress.IPv4Network | ipaddress.IPv6Network


def parse_networks(text: str | Iterable[str]) -> tuple[Network, ...]:
    """Networks from CIDRs (``10.0.0.0/8``, ``fd00::/8``, ``127.0.0.1``), comma-separated or listed."""
    items = text.split(",") if isinstance(text, str) else list(text)
    networks = []
    for item in (i.strip() for i in items):
        if not item:
            continue
        try:
            networks.append(ipaddress.ip_network(item, strict=False))
        except ValueError:
            raise ConfigError(f"{item!r} is not a network (CIDR such as 10.0.0.0/8, or an address)") from None
    return tuple(networks)


@dataclass(frozen=True)
class AddressPolicy:
    """Connect only to public addresses, or to addresses inside ``allowed``."""

    allowed: tuple[Network, ...] = ()
    setting: str = "sourceNetworks"
    """What to name in a refusal: where an operator allows more networks."""

    def permits(self, address: str) -> bool:
        ip = ipaddress.ip_address(address.split("%", 1)[0])
        if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
            ip = ip.ipv4_mapped
        if any(ip in network for network in self.allowed):
            return True
        return ip.is_global and not ip.is_multicast

    def connect(
        self,
        address: tuple[str, int],
        timeout: float | None = None,
        source_address: tuple[str, int] | None = None,
    ) -> socket.socket:
        """``socket.create_connection`` for ``address`` that connects only to permitted addresses (the
        signature ``http.client`` calls its ``_create_connection`` with)."""
        host, port = address
        try:
            found = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except socket.gaierror as exc:
            raise OSError(f"cannot resolve {host}: {exc.strerror or exc}") from exc
        permitted = [info for info in found if self.permits(str(info[4][0]))]
        if not permitted:
            refused = sorted({str(info[4][0]) for info in found})
            raise SourceUriError(
                f"{host} resolves to {_describe(refused)}, where ModelLoad sources are not read: only public"
                " addresses are, unless the operator's installation allows the network (the chart's"
                f" {self.setting}, for example [10.0.0.0/8] for an in-cluster S3 store)"
            )
        return _connect(permitted, timeout, source_address)


def _describe(addresses: Sequence[str]) -> str:
    kinds = []
    for address in addresses:
        ip = ipaddress.ip_address(address.split("%", 1)[0])
        kind = (
            "loopback"
            if ip.is_loopback
            else "link-local"
            if ip.is_link_local
            else "private"
            if ip.is_private
            else "non-public"
        )
        kinds.append(f"{address} ({kind})")
    return ", ".join(kinds)


def _connect(
    infos: list[tuple], timeout: float | None, source_address: tuple[str, int] | None
) -> socket.socket:
    last: OSError | None = None
    for family, kind, proto, _, sockaddr in infos:
        sock = socket.socket(family, kind, proto)
        try:
            if timeout is not None:
                sock.settimeout(timeout)
            if source_address is not None:
                sock.bind(source_address)
            sock.connect(sockaddr)
            return sock
        except OSError as exc:
            sock.close()
            last = exc
    assert last is not None
    raise last
