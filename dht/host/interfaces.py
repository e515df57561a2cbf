"""This machine's IPv4 interfaces, and what a node listening on them may announce.

Two questions a LAN node asks with no flags given (``--listen`` defaults to
``/ip4/0.0.0.0/tcp/4001``):

* where mDNS may run: exactly on the interfaces the node listens on
  (``mdns_interfaces``): every non-loopback IPv4 interface for a wildcard
  listener, the interface holding the address for a specific one, none for
  loopback (no LAN is there, and ``meshd demo``'s and the tests' loopback
  swarms must not find each other);
* which address our record offers peers for a wildcard listener
  (``pick_advertise_host``): the interface of the default route, else a
  private address, else any non-loopback one. ``--advertise-host`` wins.

IPv4 only: mDNS runs over IPv4 here (dht/host/mdns.py says why).

``read_ipv4_interfaces`` (ifaddr, the library zeroconf itself uses) and
``read_default_route_iface`` (/proc/net/route) are the I/O; the rest is pure.
"""
from __future__ import annotations

import ipaddress
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

__all__ = ["IfaceAddr", "read_ipv4_interfaces", "read_default_route_iface", "default_route_iface",
           "mdns_interfaces", "pick_advertise_host", "WILDCARD_IPV4"]

WILDCARD_IPV4 = "0.0.0.0"
# Interfaces looked at: a machine with more IPv4 addresses than this is not a home node.
MAX_INTERFACES = 64
ROUTE_TABLE = "/proc/net/route"
# /proc/net/route is a few lines per route; a table beyond this is not read further.
MAX_ROUTE_BYTES = 256 * 1024


@dataclass(frozen=True, slots=True)
class IfaceAddr:
    iface: str
    ip: str
    prefix: int

    def __post_init__(self) -> None:
        ipaddress.IPv4Interface(f"{self.ip}/{self.prefix}")   # ValueError for anything else

    @property
    def network(self) -> ipaddress.IPv4Network:
        return ipaddress.IPv4Interface(f"{self.ip}/{self.prefix}").network

    @property
    def loopback(self) -> bool:
        return ipaddress.IPv4Address(self.ip).is_loopback


def read_ipv4_interfaces() -> list[IfaceAddr]:
    """Every IPv4 address of this machine's interfaces (loopback included), at most MAX_INTERFACES."""
    import ifaddr

    out: list[IfaceAddr] = []
    for adapter in ifaddr.get_adapters():
        for ip in adapter.ips:
            if isinstance(ip.ip, str) and len(out) < MAX_INTERFACES:
                try:
                    out.append(IfaceAddr(str(adapter.nice_name), ip.ip, int(ip.network_prefix)))
                except ValueError:
                    continue
    return out


def default_route_iface(route_table: str) -> str | None:
    """The interface of the IPv4 default route in /proc/net/route's text, None without one."""
    for line in route_table.splitlines()[1:]:
        fields = line.split()
        if len(fields) >= 8 and fields[1] == "00000000" and fields[7] == "00000000":
            return fields[0]
    return None


def read_default_route_iface() -> str | None:
    try:
        with open(ROUTE_TABLE, encoding="ascii", errors="replace") as f:
            return default_route_iface(f.read(MAX_ROUTE_BYTES))
    except OSError:
        return None


def mdns_interfaces(listen_ips: Iterable[str], ifaces: Sequence[IfaceAddr]) -> list[IfaceAddr]:
    """The interfaces a node listening on ``listen_ips`` may run mDNS on (see the module docstring)."""
    out: list[IfaceAddr] = []
    for listen_ip in listen_ips:
        for addr in ifaces:
            if addr.loopback or addr in out:
                continue
            if listen_ip == WILDCARD_IPV4 or listen_ip == addr.ip:
                out.append(addr)
    return out


def pick_advertise_host(ifaces: Sequence[IfaceAddr], default_iface: str | None) -> str | None:
    """The address a wildcard listener offers peers: the default route's interface, else a private
    address, else any non-loopback one; None when there is only loopback."""
    usable = [a for a in ifaces if not a.loopback]
    for rank in (lambda a: a.iface == default_iface, lambda a: ipaddress.IPv4Address(a.ip).is_private,
                 lambda a: True):
        found = [a for a in usable if rank(a)]
        if found:
            return found[0].ip
    return None
