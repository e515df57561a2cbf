"""ShardAd validation, from_payload, live_adverts and the CoverageMap view."""
from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meshd.plan.adverts import CoverageMap, ShardAd, Span, live_adverts
from meshd.plan.errors import AdvertRejected, PlanInputError
from proto import shard_runtime_pb2 as pb
from proto.errors import LocalError, ProtocolError
from tests._planner_helpers import MODEL, make_ad, swarms


def payload(**overrides) -> pb.CapabilityPayload:
    p = pb.CapabilityPayload(
        schema_version=pb.SCHEMA_VERSION_1, peer_id="12D3KooWpeer", model_artifact_digest=MODEL,
        shard_range=pb.ShardRange(start_layer=2, end_layer=6), num_layers=8,
        memory_budget_bytes=4 << 30, free_kv_tokens=4096,
        throughput=pb.Throughput(decode_ms_per_layer=1.5, prefill_tokens_per_s=900.0),
        reachability=pb.Reachability(direct_addrs=["/ip4/127.0.0.1/tcp/4001"],
                                     grpc_endpoint="127.0.0.1:5000"),
        issued_at_unix_ms=1_000, expires_at_unix_ms=61_000, sequence=7,
        runtime_recipe_digest="sha256:" + "22" * 32)
    for key, value in overrides.items():
        if isinstance(value, dict):
            sub = getattr(p, key)
            sub.Clear()
            for k, v in value.items():
                if isinstance(v, list):
                    getattr(sub, k).extend(v)
                else:
                    setattr(sub, k, v)
        else:
            setattr(p, key, value)
    return p


def test_from_payload_reads_every_field():
    ad = ShardAd.from_payload(payload())
    assert (ad.peer_id, ad.model_digest, ad.start, ad.end, ad.num_layers) == \
        ("12D3KooWpeer", MODEL, 2, 6, 8)
    assert ad.decode_ms_per_layer == 1.5 and ad.prefill_tokens_per_s == 900.0
    assert (ad.free_kv_tokens, ad.memory_budget_bytes, ad.sequence) == (4096, 4 << 30, 7)
    assert (ad.issued_at_ms, ad.expires_at_ms, ad.grpc_endpoint) == (1_000, 61_000, "127.0.0.1:5000")
    assert ad.relayed is False and ad.span == Span(2, 6) and ad.layers == 4
    assert ad.recipe_digest == "sha256:" + "22" * 32


def test_relayed_only_when_no_direct_way_in():
    ad = ShardAd.from_payload(payload(reachability={"relayed_addrs": ["/p2p-circuit/x"]}))
    assert ad.relayed is True
    both = payload(reachability={"relayed_addrs": ["/p2p-circuit/x"], "grpc_endpoint": "h:1"})
    assert ShardAd.from_payload(both).relayed is False


@pytest.mark.parametrize("overrides, fragment", [
    ({"schema_version": pb.SCHEMA_VERSION_UNSPECIFIED}, "schema_version"),
    ({"withdrawn": True}, "withdrew"),
    ({"shard_range": {"start_layer": 6, "end_layer": 6}}, "end"),
    ({"shard_range": {"start_layer": 2, "end_layer": 9}}, "end"),
    ({"shard_range": {"start_layer": 2, "end_layer": 6, "effective_start_layer": 3}}, "effective"),
    ({"num_layers": 0}, "num_layers"),
    ({"peer_id": ""}, "peer_id"),
    ({"peer_id": "x" * 500}, "peer_id"),
    ({"peer_id": "bad\nid"}, "non-printable"),
    ({"model_artifact_digest": ""}, "model_digest"),
    ({"throughput": {"decode_ms_per_layer": math.nan}}, "decode_ms_per_layer"),
    ({"throughput": {"decode_ms_per_layer": -1.0}}, "decode_ms_per_layer"),
    ({"throughput": {"decode_ms_per_layer": math.inf}}, "decode_ms_per_layer"),
    ({"throughput": {"prefill_tokens_per_s": 1e12}}, "prefill_tokens_per_s"),
    ({"memory_budget_bytes": 1 << 60}, "memory_budget_bytes"),
    ({"free_kv_tokens": 1 << 40}, "free_kv_tokens"),
    ({"expires_at_unix_ms": 1_000}, "expires_at_ms"),
    ({"issued_at_unix_ms": -5}, "issued_at_ms"),
])
def test_from_payload_rejects_bad_adverts_as_the_peers_fault(overrides, fragment):
    with pytest.raises(AdvertRejected, match=fragment) as info:
        ShardAd.from_payload(payload(**overrides))
    assert isinstance(info.value, ProtocolError)
    assert info.value.code == pb.ERROR_CODE_PROTOCOL_VIOLATION


