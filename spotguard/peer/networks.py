"""Which addresses a peer may be dialled at (``peer_networks``). Stdlib only.

A registry entry names a host and a port, and the sender dials it: an entry that names the cloud's
metadata service, another host's link-local address or a service on the sender's own loopback would
make the daemon a tool for whoever wrote it. Entries are signed (only a holder of the job's token
writes one that is read at all), and on top of that every address is checked here before it is
dialled:

* link-local (169.254.0.0/16, fe80::/10) and the metadata services' addresses (169.254.169.254,
  fd00:ec2::254) are never dialled, whatever ``peer_networks`` says;
* otherwise the address must lie in one of the allowed networks: ``peer_networks`` (by default the
  private ranges: RFC 1918, 100.64.0.0/10, fc00::/7), plus loopback where the composition root
  (spotguard/config.py) allows it;
* a host name is resolved first, and every address it resolves to must pass (so
  ``metadata.google.internal``, which resolves to a link-local address, is refused); the peer is then
  dialled at the resolved address, never by name again.
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Iterable
from dataclasses import dataclass

IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network
IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address

DEFAULT_PEER_NETWORKS = ("10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16", "100.64.0.0/10", "fc00::/7")
LOOPBACK_NETWORKS = ("127.0.0.0/8", "::1/128")
NEVER = tuple(
    ipaddress.ip_network(net) for net in ("169.254.0.0/16", "fe80::/10", "fd00:ec2::254/128", "169.254.169.254/32")
)


def parse_networks(items: Iterable[str]) -> tuple[IPNetwork, ...]:
    """CIDRs as networks (host bits may be set: ``10.0.1.7/16`` is ``10.0.0.0/16``); ValueError names a bad one."""
    return tuple(ipaddress.ip_network(item.strip(), strict=False) for item in items if item.strip())


@dataclass(frozen=True)
class PeerNetworks:
    """The networks peers may be dialled on."""

    allowed: tuple[IPNetwork, ...]

    def refuses(self, address: IPAddress) -> str | None:
        """Why ``address`` must not be dialled, or None."""
        if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
            address = address.ipv4_mapped
        if address.is_link_local or any(address in net for net in NEVER):
            return f"{address} is link-local or a metadata service's address: never dialled"
        if address.is_unspecified or address.is_multicast:
            return f"{address} is no host's address"
        if not any(address in net for net in self.allowed):
            return f"{address} is outside peer_networks"
        return None

    def resolve(self, host: str, port: int) -> tuple[str | None, str | None]:
        """``(address to dial, None)`` or ``(None, why not)``; a name is resolved (blocking) and every
        address it resolves to must be allowed."""
        try:
            return self._check([ipaddress.ip_address(host.strip("[]"))])
        except ValueError:
            pass
        try:
            infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except OSError as exc:
            return None, f"{host} does not resolve: {exc}"
        return self._check([ipaddress.ip_address(str(info[4][0]).partition("%")[0]) for info in infos])

    def _check(self, addresses: list[IPAddress]) -> tuple[str | None, str | None]:
        for address in addresses:
            why = self.refuses(address)
            if why is not None:
                return None, why
        return (str(addresses[0]), None) if addresses else (None, "no address")


__all__ = ["DEFAULT_PEER_NETWORKS", "LOOPBACK_NETWORKS", "NEVER", "PeerNetworks", "parse_networks"]
