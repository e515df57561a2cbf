"""The iterative lookup's core (dht/lookup.py) over simulated Kademlia tables.

Each simulated peer keeps a real k-bucket table (one bucket of up to k peers
per shared-prefix length with its own position), as py-libp2p's does; asking
a peer returns its table's k closest to the key. The lookup must find the
true k closest of the whole network in a bounded number of rounds, skip
peers that fail, and stop by itself against a peer inventing endless
"closer" peers.
"""
from __future__ import annotations

import math
import os
import random

import pytest
from hypothesis import given, settings, strategies as st

from dht.lookup import K_CLOSEST, SEED_PEERS, Lookup, key_hash, peer_hash


def make_network(n: int, seed: int) -> dict[bytes, list[bytes]]:
    rng = random.Random(seed)
    peers = [rng.randbytes(34) for _ in range(n)]
    pos = {p: peer_hash(p) for p in peers}
    tables = {}
    for p in peers:
        buckets: dict[int, list[bytes]] = {}
        others = [q for q in peers if q != p]
        rng.shuffle(others)
        for q in others:
            b = (pos[p] ^ pos[q]).bit_length()
            if len(buckets.setdefault(b, [])) < K_CLOSEST:
                buckets[b].append(q)
        tables[p] = [q for bucket in buckets.values() for q in bucket]
    return tables


def closest_in(table: list[bytes], key: bytes, k: int = K_CLOSEST) -> list[bytes]:
    t = key_hash(key)
    return sorted(table, key=lambda q: peer_hash(q) ^ t)[:k]


def run(tables, start: bytes, key: bytes, *, dead=frozenset(), liar=None) -> Lookup:
    lk = Lookup(key, closest_in(tables[start], key, SEED_PEERS), to_bytes=lambda p: p, exclude=start)
    while batch := lk.next_batch():
        for peer in batch:
            if peer in dead or peer not in tables:   # gone, or invented by the liar
                lk.failed(peer)
            elif peer == liar:
                lk.answered(peer, [os.urandom(34) for _ in range(20)])
            else:
                lk.answered(peer, closest_in(tables[peer], key))
        lk.round_done()
    return lk


@pytest.fixture(scope="module")
def network():
    return make_network(200, seed=1)


def test_lookups_find_the_true_k_closest_within_log_rounds(network):
    peers = list(network)
    rng = random.Random(2)
    bound = math.ceil(math.log2(len(peers))) + 2
    for i in range(40):
        key = f"/meshd/model/sha256:{i:064x}".encode()
        start = rng.choice(peers)
        lk = run(network, start, key)
        truth = closest_in([p for p in peers if p != start], key)
        assert lk.answered_closest() == truth
        assert lk.rounds <= bound, lk.rounds


def test_dead_peers_leave_the_result_and_are_replaced(network):
    peers = list(network)
    rng = random.Random(3)
    dead = frozenset(rng.sample(peers, 40))
    live = [p for p in peers if p not in dead]
    for i in range(20):
        key = f"/meshd/span/x/{i}-{i + 1}".encode()
        start = rng.choice(live)
        lk = run(network, start, key, dead=dead)
        got = set(lk.answered_closest())
        assert not got & dead and len(got) == K_CLOSEST
        # the holders of a record stored before the deaths (the old k closest) are all still reached
        holders = set(closest_in([p for p in peers if p != start], key)) - dead
        assert holders <= got


def test_a_lying_peer_cannot_make_a_lookup_run_forever(network):
    peers = list(network)
    start, liar = peers[0], closest_in(network[peers[0]], b"/meshd/relays/v1")[0]
    lk = run(network, start, b"/meshd/relays/v1", liar=liar)
    assert lk.done and lk.rounds <= lk.max_rounds


def test_small_swarm_asks_alpha_then_everyone_in_a_final_round():
    tables = make_network(12, seed=4)
    start = next(iter(tables))
    lk = run(tables, start, b"/meshd/model/abc")
    assert lk.rounds == 2                       # nothing closer comes back: round 2 is final
    assert len(lk.answered_closest()) == 11     # everyone but us holds every key


@settings(max_examples=60, deadline=None)
@given(st.lists(st.binary(min_size=1, max_size=40), max_size=60), st.binary(max_size=128),
       st.integers(1, 30), st.integers(1, 8))
def test_any_answers_terminate_and_never_return_failed_peers(seeds, key, k, alpha):
    rng = random.Random(len(seeds))
    lk = Lookup(key, seeds, to_bytes=lambda p: p, k=k, alpha=alpha)
    while batch := lk.next_batch():
        for peer in batch:
            if rng.random() < 0.3:
                lk.failed(peer)
            elif rng.random() < 0.8:
                lk.answered(peer, [rng.randbytes(rng.randint(1, 40)) for _ in range(rng.randint(0, 5))])
        lk.round_done()
    assert lk.rounds <= lk.max_rounds
    assert all(lk.state[p] == "answered" for p in lk.answered_closest())
    assert len(lk.answered_closest()) <= k
