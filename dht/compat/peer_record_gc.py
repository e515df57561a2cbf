"""An expired address-book entry no longer breaks DHT answers (the adjustment ``peer_record_gc``).

Upstream: no upstream issue about KadDHT's answers found; the exception it
hits is the TTL check of https://github.com/libp2p/py-libp2p/issues/371
(``PeerStore.addrs`` raises for an expired peer). Replaces
``PeerStore.maybe_delete_peer_record`` (libp2p/peer/peerstore.py).

py-libp2p 0.8.1's ``PeerStore.get_peer_record`` first garbage-collects the
peer's signed peer record (``maybe_delete_peer_record``), which asks
``self.addrs(peer)`` whether any address is left -- and ``addrs`` *raises*
``PeerStoreError("peer ID is expired")`` once the peer's entry has outlived
its TTL. The entry's TTL is one per peer, reset by whoever touched it last:
120 s after ``host.connect``, 600 s after a DHT answer named the peer, 7200 s
after the peer's own signed record arrived. KadDHT builds every GET_VALUE
and FIND_NODE answer by calling ``get_peer_record`` for each of the k closest
peers of its routing table, outside any ``try``: one table peer not heard of
for ten minutes makes the handler reset every request whose closest peers
include it ("Failed to parse protobuf message: 'peer ID is expired'").
So lookups fail at the peers that should answer them once the table's peers
go unheard for ten minutes -- in ``meshd bench dht`` at 200 nodes, and in any
long-running daemon (docs/measurements/2026-12-04.md).

This adjustment replaces ``maybe_delete_peer_record`` by the same garbage
collection without the exception: the signed record goes when the peer has
no live (unexpired, non-empty) addresses, as the library intends, and the
caller carries on (``get_peer_record`` then returns None, and the answer
names the peer without a record). State: the original method, to restore
(tests). Applied by dht/compat/registry.py when ``dht.compat.gate`` lets it
and the library still has the method; ``MESHD_PEER_RECORD_GC=0``
leaves the library's method.
"""
from __future__ import annotations

from dht.compat.gate import gate, installed_version

NAME = "peer_record_gc"
DISABLE_ENV = "MESHD_PEER_RECORD_GC"
APPLIED = False
_ORIGINAL: dict = {}


def check(version: str) -> str | None:
    """None when the adjustment fits ``version`` and the installed library; else why it stays off."""
    return gate(version, module="libp2p.peer.peerstore", what="peerstore", owner="PeerStore",
                needs=("maybe_delete_peer_record",), disable_env=DISABLE_ENV)


def _maybe_delete_peer_record(self, peer_id) -> None:
    """meshd (dht/compat/peer_record_gc.py): drop the signed record of a peer with no live addresses; never raise."""
    if peer_id not in self.peer_record_map:
        return
    data = self.peer_data_map.get(peer_id)
    if data is None or data.is_expired() or not data.get_addrs():
        self.peer_record_map.pop(peer_id, None)


def apply(version: str | None = None) -> bool:
    """Put the non-raising garbage collection in place (idempotent). True when it is."""
    global APPLIED
    if APPLIED:
        return True
    if version is None:
        version = installed_version()
    if check(version) is not None:
        return False
    from libp2p.peer.peerstore import PeerStore

    _ORIGINAL["maybe_delete_peer_record"] = PeerStore.__dict__["maybe_delete_peer_record"]
    PeerStore.maybe_delete_peer_record = _maybe_delete_peer_record
    APPLIED = True
    return True


def restore() -> None:
    """Put the library's method back (tests compare both)."""
    global APPLIED
    if APPLIED:
        from libp2p.peer.peerstore import PeerStore

        PeerStore.maybe_delete_peer_record = _ORIGINAL.pop("maybe_delete_peer_record")
        APPLIED = False
