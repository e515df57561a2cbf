"""Iterative Kademlia lookups for meshd's value keys (pure core).

Why GET_VALUE: py-libp2p 0.8.1 answers GET_VALUE for any key with the value
it holds (if any) plus the BUCKET_SIZE peers of its routing table closest to
``sha256(key)`` -- the keyspace its routing table sorts by
(``routing_table.peer_id_to_key``: ``sha256(peer id bytes)``). Its FIND_NODE
refuses keys over 50 bytes that are not multihashes, so a ``/meshd/`` key
(up to 128 bytes) routes through GET_VALUE: one RPC returns both the value
and the next hop candidates.

Algorithm (the Kademlia paper's, with its final round)::

    seeds (routing table's closest + connected peers)
      -> round: ask the ALPHA closest not-yet-asked among the k closest live
                candidates, concurrently; answers add closer peers; a peer
                that fails (dial refused, connection gone) leaves the
                candidate set; so does one that was only late (our deadline
                cut it on a live connection) -- unless LATE_QUORUM peers of
                this lookup were late: then each late peer is asked once more
                in the next round (next to the alpha fresh ones), and leaves
                only if late again (``late``)
      -> a round that brings no candidate closer than the best one before it
         makes the next round the final one: every not-yet-asked peer among
         the k closest is asked at once
      -> done when the k closest live candidates have all answered, or after
         ``max_rounds`` rounds (bounded whatever the network answers)

Peers the caller knows to be unreachable (``skip``: a dial to them failed
lately) are never candidates: after churn every answer still names the dead
(a peer drops one from its table only when it tries it itself), and each
would cost a dial and, in the final rounds, a round of its own.

``Lookup`` is the state only (sans-I/O): the caller (dht/kademlia/ops.py, run
by dht/node.py and by the simulation) sends each batch and reports answers.
State: per peer its distance and whether it is new, asked, answered or
failed, and every candidate in distance order; the peers late once, and
those given their second ask; the round count; the best distance seen.

Why a second ask, and why only past a quorum: one late peer among answering
ones has most likely vanished (a host gone without closing its connection:
asking again would cost every read two more deadlines, the doubled one
included, until STUCK_AFTER closes it). Many late peers in one lookup mean
the machine or the network is congested, and then late means busy. In
``meshd bench dht`` (200 nodes on 2 cores) 3-6% of RPCs are cut while the
sampled nodes read; one CI run's reads missed 17 of 4000 records
(found_fraction 0.9958). Every record sat at 21 or more nodes in the runs
measured since (``min_record_replicas_before``), so a miss is the reader's:
its lookup gave up on many late holders at once -- past the quorum.
"""
from __future__ import annotations

import hashlib
from collections.abc import Callable, Container, Hashable, Iterable

# Kademlia's k (replication and the lookup's result size) and alpha (parallel asks per round).
K_CLOSEST = 20
ALPHA = 3
# Seeds a lookup takes from our own table: more than k, so that replacements
# for dead peers among the k closest are at hand (answers carry only k each,
# and a peer's table lists the dead until it notices).
SEED_PEERS = 2 * K_CLOSEST
# A lookup in a network of N peers converges in about log2(N) rounds; this bound
# covers millions of peers and stops a lookup fed endless fake "closer" peers.
MAX_ROUNDS = 24
# Candidates remembered per lookup: each answer brings at most BUCKET_SIZE (20) peers.
MAX_CANDIDATES = 1024
# Late peers in one lookup from which lateness reads as congestion (see the docstring).
LATE_QUORUM = 2

NEW, ASKED, ANSWERED, FAILED = "new", "asked", "answered", "failed"


def key_hash(key: bytes) -> int:
    """A DHT key's position in the keyspace (what py-libp2p's GET_VALUE handler sorts by)."""
    return int.from_bytes(hashlib.sha256(key).digest(), "big")


def peer_hash(peer_bytes: bytes) -> int:
    """A peer's position: sha256 of its peer id bytes (py-libp2p's peer_id_to_key)."""
    return int.from_bytes(hashlib.sha256(peer_bytes).digest(), "big")


