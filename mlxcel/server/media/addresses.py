"""Which IP addresses count as public, with IPv6 forms that embed an IPv4 address unwrapped."""

from __future__ import annotations

import ipaddress
from collections.abc import Callable

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
AddressPredicate = Callable[[IPAddress], bool]

_NAT64 = (
    ipaddress.IPv6Network("64:ff9b::/96"),  # RFC 6052 well-known prefix
    ipaddress.IPv6Network("64:ff9b:1::/48"),  # RFC 8215 local-use prefix
)
_IPV4_COMPATIBLE = ipaddress.IPv6Network("::/96")  # deprecated ::a.b.c.d


def parse_address(text: str) -> IPAddress:
    """An IP address from its text, without an IPv6 zone (`fe80::1%eth0`)."""
    return ipaddress.ip_address(text.split("%", 1)[0])


def embedded_ipv4(address: ipaddress.IPv6Address) -> ipaddress.IPv4Address | None:
    """The IPv4 address an IPv6 address stands for (mapped, NAT64, 6to4, Teredo, compatible)."""
    if address.ipv4_mapped is not None:
        return address.ipv4_mapped
    if any(address in net for net in _NAT64):
        return ipaddress.IPv4Address(int(address) & 0xFFFFFFFF)
    if address.sixtofour is not None:
        return address.sixtofour
    if address.teredo is not None:
        return address.teredo[1]
    if address in _IPV4_COMPATIBLE and int(address) > 1:  # :: and ::1 are not IPv4 forms
        return ipaddress.IPv4Address(int(address) & 0xFFFFFFFF)
    return None


def is_public_address(address: IPAddress) -> bool:
    """Whether `address` is globally routable unicast (no private, loopback, link-local,
    shared, reserved, multicast or metadata address, in any embedded spelling)."""
    if isinstance(address, ipaddress.IPv6Address):
        inner = embedded_ipv4(address)
        if inner is not None:
            return is_public_address(inner)
    return address.is_global and not address.is_multicast
