"""dht/kademlia/table.py: the pure k-bucket table follows py-libp2p 0.8.1's RoutingTable.

The differential test runs the library's table and ours through the same
insertions and removals and compares their buckets (ranges, members, seen
order) and their closest peers after every step. Bucket size and bucket
count are small (patched into the library's module) so that full buckets,
splits and pings happen within a few dozen peers. The library pings a full
bucket's oldest peer over the network; here the ping is answered from the
test's set of live peers (an in-memory stand-in for the network).
"""
from __future__ import annotations

import hashlib
import random

import pytest
import trio
from hypothesis import given, settings
from hypothesis import strategies as st
from libp2p.kad_dht import routing_table as library
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import PeerInfo
from multiaddr import Multiaddr

from dht.kademlia.table import BUCKET_SIZE, MAX_BUCKETS, RoutingTable, key_position

LOOPBACK = [Multiaddr("/ip4/127.0.0.1/tcp/4001")]   # exempt from the library's subnet cap, as ours


def peer_bytes(i: int) -> bytes:
    return hashlib.sha256(f"peer {i}".encode()).digest()[:20] + i.to_bytes(4, "big")


def ours(me: int, k: int, max_buckets: int) -> RoutingTable[int]:
    return RoutingTable(me, lambda p: key_position(peer_bytes(p)), k=k, max_buckets=max_buckets)


def test_the_constants_are_the_librarys():
    from libp2p.kad_dht.common import BUCKET_SIZE as LIB_K
    from libp2p.kad_dht.common import MAXIMUM_BUCKETS as LIB_BUCKETS

    assert (BUCKET_SIZE, MAX_BUCKETS) == (LIB_K, LIB_BUCKETS) == (20, 256)


operations = st.lists(st.tuples(st.sampled_from(["add", "add", "add", "remove"]), st.integers(0, 59)),
                      min_size=1, max_size=120)


@settings(max_examples=60, deadline=None)
@given(ops=operations, dead=st.sets(st.integers(0, 59)), k=st.integers(2, 5), max_buckets=st.integers(1, 6))
def test_insertions_and_removals_leave_both_tables_alike(monkeypatch_module, ops, dead, k, max_buckets):
    monkeypatch_module.setattr(library, "BUCKET_SIZE", k)
    monkeypatch_module.setattr(library, "MAXIMUM_BUCKETS", max_buckets)
    ids = {i: ID(peer_bytes(i)) for i in range(60)}
    by_id = {v: i for i, v in ids.items()}
    me = 0

    async def ping(bucket, peer_id):           # the oldest peer answers when it is alive
        return by_id[peer_id] not in dead

    monkeypatch_module.setattr(library.KBucket, "_ping_peer", ping)
    mine = ours(me, k, max_buckets)

    async def main():
        theirs = library.RoutingTable(ids[me], host=None)
        for op, i in ops:
            if op == "add":
                await theirs.add_peer(PeerInfo(ids[i], LOOPBACK))
                oldest = mine.add(i)
                if oldest is not None and oldest in dead:
                    mine.evict(oldest, i)
            else:
                assert theirs.remove_peer(ids[i]) == mine.remove(i)
            assert [(b.min_range, b.max_range, [by_id[p] for p in b.peer_ids()]) for b in theirs.buckets] == \
                mine.buckets()
            key = f"/meshd/model/{op}{i}".encode()
            assert [by_id[p] for p in theirs.find_local_closest_peers(key, k + 3)] == mine.closest(key, k + 3)

    trio.run(main)


@pytest.fixture(scope="module")
def monkeypatch_module():
    mp = pytest.MonkeyPatch()
    yield mp
    mp.undo()


@settings(max_examples=200, deadline=None)
@given(positions=st.lists(st.integers(0, 2 ** 256 - 1), unique=True, max_size=200),
       target=st.integers(0, 2 ** 256 - 1), count=st.integers(0, 40))
def test_closest_is_the_brute_force_xor_order(positions, target, count):
    table = RoutingTable(-1, lambda p: positions[p], k=20, max_buckets=MAX_BUCKETS)
    for i in range(len(positions)):
        assert table.add(i) is None                # never full: 256 buckets of 20
    truth = sorted(range(len(positions)), key=lambda p: positions[p] ^ target)[:count]
    assert table.closest_to(target, count) == truth


def test_a_clustered_keyspace_still_gives_the_exact_closest():
    # positions sharing long prefixes with the target and each other: the walk goes deep
    rng = random.Random(3)
    target = rng.getrandbits(256)
    positions = [target ^ (1 << rng.randrange(256)) ^ rng.getrandbits(rng.randrange(1, 40)) for _ in range(300)]
    positions = list(dict.fromkeys(positions))
    table = RoutingTable(-1, lambda p: positions[p], k=20, max_buckets=MAX_BUCKETS)
    for i in range(len(positions)):
        table.add(i)
    assert table.closest_to(target, 25) == sorted(range(len(positions)), key=lambda p: positions[p] ^ target)[:25]


def test_our_own_id_never_enters_and_a_seen_peer_moves_to_the_tail():
    table = ours(0, 3, 1)
    assert table.add(0) is None and 0 not in table and len(table) == 0
    for p in (1, 2, 3):
        assert table.add(p) is None
    assert table.add(1) is None                    # seen again: now the most recent
    assert table.buckets()[0][2] == [2, 3, 1]


def test_a_full_bucket_that_cannot_split_names_its_oldest_and_keeps_it_unless_evicted():
    table = ours(0, 2, 1)                          # one bucket of two, never split
    table.add(1), table.add(2)
    assert table.add(3) == 1 and 3 not in table    # ping 1; it answered: 3 is dropped
    assert table.buckets()[0][2] == [1, 2]         # and 1 stays oldest (the library does not refresh it)
    assert table.evict(1, 3) and table.buckets()[0][2] == [2, 3]
    assert not table.evict(9, 0)                   # our own id never enters


def test_any_full_bucket_splits_until_the_bucket_count_is_reached():
    table = ours(0, 2, 4)
    added = [p for p in range(1, 60) if table.add(p) is None]
    lows = [low for low, _, _ in table.buckets()]
    assert len(lows) == 4 and lows == sorted(lows)
    assert sum(len(peers) for _, _, peers in table.buckets()) == len(table) == len(added) <= 8
    for low, high, peers in table.buckets():
        assert all(low <= key_position(peer_bytes(p)) < high for p in peers)
