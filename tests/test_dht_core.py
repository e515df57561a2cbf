"""The Kademlia core's decisions (dht/kademlia/ops.py, values.py, book.py), with no network.

Operations are driven by a small synchronous driver that answers each effect
from a script or from a fake network of ``ValueStore``s that all know each
other (so the k closest of a key are known exactly); sub-steps of a
``Together`` run one after another. The value store is checked against the
product's own path: py-libp2p's PUT_VALUE handler order over dht/validator.py's
``MeshdValidator`` and ``MergingValueStore``.
"""
from __future__ import annotations

import hashlib
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from libp2p.kad_dht.pb.kademlia_pb2 import Record

from dht import keys as K
from dht.errors import RecordRejected
from dht.kademlia import ops
from dht.kademlia.book import (
    CLOSE,
    FOREIGN_RECHECK_S,
    KEEP,
    RPC_TIMEOUT_CEILING_S,
    RPC_TIMEOUT_S,
    STUCK_AFTER,
    ForeignPeers,
    RpcBook,
)
from dht.kademlia.ops import ANSWERED, FAILED, TIMED_OUT, Get, Outcome, Pause, Put, Together
from dht.kademlia.values import ValueStore, fetched
from dht.lookup import key_hash
from dht.records import RecordCache, encode_record_set, validate_capability
from dht.validator import MergingValueStore, MeshdValidator
from tests._daemon_helpers import DIGEST, NOW_MS, TTL_MS, as_record_set, forged_records, good, identity


def peer_bytes(i: int) -> bytes:
    return hashlib.sha256(f"peer {i}".encode()).digest()


def position(i: int) -> int:
    return int.from_bytes(hashlib.sha256(peer_bytes(i)).digest(), "big")


class FakeNode:
    """An ``ops.Node`` over ints, knowing ``peers``; records what the operations told it."""

    def __init__(self, me: int, peers: list[int], now: list[int]) -> None:
        self.me, self.peers, self.now = me, peers, now
        self.cache = RecordCache()
        self.rng = random.Random(1)
        self.store = ValueStore(lambda: now[0], self.cache)
        self.learned: list[int] = []
        self.forgotten: list[int] = []
        self.lookups: list[ops.LookupResult] = []

    def to_bytes(self, peer: int) -> bytes:
        return peer_bytes(peer)

    def position(self, peer: int) -> int:
        return position(peer)

    def seeds(self, key: bytes) -> list[int]:
        return sorted((p for p in self.peers if p != self.me), key=lambda p: position(p) ^ key_hash(key))[:40]

    def skip(self) -> frozenset[int]:
        return frozenset(self.forgotten)

    def learn(self, peer: int) -> None:
        self.learned.append(peer)

    def forget(self, peer: int) -> None:
        self.forgotten.append(peer)

    def looked_up(self, result: ops.LookupResult) -> None:
        self.lookups.append(result)

    def store_locally(self, key: str, value: bytes) -> None:
        self.store.store_locally(key, value)

    def local_value(self, key: bytes) -> bytes | None:
        return self.store.get(key)

    def wall_ms(self) -> int:
        return self.now[0]


def drive(step, answer, seen: list | None = None):
    """Run ``step`` to its end; ``answer(effect)`` gives each GET's and PUT's Outcome; every
    effect is appended to ``seen``."""
    result = None
    while True:
        try:
            effect = step.send(result)
        except StopIteration as done:
            return done.value
        if seen is not None:
            seen.append(effect)
        if isinstance(effect, (Get, Put)):
            result = answer(effect)
        elif isinstance(effect, Pause):
            result = None
        else:
            assert isinstance(effect, Together)
            result = [drive(sub, answer, seen) for sub in effect.steps]


class FakeNetwork:
    """``count`` nodes that all know each other: a GET answers the value held and the asked
    node's k closest peers; a PUT is stored by the rules of values.ValueStore."""

    def __init__(self, count: int) -> None:
        self.now = [NOW_MS]
        self.nodes = [FakeNode(i, list(range(count)), self.now) for i in range(count)]
        self.asked: list[tuple[str, int]] = []

    def answer(self, effect) -> Outcome:
        node = self.nodes[effect.peer]
        if isinstance(effect, Get):
            self.asked.append(("get", effect.peer))
            return Outcome(ANSWERED, True, value=node.store.get(effect.key), closer=tuple(node.seeds(effect.key)[:20]))
        self.asked.append(("put", effect.peer))
        try:
            return Outcome(ANSWERED, True, stored=True) if node.store.put(effect.key, effect.value) else \
                Outcome(FAILED, True)
        except RecordRejected:
            return Outcome(FAILED, True)

    def closest(self, key: bytes, count: int, but: int) -> list[int]:
        others = (i for i in range(len(self.nodes)) if i != but)
        return sorted(others, key=lambda p: position(p) ^ key_hash(key))[:count]


