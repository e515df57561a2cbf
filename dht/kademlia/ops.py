"""A node's DHT operations as sans-I/O steps: lookup, publish, fetch, join, refresh.

Each operation is a generator (a *step*) that yields effects and gets their
results sent back; it never touches a socket or a clock of its own. Two
edges carry the effects out: ``DhtNode`` (dht/node.py) over py-libp2p
streams under trio, and the simulation (dht/kademlia/sim.py) over its
in-memory network on a fake clock. Both therefore run the same decisions.

Effects::

    Get(peer, key)              -> Outcome   one GET_VALUE under the node's deadline
    Put(peer, key, value)       -> Outcome   one PUT_VALUE under the node's deadline
    Pause(seconds)              -> None
    Together(steps, limit)      -> list      the sub-steps at once (at most ``limit`` of
                                             their RPCs in flight), their results in order

An ``Outcome`` is ANSWERED (with the value the peer holds and the peers it
knows closest to the key, or whether it stored a PUT), TIMED_OUT (our
deadline cut it) or FAILED (dial refused, stream reset, connection gone),
plus whether the peer was connected when it ended.

What each operation decides:

* ``lookup(node, key)``: the iterative lookup of dht/lookup.py, rounds of
  concurrent GETs from ``node.seeds`` (the table's closest, then every
  connected peer). An answer adds the peer's closer peers and puts the peer
  in our table (``node.learn``); a peer cut by our deadline on a live
  connection is late (asked once more past a quorum: ``Lookup.late``); a
  peer we could not reach leaves our table and is left out of lookups for a
  while (``node.forget``); one cut or refused on a live connection (busy)
  stays.
* ``publish(node, record)``: store the record locally under every key it
  belongs to (dht/keys.py: the record itself under its peer key, a
  one-record set under each index key), then for every key at once a lookup
  and a PUT to the k closest peers it found (``put_remote``). A PUT a peer
  refused while it stayed connected (busy, or not news to it) is sent again
  after a short random pause, up to PUT_ATTEMPTS; one our deadline cut
  never is (that adds load where there is too much).
* ``fetch(node, key)``: a lookup keeping every answering peer's value; the
  values (with our own copy) that validate are merged (kademlia/values.py).
* ``join(node)``: once the bootstrap peers are in our table, a lookup of our
  own id, then one lookup per bucket beyond our neighbourhood (the Kademlia
  paper's bucket refresh).
* ``refresh(node, far_key)``: lookups of our own id and of one random key
  (a far bucket), every REFRESH_INTERVAL_S at a random phase
  (``refresh_delay``); the record owner republishes every
  ``republish_interval_s(ttl)`` (the daemon's advertiser: ttl / 3, so two
  republishes may fail before the record expires).

``node`` is the ``Node`` protocol below: what an operation reads from and
tells the node that runs it. The operations hold no state between calls.
"""
from __future__ import annotations

import random
from collections import Counter
from collections.abc import Container, Generator, Hashable
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

from dht import keys as K
from dht.kademlia import values
from dht.lookup import FAILED as FAILED_ASK
from dht.lookup import NEW, Lookup, key_hash
from dht.records import CapabilityRecord, RecordCache, encode_record_set

# Concurrent PUTs of one key's fan-out (Kademlia's alpha is 3; ours is a small swarm).
MAX_PARALLEL_RPCS = 8
# A PUT a live peer refused (py-libp2p 0.8.1's KadDHT resets streams beyond its inbound
# cap, "the remote will retry") is sent again, up to PUT_ATTEMPTS in all, after a short
# random pause.
PUT_ATTEMPTS = 3
PUT_RETRY_PAUSE_S = (0.05, 0.4)
# The routing-table refresh: every REFRESH_INTERVAL_S, at a random phase (x uniform
# REFRESH_JITTER) so that nodes started together never refresh together (a burst of
# every node's lookups at one moment collapses whatever phase it meets).
REFRESH_INTERVAL_S = 600.0
REFRESH_JITTER = (0.5, 1.5)
# A join refreshes at most this many buckets beyond its neighbourhood: 2^JOIN_BUCKETS x k nodes
# (a million) before the farthest buckets are left to the periodic refresh.
JOIN_BUCKETS = 16
KEYSPACE_BITS = 256
# Keys drawn in search of one in a bucket: the farthest, JOIN_BUCKETS - 1 shared bits, takes
# 2^JOIN_BUCKETS tries on average (sha256 each); this bound is never reached but keeps the loop finite.
KEY_SEARCH_LIMIT = 1 << 24
# The record owner republishes every ttl / REPUBLISHES_PER_TTL (meshd/daemon/advertiser.py):
# two republishes may fail before the record expires.
REPUBLISHES_PER_TTL = 3

