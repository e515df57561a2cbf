"""Tracker duty: one deterministic ranking that every node computes alike."""
from __future__ import annotations

import hashlib

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from meshd.plan.errors import PlanInputError
from meshd.plan.tracker import (
    TRACKER_DOMAIN,
    TRACKER_EPOCH_MS,
    current_tracker,
    eligible_peers,
    epoch_at,
    peer_distance,
    rank_trackers,
    tracker_key,
)
from tests._planner_helpers import MODEL, make_ad

HEADS = [make_ad(f"12D3KooWhead{i}", 0, 4) for i in range(6)]
TAILS = [make_ad(f"12D3KooWtail{i}", 4, 8) for i in range(3)]


def test_key_and_distance_are_the_documented_hashes():
    expected = hashlib.sha256(TRACKER_DOMAIN + MODEL.encode() + b"\x00" + (7).to_bytes(8, "big"))
    assert tracker_key(MODEL, 7) == int.from_bytes(expected.digest(), "big")
    pid = int.from_bytes(hashlib.sha256(b"peer").digest(), "big")
    assert peer_distance(12345, "peer") == 12345 ^ pid


def test_ranking_is_by_distance_and_only_heads_are_eligible():
    ranking = rank_trackers(HEADS + TAILS, model_digest=MODEL, epoch=3, now_ms=0)
    key = tracker_key(MODEL, 3)
    assert ranking == tuple(sorted((a.peer_id for a in HEADS), key=lambda p: peer_distance(key, p)))
    assert current_tracker(HEADS + TAILS, model_digest=MODEL, epoch=3, now_ms=0) == ranking[0]


def test_removing_the_top_promotes_the_second():
    first, second, *_ = rank_trackers(HEADS, model_digest=MODEL, epoch=1, now_ms=0)
    rest = [a for a in HEADS if a.peer_id != first]
    assert current_tracker(rest, model_digest=MODEL, epoch=1, now_ms=0) == second
    assert current_tracker(HEADS, model_digest=MODEL, epoch=1, now_ms=0, exclude=[first]) == second


def test_an_expired_tracker_is_replaced_without_anyone_deciding():
    first, second, *_ = rank_trackers(HEADS, model_digest=MODEL, epoch=1, now_ms=0)
    ads = [make_ad(a.peer_id, 0, 4, expires_at_ms=5_000) if a.peer_id == first else a for a in HEADS]
    assert current_tracker(ads, model_digest=MODEL, epoch=1, now_ms=4_999) == first
    assert current_tracker(ads, model_digest=MODEL, epoch=1, now_ms=5_000) == second


def test_without_a_head_any_live_node_may_direct_and_with_none_there_is_no_tracker():
    assert eligible_peers(TAILS, model_digest=MODEL, now_ms=0) == {a.peer_id for a in TAILS}
    assert eligible_peers(HEADS[:1] + TAILS, model_digest=MODEL, now_ms=0) == {HEADS[0].peer_id}
    assert eligible_peers(HEADS[:1] + TAILS, model_digest=MODEL, now_ms=0,
                          exclude=[HEADS[0].peer_id]) == {a.peer_id for a in TAILS}
    assert current_tracker([], model_digest=MODEL, epoch=0, now_ms=0) is None
    other = [make_ad("x", 0, 8, model_digest="sha256:other")]
    assert current_tracker(other, model_digest=MODEL, epoch=0, now_ms=0) is None


def test_epochs_move_the_duty_around():
    tops = {current_tracker(HEADS, model_digest=MODEL, epoch=e, now_ms=0) for e in range(40)}
    assert len(tops) > 1


@pytest.mark.parametrize("now_ms, epoch_ms, epoch", [
    (0, TRACKER_EPOCH_MS, 0), (TRACKER_EPOCH_MS - 1, TRACKER_EPOCH_MS, 0),
    (TRACKER_EPOCH_MS, TRACKER_EPOCH_MS, 1), (10_500, 1_000, 10),
])
def test_epoch_at(now_ms, epoch_ms, epoch):
    assert epoch_at(now_ms, epoch_ms) == epoch