def record(seed: int, *, seq: int = 10, now: int = NOW_MS, start: int = 0, end: int = 4):
    raw = good(identity(seed), seq=seq, now=now, start=start, end=end)
    return validate_capability(raw, now)


# ------------------------------------------------------------------------------------- publish

def test_a_record_is_published_under_its_peer_key_and_as_a_one_record_set_under_each_index():
    rec = record(60, start=2, end=4)
    plan = dict(ops.publish_plan(rec))
    assert plan == {K.peer_key(rec.peer_id): rec.raw, K.model_key(DIGEST): encode_record_set([rec]),
                    K.span_key(DIGEST, 2, 4): encode_record_set([rec])}


def test_a_publish_stores_locally_first_then_at_exactly_the_k_closest_of_every_key():
    net = FakeNetwork(40)
    publisher = net.nodes[7]
    rec = record(60)
    acked = drive(ops.publish(publisher, rec), net.answer)
    assert acked == 3 * 20
    for key, value in ops.publish_plan(rec):
        assert publisher.store.get(key.encode()) == value
        holders = {n.me for n in net.nodes if n.me != 7 and n.store.get(key.encode()) is not None}
        assert holders == set(net.closest(key.encode(), 20, but=7))
    assert len(publisher.lookups) == 3 and all(r.rounds >= 1 for r in publisher.lookups)


def test_a_refused_put_is_sent_again_after_a_pause_but_a_late_or_gone_peer_never():
    tries: dict[int, int] = {}
    script = {1: [FAILED, FAILED, "stored"], 2: [TIMED_OUT], 3: ["gone"], 4: [FAILED, FAILED, FAILED]}

    def answer(effect) -> Outcome:
        if isinstance(effect, Get):                 # the lookup: peers 1-4 answer and know nobody else
            return Outcome(ANSWERED, True)
        n = tries[effect.peer] = tries.get(effect.peer, 0) + 1
        what = script[effect.peer][n - 1]
        if what == "stored":
            return Outcome(ANSWERED, True, stored=True)
        if what == "gone":
            return Outcome(FAILED, False)
        return Outcome(what, True)

    node = FakeNode(0, [0, 1, 2, 3, 4], [NOW_MS])
    seen: list = []
    acked = drive(ops.put_remote(node, K.model_key(DIGEST), encode_record_set([record(60)])), answer, seen)
    assert acked == 1
    assert tries == {1: 3, 2: 1, 3: 1, 4: ops.PUT_ATTEMPTS}
    pauses = [e.seconds for e in seen if isinstance(e, Pause)]
    assert len(pauses) == 2 + (ops.PUT_ATTEMPTS - 1)
    assert all(ops.PUT_RETRY_PAUSE_S[0] <= p <= ops.PUT_RETRY_PAUSE_S[1] for p in pauses)
    fan_out = [e for e in seen if isinstance(e, Together) and e.limit]
    assert len(fan_out) == 1 and fan_out[0].limit == ops.MAX_PARALLEL_RPCS and len(fan_out[0].steps) == 4


# ------------------------------------------------------------------------------------- fetch

def test_a_fetch_merges_the_local_copy_and_every_answer_and_skips_a_forged_value():
    key = K.model_key(DIGEST)
    net = FakeNetwork(30)
    reader = net.nodes[0]
    reader.store.store_locally(key, encode_record_set([record(61, seq=3)]))
    net.nodes[5].store.put(key.encode(), encode_record_set([record(61, seq=4)]))    # a newer one of 61
    net.nodes[9].store.put(key.encode(), encode_record_set([record(62)]))
    forged = as_record_set(forged_records(identity(63), identity(64))["forged_signature"])

    def answer(effect):
        out = net.answer(effect)
        if effect.peer in net.closest(key.encode(), 3, but=0):     # peers answering a forged record
            return Outcome(ANSWERED, True, value=forged, closer=out.closer)
        return out

    got = drive(ops.fetch(reader, key), answer)
    assert sorted((r.peer_id, r.sequence) for r in got.records) == sorted(
        [(identity(61).peer_id, 4), (identity(62).peer_id, 10)])
    assert got.lookup is reader.lookups[-1] and got.lookup.asked >= 20


def test_a_fetch_drops_expired_records_and_refuses_a_record_of_another_model():
    key = K.model_key(DIGEST)
    now = NOW_MS + TTL_MS // 2
    old = good(identity(65), now=NOW_MS - TTL_MS)          # expired by now
    other = good(identity(66), digest="sha256:" + "cd" * 32)
    live = good(identity(67))
    values = [as_record_set(r) for r in (old, other, live)]
    assert [r.peer_id for r in fetched(key, values, now)] == [identity(67).peer_id]


