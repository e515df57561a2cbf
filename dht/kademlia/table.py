"""A pure k-bucket routing table that follows py-libp2p 0.8.1's rules.

Mirrors ``libp2p/kad_dht/routing_table.py`` of py-libp2p 0.8.1 (``RoutingTable``
and ``KBucket``), the table the product's KadDHT keeps; the simulation
(dht/kademlia/sim.py) gives every simulated node one of these, and
tests/test_dht_table.py runs both tables through the same insertions and
compares them. The library's rules, as it applies them:

* Keyspace: a peer sits at ``sha256(peer id bytes)`` (``peer_id_to_key``), a
  key at ``sha256(key)``; distance is their XOR (``find_local_closest_peers``).
* Buckets are contiguous ranges of the keyspace, kept in order; the table
  starts with one bucket over all of it. A bucket holds at most ``k`` (20)
  peers, least recently seen first.
* ``add``: a peer already in its bucket moves to the tail (seen now). A new
  peer whose bucket is full splits that bucket at its midpoint, again and
  again while the peer's bucket stays full, as long as the table has fewer
  than MAX_BUCKETS (256) buckets. The library splits *any* full bucket, not
  only the one holding our own id as the Kademlia paper does: its table keeps
  every peer it hears of until 256 buckets exist (thousands of peers).
* A full bucket that cannot split pings its oldest peer: if the ping fails the
  oldest leaves and the new peer joins at the tail; if it answers, the new
  peer is dropped and the oldest stays where it is (the library does not mark
  it seen). Here ``add`` returns the peer to ping and the caller reports a
  failed ping with ``evict`` (an answered one needs no call).
* Our own id never enters.

Not mirrored, and why: the per-bucket subnet cap (two peers per /24 or /48)
applies only to globally routable addresses -- loopback, private and relayed
peers are exempt, and simulated peers have no addresses; the stale-peer
sweep (every 5 minutes, pings of up to five peers unseen for an hour) is
beyond the hour a simulation spans.

State: the buckets (ranges and their peers in seen order) and, for
``closest``, every peer's position in one sorted list. Peers are opaque
hashables; ``position(peer)`` gives their keyspace position (an int).
"""
from __future__ import annotations

import hashlib
from bisect import bisect_left, bisect_right, insort
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterator
from typing import Generic, TypeVar

# Kademlia's k, py-libp2p's BUCKET_SIZE.
BUCKET_SIZE = 20
# py-libp2p's MAXIMUM_BUCKETS: one per bit of a 256-bit key.
MAX_BUCKETS = 256
KEYSPACE_BITS = 256


def key_position(key: bytes) -> int:
    """Where a key (or a peer id's bytes) sits in the keyspace: sha256, big-endian."""
    return int.from_bytes(hashlib.sha256(key).digest(), "big")


# A peer, as the caller names it (a libp2p ID, a simulation's index).
P = TypeVar("P", bound=Hashable)


class _Bucket(Generic[P]):
    __slots__ = ("low", "high", "peers")

    def __init__(self, low: int, high: int) -> None:
        self.low, self.high = low, high                    # [low, high)
        self.peers: OrderedDict[P, None] = OrderedDict()   # least recently seen first