ANSWERED, TIMED_OUT, FAILED = "answered", "timed_out", "failed"


@dataclass(frozen=True, slots=True)
class Get:
    peer: Hashable
    key: bytes


@dataclass(frozen=True, slots=True)
class Put:
    peer: Hashable
    key: bytes
    value: bytes


@dataclass(frozen=True, slots=True)
class Pause:
    seconds: float


@dataclass(frozen=True, slots=True)
class Together:
    steps: tuple
    limit: int | None = None


@dataclass(frozen=True, slots=True)
class Outcome:
    kind: str                        # ANSWERED, TIMED_OUT or FAILED
    connected: bool                  # the peer was connected when the RPC ended
    value: bytes | None = None       # a GET's answer: the value the peer holds
    closer: tuple = ()               # a GET's answer: the peers it knows closest to the key
    stored: bool = False             # a PUT's answer: acknowledged


@dataclass(frozen=True, slots=True)
class LookupResult:
    closest: tuple        # the k closest peers that answered, nearest first (PUT targets)
    rounds: int           # rounds of parallel asks the lookup took
    asked: int            # peers asked in all
    failed: int = 0       # of them, how many did not answer (unreachable, cut by the deadline)


@dataclass(frozen=True, slots=True)
class Fetched:
    records: list = field(hash=False)
    lookup: LookupResult


# What a step yields (an effect), is sent back (its result) and returns: see the module docstring.
Step = Generator[Any, Any, Any]
# A peer, as the edge names it: a libp2p ID in the product, an index in the simulation.
P = TypeVar("P", bound=Hashable)


class Node(Protocol[P]):
    """What an operation needs from the node that runs it."""

    me: P
    cache: RecordCache
    rng: random.Random

    def to_bytes(self, peer: P) -> bytes: ...
    def position(self, peer: P) -> int: ...                     # sha256 of its id bytes, as an int
    def seeds(self, key: bytes) -> list[P]: ...                 # a lookup's first candidates
    def skip(self) -> Container[P]: ...                         # peers left out of lookups now
    def learn(self, peer: P) -> None: ...                       # it answered: into the table
    def forget(self, peer: P) -> None: ...                      # unreachable: out of table and lookups
    def looked_up(self, result: LookupResult) -> None: ...      # a lookup ended
    def store_locally(self, key: str, value: bytes) -> None: ...
    def local_value(self, key: bytes) -> bytes | None: ...
    def wall_ms(self) -> int: ...


def lookup(node: Node[P], key: bytes, found: list[bytes] | None = None) -> Step:
    """Iterative lookup of ``key``; every answering peer's value is appended to ``found``."""
    lk = Lookup(key, node.seeds(key), to_bytes=node.to_bytes, exclude=node.me, skip=node.skip(),
                position=node.position)
    while batch := lk.next_batch():
        yield Together(tuple(_ask(node, lk, peer, key, found) for peer in batch))
        lk.round_done()
    fates = Counter(lk.state.values())
    result = LookupResult(closest=tuple(lk.answered_closest()), rounds=lk.rounds,
                          asked=len(lk.state) - fates[NEW], failed=fates[FAILED_ASK])
    node.looked_up(result)
    return result


def _ask(node: Node[Any], lk: Lookup, peer: Hashable, key: bytes, found: list[bytes] | None) -> Step:
    out: Outcome = yield Get(peer, key)
    if out.kind == TIMED_OUT and out.connected:
        lk.late(peer)            # past the quorum, asked once more, under its doubled deadline
        return
    if out.kind != ANSWERED:
        lk.failed(peer)
        if out.kind == FAILED and not out.connected:
            node.forget(peer)    # unreachable; one cut or refused on a live connection (busy) stays
        return
    lk.answered(peer, out.closer)
    if out.value and found is not None:
        found.append(out.value)
    node.learn(peer)


