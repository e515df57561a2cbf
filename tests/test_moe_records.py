"""Signed expert placement records (dht/expert_records.py), their DHT index and the pure planning over them."""
from __future__ import annotations

from contextlib import AsyncExitStack

import pytest
import trio
from hypothesis import given, settings
from hypothesis import strategies as st

from dht import keys as K
from dht.errors import RecordRejected
from dht.expert_records import (
    MAX_EXPERT_RUNS,
    ExpertClaim,
    sign_experts,
    sign_experts_withdrawal,
    validate_expert_set,
    validate_experts,
)
from dht.records import encode_record_set, merge_records
from dht.validator import MeshdValidator, check_value
from meshd.plan.experts import ExpertFootprint, coverage, placements, plan_experts, runs_of, spec_of
from proto import shard_runtime_pb2 as pb
from proto.records import sign_record
from shard.experts.spec import SHARED, ExpertSpec
from tests._daemon_helpers import DIGEST, NOW_MS, TTL_MS, identity

A, B, EVE = identity(31), identity(32), identity(33)
PIN = b"\x07" * 32
RECIPE = "sha256:" + "cd" * 32


def claim(spec: str = "0-3:E4-E7", **kw) -> ExpertClaim:
    args = dict(model_artifact_digest=DIGEST, runtime_recipe_digest=RECIPE, runs=runs_of(ExpertSpec.parse(spec)),
                num_layers=6, num_experts=8, endpoint="127.0.0.1:7001", tls_cert_sha256=PIN)
    args.update(kw)
    return ExpertClaim(**args)


def record(ident=A, *, seq=10, now=NOW_MS, ttl=TTL_MS, **kw) -> bytes:
    return sign_experts(claim(**kw), ident.signing_key, peer_id=ident.peer_id, sequence=seq, now_ms=now, ttl_ms=ttl)


@pytest.mark.parametrize("text", ["0-3:E4-E7", "0:E0+E2+E5-E7,1:shared", "2-5:E0-E7+shared", "0:E1,1:E2,2:E1"])
def test_specs_survive_the_record(text):
    spec = ExpertSpec.parse(text)
    rec = validate_experts(record(spec=text, num_layers=8), NOW_MS)
    assert spec_of(rec) == spec and rec.peer_id == A.peer_id and not rec.withdrawn


def test_forged_and_foreign_records_are_refused():
    good = pb.SignedRecord.FromString(record())
    forged = pb.SignedRecord()
    forged.CopyFrom(good)
    payload = pb.ExpertPlacementPayload.FromString(good.payload)
    payload.endpoint = "203.0.113.66:7001"          # an attacker redirects the experts' traffic
    forged.payload = payload.SerializeToString()
    with pytest.raises(RecordRejected) as info:
        validate_experts(forged.SerializeToString(), NOW_MS)
    assert info.value.reason == "signature"
    stolen = sign_record(pb.RECORD_KIND_EXPERTS, good.payload, EVE.signing_key).SerializeToString()
    with pytest.raises(RecordRejected) as info:
        validate_experts(stolen, NOW_MS)
    assert info.value.reason == "peer_id"
    as_capability = sign_record(pb.RECORD_KIND_CAPABILITY, good.payload, A.signing_key).SerializeToString()
    with pytest.raises(RecordRejected, match="kind"):
        validate_experts(as_capability, NOW_MS)


def test_lifetime_rules():
    with pytest.raises(RecordRejected, match="expired"):
        validate_experts(record(), NOW_MS + TTL_MS)
    with pytest.raises(RecordRejected, match="future"):
        validate_experts(record(now=NOW_MS + 60_000), NOW_MS)


def _raw(mutate) -> bytes:
    payload = claim()._payload(peer_id=A.peer_id, now_ms=NOW_MS, ttl_ms=TTL_MS, sequence=1)
    mutate(payload)
    return sign_record(pb.RECORD_KIND_EXPERTS, payload.SerializeToString(), A.signing_key).SerializeToString()