class RoutingTable(Generic[P]):
    def __init__(self, me: P, position: Callable[[P], int], *, k: int = BUCKET_SIZE,
                 max_buckets: int = MAX_BUCKETS) -> None:
        if k < 1 or max_buckets < 1:
            raise ValueError("k and max_buckets must be positive")
        self.me = me
        self.k, self.max_buckets = k, max_buckets
        self._position = position
        self._buckets: list[_Bucket[P]] = [_Bucket(0, 1 << KEYSPACE_BITS)]
        self._lows = [0]                          # each bucket's low end, for bisect
        self._sorted: list[int] = []              # positions of the peers in the table, ascending
        self._at: dict[int, P] = {}               # position -> peer

    # ------------------------------------------------------------------ membership

    def __len__(self) -> int:
        return len(self._at)

    def __contains__(self, peer: P) -> bool:
        return peer in self._bucket_at(self._position(peer)).peers

    def peers(self) -> Iterator[P]:
        """Every peer, bucket by bucket, least recently seen first within each."""
        for bucket in self._buckets:
            yield from bucket.peers

    def buckets(self) -> list[tuple[int, int, list]]:
        """(low, high, peers in seen order) per bucket, in keyspace order."""
        return [(b.low, b.high, list(b.peers)) for b in self._buckets]

    def _bucket_at(self, pos: int) -> _Bucket[P]:
        return self._buckets[bisect_right(self._lows, pos) - 1]

    # ------------------------------------------------------------------ changes

    def add(self, peer: P) -> P | None:
        """Insert ``peer`` or mark it seen. Returns None when that is done, else the oldest peer of
        its full bucket, which the caller pings (``evict`` when the ping failed)."""
        if peer == self.me:
            return None
        pos = self._position(peer)
        bucket = self._bucket_at(pos)
        if peer in bucket.peers:
            bucket.peers.move_to_end(peer)
            return None
        while len(bucket.peers) >= self.k and len(self._buckets) < self.max_buckets:
            self._split(bucket)
            bucket = self._bucket_at(pos)
        if len(bucket.peers) < self.k:
            self._insert(bucket, peer, pos)
            return None
        return next(iter(bucket.peers))

    def evict(self, oldest: P, newcomer: P) -> bool:
        """``oldest`` did not answer its ping: it leaves, ``newcomer`` takes a free place in
        its bucket. True when ``newcomer`` is in the table afterwards."""
        self.remove(oldest)
        if newcomer == self.me:
            return False
        pos = self._position(newcomer)
        bucket = self._bucket_at(pos)
        if newcomer in bucket.peers:
            return True
        if len(bucket.peers) >= self.k:
            return False
        self._insert(bucket, newcomer, pos)
        return True

    def remove(self, peer: P) -> bool:
        pos = self._position(peer)
        bucket = self._bucket_at(pos)
        if peer not in bucket.peers:
            return False
        del bucket.peers[peer]
        del self._sorted[bisect_left(self._sorted, pos)]
        del self._at[pos]
        return True

    def _insert(self, bucket: _Bucket[P], peer: P, pos: int) -> None:
        bucket.peers[peer] = None
        insort(self._sorted, pos)
        self._at[pos] = peer

    def _split(self, bucket: _Bucket[P]) -> None:
        mid = (bucket.low + bucket.high) // 2
        lower, upper = _Bucket[P](bucket.low, mid), _Bucket[P](mid, bucket.high)
        for peer in bucket.peers:                  # each half keeps the seen order
            (lower if self._position(peer) < mid else upper).peers[peer] = None
        i = self._buckets.index(bucket)
        self._buckets[i:i + 1] = [lower, upper]
        self._lows[i:i + 1] = [lower.low, upper.low]

    # ------------------------------------------------------------------ queries

    def closest(self, key: bytes, count: int | None = None) -> list[P]:
        """The ``count`` (default k) peers nearest ``sha256(key)``, nearest first: the library's
        ``find_local_closest_peers``."""
        return self.closest_to(key_position(key), self.k if count is None else count)

    def closest_to(self, target: int, count: int) -> list[P]:
        """The ``count`` peers with the smallest ``position ^ target``, nearest first.

        Every peer within XOR distance 2^b of ``target`` sits in one aligned block of
        2^b positions, a contiguous run of the sorted positions: walk down from the
        whole keyspace, at each halving keep the half holding ``target`` when it has
        enough peers, else take all of it (all nearer than anything in the other half)
        and go on in the other half. Cost: a bisect per level, a sort of at most
        ``count`` positions per level that takes peers."""
        out: list[P] = []
        pos, at = self._sorted, self._at
        lo, hi = 0, len(pos)            # the block's peers: pos[lo:hi]
        low, size = 0, 1 << KEYSPACE_BITS   # the block: [low, low + size)
        need = count
        while need > 0 and hi > lo:
            if hi - lo <= need:
                out += [at[d ^ target] for d in sorted([p ^ target for p in pos[lo:hi]])]
                break
            size >>= 1
            mid = bisect_left(pos, low + size, lo, hi)
            if target & size:           # target in the upper half [mid, hi)
                if hi - mid >= need:
                    lo, low = mid, low + size
                    continue
                out += [at[d ^ target] for d in sorted([p ^ target for p in pos[mid:hi]])]
                need -= hi - mid
                hi = mid                # on in the lower half
            else:                       # target in the lower half [lo, mid)
                if mid - lo >= need:
                    hi = mid
                    continue
                out += [at[d ^ target] for d in sorted([p ^ target for p in pos[lo:mid]])]
                need -= mid - lo
                lo, low = mid, low + size   # on in the upper half
        return out
