"""Who is on the other end of an HTTP request: the TCP peer, or what trusted proxies say.

A client address decides per-address admission (``POST /register``) and is bound to every log line
of a request, so it must not be forgeable. ``X-Forwarded-For`` and ``Forwarded`` (RFC 7239) are
plain request headers that any client can send; they are believed only when the TCP peer is one of
the operator's proxies (``TOASTMACHINE_TRUSTED_PROXIES``, default: nobody). Then the list is read
from the right, hop by hop, skipping addresses that are themselves trusted proxies: the first one
that is not is the client. Everything to its left was written by that client and is ignored.

Anything malformed is ignored safely, never trusted further: an unparsable header (or both headers
at once, since a client could have written either) means the peer is the client; an unparsable hop
means the last trusted proxy that reported it is.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

Address = ipaddress.IPv4Address | ipaddress.IPv6Address
Network = ipaddress.IPv4Network | ipaddress.IPv6Network

#: Hops read from the right of a forwarding list, at most: more proxies than this in a row are not
#: a real deployment, and the bound keeps a 8 KiB header of commas from costing more than a few.
MAX_HOPS = 16
#: An IPv6 client is keyed by its /64 for admission: one subscriber usually holds a whole /64, so
#: counting each of its 2**64 addresses apart would make a per-address limit no limit at all.
IPV6_KEY_PREFIX = 64


@dataclass(frozen=True, slots=True)
class TrustedProxies:
    """The proxies whose forwarding headers are believed (``TOASTMACHINE_TRUSTED_PROXIES``)."""

    networks: tuple[Network, ...] = ()

    @classmethod
    def parse(cls, raw: str) -> TrustedProxies:
        """Comma-separated IP addresses and CIDR networks; raises ValueError naming a bad entry."""
        networks: list[Network] = []
        for item in raw.split(","):
            item = item.strip()
            if not item:
                continue
            try:
                networks.append(ipaddress.ip_network(item, strict=False))
            except ValueError:
                raise ValueError(f"{item!r} is not an IP address or CIDR network") from None
        return cls(tuple(networks))

    def __contains__(self, address: object) -> bool:
        return isinstance(address, Address) and any(address in network for network in self.networks
                                                    if network.version == address.version)

    def __bool__(self) -> bool:
        return bool(self.networks)

    def __str__(self) -> str:
        return ",".join(str(n) for n in self.networks)


def parse_address(text: str) -> Address | None:
    """An IP address as a peer or a forwarding hop writes it (``1.2.3.4``, ``1.2.3.4:80``, ``::1``,
    ``[::1]:80``, quoted), IPv4-mapped IPv6 as IPv4; None for anything else (``unknown``, ``_hidden``)."""
    text = text.strip()
    if len(text) >= 2 and text[0] == text[-1] == '"':
        text = text[1:-1]
    if text.startswith("["):
        host, bracket, _port = text[1:].partition("]")
        if not bracket:
            return None
        text = host
    elif text.count(":") == 1:  # IPv4 with a port; a bare IPv6 address has at least two colons
        text = text.partition(":")[0]
    try:
        address = ipaddress.ip_address(text)
    except ValueError:
        return None
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped
    return address


def client_address(peer: str | None, forwarded: Sequence[str], x_forwarded_for: Sequence[str],
                   trusted: TrustedProxies) -> Address | None:
    """The client of a request whose TCP peer is ``peer`` and whose header lines are ``forwarded``
    (``Forwarded``) and ``x_forwarded_for`` (``X-Forwarded-For``); None when not even the peer is an
    IP address (a Unix socket)."""
    current = parse_address(peer) if peer else None
    if current is None or current not in trusted:
        return current
    if bool(forwarded) == bool(x_forwarded_for):
        return current  # neither header, or both (ambiguous: the client may have written either)
    hops = _forwarded_hops(forwarded) if forwarded else _x_forwarded_for_hops(x_forwarded_for)
    if hops is None:
        return current
    for hop in reversed(hops[-MAX_HOPS:]):
        address = parse_address(hop) if hop is not None else None
        if address is None:
            return current  # the proxy that reported this hop is the closest address we can key on
        if address not in trusted:
            return address
        current = address
    return current


def admission_key(address: Address | None) -> str:
    """The key of a client's admission budget: its IPv4 address, its IPv6 /64, or ``::`` if unknown."""
    if address is None:
        return "::/128"
    if isinstance(address, ipaddress.IPv6Address):
        return str(ipaddress.IPv6Network((address, IPV6_KEY_PREFIX), strict=False))
    return f"{address}/32"


def _x_forwarded_for_hops(lines: Iterable[str]) -> list[str | None] | None:
    hops: list[str | None] = []
    for line in lines:
        for item in line.split(","):
            item = item.strip()
            if not item:
                return None
            hops.append(item)
    return hops


def _forwarded_hops(lines: Iterable[str]) -> list[str | None] | None:
    """The ``for`` of each element of RFC 7239 ``Forwarded`` lines (None where an element has none);
    None when the syntax is broken."""
    hops: list[str | None] = []
    for line in lines:
        for element in line.split(","):
            if not element.strip():
                return None
            value: str | None = None
            for pair in element.split(";"):
                name, equals, raw = pair.strip().partition("=")
                if not equals or not name.strip():
                    return None
                if name.strip().lower() == "for":
                    value = raw.strip()
            hops.append(value)
    return hops
