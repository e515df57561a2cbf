"""py-libp2p 0.8.1's mDNS announcement, told which interfaces it runs on (the adjustment ``mdns_broadcaster``).

Upstream: the library's mDNS was made spec-compliant by
https://github.com/libp2p/py-libp2p/pull/1420 (issue
https://github.com/libp2p/py-libp2p/issues/1419); choosing interfaces has no
upstream issue found (go-libp2p's is https://github.com/libp2p/go-libp2p/issues/376).
Replaces ``PeerBroadcaster._get_local_ips`` (libp2p/discovery/mdns/broadcaster.py)
in a subclass; the library's class is not changed.

What meshd takes from the library's mDNS (libp2p/discovery/mdns/): the
service type ``_p2p._udp.local.`` and ``PeerBroadcaster``, which builds the
spec's announcement (``dnsaddr=<multiaddr>/p2p/<id>`` TXT entries, the SRV
and A records) as a zeroconf ``ServiceInfo``. What it does not take, and why
(dht/host/mdns.py runs the rest on a zeroconf it owns):

* ``MDNSDiscovery`` opens ``Zeroconf()`` on every interface of the machine;
  meshd's mDNS runs only on the interfaces the node listens on.
* With the host passed, the TXT entries are the host's transport addresses:
  ``/ip4/0.0.0.0/tcp/4001`` for a wildcard listener, which a peer would dial
  as its own machine. meshd passes the interface addresses (``listen_addrs``,
  no host).
* ``PeerListener`` resolves every ``_p2p._udp`` instance in zeroconf's
  browser thread with blocking retries (``time.sleep``), writes the peerstore
  from that thread, browses the DNS-SD meta query too, and only adds
  addresses: someone else must dial. meshd's listener reads the instance
  name first (dht/host/swarm_scope.py) and hands names to trio.
* ``register``/``unregister`` block the calling thread -- the daemon's trio
  loop -- for the probes and announcements (~1 s); meshd awaits zeroconf's
  coroutines instead.

The adjustment itself: ``PeerBroadcaster._get_local_ips`` asks the kernel
for its route to 8.8.8.8 (and an IPv6 twin) and falls back to 127.0.0.1, so
the A record names the default route's interface -- or loopback, in a LAN
without a default route -- whatever interfaces mDNS runs on. The subclass
answers with the addresses of the interfaces meshd's mDNS runs on.
``MESHD_MDNS_BROADCASTER=0`` (or another library version) uses the library's
class as it is: the TXT entries, which libp2p peers read, are the same.
"""
from __future__ import annotations

from collections.abc import Sequence

from dht.compat.gate import gate

NAME = "mdns_broadcaster"
DISABLE_ENV = "MESHD_MDNS_BROADCASTER"
MODULE = "libp2p.discovery.mdns.broadcaster"
NEEDS = ("_get_local_ips", "_build_service_info")
DETAIL = " (A records name the interfaces mDNS runs on, not the route to 8.8.8.8)"


def check(version: str) -> str | None:
    """None when the subclass fits ``version`` and the installed library; else why it stays off."""
    return gate(version, module=MODULE, what="mDNS broadcaster", owner="PeerBroadcaster", needs=NEEDS,
                disable_env=DISABLE_ENV)


def library_class():
    """The library's PeerBroadcaster, or None when it is gone (then meshd runs no mDNS)."""
    try:
        from libp2p.discovery.mdns.broadcaster import PeerBroadcaster
    except ImportError:
        return None
    return PeerBroadcaster


def broadcaster(version: str, local_ips: Sequence[str], **kwargs):
    """(a PeerBroadcaster for ``kwargs``, None when adjusted or the reason it is not); (None, why) when
    the library has no PeerBroadcaster at all."""
    base = library_class()
    if base is None:
        return None, "off: libp2p has no PeerBroadcaster"
    off = check(version)
    if off is not None:
        return base(**kwargs), off
    ips = [str(ip) for ip in local_ips]

    class MeshdBroadcaster(base):        # type: ignore[misc, valid-type]
        """meshd: the A records name the interfaces mDNS runs on (dht/compat/mdns_broadcaster.py)."""

        def _get_local_ips(self) -> list[str]:
            return list(ips)

    return MeshdBroadcaster(**kwargs), None