def test_equal_values_are_read_once():
    key = K.model_key(DIGEST)
    cache = RecordCache()
    value = encode_record_set([record(61)])
    assert fetched(key, [value] * 20, NOW_MS, cache) == fetched(key, [value], NOW_MS)
    assert cache.misses + cache.hits == 1


# ------------------------------------------------------------------------------------- lookup

def test_a_lookup_learns_who_answered_and_forgets_only_who_could_not_be_reached():
    fates = {1: Outcome(ANSWERED, True), 2: Outcome(FAILED, False), 3: Outcome(FAILED, True),
             4: Outcome(TIMED_OUT, False), 5: Outcome(TIMED_OUT, True)}
    node = FakeNode(0, list(range(6)), [NOW_MS])
    result = drive(ops.lookup(node, b"/meshd/model/x"), lambda e: fates[e.peer])
    assert node.learned == [1]
    assert node.forgotten == [2]                    # refused on a live connection (busy) stays; late stays
    assert result.closest == (1,) and result.failed == 4 and node.lookups == [result]


def test_late_peers_past_the_quorum_are_asked_once_more():
    asks: dict[int, int] = {}

    def answer(effect):
        asks[effect.peer] = asks.get(effect.peer, 0) + 1
        return Outcome(TIMED_OUT, True) if asks[effect.peer] == 1 and effect.peer in (1, 2) else Outcome(ANSWERED, True)

    node = FakeNode(0, [0, 1, 2, 3], [NOW_MS])
    result = drive(ops.lookup(node, b"/meshd/model/x"), answer)
    assert asks == {1: 2, 2: 2, 3: 1} and sorted(result.closest) == [1, 2, 3]


# ------------------------------------------------------------------------------------- join

@settings(max_examples=50, deadline=None)
@given(me=st.integers(0, 2 ** 256 - 1), bits=st.integers(0, 10), seed=st.integers(0, 1000))
def test_a_key_in_bucket_shares_exactly_that_many_leading_bits(me, bits, seed):
    key = ops.key_in_bucket(me, bits, random.Random(seed))
    assert 256 - (me ^ key_hash(key)).bit_length() == bits


def test_a_join_looks_up_its_own_id_then_one_key_per_bucket_beyond_its_neighbourhood():
    net = FakeNetwork(200)
    node = net.nodes[3]
    seen: list = []
    lookups = drive(ops.join(node), net.answer, seen)
    me = position(3)
    radius = 256 - (me ^ position(node.lookups[0].closest[-1])).bit_length()    # our k-th closest's
    assert radius >= 2 and lookups == 1 + radius == len(node.lookups)
    keys = list(dict.fromkeys(e.key for e in seen if isinstance(e, Get)))
    assert keys[0] == peer_bytes(3)
    assert sorted(256 - (me ^ key_hash(k)).bit_length() for k in keys[1:]) == list(range(radius))


def test_a_lone_node_joins_with_one_lookup():
    assert drive(ops.join(FakeNode(0, [0], [NOW_MS])), lambda e: pytest.fail("nobody to ask")) == 1


# ------------------------------------------------------------------------------------- schedules

def test_the_refresh_comes_at_a_random_phase_of_its_interval_and_the_republish_at_a_third_of_the_ttl():
    rng = random.Random(4)
    delays = [ops.refresh_delay(rng) for _ in range(200)]
    assert min(delays) >= 300 and max(delays) <= 900 and len(set(delays)) == 200
    assert ops.republish_interval_s(120) == 40


def test_the_daemons_advertiser_republishes_on_the_cores_schedule():
    from meshd.daemon.advertiser import Advertiser

    adv = Advertiser(identity(1), publish=None, ttl_s=120, wall_ms=lambda: NOW_MS)
    assert adv.interval_s == ops.republish_interval_s(120)


# ------------------------------------------------------------------------------------- the book

def test_a_connected_peers_misses_double_its_own_deadline_and_close_it_when_alone():
    book = RpcBook()
    assert book.deadline("b", True) == RPC_TIMEOUT_S
    for miss in range(STUCK_AFTER):
        misses = book.misses("b", True)
        backed_off = min(RPC_TIMEOUT_CEILING_S, book.connected.timeout() * 2 ** miss)
        assert book.deadline("b", True) == pytest.approx(backed_off)
        verdict = book.timed_out("b", True, 3.0, now=float(miss), misses=misses)
    assert verdict == CLOSE and book.counts["stuck_closed"] == 1 and book.connected.samples == 1
    assert book.deadline("c", True) == book.connected.timeout()      # another peer's is untouched


