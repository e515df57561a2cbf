"""The iterative lookup's core (dht/lookup.py) over simulated Kademlia tables.

Each simulated peer keeps a real k-bucket table (one bucket of up to k peers
per shared-prefix length with its own position), as py-libp2p's does; asking
a peer returns its table's k closest to the key. The lookup must find the
true k closest of the whole network in a bounded number of rounds, skip
peers that fail, ask a late peer once more, and stop by itself against a
peer inventing endless "closer" peers.
"""
from __future__ import annotations

import math
import os
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dht.lookup import K_CLOSEST, LATE_QUORUM, SEED_PEERS, Lookup, key_hash, peer_hash


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


def run(tables, start: bytes, key: bytes, *, dead=frozenset(), liar=None, skip=frozenset(),
        asked: list | None = None) -> Lookup:
    lk = Lookup(key, closest_in(tables[start], key, SEED_PEERS), to_bytes=lambda p: p, exclude=start, skip=skip)
    while batch := lk.next_batch():
        if asked is not None:
            asked += batch
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


def test_peers_known_unreachable_are_never_asked_and_cost_no_round(network):
    """After churn every answer still names the dead. A lookup told which peers are unreachable
    (``skip``: the caller's dials to them failed lately) never asks them and reaches the same
    live k closest, in no more rounds than one that asks them and sees them fail."""
    peers = list(network)
    rng = random.Random(5)
    dead = frozenset(rng.sample(peers, 40))
    live = [p for p in peers if p not in dead]
    saved = 0
    for i in range(20):
        key = f"/meshd/model/sha256:{i:064x}".encode()
        start = rng.choice(live)
        asked: list = []
        skipping = run(network, start, key, dead=dead, skip=dead, asked=asked)
        asking = run(network, start, key, dead=dead)
        assert asked and not set(asked) & dead
        assert skipping.answered_closest() == asking.answered_closest()
        assert skipping.rounds <= asking.rounds
        saved += asking.rounds - skipping.rounds
    assert saved > 0          # asked, the dead cost rounds of their own


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


def test_late_peers_past_the_quorum_are_asked_once_more_and_a_twice_late_one_leaves(network):
    """Peers cut by the caller's deadline on live connections (``late``), LATE_QUORUM of them in
    one lookup, read as congestion: they stay candidates and are asked in a later round; late
    again, they fail."""
    peers = list(network)
    start = peers[5]
    key = b"/meshd/model/sha256:" + b"ab" * 32
    truth = closest_in([p for p in peers if p != start], key)
    slow, stuck = truth[0], truth[1]           # the two holders nearest the key
    asked: dict[bytes, int] = {}
    lk = Lookup(key, closest_in(network[start], key, SEED_PEERS), to_bytes=lambda p: p, exclude=start)
    while batch := lk.next_batch():
        for peer in batch:
            asked[peer] = asked.get(peer, 0) + 1
            if peer == stuck or (peer == slow and asked[peer] == 1):
                lk.late(peer)
            else:
                lk.answered(peer, closest_in(network[peer], key))
        lk.round_done()
    assert LATE_QUORUM == 2
    assert asked[slow] == 2 and asked[stuck] == 2 and max(asked.values()) == 2
    assert lk.state[slow] == "answered" and lk.state[stuck] == "failed"
    assert lk.answered_closest()[:1] == [slow] and stuck not in lk.answered_closest()
    assert lk.rounds <= math.ceil(math.log2(len(peers))) + 2


def test_a_second_ask_rides_along_with_the_next_alpha_fresh_ones():
    key = b"/meshd/model/x"
    pool = sorted((bytes([i]) * 34 for i in range(64)), key=lambda p: peer_hash(p) ^ key_hash(key))
    lk = Lookup(key, pool[5:15], to_bytes=lambda p: p, alpha=3)
    first = lk.next_batch()
    lk.late(first[0])
    lk.late(first[1])                                   # the quorum: both are candidates again
    lk.answered(first[2], pool[:1])                     # a closer peer: the next round is not final
    lk.round_done()
    assert not lk.final
    second = lk.next_batch()
    assert len(second) == 3 + 2 and set(first[:2]) <= set(second) and lk.rounds == 2


def test_a_lone_late_peer_is_given_up_at_once(network):
    """One late peer among answering ones has most likely vanished: asked once, like a failure."""
    peers = list(network)
    start = peers[7]
    key = b"/meshd/span/late/0-1"
    truth = closest_in([p for p in peers if p != start], key)
    asked: dict[bytes, int] = {}
    lk = Lookup(key, closest_in(network[start], key, SEED_PEERS), to_bytes=lambda p: p, exclude=start)
    while batch := lk.next_batch():
        for peer in batch:
            asked[peer] = asked.get(peer, 0) + 1
            if peer == truth[0]:
                lk.late(peer)
            else:
                lk.answered(peer, closest_in(network[peer], key))
        lk.round_done()
    assert asked[truth[0]] == 1 and lk.state[truth[0]] == "failed"
    assert lk.answered_closest() == truth[1:] + closest_in([p for p in peers if p != start], key, K_CLOSEST + 1)[-1:]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.binary(min_size=1, max_size=40), max_size=60), st.binary(max_size=128),
       st.integers(1, 30), st.integers(1, 8))
def test_any_answers_terminate_and_never_return_failed_peers(seeds, key, k, alpha):
    rng = random.Random(len(seeds))
    lk = Lookup(key, seeds, to_bytes=lambda p: p, k=k, alpha=alpha)
    while batch := lk.next_batch():
        for peer in batch:
            if rng.random() < 0.2:
                lk.failed(peer)
            elif rng.random() < 0.15:
                lk.late(peer)
            elif rng.random() < 0.8:
                lk.answered(peer, [rng.randbytes(rng.randint(1, 40)) for _ in range(rng.randint(0, 5))])
        lk.round_done()
    assert lk.rounds <= lk.max_rounds
    assert all(lk.state[p] == "answered" for p in lk.answered_closest())
    assert len(lk.answered_closest()) <= k