@pytest.mark.parametrize("call", [
    lambda: epoch_at(5, 0), lambda: epoch_at(-1), lambda: tracker_key(MODEL, -1),
    lambda: tracker_key(MODEL, 2**64),
])
def test_bad_arguments_are_local_errors(call):
    with pytest.raises(PlanInputError):
        call()


peer_ids = st.text(st.characters(min_codepoint=33, max_codepoint=126), min_size=1, max_size=20)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])   # no clock in it
@given(st.lists(st.tuples(peer_ids, st.integers(0, 3)), max_size=12),
       st.integers(0, 2**64 - 1), st.randoms(use_true_random=False))
def test_ranking_is_permutation_invariant_and_total(entries, epoch, rnd):
    ads = [make_ad(p, s, 8) for p, s in entries]
    shuffled = list(ads)
    rnd.shuffle(shuffled)
    ranking = rank_trackers(ads, model_digest=MODEL, epoch=epoch, now_ms=0)
    assert ranking == rank_trackers(shuffled, model_digest=MODEL, epoch=epoch, now_ms=0)
    assert len(set(ranking)) == len(ranking)
    assert set(ranking) == eligible_peers(ads, model_digest=MODEL, now_ms=0)
    if ranking:  # dropping the top makes the runner-up the tracker
        rest = [a for a in ads if a.peer_id != ranking[0]]
        expect = ranking[1] if len(ranking) > 1 else None
        if expect is not None and eligible_peers(rest, model_digest=MODEL, now_ms=0) == set(ranking[1:]):
            assert current_tracker(rest, model_digest=MODEL, epoch=epoch, now_ms=0) == expect


def test_only_directly_dialable_nodes_hold_duty_even_when_a_relayed_head_is_closest():
    """A head behind NAT (relayed, or listing no direct address) is never on duty, whatever its
    distance; with only such heads the dialable tails direct; with nobody dialable, no tracker."""
    behind = [make_ad(a.peer_id, 0, 4, relayed=True, dialable=False) for a in HEADS]
    no_direct = [make_ad(a.peer_id, 0, 4, dialable=False) for a in HEADS]   # lost its relays: lists none
    for heads in (behind, no_direct):
        assert eligible_peers(heads + TAILS, model_digest=MODEL, now_ms=0) == {a.peer_id for a in TAILS}
        assert current_tracker(heads, model_digest=MODEL, epoch=2, now_ms=0) is None
    closest = rank_trackers(HEADS, model_digest=MODEL, epoch=5, now_ms=0)[0]
    mixed = [make_ad(a.peer_id, 0, 4, relayed=True, dialable=False) if a.peer_id == closest else a for a in HEADS]
    top = current_tracker(mixed, model_digest=MODEL, epoch=5, now_ms=0)
    assert top is not None and top != closest
    assert top == rank_trackers(HEADS, model_digest=MODEL, epoch=5, now_ms=0)[1]
    # the newest ad decides: a head that became reachable (new record, higher sequence) is eligible again
    again = mixed + [make_ad(closest, 0, 4, sequence=9)]
    assert current_tracker(again, model_digest=MODEL, epoch=5, now_ms=0) == closest


def test_dialable_comes_from_the_signed_records_direct_addresses():
    from meshd.plan.adverts import ShardAd
    from proto import shard_runtime_pb2 as pb

    def payload(direct, relayed):
        return pb.CapabilityPayload(
            schema_version=pb.SCHEMA_VERSION_1, peer_id="12D3KooWx", model_artifact_digest=MODEL, num_layers=8,
            shard_range=pb.ShardRange(start_layer=0, end_layer=4), issued_at_unix_ms=1, expires_at_unix_ms=10,
            reachability=pb.Reachability(direct_addrs=direct, relayed_addrs=relayed))
    public = ShardAd.from_payload(payload(["/ip4/198.51.100.4/tcp/4001"], []))
    home = ShardAd.from_payload(payload([], ["/ip4/203.0.113.1/tcp/4001/p2p/R/p2p-circuit/p2p/12D3KooWx"]))
    stranded = ShardAd.from_payload(payload([], []))
    assert public.dialable and not public.relayed
    assert not home.dialable and home.relayed
    assert not stranded.dialable and not stranded.relayed
    with pytest.raises(PlanInputError, match="dialable"):
        make_ad("p", 0, 4, dialable=1)