@pytest.mark.parametrize("mutate,match", [
    (lambda p: p.runs.add(first_layer=5, last_layer=6, first_expert=0, last_expert=0, routed=True), "layer run"),
    (lambda p: p.runs.add(first_layer=0, last_layer=0, first_expert=3, last_expert=8, routed=True), "expert run"),
    (lambda p: p.runs.add(first_layer=1, last_layer=0, routed=True), "layer run"),
    (lambda p: p.runs.add(first_layer=0, last_layer=0), "empty run"),
    (lambda p: [p.runs.add(first_layer=0, last_layer=0, routed=True) for _ in range(MAX_EXPERT_RUNS)], "runs"),
    (lambda p: setattr(p, "endpoint", "nowhere"), "host:port"),
    (lambda p: setattr(p, "endpoint", "127.0.0.1:70000"), "host:port"),
    (lambda p: setattr(p, "tls_cert_sha256", b""), "certificate hash"),
    (lambda p: setattr(p, "num_experts", 4096), "num_experts"),
    (lambda p: p.ClearField("protocol_versions"), "versions"),
    (lambda p: setattr(p, "ms_per_expert_row", float("nan")), "finite"),
    (lambda p: setattr(p, "model_artifact_digest", "bad digest!"), "digest"),
])
def test_bounds(mutate, match):
    with pytest.raises(RecordRejected, match=match):
        validate_experts(_raw(mutate), NOW_MS)


def test_claims_are_checked_when_built():
    with pytest.raises(ValueError, match="certificate"):
        claim(tls_cert_sha256=b"")
    with pytest.raises(ValueError, match="runs"):
        claim(runs=())


def test_withdrawal_outranks_and_hides():
    live = validate_experts(record(seq=10), NOW_MS)
    gone = validate_experts(sign_experts_withdrawal(DIGEST, A.signing_key, peer_id=A.peer_id, sequence=11,
                                                    now_ms=NOW_MS, ttl_ms=TTL_MS), NOW_MS)
    merged = merge_records([live], [gone], NOW_MS)
    assert merged == [gone] and gone.withdrawn
    assert placements(merged, recipe=RECIPE, now_ms=NOW_MS) == []


def test_index_key_validation_and_replays():
    key = K.experts_key(DIGEST)
    assert K.parse_key(key).kind == "experts"
    value = encode_record_set([validate_experts(record(seq=10), NOW_MS)])
    assert [r.peer_id for r in check_value(key, value, NOW_MS)] == [A.peer_id]
    with pytest.raises(RecordRejected, match="another model"):
        check_value(K.experts_key("sha256:" + "00" * 32), value, NOW_MS)
    newer = encode_record_set([validate_experts(record(seq=11), NOW_MS)])
    validator = MeshdValidator(lambda: NOW_MS)
    assert validator.select(key, [value, newer]) == 1
    assert validator.select(key, [newer, value]) == 0      # the replay of seq 10 never wins
    both = encode_record_set([validate_experts(record(seq=10), NOW_MS), validate_experts(record(B), NOW_MS)])
    assert len(validate_expert_set(both, NOW_MS)) == 2


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=600))
def test_fuzz_records_and_sets(data):
    for fn in (validate_experts, validate_expert_set):
        try:
            fn(data, NOW_MS)
        except RecordRejected:
            pass


# --------------------------------------------------------------------------- pure planning


def test_placements_keep_only_usable_peers():
    recs = [validate_experts(record(A), NOW_MS),
            validate_experts(record(B, runtime_recipe_digest="sha256:" + "ee" * 32), NOW_MS)]
    got = placements(recs, recipe=RECIPE, now_ms=NOW_MS)
    assert [(p.peer_id, p.host, p.port, p.pin) for p in got] == [(A.peer_id, "127.0.0.1", 7001, PIN)]
    assert got[0].experts == ExpertSpec.parse("0-3:E4-E7")
    assert placements(recs, recipe=RECIPE, now_ms=NOW_MS, act=3) == []


def test_plan_experts_fills_what_nobody_serves_first():
    fp = ExpertFootprint(num_layers=4, moe_layers=(0, 1, 2, 3), num_experts=8, has_shared=False, routed_bytes=100)
    recs = [validate_experts(record(spec="0-3:E0-E3", num_layers=4), NOW_MS)]
    counts = coverage(recs, NOW_MS)
    taken = plan_experts(fp, counts, memory_bytes=16 * 100)
    assert taken == ExpertSpec.parse("0-3:E4-E7")
    more = plan_experts(fp, counts, memory_bytes=20 * 100)
    assert len(more) == 20 and ExpertSpec.parse("0-3:E4-E7").pairs <= more.pairs
    assert len(plan_experts(fp, counts, memory_bytes=99)) == 0
    need = plan_experts(fp, counts, memory_bytes=100, needed=ExpertSpec.parse("2:E1"))
    assert need == ExpertSpec.parse("2:E1")