class Lookup:
    """One iterative lookup's state. Peers are opaque hashables; ``to_bytes`` gives their id bytes."""

    def __init__(self, key: bytes, seeds: Iterable[Hashable], *, to_bytes, exclude: Hashable | None = None,
                 skip: Container[Hashable] = frozenset(),
                 k: int = K_CLOSEST, alpha: int = ALPHA, max_rounds: int = MAX_ROUNDS,
                 position: Callable[..., int] | None = None) -> None:
        if k < 1 or alpha < 1 or max_rounds < 1:
            raise ValueError("k, alpha and max_rounds must be positive")
        self.target = key_hash(key)
        self.k, self.alpha, self.max_rounds = k, alpha, max_rounds
        # a peer's keyspace position: peer_hash of its id bytes, or the caller's (precomputed) one
        self._position = position or (lambda peer: peer_hash(to_bytes(peer)))
        self._exclude = exclude
        self._skip = skip        # peers known unreachable: never candidates, whoever names them
        self.distance: dict[Hashable, int] = {}
        self.state: dict[Hashable, str] = {}
        self._order: list[tuple[int, Hashable]] = []    # (distance, peer) of every candidate, nearest first
        self._sorted = True                               # _order is sorted (``add`` appends: sorted when read)
        self.rounds = 0
        self.final = False
        self._late_once: set[Hashable] = set()   # late, given up on while below the quorum
        self._retried: set[Hashable] = set()     # given their second ask
        self._best_before: int | None = None
        self.add(seeds)

    def add(self, peers: Iterable[Hashable]) -> None:
        state = self.state
        for peer in peers:
            if peer in state or peer == self._exclude or peer in self._skip or len(state) >= MAX_CANDIDATES:
                continue
            distance = self._position(peer) ^ self.target
            self.distance[peer] = distance
            state[peer] = NEW
            self._order.append((distance, peer))
            self._sorted = False

    def _ordered(self) -> list[tuple[int, Hashable]]:
        if not self._sorted:
            self._order.sort()
            self._sorted = True
        return self._order

    def closest(self) -> list[Hashable]:
        """The k closest candidates that have not failed, nearest first."""
        out, state, k = [], self.state, self.k
        for _, peer in self._ordered():
            if state[peer] != FAILED:
                out.append(peer)
                if len(out) == k:
                    break
        return out

    def answered_closest(self) -> list[Hashable]:
        """The k closest peers that answered: where a key's records live (PUT targets)."""
        out, state, k = [], self.state, self.k
        for _, peer in self._ordered():
            if state[peer] == ANSWERED:
                out.append(peer)
                if len(out) == k:
                    break
        return out

    def _best(self) -> int | None:
        return next((d for d, peer in self._ordered() if self.state[peer] != FAILED), None)

    @property
    def done(self) -> bool:
        return self.rounds >= self.max_rounds or not any(self.state[p] == NEW for p in self.closest())

    def next_batch(self) -> list[Hashable]:
        """The peers to ask in the next round ([] when the lookup is over)."""
        if self.done:
            return []
        new = [p for p in self.closest() if self.state[p] == NEW]
        if self.final:
            batch = new
        else:   # a second ask rides along with the next alpha fresh ones: it costs no round of its own
            batch = [p for p in new if p not in self._retried][:self.alpha] + [p for p in new if p in self._retried]
        for peer in batch:
            self.state[peer] = ASKED
        self.rounds += 1
        self._best_before = self._best()
        return batch

    def answered(self, peer: Hashable, closer: Iterable[Hashable]) -> None:
        if self.state.get(peer) == ASKED:
            self.state[peer] = ANSWERED
            self.add(closer)

    def failed(self, peer: Hashable) -> None:
        if self.state.get(peer) == ASKED:
            self.state[peer] = FAILED

    def late(self, peer: Hashable) -> None:
        """Our deadline cut ``peer`` on a live connection. Below LATE_QUORUM late peers it
        fails like any other; from the quorum on, it and every peer late before it are
        candidates again, asked once more; late a second time, a peer fails."""
        if self.state.get(peer) != ASKED:
            return
        self.state[peer] = FAILED
        if peer in self._retried:
            return
        self._late_once.add(peer)
        if len(self._late_once) + len(self._retried) >= LATE_QUORUM:
            for p in self._late_once:
                self.state[p] = NEW
            self._retried |= self._late_once
            self._late_once.clear()

    def round_done(self) -> None:
        """Close a round: one that found no closer candidate makes the next one final."""
        for peer, s in self.state.items():
            if s == ASKED:       # never reported: counts as failed
                self.state[peer] = FAILED
        best = self._best()
        if self._best_before is not None and (best is None or best >= self._best_before):
            self.final = True