@pytest.mark.parametrize("overrides", [
    {"start": 3, "end": 3}, {"start": -1}, {"end": 9}, {"num_layers": 5000, "end": 4},
    {"relayed": 1}, {"decode_ms_per_layer": "1"}, {"free_kv_tokens": True},
    {"grpc_endpoint": "h" * 300},
])
def test_constructor_misuse_is_a_local_error(overrides):
    with pytest.raises(PlanInputError) as info:
        make_ad("a", overrides.pop("start", 0), overrides.pop("end", 4), **overrides)
    assert isinstance(info.value, LocalError) and isinstance(info.value, ValueError)


def test_ads_are_frozen():
    ad = make_ad("a", 0, 4)
    with pytest.raises(AttributeError):
        ad.start = 1  # type: ignore[misc]


def test_live_adverts_expiry_sequence_and_model():
    old = make_ad("a", 0, 4, sequence=1)
    new = make_ad("a", 4, 8, sequence=2)
    dead = make_ad("b", 0, 8, expires_at_ms=100)
    other_model = make_ad("c", 0, 8, model_digest="sha256:other")
    live = live_adverts([new, dead, old, other_model], model_digest=MODEL, now_ms=100)
    assert live == (new,)
    assert live_adverts([dead], model_digest=MODEL, now_ms=99) == (dead,)


@given(swarms(), st.randoms(use_true_random=False))
def test_live_adverts_ignores_input_order(swarm, rnd):
    _, ads = swarm
    shuffled = list(ads)
    rnd.shuffle(shuffled)
    assert live_adverts(ads, model_digest=MODEL, now_ms=0) == \
        live_adverts(shuffled, model_digest=MODEL, now_ms=0)


@pytest.mark.parametrize("ranges, gaps, weakest", [
    ([], [(0, 8)], ((0, 8), 0)),
    ([(0, 8)], [], ((0, 8), 1)),
    ([(0, 3)], [(3, 8)], ((3, 8), 0)),
    ([(2, 4), (6, 7)], [(0, 2), (4, 6), (7, 8)], ((0, 2), 0)),       # tie on length: first
    ([(0, 1), (3, 8)], [(1, 3)], ((1, 3), 0)),
    ([(0, 8), (0, 5), (6, 8)], [], ((5, 6), 1)),                     # fully covered: weakest
    ([(0, 8), (0, 2), (4, 8)], [], ((2, 4), 1)),
    ([(0, 8), (0, 8), (0, 4), (5, 8)], [], ((4, 5), 2)),
])
def test_coverage_gaps_and_weakest_span(ranges, gaps, weakest):
    ads = [make_ad(f"p{i}", s, e) for i, (s, e) in enumerate(ranges)]
    cov = CoverageMap.build(ads, model_digest=MODEL, num_layers=8)
    assert cov.gaps() == tuple(Span(s, e) for s, e in gaps)
    (ws, we), count = weakest
    assert cov.weakest_span() == (Span(ws, we), count)
    assert cov.fully_covered == (not gaps)


def test_coverage_lists_servers_and_ignores_foreign_ads():
    ads = [make_ad("b", 0, 2), make_ad("a", 1, 3), make_ad("z", 0, 8, model_digest="sha256:x"),
           make_ad("y", 0, 4, n=4)]
    cov = CoverageMap.build(ads, model_digest=MODEL, num_layers=8)
    assert cov.servers[:4] == (("b",), ("a", "b"), ("a",), ())
    assert cov.redundancy(1) == 2
    assert cov.without("a").servers[:3] == (("b",), ("b",), ())


def test_coverage_rejects_inconsistent_construction():
    with pytest.raises(PlanInputError):
        CoverageMap(MODEL, 3, ((), ()))
    with pytest.raises(PlanInputError):
        CoverageMap.build([], model_digest=MODEL, num_layers=0)


@settings(max_examples=200)
@given(swarms())
def test_runs_partition_the_layers_and_match_counts(swarm):
    n, ads = swarm
    cov = CoverageMap.build(ads, model_digest=MODEL, num_layers=n)
    runs = cov.runs()
    assert runs[0][0].start == 0 and runs[-1][0].end == n
    for (a, ca), (b, cb) in zip(runs, runs[1:]):
        assert a.end == b.start and ca != cb
    for span, count in runs:
        for layer in range(span.start, span.end):
            assert count == sum(ad.serves(layer) for ad in ads)
    span, count = cov.weakest_span()
    assert count == min(cov.counts)
    assert all(cov.redundancy(layer) == 0 for g in cov.gaps() for layer in range(g.start, g.end))


def test_span_str_and_validation():
    assert str(Span(3, 4)) == "3" and str(Span(0, 4)) == "0..3"
    with pytest.raises(PlanInputError):
        Span(4, 4)