def test_plan_experts_counts_shared_experts():
    fp = ExpertFootprint(num_layers=2, moe_layers=(0, 1), num_experts=2, has_shared=True, routed_bytes=10,
                         shared_bytes=30)
    assert plan_experts(fp, coverage([], NOW_MS), memory_bytes=40) == ExpertSpec.parse("0-1:E0-E1")
    assert (0, SHARED) in plan_experts(fp, coverage([], NOW_MS), memory_bytes=100).pairs


# --------------------------------------------------------------------------- a live DHT


def test_expert_records_propagate_through_a_real_dht():
    import time

    from dht.host.bootstrap import connect_bootstrap
    from dht.host.build import running_host
    from dht.node import DhtNode

    def wall_ms() -> int:
        return int(time.time() * 1000)

    async def main():
        with trio.fail_after(60):
            async with AsyncExitStack() as stack:
                nodes = []
                for ident in (A, B):
                    host = await stack.enter_async_context(running_host(ident, ["/ip4/127.0.0.1/tcp/0"]))
                    nodes.append(await stack.enter_async_context(DhtNode(host, wall_ms).running()))
                await connect_bootstrap(nodes[1].host, [str(nodes[0].host.get_addrs()[0])], 10)
                for node in nodes:
                    await node.sync_peers()
                now = wall_ms()
                rec = validate_experts(record(A, now=now), now)
                assert await nodes[0].publish_experts(rec) > 0
                seen = await nodes[1].fetch_experts(DIGEST)
                assert [r.peer_id for r in seen] == [A.peer_id] and spec_of(seen[0]) == ExpertSpec.parse("0-3:E4-E7")
                gone = validate_experts(sign_experts_withdrawal(DIGEST, A.signing_key, peer_id=A.peer_id,
                                                                sequence=rec.sequence + 1, now_ms=now,
                                                                ttl_ms=TTL_MS), now)
                await nodes[0].publish_experts(gone)
                assert [r.withdrawn for r in await nodes[1].fetch_experts(DIGEST)] == [True]

    trio.run(main)


def test_holders_advertise_what_they_need_and_auto_peers_take_it_first():
    from dht.records import CapabilityClaim, sign_capability, validate_capability

    def holder(ident, start, end, needs):
        claim = CapabilityClaim(model_artifact_digest=DIGEST, runtime_recipe_digest=RECIPE, start_layer=start,
                                end_layer=end, num_layers=4, grpc_endpoint="127.0.0.1:5000",
                                tls_cert_sha256=b"\x01" * 32, delegated_experts=ExpertSpec.parse(needs).to_runs())
        return validate_capability(sign_capability(claim, ident.signing_key, peer_id=ident.peer_id, sequence=1,
                                                   now_ms=NOW_MS, ttl_ms=TTL_MS), NOW_MS)

    from meshd.plan.experts import demand

    holders = [holder(A, 0, 2, "0-1:E6-E7"), holder(B, 2, 4, "2-3:E5-E7")]
    assert ExpertSpec.from_runs(holders[0].payload.delegated_experts) == ExpertSpec.parse("0-1:E6-E7")
    need = demand(holders, NOW_MS)
    assert need == ExpertSpec.parse("0-1:E6-E7,2-3:E5-E7")
    fp = ExpertFootprint(num_layers=4, moe_layers=(0, 1, 2, 3), num_experts=8, has_shared=False, routed_bytes=100)
    served = [validate_experts(record(EVE, spec="2-3:E5-E7", num_layers=4), NOW_MS)]
    taken = plan_experts(fp, coverage(served, NOW_MS), memory_bytes=4 * 100, needed=need)
    assert taken == ExpertSpec.parse("0-1:E6-E7")      # the unserved needs, not what holders hold
    with pytest.raises(ValueError, match="delegated"):
        CapabilityClaim(model_artifact_digest=DIGEST, runtime_recipe_digest=RECIPE, start_layer=0, end_layer=2,
                        num_layers=4, delegated_experts=(pb.ExpertRun(first_layer=3, last_layer=4, routed=True),))


@pytest.mark.parametrize("text", ["0-3:E4-E7", "0:E0+E2+E5-E7,1:shared", "2:E1,3:E1"])
def test_spec_runs_round_trip(text):
    spec = ExpertSpec.parse(text)
    assert ExpertSpec.from_runs(spec.to_runs()) == spec
