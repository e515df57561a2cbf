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
                that fails (dial, timeout) leaves the candidate set
      -> a round that brings no candidate closer than the best one before it
         makes the next round the final one: every not-yet-asked peer among
         the k closest is asked at once
      -> done when the k closest live candidates have all answered, or after
         ``max_rounds`` rounds (bounded whatever the network answers)

``Lookup`` is the state only (sans-I/O): the caller (dht/node.py) sends each
batch and reports answers. State: per peer its distance and whether it is
new, asked, answered or failed; the round count; the best distance seen.
"""
from __future__ import annotations

import hashlib
from collections.abc import Iterable
from typing import Hashable

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
                 k: int = K_CLOSEST, alpha: int = ALPHA, max_rounds: int = MAX_ROUNDS) -> None:
        if k < 1 or alpha < 1 or max_rounds < 1:
            raise ValueError("k, alpha and max_rounds must be positive")
        self.target = key_hash(key)
        self.k, self.alpha, self.max_rounds = k, alpha, max_rounds
        self._to_bytes = to_bytes
        self._exclude = exclude
        self.distance: dict[Hashable, int] = {}
        self.state: dict[Hashable, str] = {}
        self.rounds = 0
        self.final = False
        self._best_before: int | None = None
        self.add(seeds)

    def add(self, peers: Iterable[Hashable]) -> None:
        for peer in peers:
            if peer == self._exclude or peer in self.state or len(self.state) >= MAX_CANDIDATES:
                continue
            self.distance[peer] = peer_hash(self._to_bytes(peer)) ^ self.target
            self.state[peer] = NEW

    def closest(self) -> list[Hashable]:
        """The k closest candidates that have not failed, nearest first."""
        live = [p for p, s in self.state.items() if s != FAILED]
        live.sort(key=self.distance.__getitem__)
        return live[:self.k]

    def answered_closest(self) -> list[Hashable]:
        """The k closest peers that answered: where a key's records live (PUT targets)."""
        ok = [p for p, s in self.state.items() if s == ANSWERED]
        ok.sort(key=self.distance.__getitem__)
        return ok[:self.k]

    def _best(self) -> int | None:
        live = [self.distance[p] for p, s in self.state.items() if s != FAILED]
        return min(live) if live else None

    @property
    def done(self) -> bool:
        return self.rounds >= self.max_rounds or not any(self.state[p] == NEW for p in self.closest())

    def next_batch(self) -> list[Hashable]:
        """The peers to ask in the next round ([] when the lookup is over)."""
        if self.done:
            return []
        new = [p for p in self.closest() if self.state[p] == NEW]
        batch = new if self.final else new[:self.alpha]
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

    def round_done(self) -> None:
        """Close a round: one that found no closer candidate makes the next one final."""
        for peer, s in self.state.items():
            if s == ASKED:       # never reported: counts as failed
                self.state[peer] = FAILED
        best = self._best()
        if self._best_before is not None and (best is None or best >= self._best_before):
            self.final = True