def publish_plan(record: CapabilityRecord) -> list[tuple[str, bytes]]:
    """(key, value) for every key ``record`` is published under: the record under its peer
    key, a one-record set under each index key (no span key for a withdrawal)."""
    span = None if record.withdrawn else record.span
    return [(key, record.raw if key == K.peer_key(record.peer_id) else encode_record_set([record]))
            for key in K.keys_for(record.peer_id, record.model_artifact_digest, span)]


def publish(node: Node[P], record: CapabilityRecord) -> Step:
    """Store ``record`` under all its keys, locally first (one validation instant), then at the
    k closest peers of every key at once; returns how many remote stores were acknowledged."""
    puts = publish_plan(record)
    for key, value in puts:
        node.store_locally(key, value)
    acked = yield Together(tuple(put_remote(node, key, value) for key, value in puts))
    return sum(acked)


def put_remote(node: Node[P], key: str, value: bytes) -> Step:
    """PUT ``value`` at the k closest peers of ``key`` that a lookup finds; returns the acks."""
    kb = key.encode()
    found = yield from lookup(node, kb)
    acks = yield Together(tuple(_put_one(node, peer, kb, value) for peer in found.closest), MAX_PARALLEL_RPCS)
    return sum(acks)


def _put_one(node: Node[P], peer: P, key: bytes, value: bytes) -> Step:
    for attempt in range(PUT_ATTEMPTS):
        if attempt:       # refused (a busy peer resets) but still connected: it is alive
            yield Pause(node.rng.uniform(*PUT_RETRY_PAUSE_S))
        out: Outcome = yield Put(peer, key, value)
        if out.kind == ANSWERED and out.stored:
            return 1
        if out.kind == TIMED_OUT or not out.connected:
            return 0      # late: busy (asking again adds load where there is too much); gone
    return 0


def fetch(node: Node[P], key: str) -> Step:
    """Every valid, unexpired record under ``key`` that we and the peers a lookup asks hold."""
    K.parse_key(key)                 # a bad key fails before any RPC
    kb = key.encode()
    found: list[bytes] = []
    local = node.local_value(kb)
    if local is not None:
        found.append(local)
    result = yield from lookup(node, kb, found)
    return Fetched(values.fetched(key, found, node.wall_ms(), node.cache), result)


def join(node: Node[P]) -> Step:
    """Kademlia's join, once the bootstrap peers are in our table: a lookup of our own id (our
    neighbourhood), then at once one lookup per bucket farther away than our k-th closest
    neighbour, each of a key in that bucket (the paper's bucket refresh; at most
    JOIN_BUCKETS). Without them a new node knows only its own neighbourhood, and so do the
    peers it asks (py-libp2p's table holds whoever it met): lookups from one region of the
    keyspace can stall short of a key's holders in another. Returns the number of lookups."""
    me = node.position(node.me)
    near = yield from lookup(node, node.to_bytes(node.me))
    if not near.closest:
        return 1
    radius = _shared_bits(me, node.position(near.closest[-1]))
    keys = [key_in_bucket(me, bits, node.rng) for bits in range(min(radius, JOIN_BUCKETS))]
    yield Together(tuple(lookup(node, key) for key in keys))
    return 1 + len(keys)


def _shared_bits(a: int, b: int) -> int:
    """How many leading bits two keyspace positions share."""
    return KEYSPACE_BITS - (a ^ b).bit_length()


def key_in_bucket(me: int, bits: int, rng: random.Random) -> bytes:
    """A random key whose position shares exactly ``bits`` leading bits with ``me``: keys are
    hashed into the keyspace (sha256), so drawn until one lands there (2^(bits+1) tries on average)."""
    for _ in range(KEY_SEARCH_LIMIT):
        key = rng.randbytes(32)
        if _shared_bits(me, key_hash(key)) == bits:
            return key
    raise ValueError(f"no key found sharing {bits} bits")


def refresh(node: Node[P], far_key: bytes) -> Step:
    """One routing-table refresh: lookups of our own id and of ``far_key``."""
    yield from lookup(node, node.to_bytes(node.me))
    yield from lookup(node, far_key)


def refresh_delay(rng: random.Random, interval_s: float = REFRESH_INTERVAL_S) -> float:
    """How long until the next refresh: the interval at a random phase."""
    return interval_s * rng.uniform(*REFRESH_JITTER)


def republish_interval_s(ttl_s: float) -> float:
    """How often a record's owner publishes it again (the daemon's advertiser)."""
    return ttl_s / REPUBLISHES_PER_TTL