def test_misses_of_several_peers_at_once_keep_them_and_an_answer_ends_the_run():
    book = RpcBook()
    verdicts = []
    for t in range(STUCK_AFTER):
        for peer in ("b", "c"):
            verdicts.append(book.timed_out(peer, True, 3.0, now=float(t), misses=book.misses(peer, True)))
    assert verdicts[-2:] == [KEEP, KEEP] and book.counts["stuck_kept"] == 2
    book.answered("b", True, 0.05)
    assert book.misses("b", True) == 0 and book.counts["answered"] == 1


def test_a_peer_we_dial_has_the_dial_deadline_and_its_timeout_is_no_miss():
    book = RpcBook()
    assert book.deadline("d", False) == book.dialed.timeout()
    assert book.timed_out("d", False, 2.0, now=0.0, misses=0) is None and book.misses("d", True) == 0


def test_a_peer_of_another_swarm_stays_out_until_its_recheck_and_is_counted_once():
    foreign = RpcBook().foreign
    assert not foreign.excluded("x", 0.0)
    assert foreign.found("x", 10.0) is True and foreign.excluded("x", 10.0 + FOREIGN_RECHECK_S - 1)
    assert not foreign.excluded("x", 10.0 + FOREIGN_RECHECK_S)          # due for a check again
    assert foreign.found("x", 100.0) is False and foreign.seen == 1     # still remembered: not new
    assert foreign.excluded("x", 100.0 + FOREIGN_RECHECK_S - 1)         # its recheck moved on
    foreign.speaks("x")                                                 # restarted into our swarm
    assert not foreign.excluded("x", 101.0) and len(foreign) == 0


@settings(max_examples=50, deadline=None)
@given(peers=st.lists(st.integers(0, 20), max_size=60), limit=st.integers(1, 8))
def test_foreign_peers_are_bounded_and_the_oldest_finding_goes_first(peers, limit):
    foreign = ForeignPeers(recheck_s=5.0, limit=limit)
    for t, peer in enumerate(peers):
        foreign.found(peer, float(t))
        assert len(foreign) <= limit and foreign.excluded(peer, float(t))
    last = {peer: float(t) for t, peer in enumerate(peers)}          # each peer's latest finding
    kept = sorted(last, key=last.__getitem__)[-limit:]                 # the latest findings survive
    now = float(len(peers))
    assert all(foreign.excluded(p, now) == (p in kept and last[p] + 5.0 > now) for p in last)
    with pytest.raises(ValueError):
        ForeignPeers(recheck_s=0.0)



# ------------------------------------------------------------------------------------- the store

def _library_put(validator: MeshdValidator, store: MergingValueStore, key: str, value: bytes) -> bool:
    """py-libp2p 0.8.1's PUT_VALUE handler, in its order, over the product's validator and store."""
    try:
        validator.validate(key, value)
    except RecordRejected:
        return False
    existing = store.get(key.encode())
    if existing is not None and validator.select(key, [existing.value, value]) == 0:
        return False
    store.put_record(key.encode(), Record(key=key.encode(), value=value))
    return True


puts = st.lists(st.tuples(st.sampled_from(["model", "peer"]), st.integers(0, 2), st.integers(1, 6),
                          st.integers(0, 3), st.integers(0, 3)), min_size=1, max_size=25)


@settings(max_examples=40, deadline=None)
@given(puts=puts)
def test_the_simulations_store_accepts_and_holds_what_the_products_does(puts):
    now = [NOW_MS]
    sim = ValueStore(lambda: now[0], RecordCache())
    validator = MeshdValidator(lambda: now[0])
    product = MergingValueStore(None, None, lambda: now[0])
    for kind, who, seq, age, advance in puts:
        ident = identity(90 + who)
        raw = good(ident, seq=seq, now=now[0] - age * TTL_MS // 4)
        key = K.peer_key(ident.peer_id) if kind == "peer" else K.model_key(DIGEST)
        value = raw if kind == "peer" else as_record_set(raw)      # some expired already: refused
        try:
            accepted = sim.put(key.encode(), value)
        except RecordRejected:
            accepted = False
        assert accepted == _library_put(validator, product, key, value)
        now[0] += advance * TTL_MS // 3
        for stored_key in {K.model_key(DIGEST)} | {K.peer_key(identity(90 + w).peer_id) for w in range(3)}:
            theirs = product.get(stored_key.encode())
            assert sim.get(stored_key.encode()) == (theirs.value if theirs is not None else None)


def test_our_own_replayed_record_is_refused_locally():
    store = ValueStore(lambda: NOW_MS, RecordCache())
    key = K.peer_key(identity(60).peer_id)
    store.store_locally(key, good(identity(60), seq=5))
    with pytest.raises(RecordRejected) as err:
        store.store_locally(key, good(identity(60), seq=5))
    assert err.value.reason == "replayed"
